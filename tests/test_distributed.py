"""Two CPU processes (gloo) under Lightning's DDP and under FSDP2 (ModelParallelStrategy + fully_shard): disjoint task
seeds, identical adapters on both ranks after training, logged success = the mean over both ranks' episodes,
validation played once across ranks and merged; FSDP2 (generation included) trains to the same adapters as DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _run(out: Path, strategy: str) -> tuple[dict, dict, dict]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(HERE))
    res = subprocess.run([sys.executable, str(HERE / "ddp_run.py"), str(out), strategy], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    r0 = torch.load(out / "rank0.pt", weights_only=False)
    r1 = torch.load(out / "rank1.pt", weights_only=False)
    return r0, r1, json.loads((out / "val_report.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {s: _run(tmp_path_factory.mktemp(s), s) for s in ("ddp", "fsdp2")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_cpu_processes(runs, strategy):
    r0, r1, report = runs[strategy]
    assert r0["rollouts_done"] == r1["rollouts_done"] == 3 and r0["global_step"] == r1["global_step"] == 3
    # one optimiser, one gradient: the adapters are identical on both ranks (and were trained)
    assert r0["params"].keys() == r1["params"].keys()
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    assert any(not torch.equal(r0["params"][n], r0["initial"][n]) for n in r0["params"])
    for s0, s1 in zip(r0["steps"], r1["steps"], strict=True):
        assert len(s0["seeds"]) == len(s1["seeds"]) == 2 and not set(s0["seeds"]) & set(s1["seeds"])  # disjoint
        everyone = s0["won"] + s1["won"]
        expected = sum(everyone) / len(everyone)
        assert s0["logged_success"] == pytest.approx(expected) and s1["logged_success"] == pytest.approx(expected)
        assert s0["logged_episodes"] == len(everyone)  # counts are summed over ranks
    # validation: 5 tasks in chunks of 2 over 2 ranks (rank 0 plays 4, rank 1 plays 1 + a padding batch), each once
    assert report["world_size"] == 2
    for mode in ("sg", "nosg"):
        seeds = sorted(e["seed"] for e in report["episodes"][mode])
        assert seeds == [1_000_000 + i for i in range(5)]
        assert report["modes"][mode]["episodes"] == 5
        won = [e["won"] for e in report["episodes"][mode]]
        assert report["modes"][mode]["rollout/success_rate"] == pytest.approx(sum(won) / len(won))


def test_fsdp2_trains_to_the_same_adapters_as_ddp(runs):
    """Same seeds, same sampling, full weights gathered for generation, gradients reduced by FSDP2 instead of our
    all-reduce: the same update up to float summation order."""
    ddp, fsdp = runs["ddp"][0], runs["fsdp2"][0]
    assert [s["seeds"] for s in ddp["steps"]] == [s["seeds"] for s in fsdp["steps"]]
    for name, p in ddp["params"].items():
        assert torch.allclose(p, fsdp["params"][name], atol=1e-5), name


def test_cli_fit_under_ddp_writes_one_run_folder(tmp_path):
    """The CLI path under DDP: config, checkpoint, adapter and validation (one rank has only a padding batch)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "sglightning.cli", "fit", "--config", str(HERE.parent / "configs" / "tiny.yaml"),
           "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
           f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    run = tmp_path / "tiny" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "adapter" / "adapter_config.json").is_file()
    assert "# package versions of this run" in (run / "config.yaml").read_text()
    assert not (tmp_path / "tiny" / "version_1").exists()  # rank 1 wrote nothing of its own
    assert "validation [self-guidance on] success" in res.stdout


def test_cli_fsdp2_distributed_checkpoint_resumes(tmp_path):
    """FSDP2 from the CLI: a sharded `last.ckpt/` folder, the adapter gathered and exported, `--ckpt_path last`
    restores the sharded state and trains on."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    base = [sys.executable, "-m", "sglightning.cli", "fit", "--config", str(HERE.parent / "configs" / "tiny.yaml"),
            "--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
            "--trainer.strategy.data_parallel_size=2", "--trainer.strategy.tensor_parallel_size=1",
            "--trainer.devices=2", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    res = subprocess.run(base + ["--trainer.max_steps=2"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    run = tmp_path / "tiny" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_dir()  # torch.distributed.checkpoint shards
    assert json.loads((run / "adapter" / "sglightning.json").read_text())["global_step"] == 2
    res = subprocess.run(base + ["--trainer.max_steps=3", "--ckpt_path=last"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resuming from" in res.stderr and "Restored all states" in res.stdout + res.stderr
    assert json.loads((run / "adapter" / "sglightning.json").read_text())["global_step"] == 3
