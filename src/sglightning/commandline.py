"""The command line around the parser: checks jsonargparse cannot word (argv's order, config files that are not
YAML mappings, no config at all) and its errors put as one sentence naming the key.

Why a module of its own: the parser's messages are dumps of nested union and class errors, several lines long. A user
needs the key, the value given and what the key allows. Each ``*_in_words`` function matches one kind of dump and
rewrites it; a message none matches is passed on unchanged (then :func:`one_line` joins its lines).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import NoReturn

#: the subcommands, as ``sglightning --help`` lists them and each one's ``--help`` describes it
SUBCOMMANDS = {
    "fit": "Train the adapters with self-guided GRPO (a run folder with config.yaml, TensorBoard events, checkpoints, "
           "the adapter and the last validation's report).",
    "validate": "Validate a model on the evaluation episodes (validation_report.json and .md in its run folder).",
}


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


#: a bare class name that several importable classes have (``ReduceLROnPlateau``: torch's and Lightning's)
_AMBIGUOUS = re.compile(r'^Parser key "(?P<key>[\w.]+)":.*?Multiple subclasses with name (?P<name>\w+)\. Give the '
                        r"full class path to avoid ambiguity: (?P<paths>[\w., ]+?)\.(?:\s|$)", re.S)


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
    if m := _AMBIGUOUS.match(text):
        return f"{m['key']}: {m['name']} names several classes; give one of {m['paths'].rstrip('.')}"
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


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    """The command's one line for an input or a run it cannot go on with (``<prog>: error: <message>``), then exit
    ``code`` (2: bad input; 1: the run failed)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(code)


def check_config_files(argv: list[str], prog: str) -> None:
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


def check_options_follow_the_subcommand(argv: list[str]) -> None:
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


def check_something_configured(argv: list[str], prog: str) -> None:
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


def in_words(message: str, parser: argparse.ArgumentParser) -> str:
    """A parse error as one sentence naming the key: each kind of the parser's dump put in words, a moved key's new
    place, else the nearest real key for an unknown one.  A message none of them matches is returned unchanged.

    Args:
        message: the parser's error message.
        parser: the (sub)command's parser, whose keys an unknown key is matched against.
    """
    message = moved_key_hint(union_in_words(value_in_words(unknown_init_arg(class_in_words(message)))))
    return message if " is now " in message else close_key_hint(message, parser)
