"""Stopping cleanly: SIGTERM (preemption), Ctrl-C, and validations that a resume plays again.

* One process: Lightning's SIGTERM handler sets its flag; the rollout in progress is abandoned at its next env round
  (:func:`sigterm_check`), Lightning stops after the current step, and :class:`PreemptionCheckpoint` saves
  ``last.ckpt`` and says how to resume.
* Several processes: the handler only notes the signal (:func:`install_sigterm_notifier`); the ranks compare their
  notes in one all-reduce at the start of each step and validation batch (:func:`agree_on_sigterm`) and stop there
  together, all saving the same step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sglightning import distributed
from sglightning.checkpointing import (
    RUN_VERSION_KEY,
    CheckpointError,
    checkpoint_dir,
    checkpoint_keeper,
    load_checkpoint_file,
    pin_run_dir,
    run_dir,
)


def sigterm_check(trainer: Trainer | None):
    """What a rollout asks before each round: has this process received SIGTERM (Lightning's handler sets the flag;
    the default handler is replaced while the trainer runs)?  Only in a single process: under several, a rank that
    abandoned its rollout alone would leave the others waiting in the update's collectives, so the ranks stop
    together at the next step or validation batch (:func:`agree_on_sigterm`) and the rollout in progress plays out."""
    if trainer is None or trainer.world_size > 1:
        return None
    return lambda: bool(getattr(trainer, "received_sigterm", False))


def install_sigterm_notifier(trainer: Trainer) -> None:
    """Under several processes, replace what Lightning does on SIGTERM with: forward the signal to the processes this
    one launched (as Lightning does) and note it locally — nothing else.

    Lightning's handler also broadcasts from inside the signal handler, and its loops stop each rank on its own flag
    at the end of a step.  A signal handler runs between two Python bytecodes of whatever the rank is doing, so that
    broadcast lands in the middle of the rank's own sequence of collectives (rank 0 may be generating while rank 1
    waits in the update's gradient all-reduce), and ranks that stop at different steps wait forever on each other's
    collectives: both ways the run hangs instead of saving.  Here the ranks compare their notes in one all-reduce at
    points every rank reaches in the same order — the start of each training step and of each validation batch
    (:func:`agree_on_sigterm`) — and only then set Lightning's flag, so every rank stops at the same place.  Called
    from ``setup``: Lightning registers the handler afterwards and picks this one up."""
    conn = trainer._signal_connector
    conn.sglightning_sigterm = False
    if trainer.world_size <= 1:
        return  # Lightning's own handler: it sets the flag, and with one process there is no collective

    def note_sigterm(signum, frame) -> None:
        if not conn.sglightning_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (Lightning's subprocess launcher)
        conn.sglightning_sigterm = True

    conn._sigterm_notifier_fn = note_sigterm


def agree_on_sigterm(trainer: Trainer, device: torch.device | str = "cpu") -> bool:
    """Has any rank received SIGTERM?  Under several processes one all-reduce (max) of the ranks' notes, which every
    rank must call at the same point; when one has, Lightning's ``received_sigterm`` is set on every rank.  In a
    single process: Lightning's flag as it stands."""
    conn = trainer._signal_connector
    if trainer.world_size <= 1:
        return bool(conn.received_sigterm)
    noted = torch.tensor([1.0 if getattr(conn, "sglightning_sigterm", False) else 0.0], device=device)
    if float(distributed.all_reduce(noted, op=torch.distributed.ReduceOp.MAX).item()) > 0:
        conn.received_sigterm = True
    return bool(conn.received_sigterm)


def _validation_pending(checkpoint: dict) -> None:
    """Edit a checkpoint being written so that its validation-loop progress reads "stopped mid-evaluation": the state
    in which Lightning's resume plays that validation again (from its first batch: the epoch hooks reset what the
    module accumulates) before training on.  Saved as they stand (a validation not yet started, or stopped in a
    batch's start hook, or between batches), the counters read "validation finished" and the resume would skip it.
    The current counts say "first batch started" so that the replay covers every batch (otherwise Lightning counts the
    batches done before the stop as fetched and ends the replay early)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.val_loop.batch_progress")
    if progress is None:
        return
    for key, ready in (("total", max(int(progress["total"]["ready"]), 1)), ("current", 1)):
        progress[key].update(ready=ready, started=ready, processed=ready - 1, completed=ready - 1)
    progress["is_last_batch"] = False


def validation_pending(checkpoint: dict) -> bool:
    """Whether a checkpoint reads "stopped mid-evaluation" (:func:`_validation_pending` wrote it so, or a run died in
    a validation): its validation loop started a batch it did not complete."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.val_loop.batch_progress") or {}
    current = progress.get("current", {})
    return current.get("ready", 0) > current.get("completed", 0)


def _saved_steps(last: Path, default: int) -> int:
    """The completed steps ``last`` holds (memory-mapped: the tensors are not read): one fewer than the module's count
    when Ctrl-C came while the step's save was being written.  ``default`` for a sharded (folder) checkpoint."""
    try:
        return int(load_checkpoint_file(last, mmap=True)["sglightning"]["rollouts_done"])
    except (CheckpointError, KeyError, TypeError, ValueError):  # a folder, or a file of another release
        return default


class PreemptionCheckpoint(Callback):
    """SIGTERM (preemption): Lightning stops at the end of the current step, or the rollout abandons its step; then
    this saves ``last.ckpt`` (atomically) where ``--ckpt_path last`` finds it, exports the adapter, says how to
    resume, and the process exits 0.

    Validations inside fit are made resumable too: ``last.ckpt`` is written again as each one starts, marked
    "validation pending", and once more when it ends, unmarked.  A run stopped in between (SIGTERM, ``kill -9``,
    Ctrl-C) resumes by playing that validation again, so a learning curve loses no evaluation point; a run stopped
    after it does not play it twice."""

    def __init__(self) -> None:
        self._validating_in_fit = False
        #: the exit code the CLI ends with after an interruption: 130 Ctrl-C, 143 SIGTERM outside fit (0: none)
        self.exit_code = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        install_sigterm_notifier(trainer)
        pin_run_dir(trainer)  # every rank writes to rank 0's run folder

    @classmethod
    def last_path(cls, trainer: Trainer) -> Path:
        """Where ``--ckpt_path last`` finds ``last.ckpt``: its ModelCheckpoint's folder, else the run's
        ``checkpoints``."""
        return checkpoint_dir(trainer) / "last.ckpt"

    def _save_last(self, trainer: Trainer) -> None:
        """Rewrite ``last.ckpt`` (only when a ModelCheckpoint keeps one, and never in ``fast_dev_run``, which saves
        nothing)."""
        if checkpoint_keeper(trainer) is not None and not trainer.fast_dev_run:
            trainer.save_checkpoint(self.last_path(trainer), weights_only=False)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validating_in_fit = True
            self._save_last(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validating_in_fit:
            self._validating_in_fit = False
            self._save_last(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if trainer.loggers and not trainer.fast_dev_run:  # the run's version folder, for a resume from a
            checkpoint[RUN_VERSION_KEY] = run_dir(trainer).name  # ModelCheckpoint's own dirpath
        if self._validating_in_fit:
            _validation_pending(checkpoint)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            self.exit_code = 130
            self._interrupted(trainer, pl_module)
            return
        if not isinstance(exception, SIGTERMException):
            return
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            if trainer.state.fn != "fit":
                self.exit_code = 128 + 15
            self._stopped_evaluating(trainer)
            return
        path = self.last_path(trainer)
        if trainer.fast_dev_run:  # which saves nothing, by its promise
            if trainer.is_global_zero:
                print("sglightning: SIGTERM received; fast_dev_run stopped, nothing saved", file=sys.stderr, flush=True)
            return
        trainer.save_checkpoint(path, weights_only=False)  # full state (says so: Lightning logs the default)
        if trainer.is_global_zero:
            step = pl_module.rollouts_done
            pending = f" (the validation at step {step} runs again)" if self._validating_in_fit else ""
            print(
                f"sglightning: SIGTERM received; stopped after {step} completed step{'s' * (step != 1)}, "
                f"saved {path}. "
                f"Resume with the same command plus --ckpt_path last{pending}",
                file=sys.stderr,
                flush=True,
            )

    @staticmethod
    def _stopped_evaluating(trainer: Trainer) -> None:
        """SIGTERM while evaluating outside training (``validate``, or fit's evaluation before the first step):
        nothing was trained, so nothing is saved and no partial result is reported.  ``validate`` exits 143 (the
        evaluation did not finish); fit exits 0 like any preemption."""
        if trainer.is_global_zero:
            what = "validation" if trainer.state.fn != "fit" else "the evaluation before the first step"
            print(f"sglightning: SIGTERM received; {what} stopped before it finished: nothing was saved or reported. "
                  "Run the same command again to start over", file=sys.stderr, flush=True)

    @staticmethod
    def _interrupted(trainer: Trainer, pl_module: LightningModule) -> None:
        """Ctrl-C: the interrupted step may be half done, so nothing new is saved; ``last.ckpt`` (written after every
        completed step) is where ``--ckpt_path last`` resumes.  The CLI exits 130."""
        if not trainer.is_global_zero:
            return
        if trainer.state.fn != "fit":
            print("sglightning: interrupted; the validation stopped before it finished: nothing was reported",
                  file=sys.stderr, flush=True)
            return
        last = PreemptionCheckpoint.last_path(trainer)
        if last.exists():
            done = _saved_steps(last, pl_module.rollouts_done)
            msg = (f"interrupted after {done} completed step{'s' * (done != 1)}; {last} holds the last of them. "
                   "Resume with the same command plus --ckpt_path last")
        else:
            msg = "interrupted before the first step completed; nothing to resume"
        print(f"sglightning: {msg}", file=sys.stderr, flush=True)
