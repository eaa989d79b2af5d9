"""``sglightning fit | validate`` — LightningCLI over :class:`~sglightning.module.SelfGuideModule`.

    sglightning fit --config configs/quickstart.yaml
    sglightning validate --config configs/quickstart.yaml [--ckpt_path …] [--model.adapter_path …]
    sglightning fit --config configs/tiny.yaml --print_config

``--config`` can be given several times (later files override earlier ones).  The resolved config is saved as
``config.yaml`` in the run directory.  ``validate`` also writes ``validation_report.json`` and ``.md`` there (``fit``
writes its last validation's).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import inspect
import os
import random
import re
import sys
import traceback
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from jsonargparse import Namespace, set_parsing_settings
from jsonargparse.typing import PositiveInt
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger

from sglightning import distributed, threads
from sglightning.checkpointing import (
    RUN_VERSION_KEY,
    CheckpointError,
    check_run_dir,
    load_checkpoint_file,
    run_dir,
    version_folder,
)
from sglightning.console import StepProgressBar, quiet, quiet_resume, quiet_validate
from sglightning.errors import ConfigError, EngineError, OutOfMemory, exit_process
from sglightning.files import atomic_write_text, temp_path
from sglightning.models import check_environment as check_model_environment
from sglightning.module import SelfGuideModule
from sglightning.preemption import PreemptionCheckpoint, validation_pending
from sglightning.report import report_markdown, run_settings, write_validation_report
from sglightning.strategies import LOOP_STATE_FILE, recover_swapped_checkpoints

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


def one_line(message: str, limit: int = 600) -> str:
    """A (possibly multi-line) error message as one line."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: config keys that moved (old -> new): a config that still uses one is told where it went
MOVED_KEYS = {
    **{f"model.grpo.{k}": f"model.update.{k}"
       for k in ("micro_batch_size", "share_prefix", "skip_zero_advantage", "max_consecutive_skips")},
    "model.rollout.invalid_action_penalty": "model.grpo.invalid_action_penalty",
    "model.decoder": "model.engine.backend (an engine class path, or builtin / vllm)",
}


_TYPE_WORDS = {"PositiveInt": "a positive integer", "NonNegativeInt": "an integer >= 0", "NoneType": "null",
               "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "tuple": "a list ([a, b, …])", "list": "a list ([a, b, …])", "dict": "a mapping ({key: value, …})"}
_UNION = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*Does not validate against any of the Union subtypes'
                    r'\s+Subtypes:\s*\[(?P<types>.*)\]\s+Errors:.*Given value: (?P<value>.*?)\s*$', re.DOTALL)


def union_in_words(message: str) -> str:
    """The parser's dump for a value that fits no member of a union type (``--threads 0``,
    ``grpo.trust_constant=half``), as one sentence: the key, what it allows, the value given."""
    m = _UNION.match(message.strip())
    if not m:
        return message
    allowed = []
    for t in re.split(r",\s*(?![^\[]*\])", m["types"]):
        lit = re.search(r"Literal\[(.*)\]", t)
        if lit:
            allowed += _literal_values(lit[1])
            continue
        name = re.sub(r"^.*[.']|[>'\]]+$", "", t.strip(" <>").removeprefix("class ").strip("'"))
        allowed.append(_TYPE_WORDS.get(name, name))
    key = f"--{m['key']}" if m["key"] in ("threads", "ckpt_path") else m["key"]
    return f"{key}: {m['value']!r} is not {', '.join(allowed[:-1]) + ' or ' if len(allowed) > 1 else ''}{allowed[-1]}"


_SCALAR = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*Expected a <class \'(?P<type>\w+)\'>\. '
                     r'Got value: (?P<value>.*?)\s*$', re.DOTALL)
_CHOICE = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*Expected a typing\.Literal\[(?P<values>.*)\]\. '
                      r'Got value: (?P<value>.*?)\s*$', re.DOTALL)
_ENV = re.compile(r'^Parser key "model\.env":.*?(?:class_path=\'(?P<path>[^\']+)\'|dot import path string: '
                  r'(?P<given>\S+)|Got value: (?P<value>[\w.]+)\s*$)', re.DOTALL)
#: the environments sglightning ships (``model.env.class_path``)
SHIPPED_ENVS = ("sglightning.envs.household.HouseholdEnv", "sglightning.envs.alfworld.ALFWorldEnv",
                "sglightning.envs.scienceworld.ScienceWorldEnv",
                "sglightning.envs.textworld_express.TextWorldExpressEnv", "sglightning.envs.webshop.WebShopEnv")


def import_shipped_envs() -> None:
    """Import every shipped environment's module (cheap: their simulators load on first use), so that ``--help``
    lists them and ``--model.env.help TextWorldExpressEnv`` finds one by its bare name."""
    for path in SHIPPED_ENVS:
        importlib.import_module(path.rpartition(".")[0])


def _literal_values(listed: str) -> list[str]:
    """The values ``typing.Literal[...]`` lists between its brackets, unquoted."""
    return [v.strip(" '\"") for v in listed.split(",")]


def not_one_of(key: str, value: str, choices: str) -> str:
    """``key: 'value' is not one of a, b (did you mean b?)``, from the parser's ``Literal[...]`` listing.

    Args:
        key: the key as the command line spells it.
        value: the value given.
        choices: what ``typing.Literal[...]`` lists between its brackets.
    """
    allowed = _literal_values(choices)
    close = difflib.get_close_matches(value, allowed, n=1, cutoff=0.6)
    return f"{key}: {value!r} is not one of {', '.join(allowed)}" + (f" (did you mean {close[0]}?)" if close else "")


def value_in_words(message: str) -> str:
    """The parser's dump for a value of the wrong type (``--model.rollout.group_size four``), a value not among a
    key's choices (``--model.guidance.actor_format xml``) or an environment class that cannot be imported
    (``--model.env HouseEnv``) as one sentence naming the key and what it allows."""
    if m := _SCALAR.match(message.strip()):
        return f"{m['key']}: {m['value']!r} is not {_TYPE_WORDS.get(m['type'], m['type'])}"
    if m := _CHOICE.match(message.strip()):
        return not_one_of(m["key"], m["value"], m["values"])
    if not (m := _ENV.match(message.strip())):
        return message
    given = m["path"] or m["given"] or m["value"]
    module, _, name = given.rpartition(".")
    shipped = [e.rpartition(".")[2] for e in SHIPPED_ENVS]
    if not module:  # a bare name: the class name of a shipped (imported) environment
        if name in shipped:
            return message  # the class is there: the parser's complaint is about something else
        close = difflib.get_close_matches(name, shipped, n=1, cutoff=0.6)
        why = "no environment class of that name" + (f" (did you mean {close[0]}?)" if close else "")
    elif (why := import_problem(given)) is None:
        return message  # the class is there: the complaint is about something else (an init argument)
    if why.startswith("importing "):
        return f"model.env: {given}: {why}"
    return (f"model.env: {given}: {why}; the shipped environments are {', '.join(SHIPPED_ENVS)}, or give the import "
            "path of a TextEnv subclass of your own")


def import_problem(path: str) -> str | None:
    """Why the dotted ``path`` (``module.Name``) names nothing, in words, with the nearest name its module has; None
    when it does."""
    module, _, name = path.rpartition(".")
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        if err.name is None or not (module == err.name or module.startswith(err.name + ".")):
            return f"importing {module} failed ({type(err).__name__}: {err})"
        return f"no module {module}"
    if hasattr(found, name):
        return None
    close = difflib.get_close_matches(name, [n for n in dir(found) if not n.startswith("_")], n=1, cutoff=0.6)
    return f"{module} has no {name}" + (f" (did you mean {module}.{close[0]}?)" if close else "")


_CLASS_ARG = re.compile(r'^Parser key "(?P<key>[^"]+)":.*?Parser key "(?P<arg>\w+)":\s*(?:'
                        r"Expected a <class '(?P<type>\w+)'>\. Got value: (?P<value>.*?)(?:\. Got value: |\n|$)"
                        r"|Expected a typing\.Literal\[(?P<choices>.*?)\]\. "
                        r"Got value: (?P<lvalue>.*?)(?:\. Got value: |\n|$)"
                        r"|.*?Expected a <class '(?P<utype>\w+)'>.*?Given value: (?P<uvalue>.*?)\. Got value: )",
                        re.DOTALL)  # a plain type; a union's first member (lr: float or Tensor)
_REQUIRED = re.compile(r'^Parser key "(?P<key>[^"]+)":.*?Problem with given class_path \'(?P<cls>[\w.]+)\':\s*'
                       r"the following arguments are required: (?P<args>[\w, ]+)", re.DOTALL)
_CLASS_GIVEN = re.compile(r'^Parser key "(?P<key>[^"]+)":.*?(?:Problem with given class_path \'(?P<path>[\w.]+)\''
                          r"|Given value: (?P<value>[\w.]+)\s*$)", re.DOTALL)


def class_in_words(message: str) -> str:
    """The parser's dump for a key that takes a class (``trainer.callbacks``, ``trainer.logger``, ``model.optimizer``)
    as one sentence: an init argument of the wrong type, a required one not given, or a class path that names
    nothing (with the nearest name)."""
    text = message.strip()
    if m := _CLASS_ARG.match(text):
        if m["choices"] is not None:
            return not_one_of(f"{m['key']}.init_args.{m['arg']}", m["lvalue"], m["choices"])
        value, kind = (m["value"], m["type"]) if m["type"] else (m["uvalue"], m["utype"])
        return f"{m['key']}.init_args.{m['arg']}: {value!r} is not {_TYPE_WORDS.get(kind, kind)}"
    if m := _REQUIRED.match(text):
        args = [a.strip() for a in m["args"].split(",")]
        return (f"{m['key']}: {m['cls'].rpartition('.')[2]} needs {', '.join(args)}: give --{m['key']}.{args[0]}="
                "VALUE after it")
    if not re.search(r"class_path|dot import path|callable class", text) or not (m := _CLASS_GIVEN.match(text)) \
            or m["key"] == "model.env":
        return message  # not a class key's complaint (or the environment's, which value_in_words words)
    given = m["path"] or m["value"]
    if "." not in given:
        return f"{m['key']}: {given!r} is not a class it takes; give its import path (module.Class)"
    why = import_problem(given)
    return f"{m['key']}: {given}: {why}" if why else message


#: the sections of ``model`` whose checks name their keys from the section down (``update.micro_batch_size``)
_MODEL_SECTION = re.compile(r"^(policy|env|rollout|guidance|grpo|update|evaluation|engine|optimizer|adapter_path)"
                            r"(?=[.:])")


def full_key(message: str) -> str:
    """``message`` with the key it starts with as the command line spells it: ``update.micro_batch_size: …`` (a
    config class's own check, which knows no ``model``) becomes ``model.update.micro_batch_size: …``."""
    return _MODEL_SECTION.sub(r"model.\1", message, count=1)


def moved_key_hint(message: str) -> str:
    """``message`` preceded by where a moved key went, when it names one (``--model.grpo.micro_batch_size=4`` or a
    config file's ``model.grpo.micro_batch_size``)."""
    hints = [f"{old} is now {new}" for old, new in MOVED_KEYS.items() if old in message]
    return "; ".join(hints) + " — " + message if hints else message


_UNKNOWN = re.compile(r"unrecognized arguments: (?P<args>.*)|(?:Group '(?P<group>[^']+)' )?does not accept "
                      r"(?:nested )?(?:option|key) '(?P<key>[^']+)'")


def close_key_hint(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with the nearest real key for each unknown one it names (``--model.update.micro_batch_sise`` or a
    config file's ``model.update.micro_batch_sise``: "did you mean --model.update.micro_batch_size?")."""
    m = _UNKNOWN.search(message)
    if not m:
        return message
    options = {o[2:] for a in parser._actions for o in a.option_strings
               if o.startswith("--") and not o.endswith(".help")}  # a class key's --KEY.help is not a key to name
    leaves = [k for k in options if not any(o.startswith(k + ".") for o in options)]  # keys, not whole sections
    if m["args"] is not None:
        unknown, dash = re.findall(r"(?:^|\s)--([\w.\-]+)", m["args"]), "--"
    else:
        unknown, dash = [f"{m['group']}.{m['key']}" if m["group"] else m["key"]], ""
    sections = {o.split(".")[0] for o in options}
    hints = []
    for key in unknown:
        key = key.split("=")[0]
        close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.75)
        head, _, rest = key.partition(".")
        section = difflib.get_close_matches(head, sections, n=1, cutoff=0.75) if rest and not close else []
        if section and any(o == f"{section[0]}.{rest}" or o.startswith(f"{section[0]}.{rest}.") for o in options):
            close = [f"{section[0]}.{rest}"]  # a misspelt section: trainr.max_steps -> trainer.max_steps
        hints += [dash + close[0]] if close else []
    return f"{message}; did you mean {' or '.join(hints)}?" if hints else message


_INIT_ARG = re.compile(r'^Parser key "(?P<key>[^"]+)":.*?(?:class_path \'(?P<listed>[\w.]+)\':\s*)?'
                       r"Option '(?P<arg>[^']+)' is not accepted.*?(?:class_path='(?P<cls>[\w.]+)'|$)", re.DOTALL)


def unknown_init_arg(message: str) -> str:
    """The parser's dump for an argument a class does not take (``--model.env.init_args.difficuly=1``, or a reward
    term's ``init_args: {wieght: 1}``) as one sentence naming the key, with the nearest argument the class takes."""
    m = _INIT_ARG.search(message)
    if not m or not (m["cls"] or m["listed"]):
        return message
    listed = m["listed"] is not None  # an element of a list: its class is the one named beside the complaint
    module, _, name = (m["listed"] or m["cls"]).rpartition(".")
    try:
        params = [p.name for p in inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (ImportError, AttributeError, TypeError, ValueError):
        params = []
    close = difflib.get_close_matches(m["arg"], params, n=1, cutoff=0.6)
    # an element of a list (model.reward_terms) has no key of its own: the list's is named, and the bare argument
    where, spelt = (m["key"], "") if listed else (f"{m['key']}.init_args.{m['arg']}", f"{m['key']}.init_args.")
    hint = f"; did you mean {spelt}{close[0]}?" if close else f" (it takes {', '.join(params)})" if params else ""
    return f"{where}: {name} takes no argument {m['arg']!r}{hint}"


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
#: the subcommands, as ``sglightning --help`` lists them and each one's ``--help`` describes it
SUBCOMMANDS = {
    "fit": "Train the adapters with self-guided GRPO (a run folder with config.yaml, TensorBoard events, checkpoints, "
           "the adapter and the last validation's report).",
    "validate": "Validate a model on the evaluation episodes (validation_report.json and .md in its run folder).",
}


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
        message = moved_key_hint(union_in_words(value_in_words(unknown_init_arg(class_in_words(message)))))
        if " is now " not in message:
            message = close_key_hint(message, parser)
        sys.stderr.write(f"{prog}: error: {one_line(message)} (see: {prog} --help)\n")
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
        # given before the subcommand is refused: _check_options_follow_the_subcommand)
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
                _pin_version(cfg, version_of_checkpoint(cfg["ckpt_path"], cfg))  # a run's own checkpoint: its folder
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
        _pin_version(cfg, version)
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
                _remove_unstarted_run(self.trainer)  # stopped before its first step: no folder left behind
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
        _remove_unstarted_run(self.trainer)
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


def unknown_monitor(message: str) -> str:
    """EarlyStopping's complaint about a metric never logged (Lightning lists every logged key) as one short line:
    the key, and the nearest logged one."""
    names = re.findall(r"`([^`]+)`", message)
    if not names:
        return one_line(message)
    close = difflib.get_close_matches(names[0], names[2:], n=1, cutoff=0.5)  # names[1]: `EarlyStopping`
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"EarlyStopping monitors {names[0]!r}, which is not logged{hint} (every logged key: docs/metrics.md; "
            "a validation metric: val/sg/success_rate)")


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


def _pin_version(cfg, version: str | None) -> None:
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


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    """The command's one line for an input or a run it cannot go on with (``<prog>: error: <message>``), then exit
    ``code`` (2: bad input; 1: the run failed)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(code)


def saved_config_name(trainer, stage: str, name: str = "config.yaml") -> str:
    """The file a run's config is saved as: ``name``, but ``validate_config.yaml`` for a validate without a logger
    (its folder is the fit's, whose config stays)."""
    return "validate_config.yaml" if stage == "validate" and not trainer.loggers else name


def _remove_unstarted_run(trainer) -> None:
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


def _check_config_files(argv: list[str], prog: str) -> None:
    """Each ``--config`` file must exist and be YAML: a syntax error is reported with the file's name (the parser's
    own message only says ``<unicode string>``), in one line, exit 2."""
    import yaml

    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        p = Path(path)
        if not p.is_file():
            continue  # the parser says "File does not exist" with the path
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as err:  # unreadable, or not text
            reason = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
            fail(prog, f"{path}: cannot be read as a YAML config ({reason})")
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            tab = " (YAML does not allow tabs for indentation)" if "\t" in text and "token" in problem else ""
            fail(prog, f"{path}:{where} YAML syntax error: {problem}{tab}")
        if not isinstance(loaded, dict):
            what = "is empty" if loaded is None else f"holds a {type(loaded).__name__}, not a mapping"
            fail(prog, f"{path}: the config {what}; a config maps sections to settings (trainer: …, model: …)")
        if (key := _section_not_a_mapping(loaded)) is not None:
            fail(prog, f"{path}: {key[0]}: {key[1]!r} is not a mapping of settings ({key[0]}: {{name: value, …}})")


#: the config sections that hold settings (a value of another kind was passed to the parser, which crashed on it)
_MAPPINGS = ("trainer", "model", *(f"model.{s}" for s in ("policy", "rollout", "guidance", "grpo", "update",
                                                            "evaluation", "engine")))


def _section_not_a_mapping(loaded: dict) -> tuple[str, object] | None:
    """The first section of a loaded config (or of its ``fit:``/``validate:`` parts) given a value that is not a
    mapping, as (key, value); None when all are mappings (or absent)."""
    for part in [loaded, *(loaded[s] for s in SUBCOMMANDS if isinstance(loaded.get(s), dict))]:
        for key in _MAPPINGS:
            value: object = part
            for name in key.split("."):
                value = value.get(name) if isinstance(value, dict) else None
            if value is not None and not isinstance(value, dict):
                return key, value
    return None


def _check_options_follow_the_subcommand(argv: list[str]) -> None:
    """``sglightning -c X fit``: LightningCLI's top-level ``--config`` reads only top-level keys, so a config of ours
    fails on its first section, and ``--print_config`` there prints the defaults.  One line naming the right order."""
    sub = next((i for i, a in enumerate(argv) if a in SUBCOMMANDS), None)
    if sub is None and argv and not argv[0].startswith("-"):
        return  # a misspelt subcommand (`fitt --config X`): the parser names the choices
    before = argv[:sub] if sub is not None else argv
    given = []
    for i, a in enumerate(before):
        if a.startswith("--print_config"):
            given.append(a)
        elif a in ("-c", "--config") or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (before[i + 1] if i + 1 < len(before) else "")
            if not _keyed_by_subcommand(path):  # LightningCLI's own form: `fit:` / `validate:` at the top
                given.append(a)
    if given:
        name = argv[sub] if sub is not None else "fit"
        fail("sglightning", f"{given[0].split('=')[0]} goes after the subcommand, e.g. sglightning {name} --config "
             "configs/tiny.yaml")


def _keyed_by_subcommand(path: str) -> bool:
    """Whether the config file ``path`` holds sections named by subcommand (``fit:``), as a top-level ``--config``
    must; False for a file that cannot be read (its own error comes later)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and any(k in SUBCOMMANDS for k in data)


def _check_something_configured(argv: list[str], prog: str) -> None:
    """``sglightning fit`` (or ``validate``) with no config file and no ``--model.*`` key would run the defaults — the
    embedded model on a household env it was not sized for, every action invalid, minutes for nothing: say which
    configs to start from instead, in one line, exit 2."""
    if not argv or argv[0] not in ("fit", "validate"):
        return
    if any(a in ("-h", "--help", "--print_config") or a.startswith(("--config", "-c", "--model", "--print_config"))
           or a.split("=")[0].endswith(".help") for a in argv[1:]):  # a class's help (--trainer.strategy.help X)
        return
    fail(prog, f"no --config: start from configs/quickstart.yaml (the embedded SmolLM2, minutes on CPU) or "
         f"configs/tiny.yaml (a tiny model, seconds), e.g. {prog} --config configs/tiny.yaml")


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


def cli_main(args: list[str] | None = None, callbacks: Sequence[Callback] = ()) -> SGLightningCLI:
    """Run ``sglightning`` with ``args`` (None: ``sys.argv``).

    Args:
        args: the command line after the program's name.
        callbacks: more callbacks, for a program that runs the CLI in its own process (``benchmarks/gpu_check.py``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(args) if args is not None else sys.argv[1:]
    prog = "sglightning " + (argv[0] if argv and not argv[0].startswith("-") else "")
    _check_options_follow_the_subcommand(argv)
    _check_something_configured(argv, prog.strip())
    _check_config_files(argv, prog)
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
