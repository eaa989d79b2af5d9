"""Where a run's files go, and checkpoints that survive kills: atomic writes, safe loads, clear errors.

* **The run directory.** :func:`run_dir`: the first logger's version folder (``runs/<name>/version_<k>``), else the
  trainer's ``default_root_dir``; the config, checkpoints, adapter and reports of a run are written there.
  :func:`check_run_dir` refuses one that cannot be created or written, naming the folder and the key, before the
  model loads.

* **Atomic writes.** :class:`AtomicCheckpointIO` saves through :func:`sglightning.files.atomic_write`: a temp file
  next to the target, fsynced, then ``os.replace``-d over it.  A kill at any moment leaves either the previous
  complete file or the new complete file, never a torn one; a stale temp file from a killed write is removed by the
  next save to that target.
* **Safe loads.** ``torch.load(..., weights_only=True)``: a checkpoint is tensors and plain containers, never pickled
  code.  A file that is missing, truncated, not a torch file, or not a sglightning checkpoint raises ``ValueError``
  naming the file and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from sglightning.errors import ConfigError, nonfinite_stop, not_writable
from sglightning.files import atomic_write, fsync_dir


def run_dir(trainer) -> Path:
    """The run directory: the first logger's version folder, else ``default_root_dir``.  A logger without a folder
    of its own (W&B, MLflow: a save_dir, a project name, a run id) gets ``save_dir/name/version``, the folder
    Lightning's ModelCheckpoint puts its ``checkpoints`` in (the save_dir alone was shared by every run).  Reads the
    logger directly (``trainer.log_dir`` broadcasts from rank 0, which deadlocks in code that only rank 0 runs)."""
    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    if getattr(trainer, "sglightning_run_dir", None) is not None:  # pin_run_dir: rank 0's, on every rank
        return trainer.sglightning_run_dir
    logger = trainer.loggers[0]
    path = getattr(logger, "log_dir", None)
    if path is None:
        folder = version_folder(getattr(logger, "version", None))
        path = Path(getattr(logger, "save_dir", None) or trainer.default_root_dir) / str(logger.name) / folder
    return Path(path)


def version_folder(version: int | str | None) -> str:
    """A logger version's folder name, as Lightning names it: a string as it is, a number ``version_<n>``."""
    return version if isinstance(version, str) else f"version_{version}"


#: the checkpoint key naming the version folder of the run that wrote it (a logger's run folder): a checkpoint kept in
#: a ModelCheckpoint's own ``dirpath`` says where ``--ckpt_path last`` continues
RUN_VERSION_KEY = "sglightning_run_version"


def pin_run_dir(trainer) -> None:
    """On every rank, at setup: a first logger without a folder of its own (W&B, MLflow) knows its run id on rank 0
    alone (the others would make ``version_None``), so :func:`run_dir` takes rank 0's folder from here on.  A
    collective under several processes; nothing to do for a logger with a ``log_dir``."""
    trainer.sglightning_run_dir = None
    if trainer.loggers and getattr(trainer.loggers[0], "log_dir", None) is None:
        trainer.sglightning_run_dir = Path(trainer.strategy.broadcast(str(run_dir(trainer))))


def readable_as_made(folder: Path) -> None:
    """``folder`` and the files in it get the modes the umask gives a new folder and file (``tempfile.mkdtemp`` makes
    0700 folders: an exported adapter other users could not read, beside a run folder they can)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def check_run_dir(trainer) -> None:
    """The run directory can be created and written: else ``ConfigError`` naming the folder and the config key that
    sets it — checked when the trainer is built, before the model loads (a run that could not save its config,
    checkpoints or adapter would otherwise end in a traceback from deep inside the logger).  Nothing is left behind:
    the probe is an empty folder, removed at once.  The version folder itself is checked when it is fixed (a resume);
    otherwise the logger's root (``save_dir/name``), where the next version folder will be made."""
    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is not None:
        key = "trainer.logger.init_args.save_dir"
        folder = getattr(logger, "root_dir", None) or getattr(logger, "save_dir", None)
        if folder is not None and getattr(logger, "_version", None) is not None:
            folder = getattr(logger, "log_dir", None) or folder  # a resume continues in a given version folder
    else:
        key, folder = "trainer.default_root_dir", trainer.default_root_dir
    if folder is None:
        return  # a logger without a folder of its own
    if (logger is not None and getattr(logger, "name", None) == "lightning_logs"
            and str(getattr(logger, "save_dir", None)) == str(trainer.default_root_dir)):
        key = "trainer.default_root_dir"  # `trainer.logger: true`: Lightning's own logger, in the default folder
    if "://" in str(folder):  # checkpoints are written atomically and the adapter exported to local folders
        raise ConfigError(f"{key}: {folder} is a remote folder; sglightning writes its runs to a local folder (copy "
                          "or sync it from there)")
    folder = Path(folder).absolute()
    reason = not_writable(folder)
    if reason:
        raise ConfigError(f"{key}: cannot write the run folder {folder}: {reason}; give a folder you can write to")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (the message names the file)."""


def checkpoint_keeper(trainer):
    """The ModelCheckpoint that keeps ``last.ckpt`` (``save_last``), or None."""
    return next((c for c in trainer.checkpoint_callbacks if getattr(c, "save_last", None)), None)


def checkpoint_dir(trainer) -> Path:
    """The run's checkpoint folder: the ``dirpath`` of the ModelCheckpoint that keeps ``last.ckpt``, else the run
    folder's ``checkpoints``. ``last.ckpt`` and the non-finite stop's checkpoint are written there."""
    dirpath = getattr(checkpoint_keeper(trainer), "dirpath", None)
    return Path(dirpath) if dirpath else run_dir(trainer) / "checkpoints"


def stop_nonfinite(trainer, limit: int, step: int) -> str:
    """After ``limit`` non-finite updates in a row, at the end of ``step``: the full state saved to
    ``nonfinite-stop.ckpt`` in the checkpoint folder, the trainer asked to stop; returns the reason (the CLI's one
    line).

    Args:
        trainer: the Lightning trainer of the run.
        limit: ``update.max_consecutive_skips``.
        step: the training step, counted from 1.
    """
    path = checkpoint_dir(trainer) / "nonfinite-stop.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path, weights_only=False)  # full state (says so: Lightning logs the default)
    trainer.should_stop = True
    return nonfinite_stop(limit, step, path)


def check_shapes(checkpoint: dict, own: dict[str, Any]) -> None:
    """``checkpoint``'s tensors are those ``own`` trains (the module's parameters by name, ``requires_grad`` ones
    expected in the checkpoint), each of its shape: else ``CheckpointError`` naming the first that differs (a
    checkpoint of another ``model.policy``: another model, LoRA rank or target modules)."""
    state = checkpoint.get("state_dict", {})
    for key, value in state.items():
        mine = own.get(key)
        if mine is None:
            problem = f"the checkpoint's {key} is not in this config's model"
        elif hasattr(value, "shape") and tuple(value.shape) != tuple(mine.shape):
            problem = f"the checkpoint's {key} is {list(value.shape)}, this config's is {list(mine.shape)}"
        else:
            continue
        break
    else:
        missing = [k for k, p in own.items() if getattr(p, "requires_grad", False) and k not in state]
        if not missing:
            return
        problem = f"this config's {missing[0]} is not in the checkpoint"
    raise CheckpointError(f"--ckpt_path: {problem}: it was trained with another model.policy (model, lora_r, "
                          "lora_target_modules); use that run's config.yaml (in its run folder)")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` atomically (:func:`sglightning.files.atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def old_of(target: Path) -> Path:
    """Where :func:`swap_in_folder` keeps ``target``'s previous version during a swap (``.<name>.old``)."""
    return target.with_name(f".{target.name}.old")


def partial_of(target: Path) -> Path:
    """Where a distributed save writes ``target``'s next version before it is swapped in (``.<name>.partial``)."""
    return target.with_name(f".{target.name}.partial")


def _old_names(target: Path) -> tuple[Path, Path]:
    """``target``'s previous version: :func:`old_of`, and ``<name>.old`` as earlier releases named it."""
    return old_of(target), target.with_name(target.name + ".old")


def restore_old(target: Path) -> bool:
    """Put ``target``'s previous version back where a kill between :func:`swap_in_folder`'s two renames left none
    (``.<name>.old``, or ``<name>.old`` from earlier releases).  Safe when several processes try at once (torchrun:
    every rank resolves ``--ckpt_path last``): one moves it, the others find it gone.  Returns whether one did."""
    for old in _old_names(target):
        if old.exists() and not target.exists():
            with contextlib.suppress(FileNotFoundError):  # another process restored it first
                os.replace(old, target)
                return True
    return False


def recover_folder(target: Path) -> None:
    """Before ``target`` is written anew: undo what a killed :func:`swap_in_folder` left.  Its previous version goes
    back where a kill between the two renames left none (:func:`restore_old`); a leftover old version (a kill before
    the cleanup) and temp folders (``.<name>-*``, ``.<name>.partial``: a kill while writing) go."""
    restore_old(target)
    for stale in (*_old_names(target), partial_of(target), *target.parent.glob(f".{target.name}-*")):
        _remove(stale)


def swap_in_folder(tmp: Path, target: Path) -> None:
    """Put the finished folder ``tmp`` (a sibling of ``target``) in ``target``'s place: its files fsynced, ``target``
    (a folder or a file) moved to ``.<name>.old``, ``tmp`` renamed to ``target``, the folder fsynced, the old one
    removed.  A reader sees the old version or the new one; :func:`restore_old` mends a kill between the renames.
    Adapter exports and FSDP checkpoint folders are swapped in this way."""
    for file in tmp.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    for folder in (*(d for d in tmp.rglob("*") if d.is_dir()), tmp):  # their entries too
        fsync_dir(folder)
    old = old_of(target)
    _remove(old)
    if target.exists():
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:  # Ctrl-C or a failure between the two renames: the previous version goes back
        restore_old(target)
        raise
    fsync_dir(target.parent)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


#: the warnings a checkpoint load said, by place (each once per process, as Python's default filter shows them)
_LOAD_WARNINGS: dict = {}


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu", require_sglightning: bool = True,
                         mmap: bool = False) -> dict:
    """Load a checkpoint with ``weights_only=True``; ``CheckpointError`` naming the file when it cannot be used.

    Args:
        path: the checkpoint file.
        map_location: torch.load's.
        require_sglightning: refuse a file without the ``sglightning`` section (not written by ``sglightning fit``).
        mmap: map the file instead of reading it (the tensors are read only when used).
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path}: is a folder, a sharded checkpoint: resume it with the "
                              "trainer.strategy that wrote it (FSDP)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        with warnings.catch_warnings(record=True) as said:  # a file that fails: its line alone, not torch's guesses
            warnings.simplefilter("always")
            ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        for w in said:  # a file that loads: what torch said, as it would have (once per place, as by default)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_LOAD_WARNINGS)
    except Exception as err:  # noqa: BLE001 - torch raises many types for bad files (IndexError for some text files)
        text = str(err).strip()
        if "WeightsUnpickler error:" in text:  # torch's paragraph on weights_only first, then the reason
            text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
        first = " ".join(text.split()).split(". ")[0] if text.strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {path}: cannot be read ({type(err).__name__}: {first[:300]}); it is truncated, corrupt, "
            "or not a torch checkpoint that loads with weights_only=True"
        ) from err
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"checkpoint {path}: holds a {type(ckpt).__name__}, not a Lightning checkpoint dict")
    if require_sglightning and "sglightning" not in ckpt:
        keys = ", ".join(sorted(map(str, ckpt))[:8])
        raise CheckpointError(
            f"checkpoint {path}: not a sglightning checkpoint (no 'sglightning' section; keys: {keys}). Pass a "
            "checkpoint written by `sglightning fit`, or a peft adapter folder with --model.adapter_path"
        )
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO with atomic local writes and safe, explained loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location=map_location)


def use_atomic_io(strategy) -> None:
    """Give a Lightning strategy :class:`AtomicCheckpointIO` in place of its default IO (a user's plugin is left
    alone)."""
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
