"""Run by tests/test_distributed.py as a script: the tiny config under DDP, FSDP2 or FSDP1 on 2 CPU processes (gloo).

    python tests/ddp_run.py OUT_DIR ddp|fsdp2|fsdp1 [bf16] [dropout [idle1]] [compiled]

``bf16``: the base model in bfloat16 (LoRA weights stay fp32) with ``precision="bf16-mixed"``, as the multi-GPU configs
run it (mixed dtypes inside one sharded unit).  ``dropout``: LoRA dropout 0.1 (the rollout correction then runs its
own no-grad pass, a collective under FSDP).  ``idle1``: rank 1 scores no rows (its rows left out, as zero-advantage rows
are), so under FSDP it must run as many forwards as rank 0 with nothing of its own.  ``compiled``: the update's
decoder layers compiled (``update.compile``), inside the sharded units.

Lightning re-launches this script for rank 1.  Each rank writes ``OUT_DIR/rank{r}.pt``: its trainable parameters after
training (rank 0 also exports the peft adapter to ``OUT_DIR/adapter``), and per step its task seeds, its episodes'
outcomes and the success rate it logged; rank 0 also writes the merged validation report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from tiny import tiny_module

from sglightning.callbacks import AdapterExport
from sglightning.data import RolloutConfig
from sglightning.distributed import release_process_group
from sglightning.errors import exit_process
from sglightning.models import PolicyConfig
from sglightning.module import EvalConfig
from sglightning.update import UpdateConfig


class Record(Callback):
    def __init__(self):
        self.steps = []
        self.initial = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = pl_module.adapter_state_dict()  # full tensors (gathered under FSDP: every rank calls it)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rb = batch.rollout  # trainer callbacks run before the module's RolloutCallback clears it
        self.steps.append({
            "seeds": sorted({e.seed for e in rb.episodes}),
            "won": [bool(e.won) for e in rb.episodes],
            "logged_success": pl_module.history[-1]["rollout/success_rate"],
            "logged_episodes": pl_module.history[-1]["rollout/episodes"],
            "logprob_gap": pl_module.history[-1].get("policy/logprob_gap_sampler_trainer", float("nan")),
            "correction_s": pl_module.history[-1].get("time/update_correction_s"),  # the separate pass's time
            "is_weight_mean": pl_module.history[-1].get("policy/is_weight_mean"),  # merged over ranks
            "is_weight_rank": PASSES[-1].get("policy/is_weight_mean") if PASSES else None,  # this rank's own
            "passes": len(PASSES),
        })


#: what each of this rank's separate rollout-correction passes returned (its statistics; {} with no rows)
PASSES: list[dict] = []


def _rank1_scores_nothing() -> None:
    """``prepare_update`` on rank 1 leaves every row out (its counts stay: the loss is one mean over both ranks); every
    rank notes what its correction passes return."""
    import dataclasses

    import sglightning.module

    real, passed = sglightning.module.prepare_update, sglightning.module.SelfGuideModule._rollout_correction

    def correction(self, *args, **kwargs):
        PASSES.append(passed(self, *args, **kwargs))
        return PASSES[-1]

    sglightning.module.SelfGuideModule._rollout_correction = correction

    def prepare(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.distributed.get_rank() == 1:
            out = dataclasses.replace(out, data=None, adv=None, rows_left_out=True)
        return out

    sglightning.module.prepare_update = prepare


def main(out: Path, strategy: str, bf16: bool = False, dropout: bool = False, idle1: bool = False,
         compiled: bool = False) -> None:
    torch.manual_seed(0)
    if idle1:
        _rank1_scores_nothing()
    policy = PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, lora_dropout=0.1 if dropout else 0.0,
                          dtype="bfloat16" if bf16 else "float32")
    module = tiny_module(  # the test suite's tiny setup, with longer episodes, one-sample micro-batches, 5 eval tasks
        policy=policy,
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_steps=3),
        update=UpdateConfig(micro_batch_size=1, compile=compiled),
        evaluation=EvalConfig(num_tasks=5, tasks_per_batch=2),
    )
    if strategy == "fsdp2":
        from sglightning.strategies import FSDP2Strategy

        strat = FSDP2Strategy()
    elif strategy == "fsdp1":
        from cpu_fsdp import CPUFSDPStrategy

        strat = CPUFSDPStrategy()
    else:
        strat = "ddp"
    rec = Record()
    trainer = Trainer(
        max_steps=3, accelerator="cpu", devices=2, strategy=strat, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[rec],
        default_root_dir=out, precision="bf16-mixed" if bf16 else "32-true",
    )
    trainer.fit(module)
    trainer.limit_val_batches = 1.0
    trainer.validate(module)
    rank = trainer.global_rank
    params = module.adapter_state_dict()
    AdapterExport().export(trainer, module)  # rank 0 writes OUT_DIR/adapter (a gather under FSDP: every rank calls it)
    base_dtypes = sorted({str(p.dtype) for p in module.peft_model.get_base_model().parameters() if not p.requires_grad})
    torch.save({"params": params, "base_dtypes": base_dtypes, "initial": rec.initial, "steps": rec.steps,
                "rollouts_done": module.rollouts_done, "global_step": trainer.global_step}, out / f"rank{rank}.pt")
    if rank == 0:
        (out / "val_report.json").write_text(json.dumps(module.val_report, default=str))
    release_process_group()


if __name__ == "__main__":
    flags = sys.argv[3:]
    strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    main(Path(sys.argv[1]), strategy, bf16="bf16" in flags, dropout="dropout" in flags, idle1="idle1" in flags,
         compiled="compiled" in flags)
    exit_process(0)  # as the CLI ends a distributed run: gloo's threads left to teardown can abort the process
