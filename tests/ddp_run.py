"""Run by tests/test_distributed.py as a script: the tiny config under DDP or FSDP2 on 2 CPU processes (gloo).

    python tests/ddp_run.py OUT_DIR ddp|fsdp2

Lightning re-launches this script for rank 1.  Each rank writes ``OUT_DIR/rank{r}.pt``: its trainable parameters after
training, and per step its task seeds, its episodes' outcomes and the success rate it logged; rank 0 also writes
the merged validation report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from sglightning.module import EvalConfig, GRPOConfig
from sglightning.rollout import RolloutConfig
from test_trainer import tiny_module


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain full tensor (FSDP2 shards are DTensors: gathered, a collective on every rank)."""
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).cpu().clone()


class Record(Callback):
    def __init__(self):
        self.steps = []
        self.initial = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = {n: _full(p) for n, p in pl_module.policy.named_parameters() if p.requires_grad}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rb = pl_module.current_rollout
        self.steps.append({
            "seeds": sorted({e.seed for e in rb.episodes}),
            "won": [bool(e.won) for e in rb.episodes],
            "logged_success": pl_module.history[-1]["rollout/success_rate"],
            "logged_episodes": pl_module.history[-1]["rollout/episodes"],
        })


def main(out: Path, strategy: str) -> None:
    torch.manual_seed(0)
    module = tiny_module(  # the test suite's tiny setup, with longer episodes, one-sample micro-batches, 5 eval tasks
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_steps=3),
        grpo=GRPOConfig(kl_coef=0.01, micro_batch_size=1),
        evaluation=EvalConfig(num_tasks=5, tasks_per_batch=2),
    )
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strat = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strat = "ddp"
    rec = Record()
    trainer = Trainer(
        max_steps=3, accelerator="cpu", devices=2, strategy=strat, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[rec],
        default_root_dir=out,
    )
    trainer.fit(module)
    trainer.limit_val_batches = 1.0
    trainer.validate(module)
    rank = trainer.global_rank
    params = {n: _full(p) for n, p in module.policy.named_parameters() if p.requires_grad}
    torch.save({"params": params, "initial": rec.initial, "steps": rec.steps, "rollouts_done": module.rollouts_done,
                "global_step": trainer.global_step}, out / f"rank{rank}.pt")
    if rank == 0:
        (out / "val_report.json").write_text(json.dumps(module.val_report, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ddp")
