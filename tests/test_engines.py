"""The engine seam's parts that need no vLLM server: the engine config and its one-line errors, the launch that
fails, the rollout-correction weights, and the process-group shutdown (tests/test_vllm.py runs a real server)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglightning.cli import cli_main
from sglightning.embedded import TinyModelConfig
from sglightning.engines import EngineConfig
from sglightning.engines.server import VLLMServer, group_members
from sglightning.grpo import grpo_loss, rollout_correction_weights
from sglightning.models import PolicyConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
VLLM_PYTHON = os.environ.get("SGLIGHTNING_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.mark.parametrize("kw,needle", [
    ({"backend": "sglang"}, "model.engine.backend: 'sglang' is not one of builtin, vllm or a class path"),
    ({"url": "127.0.0.1:8000"}, "model.engine.url: '127.0.0.1:8000' is not an http(s) URL"),
    ({"max_loras": 1}, "model.engine.max_loras: must be >= 2"),
    ({"kv_cache_gb": 0}, "model.engine.kv_cache_gb: must be a finite number > 0"),
    ({"kv_cache_gb": float("nan")}, "model.engine.kv_cache_gb: must be a finite number > 0"),
    ({"dtype": "int8"}, "model.engine.dtype: 'int8' is not one of float32, bfloat16, float16"),
])
def test_engine_config_names_the_key(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kw)


@pytest.mark.parametrize("args,needle", [
    (["--model.engine.url=http://127.0.0.1:9"], "model.engine.url: no vLLM server answers /health at http://127.0.0.1:9"),
    (["--model.engine.python=/no/such/python"], "model.engine.python: /no/such/python is not an executable python"),
    (["--model.engine.python=/no/such/python", "--model.rollout.top_k=5"], "rollout.top_k: top-k sampling is not "
     "supported with model.engine.backend vllm"),
    (["--model.engine.dtype=bfloat16", "--model.grpo.rollout_correction=null"],  # auto would correct it
     "grpo.rollout_correction: an engine in bfloat16 samples from other "
     "log-probs than the trainer's"),
    # configs/tiny.yaml's head size is 16: refused before a server starts, naming the cause
    ([f"--model.engine.python={sys.executable}"], "model.engine.backend: vLLM's CPU build has no attention kernel for "
     "head size 16"),
])
def test_a_vllm_engine_that_cannot_work_is_one_line_before_anything_starts(args, needle, tmp_path, capsys,
                                                                           monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["sglightning"])
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.engine.backend=vllm",
                  f"--model.engine.python={VLLM_PYTHON}", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglightning fit: error: "), lines
    assert needle in lines[0], lines[0]
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))  # nothing left behind


def test_an_engine_that_fails_to_start_is_one_line_with_its_log(tmp_path, capsys, monkeypatch):
    """A python without vLLM: the server process exits at once; the fit stops in one line quoting the server's
    error and naming its log, exit 2, no run folder, no process left."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["sglightning"])
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.engine.backend=vllm",
                  f"--model.engine.python={sys.executable}", "--model.engine.startup_timeout_s=120",
                  "--model.policy.tiny.hidden_size=128", "--model.policy.tiny.num_heads=2"])  # head size 64
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "model.engine: the vLLM server exited with code 1 before it was ready" in lines[0]
    assert "No module named 'vllm'" in lines[0] and "vllm-server.log" in lines[0]
    assert not any(tmp_path.rglob("*"))


def test_a_stopped_servers_temporary_log_goes_unless_an_error_named_it():
    """Every launch made a temporary log folder that was never removed (one per run, piling up in /tmp)."""
    folders = []
    for keep in (False, True):
        server = VLLMServer([sys.executable, "-c", "import time; time.sleep(600)"], {}, "127.0.0.1", 9, 1)
        server.proc = subprocess.Popen(server.command, start_new_session=True)
        server.ready, server.keep_log = True, keep
        server.log_path.write_text("INFO ready\n")
        server.stop()
        folders.append(server.log_path.parent)
    assert not folders[0].exists() and folders[1].is_dir()  # the second's log was named in an error: kept
    shutil.rmtree(folders[1])


def test_stop_ends_the_whole_process_group(tmp_path):
    """A server's process group — the process and the children it started — is gone after ``stop()``, even when
    the process ignores SIGTERM (SIGKILL after the grace period)."""
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "time.sleep(600)\n")
    server = VLLMServer([sys.executable, "-c", script], {}, "127.0.0.1", 9, 1, log_dir=str(tmp_path))
    server.proc = subprocess.Popen(server.command, start_new_session=True)
    deadline = time.monotonic() + 10
    while len(group_members(server.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(server.pid)) == 2
    t0 = time.monotonic()
    server.stop(timeout_s=1.0)
    assert group_members(server.pid) == [] and time.monotonic() - t0 < 10


def test_rollout_correction_weights_by_hand():
    """Token level: w = min(e^{old − engine}, C); sequence level: the product over the sample's tokens, truncated,
    on every token of it; the mismatch is the k3 KL mean over the sampled tokens."""
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    eng = torch.tensor([[0.0, -1.5, -1.0], [0.0, -0.5, 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    w, kl = rollout_correction_weights(old, eng, mask, "token", 2.0)
    d = [0.5, -1.0, 0.0]  # old − engine at the three policy tokens
    assert torch.allclose(w, torch.tensor([[0.0, math.exp(0.5), math.exp(-1.0)], [0.0, 1.0, 0.0]]))
    assert math.isclose(float(kl), sum(math.exp(x) - x - 1 for x in d) / 3, rel_tol=1e-6)
    w, _ = rollout_correction_weights(old, eng, mask, "sequence", 2.0)
    assert torch.allclose(w, torch.tensor([[0.0, math.exp(-0.5), math.exp(-0.5)], [0.0, 1.0, 0.0]]))
    w, _ = rollout_correction_weights(old + torch.tensor([[0.0, 3.0, 0.0], [0, 0, 0]]), eng, mask, "token", 2.0)
    assert float(w[0, 1]) == 2.0  # truncated at C
    with pytest.raises(ValueError, match="grpo.rollout_correction"):
        rollout_correction_weights(old, eng, mask, "both", 2.0)


def test_sequence_correction_is_per_turn_so_long_episodes_do_not_weigh_less():
    """A single-stream sample holds every turn of an episode: the sequence weight is the product over one turn's
    tokens (its episode step), not over the whole episode, whose weight would shrink with its length."""
    turns, per_turn = 50, 20
    d = -0.001  # a small, steady gap per token (bf16-like)
    L = turns * per_turn
    old, eng = torch.full((1, L), d), torch.zeros(1, L)
    mask = torch.ones(1, L, dtype=torch.bool)
    steps = torch.arange(L).div(per_turn, rounding_mode="floor").unsqueeze(0)  # [1, L] the turn of each token
    whole, _ = rollout_correction_weights(old, eng, mask, "sequence", 2.0)
    turn, _ = rollout_correction_weights(old, eng, mask, "sequence", 2.0, segments=steps)
    assert math.isclose(float(whole[0, 0]), math.exp(d * L), rel_tol=1e-5)  # 0.37: the episode weighs a third
    assert torch.allclose(turn, torch.full((1, L), math.exp(d * per_turn)), rtol=1e-5)  # 0.98 on every token
    # two turns of one row get their own weights; tokens outside the mask get 0
    old2 = torch.tensor([[0.0, 0.2, 0.2, -0.3, 0.0]])
    m2 = torch.tensor([[False, True, True, True, False]])
    w, _ = rollout_correction_weights(old2, torch.zeros(1, 5), m2, "sequence", 2.0,
                                      segments=torch.tensor([[0, 0, 0, 1, 1]]))
    assert torch.allclose(w, torch.tensor([[0.0, math.exp(0.4), math.exp(0.4), math.exp(-0.3), 0.0]]))


def test_the_correction_weight_scales_each_tokens_policy_term_not_its_kl():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0, -2.0]])
    mask = torch.tensor([[False, True, True]])
    adv = torch.tensor([1.0])
    w = torch.tensor([[0.0, 0.5, 2.0]])
    plain, _ = grpo_loss(logp, old, adv, mask, ref_logp=old - 0.3, kl_coef=0.1)
    weighted, _ = grpo_loss(logp, old, adv, mask, ref_logp=old - 0.3, kl_coef=0.1, is_weight=w)
    kl = float(_k3(torch.tensor(-0.3)))  # d = ref − logp at both tokens
    # ratio 1: pg = −A per token; loss = mean_k (w_k · (−A) + β·KL)
    assert math.isclose(float(plain), -1.0 + 0.1 * kl, rel_tol=1e-6)
    assert math.isclose(float(weighted), (0.5 * -1.0 + 2.0 * -1.0) / 2 + 0.1 * kl, rel_tol=1e-6)


def _k3(d: torch.Tensor) -> torch.Tensor:
    return d.exp() - d - 1


def test_the_backend_key_names_one_engine_or_a_class_path(tmp_path, monkeypatch):
    """``model.engine.backend`` is the one key choosing the engine: a shipped name, or an Engine subclass by class
    path; anything else is one line naming the key."""
    from sglightning.engines import make_engine
    from sglightning.engines.builtin import BuiltinEngine
    from sglightning.engines.vllm import VLLMEngine
    from sglightning.errors import ConfigError

    assert type(make_engine(EngineConfig())) is BuiltinEngine
    assert type(make_engine(EngineConfig(backend="vllm"))) is VLLMEngine
    (tmp_path / "my_engines.py").write_text(
        "from sglightning.engines.builtin import BuiltinEngine\nclass Mine(BuiltinEngine):\n    pass\n"
        "class NotAnEngine:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = make_engine(EngineConfig(backend="my_engines.Mine"))
    assert type(mine).__name__ == "Mine" and mine.cfg.backend == "my_engines.Mine"
    with pytest.raises(ConfigError, match="model.engine.backend: my_engines.NotAnEngine is not an sglightning"):
        make_engine(EngineConfig(backend="my_engines.NotAnEngine"))
    with pytest.raises(ConfigError, match="model.engine.backend: cannot import my_engines.Nope"):
        make_engine(EngineConfig(backend="my_engines.Nope"))
    with pytest.raises(ValueError, match="model.engine.backend: 'sglang' is not one of builtin, vllm or a class path"):
        EngineConfig(backend="sglang")


def test_the_old_decoder_key_says_where_it_went(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["sglightning"])
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
                  "--model.decoder=sglightning.engines.builtin.DecodeSession"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "model.decoder is now model.engine.backend" in err[0], err[0]


def test_a_vllm_engine_refuses_a_head_size_its_cpu_build_has_no_kernel_for(monkeypatch):
    """The tiny config's head size (16) makes vLLM's CPU server die at its first request; refused before start, in
    one line naming the cause (not the server log)."""
    from tiny import tiny_module

    from sglightning.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = tiny_module(engine=EngineConfig(backend="vllm", python=sys.executable))
    with pytest.raises(ConfigError, match="vLLM's CPU build has no attention kernel for head size 16"):
        module.preflight()
    shape = TinyModelConfig(hidden_size=128, num_heads=2, intermediate_size=256)  # head size 64
    tiny_module(policy=PolicyConfig(name_or_path="embedded:tiny", tiny=shape),
                engine=EngineConfig(backend="vllm", python=sys.executable)).preflight()


@pytest.mark.parametrize("over,expected", [
    ({}, None),  # fp32 weights, a 32-bit trainer: the sampler's log-probs are the trainer's
    ({"policy": "bfloat16"}, "token"),  # a bf16 base samples and trains in bf16
    ({"engine": EngineConfig(backend="vllm", dtype="bfloat16")}, "token"),
    ({"grpo": {"rollout_correction": None}, "policy": "bfloat16"}, None),  # said explicitly
    ({"grpo": {"rollout_correction": "sequence"}}, "sequence"),
])
def test_rollout_correction_auto_is_on_where_half_precision_samples_or_trains(over, expected):
    from tiny import tiny_module

    from sglightning.grpo import GRPOConfig

    kw = {}
    if "policy" in over:
        kw["policy"] = PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, dtype=over["policy"])
    if "engine" in over:
        kw["engine"] = over["engine"]
    if "grpo" in over:
        kw["grpo"] = GRPOConfig(**over["grpo"])
    module = tiny_module(**kw)
    module.configure_model()
    module._trainer = None
    assert module.grpo_cfg.rollout_correction == over.get("grpo", {}).get("rollout_correction", "auto")
    assert module.correction_mode() == expected


def _moving_module(policy: PolicyConfig, grpo):
    """The tiny module on ``policy`` with adapters that move the logits (and the KL term): LoRA B is zero at
    initialisation, so every lora_B is drawn from N(0, 0.5²), seeded."""
    from tiny import tiny_module

    module = tiny_module(policy=policy, grpo=grpo)
    module.configure_model()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module


def _bf16_moving_module(mode: str, epochs: int):
    """:func:`_moving_module` on a bf16 base (sampler and trainer differ), rollout correction ``mode``, KL on."""
    from sglightning.grpo import GRPOConfig

    torch.manual_seed(0)
    return _moving_module(PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, dtype="bfloat16"),
                          GRPOConfig(kl_coef=0.01, rollout_correction=mode, ppo_epochs=epochs))


def test_the_recompute_runs_without_dropout_and_its_weights_are_logged(tmp_path):
    """LoRA dropout 0.5 on adapters that change the model: the trainer's recomputed old log-probs are the sampler's
    (both without dropout: every weight 1, none truncated), while the first training pass, with dropout, is not (its
    logged ratio to the sampler spreads): the weights correct the sampler, not the dropout."""
    from tiny import tiny_trainer

    from sglightning.grpo import GRPOConfig

    # adapters that move the logits, for the dropout to drop; KL: every row is scored
    module = _moving_module(PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, lora_dropout=0.5),
                            GRPOConfig(kl_coef=0.01, rollout_correction="token"))
    tiny_trainer(tmp_path, steps=2).fit(module)
    assert len(module.history) == 2
    for h in module.history:
        assert h["policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-4), h
        assert h["policy/is_weight_min"] == pytest.approx(1.0, abs=1e-4)
        assert h["policy/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert h["policy/is_weight_truncated"] == 0.0 and h["policy/engine_mismatch_kl"] < 1e-8
        assert h["policy/sampler_ratio_max"] > 1.01  # dropout in the training pass: the logged ratio shows it
        assert 0.0 <= h["policy/sampler_ratio_outside_0.9_1.1"] <= 1.0 and h["policy/sampler_ratio_mean"] > 0


@pytest.mark.parametrize("mode,epochs", [("token", 1), ("sequence", 2)])
def test_the_correction_taken_from_the_first_pass_is_the_recomputes(tmp_path, monkeypatch, mode, epochs):
    """A bf16 base (sampler and trainer differ, the correction is on): without dropout the old log-probs come from
    the update's own first forward, one pass fewer per micro-batch, and the fit is the one with the separate no-grad
    pass — the same weights, statistics and adapters, later PPO epochs included (they read what the first wrote)."""
    from tiny import tiny_trainer

    import sglightning.module as module_file

    def fit(recompute: bool):
        monkeypatch.setattr(module_file, "drops_out", lambda model: recompute)  # True: as with dropout
        module = _bf16_moving_module(mode, epochs)
        calls = []
        real = module_file.SelfGuideModule.token_logprobs
        monkeypatch.setattr(module_file.SelfGuideModule, "token_logprobs",
                            lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
        tiny_trainer(tmp_path, steps=2 * epochs).fit(module)
        adapters = {k: v.detach().clone() for k, v in module.policy.named_parameters() if v.requires_grad}
        return module.history, adapters, len(calls)

    before, before_w, before_calls = fit(recompute=True)
    after, after_w, after_calls = fit(recompute=False)
    assert len(before) == len(after) == 2
    keys = ("policy/is_weight_mean", "policy/is_weight_min", "policy/is_weight_max", "policy/engine_mismatch_kl",
            "loss/total", "policy/logprob_gap_sampler_trainer", "train/grad_norm")
    for b, a in zip(before, after):
        assert "time/update_correction_s" in b and "time/update_correction_s" not in a
        assert b["policy/engine_mismatch_kl"] > 0 and b["policy/is_weight_min"] < 1  # weights that weigh
        assert b["train/grad_norm"] > 0 and b["policy/logprob_gap_sampler_trainer"] > 0
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    for k in before_w:
        torch.testing.assert_close(after_w[k], before_w[k], rtol=1e-4, atol=1e-6)
    assert after_calls < before_calls  # the recompute's forwards are gone (rollouts and the update's own remain)


def test_the_rollout_benchmark_plays_the_same_episodes_on_both_caches(tmp_path, monkeypatch):
    """benchmarks/rollout_throughput.py, its dynamic-cache arm against the slot cache's: every round the same tokens
    and episodes, and the ratio written to its JSON."""
    import json

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import rollout_throughput

    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["rollout_throughput.py", "--models", "tiny", "--arms", "shared", "static",
                                     "--tasks", "2", "--group", "2", "--steps", "2", "--max-new", "8", "--repeats", "2",
                                     "--decoding", "constrained", "--json", str(out)])
    rollout_throughput.main()
    report = json.loads(out.read_text())
    runs = {(r["arm"], r["round"]): r for r in report["runs"]}
    for rnd in (0, 1):
        a, b = runs[("shared", rnd)], runs[("static", rnd)]
        assert a["tokens"] == b["tokens"] > 0 and a["episodes"] == b["episodes"] == 4
    assert report["ratios"]["tiny"]["static_vs_shared"] > 0


def test_the_host_time_benchmark_never_runs_the_model(monkeypatch):
    """benchmarks/engine_host.py times the engine's host work around its decode steps: the rollout plays on the
    static path with stored logits, so the model's own forward never runs, and every step is counted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import engine_host

    calls = []
    real_load = engine_host.load_policy

    def load(cfg):
        model, tok = real_load(cfg)
        monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(1))
        return model, tok

    monkeypatch.setattr(engine_host, "load_policy", load)
    report = engine_host.main(["--rows", "8", "--repeats", "1", "--decoding", "constrained"])
    (med,) = report["medians"]
    assert calls == [] and med["lock_steps"] > 10 and med["tokens"] > med["lock_steps"]  # forced tokens ride along
    assert med["host_ms_per_lock_step"] > 0 and 0 < med["draw_share"] < 1
    # operations outside the model: the stored logits' copy and the draw at least, far fewer than a forward's
    assert 5 < med["ops_per_lock_step"] < 200


def test_the_probe_gap_is_the_mean_over_the_tokens_that_have_both_log_probs():
    """The sync's gaps: mean and largest |engine − trainer| over tokens 2..n (the mean carries the check: a
    half-precision token's own rounding does not stop a run); no pair at all is an error, not a gap of 0."""
    from sglightning.engines.vllm import probe_gap
    from sglightning.errors import EngineError

    assert probe_gap([None, -1.0, -2.0, -0.5], [None, -1.1, -1.6, -0.5]) == pytest.approx((0.5 / 3, 0.4))
    assert probe_gap([None, -1.0, None], [None, -1.25, -3.0]) == pytest.approx((0.25, 0.25))
    with pytest.raises(EngineError, match="no prompt log-probs"):
        probe_gap([None, None], [None, -1.0])


def test_a_step_cut_short_passes_the_correction_again_in_the_next_epoch(tmp_path, monkeypatch):
    """The first micro-batch's loss is not finite in the first PPO epoch: the update is skipped (the weights stay), no
    partial statistics are logged from it, and the second epoch, on the same weights, takes the correction from its
    own first pass: the step logs what an uncut step logs."""
    from tiny import tiny_trainer

    import sglightning.module as module_file

    def fit(cut: bool):
        module = _bf16_moving_module("token", 2)
        calls = []
        real = module_file.microbatch_objective

        def objective(*a, **kw):
            part = real(*a, **kw)
            calls.append(1)
            if cut and len(calls) == 1:
                part.objective = part.objective * float("nan")
            return part

        monkeypatch.setattr(module_file, "microbatch_objective", objective)
        with pytest.warns(RuntimeWarning, match="update skipped") if cut else contextlib.nullcontext():
            tiny_trainer(tmp_path, steps=2).fit(module)
        return module.history

    (whole,), (cut,) = fit(False), fit(True)
    assert cut["train/skipped_updates"] == 1 and whole["train/skipped_updates"] == 0
    for k in ("policy/is_weight_mean", "policy/is_weight_min", "policy/is_weight_max", "policy/engine_mismatch_kl"):
        assert cut[k] == pytest.approx(whole[k], rel=1e-5), k


def test_drops_out_sees_lora_dropout_and_the_configs_dropout_rates():
    """Where the training pass may differ from the sampler's (dropout), the correction keeps its own no-grad pass."""
    from sglightning.models import load_policy
    from sglightning.traits import drops_out

    model, _ = load_policy(PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8))
    assert not drops_out(model)
    model.config.attention_dropout = 0.1  # attention dropout is a call inside attention, not a layer
    assert drops_out(model)
    model.config.attention_dropout = 0.0
    model.config.router_jitter_noise = 0.01  # a mixture of experts' router noise, in train mode only
    assert drops_out(model)
    model, _ = load_policy(PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, lora_dropout=0.1))
    assert drops_out(model)


# ==================================================================== the vLLM engine's client side, on fake servers
class _FakeClient:
    """A vLLM client whose completions are scripted: ``answer(body)`` returns the response or raises."""

    url = "http://127.0.0.1:9"

    def __init__(self, answer, healthy=True):
        self.answer, self._healthy, self.bodies = answer, healthy, []

    def completions(self, body):
        self.bodies.append(body)
        return self.answer(body)

    def healthy(self, timeout=5.0):
        return self._healthy

    def models(self):
        return ["base"]  # the base model; a synced adapter's name once a test loads one


def _fake_engine(client):
    import concurrent.futures

    from sglightning.engines.vllm import VLLMEngine

    engine = VLLMEngine(EngineConfig(backend="vllm", url=client.url))
    engine.client, engine.pool = client, concurrent.futures.ThreadPoolExecutor(4)
    return engine


def _one_token(body):
    return {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}}], "usage": {"prompt_tokens": 3}}


def test_a_server_that_returns_raw_log_probs_is_refused_naming_its_key():
    """A server given by engine.url started without --logprobs-mode processed_logprobs returns log π over the whole
    vocabulary at temperature 1, not log q over the allowed set: wrong old log-probs, which no probe caught (prompt
    log-probs are raw in every mode). One token drawn from one allowed token tells: its processed log q is 0."""
    from sglightning.errors import ConfigError

    def answer(logprob):
        return lambda body: {"choices": [{"token_ids": body["allowed_token_ids"],
                                          "logprobs": {"token_logprobs": [logprob]}}]}

    client = _FakeClient(answer(0.0))
    _fake_engine(client)._warm_up()  # the control: processed log-probs
    assert client.bodies[0]["allowed_token_ids"] == [3] and client.bodies[0]["temperature"] == 0.5
    with pytest.raises(ConfigError, match=r"^model\.engine\.url: the vLLM server returns raw log-probs .*"
                                          r"--logprobs-mode processed_logprobs"):
        _fake_engine(_FakeClient(answer(-6.2)))._warm_up()


def test_a_broken_answer_fails_the_request_not_the_run():
    """http.client's errors are no OSError: a port answering with another protocol raised from healthy() (a
    traceback, not the one-line ConfigError), and an answer cut short escaped the request's failure handling."""
    import socketserver
    import threading

    from sglightning.engines.server import RequestFailed, VLLMClient

    replies = {"banner": b"SSH-2.0-OpenSSH_9.6\r\n", "cut": b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{\"ch"}

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            self.request.sendall(replies[self.server.kind])

    for kind in replies:
        with socketserver.TCPServer(("127.0.0.1", 0), Handler) as server:
            server.kind = kind
            threading.Thread(target=server.serve_forever, daemon=True).start()
            client = VLLMClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5)
            if kind == "banner":
                assert client.healthy(timeout=5) is False
            with pytest.raises(RequestFailed, match="a broken answer") as err:
                client.completions({"prompt": [1]})
            assert err.value.engine_side
            server.shutdown()
    engine = _fake_engine(_FakeClient(lambda body: {"object": "error"}))  # a 200 without choices: this request fails
    session = engine.session(None, 0)
    session.feed([[1, 2, 3]])
    from sglightning.engines.program import Free

    pieces = session.run([[Free(2, frozenset())]])[0]
    assert "no token ids and log-probs" in pieces[-1].error


def test_a_server_that_lost_the_adapter_stops_the_step():
    """A server at engine.url that restarted no longer has the synced adapter: every request answered 404, each
    counted as its own episode's failure, and the step trained on nothing until the next version's sync."""
    from sglightning.engines.program import Free
    from sglightning.engines.server import RequestFailed
    from sglightning.errors import EngineError

    def missing(body):
        raise RequestFailed("HTTP 404 from /v1/completions: The model `policy-v3.x` does not exist.")

    for served, stops in ((["base"], True), (["base", "policy-v3.x"], False)):  # the control: still served
        client = _FakeClient(missing)
        client.models = lambda served=served: served  # noqa: B023 (bound here)
        engine = _fake_engine(client)
        engine.adapter_name, engine.version = "policy-v3.x", 3
        session = engine.session(None, 0)
        session.feed([[1, 2, 3], [1, 2, 4]])
        if stops:
            with pytest.raises(EngineError, match="no longer serves policy-v3.x .*does not exist"):
                session.run([[Free(2, frozenset())]] * 2)
            assert engine.version is None  # the next rollout syncs again
        else:
            assert all(p[-1].error for p in session.run([[Free(2, frozenset())]] * 2))


def test_every_vllm_request_names_neutral_sampling_settings():
    """A field a request leaves out comes from the model's generation_config.json on a server started without
    --generation-config vllm (Qwen3: top_k 20, top_p 0.95): the engine would draw from a cut distribution the
    trainer never scores.  Every request names them; a launched server is started with --generation-config vllm."""
    from sglightning.engines.program import Choice, Free
    from sglightning.engines.vllm import NEUTRAL_SAMPLING

    client = _FakeClient(lambda body: {"choices": [{"token_ids": [body.get("allowed_token_ids", [5])[0]],
                                                    "logprobs": {"token_logprobs": [-0.5]}}], "usage": {}})
    engine = _fake_engine(client)
    session = engine.session(None, 0, temperature=0.7)
    session.feed([[1, 2, 3]])
    session.run([[Free(1, frozenset()), Choice([[7], [8]])]])
    assert len(client.bodies) == 2
    for body in client.bodies:
        assert {k: body[k] for k in NEUTRAL_SAMPLING} == {"top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                                          "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                          "frequency_penalty": 0.0}
        assert body["temperature"] == 0.7
    engine.model_path = "m"
    cmd = engine.command(8000)
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"


@pytest.mark.parametrize("healthy,rows,failing,code,raises", [
    (False, 2, {0}, 500, "no longer answers /health"),  # an engine that died answered its last requests with errors
    (True, 2, {0, 1}, 500, "every request of this turn failed on the engine's side"),  # e.g. a hung engine core
    (True, 2, {0}, 500, None),  # one request failed on a healthy engine: its episode fails, the others go on
    (True, 2, {0, 1}, 400, None),  # the requests' own failures (e.g. past max_model_len): their episodes fail
    (True, 1, {0}, 500, None),  # the last live row of a rollout, or a one-task validation batch: its episode only
])
def test_a_vllm_engine_that_fails_its_requests_abandons_the_step(healthy, rows, failing, code, raises):
    """The client took an HTTP 500 (or a timeout) as one row's failure, so a dying engine gave a whole step of failed
    episodes that was trained on and checkpointed; only the next step said the engine was gone."""
    from sglightning.engines.program import Free
    from sglightning.engines.server import RequestFailed
    from sglightning.errors import EngineError

    def answer(body):
        if body["prompt"][0] in failing:
            raise RequestFailed(f"HTTP {code} from /v1/completions: EngineDeadError", code >= 500)
        return _one_token(body)

    session = _fake_engine(_FakeClient(answer, healthy=healthy)).session(None, 0)
    session.feed([[i] for i in range(rows)])
    programs = [[Free(1, frozenset())] for _ in range(rows)]
    if raises:
        with pytest.raises(EngineError, match=raises):
            session.run(programs)
    else:
        out = session.run(programs)
        assert [bool(o[-1].error) for o in out] == [i in failing for i in range(rows)]


def test_a_launched_vllm_server_is_refused_on_several_nodes():
    """Rank 0 would send every node its 127.0.0.1 URL and its local adapter folders; one line instead."""
    from sglightning.engines.base import RunContext
    from sglightning.engines.vllm import VLLMEngine
    from sglightning.errors import ConfigError

    with pytest.raises(ConfigError, match="model.engine.url: a launched vLLM server serves one machine, and this "
                                          "run has 2 nodes"):
        VLLMEngine(EngineConfig(backend="vllm")).start(RunContext(rank=0, world_size=4, nodes=2))


@pytest.mark.parametrize("trainer_dtype", [torch.bfloat16, torch.float32])
def test_the_sync_tolerance_follows_the_trainers_precision_too(tmp_path, trainer_dtype):
    """An fp32 engine against a bf16 trainer (policy.dtype auto on a GPU) differs by ~0.03 on the probe: with the
    fp32 bound of 1e-3 the first sync stopped the run after the server's minutes-long start."""
    import contextlib

    from sglightning.errors import EngineError

    cfg = EngineConfig(backend="vllm")
    assert cfg.tolerance() == 1e-3 and cfg.tolerance(trainer_half=True) == 0.15
    assert EngineConfig(backend="vllm", dtype="bfloat16").tolerance() == 0.15
    assert EngineConfig(backend="vllm", sync_tolerance=0.5).tolerance(trainer_half=True) == 0.5

    class Client(_FakeClient):  # the engine's probe log-probs, 0.03 off the trainer's (bf16 rounding)
        def load_lora(self, name, path):
            pass

        def unload_lora(self, name):
            pass

    client = Client(lambda body: {"prompt_logprobs": [None] + [{str(t): {"logprob": -1.03}}
                                                               for t in body["prompt"][1:]]})
    engine = _fake_engine(client)
    engine._adapter_root = tmp_path
    embeddings = torch.nn.Embedding(4, 2).to(trainer_dtype)

    class Weights:
        version, sharding = 1, None
        model = type("Model", (), {"get_input_embeddings": lambda self: embeddings})()
        tokenizer = type("Tok", (), {"encode": lambda self, text: [1, 2, 3, 4]})()

        def gathered(self):
            return contextlib.nullcontext()

        def adapter_state(self):
            return {}

        def write_adapter(self, state, folder):
            folder.mkdir()

        def probe_logprobs(self, ids):
            return [None] + [-1.0] * (len(ids) - 1)

    if trainer_dtype == torch.bfloat16:
        with engine.sampling(Weights()) as synced:
            assert synced["sync_gap"] == pytest.approx(0.03)
    else:
        with pytest.raises(EngineError, match="differ from the trainer's by 0.03"), engine.sampling(Weights()):
            pass


def test_a_plain_trainer_fit_checks_the_engine_like_the_cli(tmp_path):
    """The engine's checks ran only in the CLI: Trainer.fit accepted a bf16 vLLM engine with no rollout correction
    and trained on its log-probs as the old policy."""
    from tiny import tiny_module, tiny_trainer

    from sglightning.errors import ConfigError
    from sglightning.grpo import GRPOConfig

    module = tiny_module(engine=EngineConfig(backend="vllm", dtype="bfloat16", url="http://127.0.0.1:9"),
                         grpo=GRPOConfig(rollout_correction=None))
    with pytest.raises(ConfigError, match="grpo.rollout_correction: an engine in bfloat16"):
        tiny_trainer(tmp_path).fit(module)
    assert module.policy is None  # refused before the model loaded


def _engine_ranks(tmp_path: Path, scenario: str) -> tuple[dict, dict]:
    """What each of two gloo ranks raised in ``scenario`` (tests/engine_ranks.py), and after how long."""
    import json

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(here / "engine_ranks.py"), str(tmp_path), scenario], env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return tuple(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))


@pytest.mark.parametrize("scenario,raised", [("sync", "EngineError: the vLLM engine refused adapter"),
                                              ("rollout", "EngineError: every request of this turn failed")])
def test_an_engine_failing_on_rank_0_fails_every_rank_at_once(tmp_path, scenario, raised):
    """Rank 0 loads the adapter into the shared server and broadcasts its name: when it raised before the broadcast,
    the other ranks waited there until the process group timed out (30 min by default).  The same for a rollout
    whose engine failed on one rank only: the others went on to the update's collectives."""
    r0, r1 = _engine_ranks(tmp_path, scenario)
    assert r0["raised"].startswith(raised)
    assert r1["raised"] == r0["raised"] and r1["s"] < 20, r1


@pytest.mark.parametrize("scenario,own,other", [
    ("oom", "OutOfMemoryError: CUDA out of memory", "OutOfMemoryError: rank 1's rollout: OutOfMemoryError: CUDA out"),
    ("error", "KeyError: 'answer'", "EngineError: rank 1's rollout: KeyError: 'answer'")])
def test_any_error_in_one_ranks_rollout_ends_every_ranks(tmp_path, scenario, own, other):
    """Only an EngineError was exchanged: an out-of-memory error (or a bug) on one rank left the others waiting in
    their next collective until the process group timed out. The failing rank raises its own error; the others say it
    (out of memory as out of memory: their line names the keys that shrink it)."""
    r0, r1 = _engine_ranks(tmp_path, scenario)
    assert r1["raised"].startswith(own) and r0["raised"].startswith(other), (r0, r1)
    assert r0["s"] < 20, r0


def test_a_launched_vllm_server_loads_the_trainers_revision_and_code(monkeypatch):
    """The server loaded a hub id's default branch (and no remote code) whatever policy.revision said: other weights
    than the trainer's, which a probe passes when they differ little."""
    from sglightning.engines.base import RunContext
    from sglightning.engines.vllm import VLLMEngine

    engine = VLLMEngine(EngineConfig(backend="vllm"))
    monkeypatch.setattr(engine, "_launch", lambda: None)
    policy = PolicyConfig(name_or_path="org/model", revision="v2", trust_remote_code=True)
    engine.start(RunContext(policy=policy))
    try:
        cmd = engine.command(8000)
        assert cmd[cmd.index("--model") + 1:cmd.index("--served-model-name")] == [
            "org/model", "--revision", "v2", "--trust-remote-code"]
    finally:
        engine.close()
