"""A run's folders: the one a resume continues in, the newest ``last.ckpt`` of a config's runs, and what a run
that never reached its first step leaves behind.

Why a module of its own: Lightning names a run's folder from its logger (``save_dir/name/version_N``), or from
``trainer.default_root_dir`` without one. ``--ckpt_path last`` must find the same folder from the config alone, before
any Trainer exists, and a resume must write on in it. These functions read the config's plain mappings; the CLI calls
them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch.loggers import CSVLogger

from sglightning.checkpointing import RUN_VERSION_KEY, CheckpointError, load_checkpoint_file, run_dir, version_folder
from sglightning.preemption import validation_pending
from sglightning.strategies import LOOP_STATE_FILE, recover_swapped_checkpoints


def keep_csv_metrics(loggers) -> None:
    """A CSVLogger given a version folder that holds a ``metrics.csv`` (a resume) deletes that file (Lightning's
    behaviour): move it aside first, to ``metrics.1.csv`` (then ``.2``, …), so that no logged step is lost.
    ``loggers``: the Trainer's ``logger`` argument, built.  Rank 0 only (the one that writes)."""
    if not first_process():
        return
    for lg in loggers if isinstance(loggers, (list, tuple)) else [loggers]:
        if not isinstance(lg, CSVLogger) or getattr(lg, "_version", None) is None:
            continue
        folder = Path(lg.log_dir)
        if (folder / "metrics.csv").is_file():
            n = next(k for k in range(1, 10_000) if not (folder / f"metrics.{k}.csv").exists())
            with contextlib.suppress(FileNotFoundError):  # moved already (another process of this run)
                os.replace(folder / "metrics.csv", folder / f"metrics.{n}.csv")


def first_process() -> bool:
    """Whether this is the run's first process (rank 0 of node 0), by the variables its launcher set: Lightning's
    (LOCAL_RANK, NODE_RANK), torchrun (RANK, GROUP_RANK) or SLURM (SLURM_PROCID); before any process group."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    return not _get_rank() and all(os.environ.get(k, "0") == "0" for k in ("NODE_RANK", "GROUP_RANK"))


def earlier_run_without_logger(trainer) -> Path | None:
    """With no logger (``trainer.logger: false``) a run's folder is ``trainer.default_root_dir`` itself, the same for
    every run: that folder when it holds an earlier run's checkpoint, adapter or ``config.yaml`` (which the run would
    overwrite, and remove if it failed before its first step), else None."""
    logger = trainer.get("logger")
    if (logger is not False and logger != []) or trainer.get("fast_dev_run"):
        return None
    folder = Path(str(trainer.get("default_root_dir") or "."))
    earlier = any((folder / "checkpoints").glob("last*.ckpt")) or (folder / "adapter").is_dir()
    return folder if earlier or (folder / "config.yaml").is_file() else None


def resumed_logger_inits(logger) -> list:
    """The ``init_args`` of the loggers a resume continues in the run's folder: the first logger, and any other
    TensorBoard or CSV logger with the same ``save_dir`` and ``name`` (that folder is the run's).  Others start a
    version of their own (another folder's version_N may be another run's; MLflow, W&B have no version folder)."""
    items = [i for i in (logger if isinstance(logger, list) else [logger]) if hasattr(i, "get")]
    inits = [i.get("init_args") for i in items]
    if not inits or inits[0] is None:
        return []
    key = (inits[0].get("save_dir"), inits[0].get("name"))
    return [inits[0]] + [init for item, init in zip(items[1:], inits[1:]) if init is not None
                         and str(item.get("class_path", "")).endswith(("TensorBoardLogger", "CSVLogger"))
                         and (init.get("save_dir"), init.get("name")) == key]


def pin_version(cfg, version: str | None) -> None:
    """A resume continues in the run's version folder ``version`` (None: nothing to pin): the loggers that share the
    run's folder are given it (Lightning's default logger made explicit first)."""
    if version is None:
        return
    trainer = cfg.get("trainer")
    if trainer is not None and trainer.get("logger") in (True, None):  # Lightning's default, made explicit
        where = Namespace(save_dir=str(trainer.get("default_root_dir") or "."), name="lightning_logs")
        trainer["logger"] = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=where)
    for init in resumed_logger_inits(cfg.get("trainer", {}).get("logger")):
        init["version"] = version


def version_of_checkpoint(path, cfg) -> str | None:
    """The version folder of a checkpoint given by path when it is the ``last*.ckpt`` of one of this config's runs
    (``<root>/<version>/checkpoints/last.ckpt``, the root as :func:`find_last_checkpoint` searches), else None: an
    older checkpoint of a run starts a branch, in a folder of its own."""
    path = Path(str(path)).absolute()
    if path.parent.name != "checkpoints" or not path.name.startswith("last"):  # an older one: a branch, its own folder
        return None
    for root, pattern in _run_roots(cfg):
        if pattern and path.parent.parent.parent == root.absolute() and path.parent.parent.match(pattern):
            return path.parent.parent.name
    return None


def _run_roots(cfg) -> list[tuple[Path, str | None]]:
    """Where this config's runs keep their checkpoints: (root, the version folders' pattern there; None: the root's
    own ``checkpoints``)."""
    trainer = cfg.get("trainer") or {}
    inits = resumed_logger_inits(trainer.get("logger"))
    init = inits[0] if inits else None  # the first logger's folder is the run's (checkpoints, adapter, reports)
    if init is not None and init.get("save_dir") is not None:
        # TensorBoard's and CSV's name: absent = "lightning_logs"; null or "" = the versions sit in save_dir itself
        name = str(init.get("name") or "") if "name" in init else "lightning_logs"
        root = Path(str(init.get("save_dir"))) / name if name else Path(str(init.get("save_dir")))
        version = init.get("version")  # a version the config fixes: that folder alone
        return [(root, "version_*" if version is None else version_folder(version))]
    # no logger: Lightning's checkpoints/; Lightning's default logger (true or null): lightning_logs/version_*/
    root = Path(str(trainer.get("default_root_dir") or "."))
    return [(root, None)] + ([] if trainer.get("logger") in (False, []) else [(root / "lightning_logs", "version_*")])


def find_last_checkpoint(cfg) -> tuple[Path, str | None] | None:
    """The newest ``last.ckpt`` of this config's runs, with the version folder name to continue in: with a logger
    that has a ``save_dir``, only under ``save_dir/name/version_*/checkpoints/`` (another run's checkpoints — another
    logger name in the same folder — are never taken); without one, under ``trainer.default_root_dir`` (its
    ``checkpoints/``, and with Lightning's default logger its ``lightning_logs/version_*/checkpoints/``).  A
    ModelCheckpoint's own ``dirpath`` is searched too (its checkpoint names the version folder its run wrote to:
    :data:`RUN_VERSION_KEY`)."""
    trainer = cfg.get("trainer") or {}
    folders = [(folder, pattern is not None) for root, pattern in _run_roots(cfg)
               for folder in root.glob(f"{pattern}/checkpoints" if pattern else "checkpoints")]
    dirpaths = checkpoint_dirpaths(trainer)  # where a stop saves, if a callback says
    folders += [(folder, False) for folder in dirpaths]
    best: tuple[float, Path, str | None] | None = None
    for folder, versioned in folders:
        recover_swapped_checkpoints(folder)  # a distributed save killed between its two renames
        for path in folder.glob("last*.ckpt"):
            mtime = path.stat().st_mtime
            if best is None or mtime > best[0]:
                best = (mtime, path.resolve(), path.parent.parent.name if versioned else None)
    if best is not None and best[2] is None and best[1].parent in {d.resolve() for d in dirpaths}:
        with contextlib.suppress(CheckpointError):  # a folder, or an older file: a new version folder, as before
            version = load_checkpoint_file(best[1], mmap=True).get(RUN_VERSION_KEY)
            best = (best[0], best[1], version if isinstance(version, str) else None)
    return None if best is None else (best[1], best[2])


def checkpoint_dirpaths(trainer) -> list[Path]:
    """The ``dirpath`` of each ModelCheckpoint in the config's ``trainer.callbacks`` (its ``last.ckpt`` is where a
    stop saves and what ``--ckpt_path last`` resumes)."""
    found = []
    for cb in trainer.get("callbacks") or []:
        get = getattr(cb, "get", None)
        init = get("init_args") if get else None
        dirpath = init.get("dirpath") if hasattr(init, "get") else None
        if dirpath and str(get("class_path") or "").endswith("ModelCheckpoint") and Path(str(dirpath)).is_dir():
            found.append(Path(str(dirpath)))
    return found


def saved_config_name(trainer, stage: str, name: str = "config.yaml") -> str:
    """The file a run's config is saved as: ``name``, but ``validate_config.yaml`` for a validate without a logger
    (its folder is the fit's, whose config stays)."""
    return "validate_config.yaml" if stage == "validate" and not trainer.loggers else name


def remove_unstarted_run(trainer) -> None:
    """A run that failed before its first step: remove the files it wrote (config, hyper-parameters, empty event
    files) and then its folder if that is empty.  Nothing else is ever deleted."""
    if trainer is None or trainer.global_step > 0:
        return
    folder = run_dir(trainer)
    if not folder.is_dir() or (folder / "checkpoints").exists():
        return
    own = saved_config_name(trainer, trainer.state.fn)
    for f in folder.iterdir():
        if f.is_file() and (f.name in (own, "hparams.yaml") or f.name.startswith("events.out.tfevents")):
            f.unlink()
    if not any(folder.iterdir()):
        folder.rmdir()
        if folder.parent != Path(trainer.default_root_dir) and not any(folder.parent.iterdir()):
            folder.parent.rmdir()  # the logger's name folder, made for this run alone


def nothing_left_to_train(ckpt: str | os.PathLike, trainer: dict) -> None:
    """A resume whose checkpoint already holds ``trainer.max_steps`` steps or more has nothing to train: one line,
    exit 0, and nothing written (Lightning would start, train nothing and rewrite the run's ``config.yaml``).

    Args:
        ckpt: the checkpoint to resume from: a file, or a distributed checkpoint's folder (its ``meta.pt`` is read).
        trainer: the ``trainer`` section of the config."""
    max_steps = trainer.get("max_steps")
    path = Path(str(ckpt))
    loop_state = path / LOOP_STATE_FILE if path.is_dir() else path  # a folder's loop state sits beside its shards
    if not isinstance(max_steps, int) or max_steps < 0 or not loop_state.is_file():
        return
    try:
        state = load_checkpoint_file(loop_state)
    except CheckpointError:
        return  # the run's own load says what is wrong with it, in one line
    done = state.get("global_step", 0)
    if done < max_steps:
        return
    if first_process():
        pending = (f"; its validation at step {done} did not finish: sglightning validate with the same config and "
                   f"--ckpt_path {path} plays it") if validation_pending(state) else ""
        print(f"sglightning: {path} holds {done} trained steps and trainer.max_steps is {max_steps}: nothing to "
              f"train (raise trainer.max_steps to train on){pending}", file=sys.stderr)
    sys.exit(0)
