"""What a run prints: one progress bar (step k/N, s/step, success, λ), and nothing its user did not ask to see.

Each filter below removes one message we understand and that says nothing about the run (found by running
``sglightning fit`` on a fresh box); everything else — a real warning — still prints.
"""

from __future__ import annotations

import logging
import sys
import warnings

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

#: (message start, category) of warnings that are expected in every run of this trainer
_EXPECTED_WARNINGS = (
    # peft reads PreTrainedModel.is_gradient_checkpointing, which transformers 5 deprecates: nothing a user can change
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning),
    # our loaders are iterables on purpose (no DistributedSampler; every rank walks every step) and run in the main
    # process (num_workers=0), where __len__ is exact
    (r"Your `IterableDataset` has `__len__` defined", UserWarning),
    # checkpoints hold the state after each step's optimiser step, by design; the warning (with 12 lines of example
    # code) would print after every step
    (r"Using ModelCheckpoint with manual optimization", UserWarning),
    # lightning's pytree compatibility shim, emitted inside lightning itself
    (r".*isinstance\(treespec, LeafSpec\)", Warning),
)

#: Lightning's info lines that say nothing about this run: advertisements for its cloud products, accelerators that are
#: not in use (the device is in the config), the seed and the mixed precision (both in the config), why fit stopped
#: (the summary says it), the two lines of a resume (``sglightning fit`` prints one "resuming from" line itself), and
#: the notice that the module's callbacks replace Lightning's default checkpoint callback (by design:
#: ``sglightning.callbacks.default_callbacks``; a user's own is never replaced)
_NOISE = ("💡 Tip: For seamless cloud", "GPU available:", "TPU available:", "HPU available:", "Seed set to ",
          "`Trainer.fit` stopped: `max_steps=", "Automatic Mixed Precision (AMP)",
          "was configured so validation will run", "Restoring states from the checkpoint path at",
          "Restored all states from the checkpoint at",
          "will override existing callbacks passed to Trainer")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not any(n in message for n in _NOISE)


def quiet() -> None:
    """Install the filters (idempotent)."""
    for message, category in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())


class StepProgressBar(TQDMProgressBar):
    """One bar for the whole run: ``fit  k/N`` in optimiser steps (right after a resume too: the restored steps are
    counted in ``k`` but not in the rate, which is over the steps this process ran), seconds per step, and the last
    step's success rate and trust weight λ."""

    BAR_FORMAT_STEPS = "{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"

    @property
    def sanity_check_description(self) -> str:
        return "Validation before training"  # evaluation.before_fit runs as Lightning's sanity check

    def init_train_tqdm(self):
        """The bar, made at the start of fit with its final label, total and start (Lightning's would first print
        ``Training 0/?``, and a resume — which calls no ``on_train_epoch_start`` when it continues an epoch — kept
        that label and counted the restored steps in the rate): ``initial`` is the restored step, so tqdm's rate is
        (n − initial) / elapsed."""
        trainer = self.trainer
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        return Tqdm(desc="fit:", initial=trainer.global_step, total=total, unit="step",
                    position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT_STEPS)

    def on_train_epoch_start(self, trainer, *_) -> None:
        pass  # one bar for the whole run, across epochs (Lightning's resets it to "Epoch k" at 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module))
        bar.refresh()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
