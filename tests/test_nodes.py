"""Several nodes, played on one machine: two `sglightning fit` processes, one rank each, started as a cluster starts
one per node, through Lightning's own variables (MASTER_ADDR, MASTER_PORT, NODE_RANK) and through torchrun's
rendezvous. One run folder, written by global rank 0 alone; the second node prints nothing; validation is shared over
the global ranks; `--ckpt_path last` resumes on every node. Each node is told `--threads 1`: the two share this
machine's cores, where real nodes would not."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from processes import free_port, run_together

HERE = Path(__file__).resolve().parent
TINY = str(HERE.parent / "configs" / "tiny.yaml")

pytestmark = pytest.mark.slow


def _fit_args(out: Path, *extra: str) -> list[str]:
    return ["fit", "--config", TINY, "--trainer.strategy=ddp", "--trainer.accelerator=cpu", "--trainer.num_nodes=2",
            "--trainer.devices=1", "--trainer.enable_progress_bar=false", "--threads=1",
            f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}", *extra]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NODE_RANK", "LOCAL_RANK", "RANK")}
    return dict(env, TOKENIZERS_PARALLELISM="false", **extra)


def _lightning_nodes(out: Path, *extra: str):
    """Node 0 and node 1 as Lightning's launcher expects them without a cluster manager: the same command on each,
    the master's address and port, and each node's rank."""
    port = str(free_port())
    cmd = [sys.executable, "-m", "sglightning.cli", *_fit_args(out, *extra)]
    envs = [_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(n)) for n in (0, 1)]
    return run_together([cmd, cmd], 600, envs)


def test_two_nodes_write_one_run_validate_once_and_resume(tmp_path):
    first, second = _lightning_nodes(tmp_path, "--trainer.max_steps=2")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-4000:]
    assert (first.stderr, second.stdout, second.stderr) == ("", "", "")  # node 1 prints nothing at all
    # two ranks × 8 episodes a step (one process plays 8) × 2 steps
    assert "sglightning fit: 2 GRPO steps, 32 episodes" in first.stdout, first.stdout
    runs = sorted(p.name for p in (tmp_path / "tiny").iterdir())
    assert runs == ["version_0"], runs  # node 1 took no version folder of its own
    run = tmp_path / "tiny" / "version_0"
    report = json.loads((run / "validation_report.json").read_text())
    assert report["world_size"] == 2
    for mode, episodes in report["episodes"].items():  # each held-out task played once over the global ranks
        seeds = [e["seed"] for e in episodes]
        assert len(seeds) == len(set(seeds)) == report["modes"][mode]["episodes"], (mode, seeds)

    first, second = _lightning_nodes(tmp_path, "--trainer.max_steps=3", "--ckpt_path=last")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-4000:]
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in first.stderr, first.stderr
    assert (second.stdout, second.stderr) == ("", "")
    assert json.loads((run / "adapter" / "sglightning.json").read_text())["global_step"] == 3
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["version_0"]


def test_two_nodes_under_torchrun(tmp_path):
    """The elastic rendezvous of torchrun (the command docs/scale-out.md gives): it, not the command line, decides which
    node holds global rank 0, so either node's output may be the run's."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-nodes", "-m", "sglightning.cli",
           *_fit_args(tmp_path, "--trainer.max_steps=2", "--trainer.limit_val_batches=0")]
    nodes = run_together([cmd, cmd], 600, [_env(), _env()])
    assert all(n.returncode == 0 for n in nodes), "".join(n.stderr for n in nodes)[-4000:]
    printed = [n for n in nodes if n.stdout]
    assert len(printed) == 1 and "sglightning fit: 2 GRPO steps, 32 episodes" in printed[0].stdout
    # torch's agents may log their own exit barrier's race (pytorch#69520); nothing of ours goes to stderr
    assert not [line for n in nodes for line in n.stderr.splitlines() if line.startswith("sglightning")]
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["version_0"]
    run = tmp_path / "tiny" / "version_0"
    assert json.loads((run / "adapter" / "sglightning.json").read_text())["global_step"] == 2
