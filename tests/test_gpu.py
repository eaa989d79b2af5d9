"""On a CUDA device only (skipped elsewhere; ``benchmarks/gpu_session.sh`` runs this file on a lent GPU): the
main command's seeded rollouts run there, and every decode step of the in-process engine plays the episodes the
dynamic cache plays, with the trainer's log-probs of them (fp32, the tiny model)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from sglightning.cli import cli_main
from sglightning.data import RolloutConfig, sampling_generator
from sglightning.engines import EngineConfig
from sglightning.engines.builtin import BuiltinEngine
from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig
from sglightning.models import PolicyConfig, load_policy
from sglightning.rollout import Rollout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
ENV = functools.partial(HouseholdEnv, difficulty=0, info_actions=False)


@pytest.fixture(scope="module")
def tiny_cuda():
    model, tok = load_policy(PolicyConfig(name_or_path="embedded:tiny", dtype="float32"), device="cuda")  # not bf16
    return model.to("cuda").eval(), tok


def _play(model, tok, compile_mode: str, mode: str, engine: BuiltinEngine | None = None):
    gc = GuidanceConfig(prompt_mode=mode, decoding="constrained", action_decoding="admissible", max_guidance_tokens=6)
    r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=3, max_steps=4, temperature=0.8),
                engine=engine or BuiltinEngine(EngineConfig(compile=compile_mode)))
    try:
        return r.run([1, 2, 3], generator=sampling_generator(0, 0, 0, device="cuda"))
    finally:
        r.close()


@pytest.mark.parametrize("compile_mode,mode", [("static", "two_call"), ("default", "single_stream"),
                                               ("reduce-overhead", "single_stream"), ("reduce-overhead", "two_call"),
                                               ("graphs", "single_stream")])
def test_every_decode_step_plays_the_dynamic_caches_episodes_on_cuda(tiny_cuda, compile_mode, mode):
    """The same tokens as the dynamic cache; a graph mode ran as CUDA graphs (torch skips them silently when a step
    cannot be captured: its count of skips must not move).  ``graphs``: the engine captures and replays them."""
    from torch._dynamo.utils import counters

    from sglightning.engines.static import GraphedStep

    model, tok = tiny_cuda
    skips, pieces = counters["inductor"]["cudagraph_skips"], counters["inductor"]["cudagraph_partitions"]
    engine = BuiltinEngine(EngineConfig(compile=compile_mode))
    a, b = _play(model, tok, "off", mode), _play(model, tok, compile_mode, mode, engine)
    assert len(a.samples) == len(b.samples) > 0
    for x, y in zip(a.samples, b.samples):
        assert x.ids == y.ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    assert counters["inductor"]["cudagraph_skips"] == skips
    graphed = [s for s in engine._steps.values() if isinstance(s, GraphedStep)]
    assert all(g.captured and g.replayed > g.captured and not g.failed for g in graphed)
    print(f"{compile_mode}, {mode}: {counters['inductor']['cudagraph_partitions'] - pieces} CUDA-graph pieces")  # -rA


def test_under_a_low_cache_memory_one_slot_cache_serves_both_calls_on_cuda(tiny_cuda):
    """``model.engine.cache_memory`` is a share of this GPU's memory; set that low, two_call's calls hand one cache
    back and forth (each prompt prefilled anew) and play the dynamic cache's tokens.  Eager steps (no compile: this
    file must stay short); part 7 of gpu_session.sh runs it compiled."""
    model, tok = tiny_cuda
    engine = BuiltinEngine(EngineConfig(compile="static", cache_memory=1e-6))
    assert engine.slots.limit(torch.device("cuda")) == int(1e-6 * torch.cuda.get_device_properties(0).total_memory)
    a, b = _play(model, tok, "off", "two_call"), _play(model, tok, "", "two_call", engine)
    assert [x.ids for x in a.samples] == [y.ids for y in b.samples]
    assert engine.slots.given_back > 0 and len(engine.slots.caches) == 1


def test_the_tiny_config_fits_resumes_and_validates_on_cuda(tmp_path):
    """The first GPU run's crash: seeded validation rollouts (before training, after it, and from a checkpoint) on
    CUDA, through the CLI."""
    common = ["--config", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
              f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.accelerator=gpu",
              "--trainer.precision=bf16-mixed", "--trainer.enable_progress_bar=false",
              "--model.evaluation.before_fit=true"]
    cli = cli_main(["fit", *common, "--trainer.max_steps=2"])
    assert len(cli.model.history) == 2 and cli.model.val_report_before and cli.model.val_report
    cli = cli_main(["fit", *common, "--trainer.max_steps=3", "--ckpt_path=last"])
    assert cli.model.global_step == 3
    cli = cli_main(["validate", *common, "--ckpt_path=last"])
    assert cli.model.val_report["step"] == 3
    assert list(tmp_path.rglob("adapter/adapter_model.safetensors"))  # the adapter export ran


def test_the_tiny_config_under_fsdp2_on_one_gpu(tmp_path):
    """FSDP2 on one device: the rollout gathers the weights (the decode step falls back to the dynamic cache: a
    compiled graph could not follow weights gathered anew each rollout), two steps, validation after."""
    cli = cli_main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
                    f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.accelerator=gpu",
                    "--trainer.devices=1", "--trainer.strategy.class_path=sglightning.strategies.FSDP2Strategy",
                    "--trainer.precision=bf16-mixed", "--trainer.enable_progress_bar=false", "--trainer.max_steps=2"])
    assert len(cli.model.history) == 2 and cli.model.val_report
