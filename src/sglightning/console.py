"""What a run prints: one progress bar (step k/N, s/step, success, λ), and nothing its user did not ask to see.

On a terminal the bar redraws itself in place; when standard output is not a terminal (a file, a pipe, a batch
job's log) the run writes plain lines instead — one per training step and one per validation, without carriage
returns or escape codes.

Each filter below removes one message we understand and that says nothing about the run (found by running
``sglightning fit`` on a fresh box); everything else — a real warning — still prints.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from sglightning.report import validation_line

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
    # our loaders yield an index per step; the work is the rollout in the main process, which workers cannot do
    # (printed on boxes with more than 2 cores, twice: train and validation)
    (r"The '.*' does not have many workers", Warning),
    # inductor, compiling on CUDA (the decode step, update.compile): its TF32 tip; fp32 matmuls stay exact on purpose
    # (the sampler's and the trainer's log-probs are compared), as for Lightning's own tip below
    (r"TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled", UserWarning),
)

#: warnings of a resumed fit only: it continues in its own run folder, which is not empty
_RESUME_WARNINGS = (
    # a CSVLogger: the earlier metrics.csv is kept as metrics.<n>.csv (sglightning.runs.keep_csv_metrics), not deleted
    (r"Experiment logs directory .* exists and is not empty", UserWarning),
    # a user's own ModelCheckpoint: its folder is the resumed run's
    (r"Checkpoint directory .* exists and is not empty", UserWarning),
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
          "will override existing callbacks passed to Trainer",
          # validate: ``sglightning validate`` names the checkpoint it loads in its own line
          "Loaded model weights from the checkpoint at",
          # CUDA: the visible devices (the device is in the config); the TF32 tip (fp32 matmuls stay exact on
          # purpose: the sampler's and the trainer's log-probs are compared; bf16 runs do not use them)
          "CUDA_VISIBLE_DEVICES: [", "that has Tensor Cores. To properly utilize them",
          # DDP / FSDP: each rank's "Initializing distributed" line and the banner that all joined (the strategy and
          # the processes are in the config; FSDP2 prints them on one device too)
          "Initializing distributed: GLOBAL_RANK", "All distributed processes registered",
          # SIGTERM: sglightning says in its own line what it saved and how to resume; on SLURM, the handlers'
          # set-up at every start
          "Received SIGTERM: ", "SLURM auto-requeueing enabled",
          # Ctrl-C: the same, in sglightning's own line (what was saved, how to resume)
          "Detected KeyboardInterrupt, attempting graceful shutdown")

#: warnings that say nothing about a ``validate`` run: it saves no checkpoint, so the checkpoint callback's state in
#: the file it loads (best scores, kept paths of the training run's folder) is of no use to it, wherever it writes
_VALIDATE_WARNINGS = ((r"The dirpath has changed from", Warning),)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not any(n in message for n in _NOISE)


def quiet() -> None:
    """Install the filters (idempotent)."""
    for message, category in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.fabric.utilities.seed", "lightning.pytorch.accelerators.cuda",
                 "lightning.fabric.utilities.distributed", "lightning.pytorch.trainer.connectors.signal_connector"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())


def quiet_validate() -> None:
    """The filters of :func:`quiet`, and those that hold for a ``validate`` run only."""
    quiet()
    for message, category in _VALIDATE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def quiet_resume() -> None:
    """The filters that hold for a resumed fit (``--ckpt_path``): its folder is its own, and not empty."""
    for message, category in _RESUME_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def is_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal a bar can redraw itself on: one that reports no width (a pseudo-terminal whose
    size nobody set) showed tqdm's bar as nothing at all, so it gets plain lines."""
    isatty = getattr(stream, "isatty", None)
    try:
        if not (isatty and isatty()):
            return False
    except ValueError:  # a closed stream
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (OSError, ValueError, AttributeError):  # no file descriptor with a size (a stand-in stream): a bar
        return True


class _OneLoaderTqdm(Tqdm):
    """A validation bar whose label leaves out Lightning's `` DataLoader 0`` (there is one), before it is drawn."""

    def set_description(self, desc=None, refresh=True):
        super().set_description(re.sub(r" DataLoader \d+$", "", desc or ""), refresh)


def _one_loader(bar: Tqdm) -> Tqdm:
    bar.__class__ = _OneLoaderTqdm
    return bar


class StepProgressBar(TQDMProgressBar):
    """One bar for the whole run: ``fit  k/N`` in optimiser steps (right after a resume too: the restored steps are
    counted in ``k`` but not in the rate, which is over the steps this process ran), seconds per step, and the last
    step's success rate and trust weight λ.

    After each validation, its result in one line (``validation at step k: …``) above the bar.  When standard output
    (where the bar writes) is not a terminal, plain lines instead: ``fit: step k/N  0.61 s/step success=0.250
    lam=0.000`` after each step and the validation lines, nothing else (no bar frames, no validation bars)."""

    BAR_FORMAT_STEPS = "{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain = False  # set at setup: standard output is not a terminal
        self._started: tuple[float, int] = (0.0, 0)  # (when, global step) this process's training started
        self._validation_started = 0.0

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.plain = not is_terminal(sys.stdout)

    @property
    def sanity_check_description(self) -> str:
        return "validation before training"  # evaluation.before_fit runs as Lightning's sanity check

    @property
    def validation_description(self) -> str:
        return "validation"

    def init_sanity_tqdm(self):
        return Tqdm(disable=True) if self.plain else _one_loader(super().init_sanity_tqdm())

    def init_validation_tqdm(self):
        return Tqdm(disable=True) if self.plain else _one_loader(super().init_validation_tqdm())

    def init_train_tqdm(self):
        """The bar, made at the start of fit with its final label, total and start (Lightning's would first print
        ``Training 0/?``, and a resume — which calls no ``on_train_epoch_start`` when it continues an epoch — kept
        that label and counted the restored steps in the rate): ``initial`` is the restored step, so tqdm's rate is
        (n − initial) / elapsed."""
        if self.plain:
            return Tqdm(disable=True)
        trainer = self.trainer
        return Tqdm(desc="fit:", initial=trainer.global_step, total=self._total(trainer), unit="step",
                    position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT_STEPS)

    @staticmethod
    def _total(trainer) -> int | None:
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._started = (time.perf_counter(), trainer.global_step)

    def on_train_epoch_start(self, trainer, *_) -> None:
        pass  # one bar for the whole run, across epochs (Lightning's resets it to "Epoch k" at 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.plain:
            self._line(self._step_line(trainer, pl_module))
            return
        bar = self.train_progress_bar
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module))
        bar.refresh()

    def _step_line(self, trainer, pl_module) -> str:
        """``fit: step k/N  s/step  success=…  lam=…``: the rate over the steps this process ran."""
        step, total = trainer.global_step, self._total(trainer)
        since, first = self._started
        ran = step - first
        rate = f"  {(time.perf_counter() - since) / ran:.2f} s/step" if ran > 0 else ""
        metrics = "".join(f"  {k}={v:.3f}" if isinstance(v, float) else f"  {k}={v}"
                          for k, v in self.get_metrics(trainer, pl_module).items())
        return f"fit: step {step}{f'/{total}' if total else ''}{rate}{metrics}"

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        super().on_sanity_check_start(trainer, pl_module)
        self._validation_started = time.perf_counter()

    def on_sanity_check_end(self, trainer, pl_module) -> None:
        super().on_sanity_check_end(trainer, pl_module)
        self._validation_done(getattr(pl_module, "val_report_before", None), before_training=True)

    def on_validation_start(self, trainer, pl_module) -> None:
        super().on_validation_start(trainer, pl_module)
        if not trainer.sanity_checking:
            self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.sanity_checking:
            self._validation_done(getattr(pl_module, "val_report", None))

    def _validation_done(self, report, before_training: bool = False) -> None:
        if report is not None:  # on a terminal too: the validation bar goes, its result stays above the fit bar
            self._line(validation_line(report, time.perf_counter() - self._validation_started, before_training))

    def _line(self, text: str) -> None:
        if self.is_disabled:  # rank 0 only, as the bar
            return
        if self.plain:
            print(text, file=sys.stdout, flush=True)
        else:
            Tqdm.write(text, file=sys.stdout)

    def get_metrics(self, trainer, pl_module) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
