"""``sglightning fit | validate`` — LightningCLI over :class:`~sglightning.module.SelfGuideModule`.

    sglightning fit --config configs/quickstart.yaml
    sglightning validate --config configs/quickstart.yaml [--ckpt_path …] [--model.adapter_path …]
    sglightning fit --config configs/tiny.yaml --print_config

``--config`` can be given several times (later files override earlier ones).  The resolved config is saved as
``config.yaml`` in the run directory.  ``validate`` also writes ``validation_report.json`` and ``.md`` there (``fit``
writes its last validation's).

Around it: :mod:`sglightning.commandline` checks argv and config files and words the parser's errors;
:mod:`sglightning.runs` finds a run's folders (the one a resume continues in, the newest ``last.ckpt``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import traceback
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from jsonargparse import set_parsing_settings
from jsonargparse.typing import PositiveInt
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from sglightning import distributed, threads
from sglightning.checkpointing import (
    CheckpointError,
    check_run_dir,
    load_checkpoint_file,
    run_dir,
)
from sglightning.commandline import (
    SUBCOMMANDS,
    check_config_files,
    check_options_follow_the_subcommand,
    check_something_configured,
    fail,
    full_key,
    import_shipped_envs,
    in_words,
    one_line,
    unknown_monitor,
)
from sglightning.console import StepProgressBar, quiet, quiet_resume, quiet_validate
from sglightning.errors import ConfigError, EngineError, OutOfMemory, exit_process
from sglightning.files import atomic_write_text, temp_path
from sglightning.models import check_environment as check_model_environment
from sglightning.module import SelfGuideModule
from sglightning.preemption import PreemptionCheckpoint
from sglightning.report import report_markdown, run_settings, write_validation_report
from sglightning.runs import (
    earlier_run_without_logger,
    find_last_checkpoint,
    first_process,
    keep_csv_metrics,
    nothing_left_to_train,
    pin_version,
    remove_unstarted_run,
    resumed_logger_inits,
    saved_config_name,
    version_of_checkpoint,
)
from sglightning.strategies import LOOP_STATE_FILE

quiet()

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 10,
    "max_epochs": -1,  # the run ends at max_steps (the train dataloader yields one item per rollout; a resumed run
    # that raised max_steps goes on into a next pass)
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,

    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "sglightning"},
    },
}


class _Announce(Callback):
    """Prints ``line`` (the checkpoint a run resumes or validates) once it has loaded, on rank 0: before, a checkpoint
    of another config printed it and then the error that refused it."""

    def __init__(self, line: str):
        self.line = line

    def _say(self, trainer) -> None:
        if self.line and trainer.is_global_zero:
            print(self.line, file=sys.stderr, flush=True)
        self.line = ""

    def on_train_start(self, trainer, pl_module) -> None:
        self._say(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._say(trainer)


class VersionedSaveConfig(SaveConfigCallback):
    """Saves the resolved config like Lightning does, then appends the package versions of this run as YAML comments
    (benchmark versions change scores between releases), so the file stays a valid ``--config`` and records what ran."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        """The checkpoint a run resumed from is noted as a comment, not kept as ``ckpt_path``: a fit of the saved
        config would otherwise resume that checkpoint again, in a new folder, or find nothing left to train."""
        self._resumed_from = self.config.get("ckpt_path") if "ckpt_path" in self.config else None
        self._pinned = None
        if self._resumed_from and stage == "fit":
            self.config = self.config.clone()
            self.config.ckpt_path = None
            trainer_cfg = self.config.get("trainer") or {}
            for init in resumed_logger_inits(trainer_cfg.get("logger") if hasattr(trainer_cfg, "get") else None):
                # the version folder the resume continued in: pinned in the saved file, a fresh fit of it would
                # write into this run's folder (over its last.ckpt, adapter and reports)
                self._pinned, init["version"] = init.get("version") or self._pinned, None
        # Lightning writes a temp file; save_config (rank 0, within this call) completes it and swaps it in, so a kill
        # keeps the previous config.yaml whole (a resume rewrites the run's only copy).  Run folders are local
        # (checkpointing.check_run_dir refuses a remote one)
        self._final = saved_config_name(trainer, stage, self.config_filename)
        self.config_filename = temp_path(Path(self._final)).name
        # where Lightning writes it: trainer.log_dir, a logger's save_dir where it has no log_dir (W&B, MLflow); the
        # config goes to the run folder (run_dir) all the same.  Every rank is here (log_dir is a broadcast)
        self._written_in = Path(trainer.log_dir) if trainer.log_dir is not None else None
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.config_filename = self._final

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if not self.save_to_log_dir:
            return
        tmp = (getattr(self, "_written_in", None) or run_dir(trainer)) / self.config_filename  # rank 0 only
        if not tmp.is_file():
            return
        body, notes = tmp.read_text(), ""
        if self._resumed_from and stage == "fit":
            where = f" in {self._pinned}" if self._pinned else ""
            notes += f"# resumed from {self._resumed_from}{where} (give --ckpt_path to resume again)\n"
        versions = pl_module.package_versions() if hasattr(pl_module, "package_versions") else {}
        if versions:
            notes += "# package versions of this run (written by sglightning):\n"
            notes += "".join(f"#   {k}: {v}\n" for k, v in versions.items())
        tmp.unlink(missing_ok=True)
        run_dir(trainer).mkdir(parents=True, exist_ok=True)
        self._pending = (run_dir(trainer) / self._final, body, notes)
        if not (self._resumed_from and stage == "fit"):
            self.on_train_start(trainer, pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        """A resume's config replaces the run's once the checkpoint restored: a refused one (another
        ``model.policy``, a corrupt file) leaves the run's config.yaml as it was, as its error line advises."""
        pending, self._pending = getattr(self, "_pending", None), None
        if not pending:
            return
        path, body, notes = pending
        horizon = getattr(getattr(pl_module, "trust", None), "saved_horizon", None)
        if horizon is not None and self.config.get("model.grpo.total_steps") is None:
            # the resume kept the checkpoint's trust horizon: said in the file, so a fit of it schedules λ as this run
            config = self.config.clone()
            config["model.grpo.total_steps"] = int(horizon)
            body = self.parser.dump(config, skip_none=False)
        atomic_write_text(path, body + notes)


# field docs are attribute docstrings (below each dataclass field): --help shows them
set_parsing_settings(docstring_parse_attribute_docstrings=True)


#: what ``--help`` says about the options sglightning gives its own meaning (Lightning's text describes its loader)
CKPT_PATH_HELP = {
    "fit": "resume from this checkpoint: a .ckpt file, a distributed checkpoint folder, or last = the newest "
           "last.ckpt of this config's runs (<save_dir>/<name>/version_*/checkpoints/), continuing in that run's "
           "folder; with none, fit starts fresh, so one command line serves the first launch and every requeue. The "
           "config is not read from the checkpoint: the --config given is the run's",
    "validate": "the trained adapters to validate: a .ckpt file, a distributed checkpoint folder, or last = the "
                "newest last.ckpt of this config's runs (none is an error); without it the model is validated as "
                "configured (model.adapter_path's adapter, or the untrained one)",
}
WEIGHTS_ONLY_HELP = ("ignored: sglightning loads checkpoints with weights_only=True (tensors and plain containers, "
                     "never pickled code) unless a checkpoint_io plugin of your own is set")
SEED_HELP = ("seed set before the classes are built (the LoRA initialisation); training and validation episodes "
             "draw from model.rollout.seed and model.evaluation.seed. true = a random seed")
USAGE = "sglightning {sub} [-h] [-c CONFIG ...] [--print_config] [--KEY VALUE ...]"
VERBOSE_HELP = ("also print Lightning's table of every logged val/* metric (default false: the validation report "
                "printed after it holds the same numbers, by mode, and is written to validation_report.md)")


_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data):`~?(?:[\w.]+\.)?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def plain_markup(text: str) -> str:
    """Docstring markup as a terminal reader wants it: ``x`` becomes `x`, a role :func:`a.b.c` becomes `c`."""
    return _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", text))


class OneLineParser(LightningArgumentParser):
    """Every parse error is one line on stderr — what is wrong, naming the key or file — and exit 2; no usage dump
    (``--help`` lists every key with its documentation and allowed values).

    ``--help`` reads top down: the options, then sglightning's keys (``model.*``, section by section, each headed by
    its key), then Lightning's Trainer keys; ``--data`` (a LightningDataModule: this trainer makes its own data) is
    left out.  No key may be abbreviated (argparse's default would read ``--trainer.max_step`` as ``max_steps``, and
    a key added later could make a command line that worked ambiguous)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def format_help(self, *args, **kwargs) -> str:
        saved = self._action_groups, {g: (g.title, list(g._group_actions)) for g in self._action_groups}
        try:
            self._action_groups = self._groups_for_help()
            return plain_markup(super().format_help(*args, **kwargs))
        finally:
            self._action_groups = saved[0]
            for group, (title, actions) in saved[1].items():
                group.title, group._group_actions = title, actions

    def _groups_for_help(self) -> list:
        """The groups in reading order, titled by their key; the subcommand's own group (``--ckpt_path``,
        ``--weights_only``) folded into the options.  The caller restores titles and lists."""
        names = {id(g): n for n, g in (self.groups or {}).items()}
        options = [g for g in self._action_groups if id(g) not in names]
        model = [g for g in self._action_groups if names.get(id(g), "").split(".")[0] == "model"]
        trainer = [g for g in self._action_groups if names.get(id(g), "").split(".")[0] == "trainer"]
        method = [g for g in self._action_groups if names.get(id(g)) in ("fit", "validate")]
        for group in method:
            opts = next((g for g in options if g.title == "options"), None)
            if opts is not None:
                opts._group_actions = opts._group_actions + group._group_actions
        for group in model + trainer:
            title = (group.title or "").rstrip(":")
            group.title = f"{names[id(group)]} — {title}" if title else names[id(group)]
        for group in trainer[:1]:
            group.title = ("trainer — Lightning's Trainer (the Lightning documentation has the details; the defaults "
                           "shown are sglightning's)")
        known = {id(g) for g in options + model + trainer + method}
        rest = [g for g in self._action_groups if id(g) not in known and names.get(id(g)) != "data"]
        return options + model + rest + trainer

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        subs = [p for a in parser._actions if isinstance(getattr(a, "choices", None), dict)
                for p in a.choices.values() if isinstance(p, argparse.ArgumentParser)]
        parser = subs[0] if len(subs) == 1 else parser  # a config file's key, reported by the root: its subcommand's
        prog = " ".join(["sglightning", *parser.prog.replace(" [options]", "").split()[1:]])
        sys.stderr.write(f"{prog}: error: {one_line(in_words(message, parser))} (see: {prog} --help)\n")
        self.exit(2)


class SGLightningCLI(LightningCLI):
    def __init__(self, *args, subcommand: str | None = None, **kwargs):
        """``subcommand``: build only that subcommand's parser (the command line names it; building each parser
        reads the signatures and docstrings of every class in it: ~1 s apiece on 2 cores)."""
        self._only = subcommand
        super().__init__(*args, **kwargs)

    def subcommands(self=None) -> dict[str, set[str]]:
        full = LightningCLI.subcommands()
        only = getattr(self, "_only", None)
        return {k: full[k] for k in ((only,) if only else ("fit", "validate"))}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """Lightning's, listed in ``sglightning --help`` in sglightning's words."""
        super()._add_subcommands(parser, **kwargs)
        for action in parser._actions:
            for choice in getattr(action, "_choices_actions", []):
                choice.help = SUBCOMMANDS.get(choice.dest, choice.help)
        # the subcommands' names are made by now; the top-level usage shows the order that works (a config of ours
        # given before the subcommand is refused: check_options_follow_the_subcommand)
        parser.usage = "sglightning {fit,validate} --config CONFIG [--KEY VALUE ...]"

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's, with sglightning's words for the options it gives its own meaning."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        for dest, text in (("ckpt_path", CKPT_PATH_HELP.get(subcommand)), ("weights_only", WEIGHTS_ONLY_HELP),
                           ("seed_everything", SEED_HELP)):
            action = next((a for a in parser._actions if a.dest == dest), None)
            if action is not None and text:
                action.help = text
        for action in parser._actions:
            if action.dest in ("data", "data.help"):
                action.help = argparse.SUPPRESS  # a LightningDataModule: this trainer makes its own data
            if action.dest == "verbose" and subcommand == "validate":
                action.help = VERBOSE_HELP
        if subcommand == "validate":
            parser.set_defaults(verbose=False)  # the report prints every number; Lightning's table would repeat it
        return parser

    def instantiate_classes(self) -> None:
        """Config values our dataclasses, the Trainer or the optimiser reject become a one-line parser error (exit 2)
        — before anything runs, so a run that cannot start leaves no run folder behind."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            super().instantiate_classes()
            if getattr(self, "_announce", None):  # said once the checkpoint loaded: a refused one says only why
                self.trainer.callbacks.append(_Announce(self._announce))
        except TypeError as err:  # the Trainer's own checks: "`devices` selected with `CPUAccelerator` should be …"
            named = re.match(r"`(\w+)`", str(err))
            self._error(f"trainer.{named.group(1)}: {err}" if named else str(err).splitlines()[0])
        except ValueError as err:
            msg = str(err)
            while err.__cause__ is not None and isinstance(err.__cause__, ValueError):
                err = err.__cause__
                msg = str(err)
            self._error(msg.splitlines()[0] if msg else repr(err))
        except MisconfigurationException as err:
            key = "trainer.accelerator" if "backend found" in str(err) else "trainer"
            self._error(f"{key}: {err}")
        try:
            check_run_dir(self.trainer)  # a folder that cannot be written: one line, before the model loads
            self.model.preflight(self.trainer.strategy)
            if self.subcommand == "fit":  # trainer.max_steps against grpo.ppo_epochs, before anything is written
                self.model.total_steps(self.trainer.max_steps)
        except (ConfigError, ValueError) as err:
            self._error(str(err))

    def _error(self, message: str):
        """One line from the subcommand's parser (``sglightning fit: error: …``), exit 2."""
        parser = getattr(self, "_subcommand_parsers", {}).get(self.subcommand, self.parser)
        parser.error(full_key(message))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--threads", type=PositiveInt | Literal["auto"] | None, default="auto",
            help="torch CPU threads per process: auto = one less than this process's share of the CPUs (at least 1; "
                 "both cores when one process has 2 cores of an idle machine; OMP_NUM_THREADS wins when set), an "
                 "integer, or null for torch's default (one per core, which collapses when another busy process "
                 "shares the cores)")
        for action in parser._actions:  # Lightning's text for the Trainer flags this trainer refuses: ours instead
            if action.dest in REFUSED_FLAG_HELP:
                action.help = REFUSED_FLAG_HELP[action.dest]

    def before_instantiate_classes(self) -> None:
        """Set the thread budget (before the model and the env workers exist); then ``--ckpt_path last`` on a fresh
        process: find the newest ``last.ckpt`` of this config's runs (``<save_dir>/<name>/version_*/checkpoints/``)
        and continue in that run's folder; with none, start fresh (so one command line serves both the first launch
        and every requeue after a preemption)."""
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        try:
            threads.check_environment()
            check_model_environment()
        except ConfigError as err:
            self._error(str(err))
        threads.apply(cfg.get("threads", "auto"), cfg.get("trainer"))
        if self.subcommand == "fit" and (refused := refused_trainer_flag(cfg.get("trainer") or {})) is not None:
            self._error(refused)
        if self.subcommand == "validate":
            quiet_validate()
            self._resolve_validate_checkpoint(cfg)
            return
        if self.subcommand != "fit":
            return
        if cfg.get("model.evaluation.before_fit") and cfg.get("trainer") is not None:
            # Lightning's sanity check over every validation batch is the "before" validation (the module keeps its
            # report; Lightning itself discards what a sanity check logs)
            cfg["trainer"]["num_sanity_val_steps"] = -1
        if not cfg.get("ckpt_path") and (earlier := earlier_run_without_logger(cfg.get("trainer") or {})):
            self._error(f"trainer.default_root_dir: {earlier} holds an earlier run or a config.yaml, which this one "
                        "would overwrite (without a logger every run uses that folder): resume it with --ckpt_path "
                        "last, or give another trainer.default_root_dir")
        if cfg.get("ckpt_path") != "last":
            if cfg.get("ckpt_path"):
                nothing_left_to_train(cfg["ckpt_path"], cfg.get("trainer") or {})
                pin_version(cfg, version_of_checkpoint(cfg["ckpt_path"], cfg))  # a run's own checkpoint: its folder
                quiet_resume()
                self._announce = f"sglightning: resuming from {cfg['ckpt_path']}"
            return
        found = find_last_checkpoint(cfg)
        if found is None:
            print("sglightning: --ckpt_path last: no last.ckpt from an earlier run of this config; starting fresh",
                  file=sys.stderr)
            cfg["ckpt_path"] = None
            return
        ckpt, version = found
        nothing_left_to_train(ckpt, cfg.get("trainer") or {})
        cfg["ckpt_path"] = str(ckpt)
        pin_version(cfg, version)
        quiet_resume()
        self._announce = f"sglightning: resuming from {ckpt}"

    def _resolve_validate_checkpoint(self, cfg) -> None:
        """``validate --ckpt_path last``: the newest ``last.ckpt`` of this config's runs, found as ``fit`` finds it
        (Lightning alone would validate the untrained adapters); none is an error — validating "the last
        checkpoint" of a config that has none would report an untrained model as if it were trained.  Either way
        the checkpoint validated is named in one line (Lightning's own line about it is filtered out)."""
        if cfg.get("ckpt_path") != "last":
            if cfg.get("ckpt_path"):
                self._announce = f"sglightning: validating {cfg['ckpt_path']}"
            return
        found = find_last_checkpoint(cfg)
        if found is None:
            self._error("--ckpt_path last: no last.ckpt from a run of this config (its logger's save_dir/name); "
                        "give a checkpoint file, or run fit first")
        cfg["ckpt_path"] = str(found[0])
        self._announce = f"sglightning: validating {found[0]}"

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` up front (safe load, sglightning checkpoint); our checkpoints carry no
        hyper-parameters, so there is nothing to merge into the config (the config file is the source of truth)."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if not path or path == "last":
            return  # resolved later (before_instantiate_classes)
        if path in ("best", "hpc") or str(path).lower().split(":")[0] == "registry":
            fail(f"sglightning {sub}", f"--ckpt_path: {path!r} is Lightning's, and sglightning keeps no such "
                 "checkpoint: give a checkpoint file, a distributed checkpoint folder, or last")
        p = Path(str(path))
        if "://" in str(path):
            return  # an fsspec URL: Lightning's to load
        if p.is_dir():
            if not (p / LOOP_STATE_FILE).is_file() and not (p / ".metadata").is_file():
                fail(f"sglightning {sub}", f"--ckpt_path: {p} is a folder, not a checkpoint (give a .ckpt file such "
                     f"as {p / 'last.ckpt'}, a distributed checkpoint folder, or last)")
            return  # a distributed checkpoint
        try:  # a missing file too: before any line announces it
            load_checkpoint_file(path)
        except CheckpointError as err:
            fail(f"sglightning {sub}", str(err))

    def _set_seed(self) -> None:
        """Lightning's, but ``seed_everything: true`` draws a random seed, as its help says (Lightning's
        ``seed_everything(None)`` now sets 0); the seed drawn is recorded in the run's ``config.yaml``.  The other
        processes Lightning launches inherit rank 0's (``PL_GLOBAL_SEED``); under torchrun or srun, whose processes
        start apart, the seed comes from the job's id, the same on every rank."""
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if cfg.get("seed_everything") is True:
            inherited = os.environ.get("PL_GLOBAL_SEED") if not first_process() else None
            job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
            if inherited:  # a process Lightning launched: rank 0's seed
                cfg["seed_everything"] = int(inherited)
            elif job and int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) > 1:
                cfg["seed_everything"] = zlib.crc32(job.encode()) % 2**31  # torchrun, srun: one seed per job
            else:
                cfg["seed_everything"] = random.SystemRandom().randrange(2**31)
        super()._set_seed()

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list):
        """Lightning's, but sglightning's progress bar stays out when ``trainer.enable_progress_bar`` is false (the
        Trainer refuses a progress-bar callback then) or the user gives one of their own (the Trainer takes one);
        a CSVLogger resuming in its folder keeps its earlier metrics (:func:`keep_csv_metrics`)."""
        own = config.get("callbacks") or []
        own = own if isinstance(own, list) else [own]  # one callback may be given alone
        given = [c for c in own + list(callbacks or []) if isinstance(c, ProgressBar)]
        if config.get("enable_progress_bar") is False or given:
            defaults = self.trainer_defaults.get("callbacks") or []
            self.trainer_defaults = dict(self.trainer_defaults, callbacks=[
                c for c in defaults if not isinstance(c, StepProgressBar)])
        if not config.get("fast_dev_run"):
            keep_csv_metrics(config.get("logger"))
        return super()._instantiate_trainer(config, callbacks)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            self._run_and_report(subcommand)
        finally:
            distributed.release_process_group()  # every ending; main() then exits without teardown

    def _run_and_report(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except SystemExit:
            code = self._interruption_code()  # Ctrl-C (130) or SIGTERM in validate (143): the callback said what
            if code:  # happened
                remove_unstarted_run(self.trainer)  # stopped before its first step: no folder left behind
                sys.exit(code)
            raise
        except (CheckpointError, ConfigError) as err:  # one line naming the file / config key, no traceback wall
            self._stop(subcommand, full_key(str(err)), 2)
        except MisconfigurationException as err:  # a Trainer setting or callback Lightning refuses inside fit
            self._stop(subcommand, f"Lightning: {err}", 2, last=True)
        except (EngineError, OutOfMemory) as err:  # the engine died / a phase did not fit: the step was abandoned
            self._stop(subcommand, str(err), 1, last=True)
        except RuntimeError as err:  # after EngineError and OutOfMemory, which are RuntimeErrors too
            if not str(err).startswith("Early stopping conditioned on metric"):  # a callback's monitor: no such key
                raise
            self._stop(subcommand, f"trainer.callbacks: {unknown_monitor(str(err))}", 2, last=True)

    def _stop(self, subcommand: str, message: str, code: int, last: bool = False) -> NoReturn:
        """End the command with one line (:func:`fail`): a run stopped before its first step leaves no folder; with
        ``last``, the line says where the last whole step is."""
        remove_unstarted_run(self.trainer)
        fail(f"sglightning {subcommand}", one_line(message) + (self._last_whole_step() if last else ""), code)

    def _last_whole_step(self) -> str:
        """Where the last whole step is, for an error that abandoned the step in progress (fit only)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or self.subcommand != "fit":
            return ""
        ckpt = PreemptionCheckpoint.last_path(trainer)
        # a sharded (FSDP) last.ckpt is a folder
        return f"; {ckpt} holds the last whole step: resume with --ckpt_path last" if ckpt.exists() else ""

    def _interruption_code(self) -> int:
        trainer = getattr(self, "trainer", None)
        callbacks = trainer.callbacks if trainer is not None else []
        return next((c.exit_code for c in callbacks if isinstance(c, PreemptionCheckpoint)), 0)

    def after_fit(self) -> None:
        reason = getattr(self.model, "stop_reason", None)
        if reason:
            if self.trainer.global_rank == 0:  # one line, not one per rank
                print(f"sglightning: {reason}", file=sys.stderr)
            sys.exit(1)

    def after_validate(self) -> None:
        report = getattr(self.model, "val_report", None)
        if report is None or self.trainer.global_rank != 0:
            return
        checkpoint = self.config_init[self.subcommand].get("ckpt_path") if self.subcommand else None
        report = dict(report, config=run_settings(self.model, checkpoint))
        if self.trainer.fast_dev_run:  # a trial: shown, nothing written (as Lightning writes nothing then)
            print(report_markdown(report))
            return
        path, text = write_validation_report(report, run_dir(self.trainer))
        print(text)
        print(f"report: {path}")


#: --help for the Trainer flags that ``refused_trainer_flag`` turns down (Lightning's own text would offer them)
REFUSED_FLAG_HELP = {
    "trainer.accumulate_grad_batches": "Only 1: one optimiser step is one rollout's update, its micro-batches "
                                       "already accumulated (model.update.micro_batch_size sets their size).",
    "trainer.gradient_clip_val": "Not used: model.grpo.max_grad_norm sets the gradient norm clipped to.",
    "trainer.gradient_clip_algorithm": "Not used: model.grpo.max_grad_norm clips the gradient norm.",
    "trainer.overfit_batches": "Only 0: every step plays new tasks (model.rollout.seed); for a fixed set of tasks, "
                               "give the environment one.",
    "trainer.barebones": "Only false: a run keeps its logger, progress line and checkpoints.",
}


def refused_trainer_flag(trainer) -> str | None:
    """The first Trainer setting this trainer cannot honour, as one line naming the key and what to use instead (else
    Lightning would fail inside ``fit`` with a traceback, or silently do something else); None when all can be."""
    get = trainer.get
    accumulate, clip = get("accumulate_grad_batches", 1), get("gradient_clip_val")
    if accumulate not in (None, 1):
        return (f"trainer.accumulate_grad_batches: {accumulate} is not supported: one optimiser step is one rollout's "
                "update, its micro-batches already accumulated (model.update.micro_batch_size sets their size; "
                "model.rollout.groups_per_step the episodes per step)")
    if clip not in (None, 0, 0.0):
        return f"trainer.gradient_clip_val: {clip} is not used: set model.grpo.max_grad_norm (the norm clipped to)"
    if get("overfit_batches") not in (None, 0, 0.0):
        return ("trainer.overfit_batches: not supported: every step plays new tasks (model.rollout.seed); to train "
                "on a fixed set of tasks, give the environment one")
    if str(get("precision")) == "16-true":
        return ("trainer.precision: 16-true trains float16 weights, and AdamW's steps turn them into inf/NaN (its "
                "eps of 1e-8 is 0 in float16); use bf16-mixed, 16-mixed or 32-true")
    if get("max_steps") == 0:
        return ("trainer.max_steps: 0 trains nothing; give the steps to train (sglightning validate evaluates without "
                "training)")
    if get("barebones"):
        return ("trainer.barebones: not supported (a run keeps its logger, progress line and checkpoints); for the "
                "fewest extras: --trainer.logger false --trainer.enable_progress_bar false "
                "--trainer.enable_checkpointing false")
    return None


def cli_main(args: list[str] | None = None, callbacks: Sequence[Callback] = ()) -> SGLightningCLI:
    """Run ``sglightning`` with ``args`` (None: ``sys.argv``).

    Args:
        args: the command line after the program's name.
        callbacks: more callbacks, for a program that runs the CLI in its own process (``benchmarks/gpu_check.py``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(args) if args is not None else sys.argv[1:]
    prog = "sglightning " + (argv[0] if argv and not argv[0].startswith("-") else "")
    check_options_follow_the_subcommand(argv)
    check_something_configured(argv, prog.strip())
    check_config_files(argv, prog)
    subcommand = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    import_shipped_envs()
    return SGLightningCLI(
        SelfGuideModule,
        subcommand=subcommand,
        # the one progress bar (given to the Trainer: Lightning would otherwise add its own, rich when installed)
        trainer_defaults={**TRAINER_DEFAULTS, "callbacks": [StepProgressBar(), *callbacks]},
        save_config_callback=VersionedSaveConfig,
        parser_class=OneLineParser,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        seed_everything_default=0,
        args=args,
        parser_kwargs={"prog": "sglightning",
                       "description": "Self-guided GRPO for LLM agents. `sglightning fit --help` and `sglightning "
                                      "validate --help` list every key with its documentation and allowed values.",
                       **{sub: {"description": text, "usage": USAGE.format(sub=sub)}
                          for sub, text in SUBCOMMANDS.items() if subcommand in (None, sub)}},
    )


def main() -> int:
    """Console-script entry point (``sglightning``): exit code 0 on success.  A process that ran a process group
    (DDP, FSDP), and a run stopped by Ctrl-C (130), end through :func:`~sglightning.errors.exit_process`, which skips
    interpreter teardown."""
    try:
        cli_main()  # LightningCLI reads sys.argv itself (passing it again triggers a warning)
    except BaseException as err:
        if distributed.group_was_released() or (isinstance(err, SystemExit) and err.code == 130):
            exit_process(_report_exit(err))
        raise
    if distributed.group_was_released():
        exit_process(0)
    return 0


def _report_exit(err: BaseException) -> int:
    """What Python prints for ``err`` reaching the top (a ``sys.exit`` message, a crash's traceback), and the exit
    status it would give."""
    if isinstance(err, SystemExit):
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        print(err.code, file=sys.stderr)  # sys.exit("message") or any other object: Python prints it, exits 1
        return 1
    traceback.print_exception(err)
    return 130 if isinstance(err, KeyboardInterrupt) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
