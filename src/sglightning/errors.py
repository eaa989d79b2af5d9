"""Errors the CLI turns into one line (no traceback wall), and how a process ends after one (:func:`exit_process`)."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import NoReturn


class ConfigError(ValueError):
    """A configuration value that cannot work, found at setup time (env, splits, model loading); the message starts
    with the config key, e.g. ``evaluation.split: 'dev' is not a split of ALFWorldEnv; allowed: ...``."""


class EngineError(RuntimeError):
    """The generation engine (a vLLM server) is gone or refused something essential mid-run: the step in progress is
    abandoned (``last.ckpt`` still holds the last whole step) and the CLI says so in one line."""


class OutOfMemory(RuntimeError):
    """The accelerator ran out of memory in a rollout or an update: the step in progress is abandoned (``last.ckpt``
    still holds the last whole step) and the CLI says so in one line, naming the keys that shrink that phase."""


#: the keys that shrink each phase's memory, named by the out-of-memory line
SHRINKS = {
    "rollout": "rollout.groups_per_step, rollout.group_size, rollout.max_context_tokens (model.engine.compile: off "
               "drops the static cache; in two_call, a lower model.engine.cache_memory or rollout.reuse_prefix: false "
               "holds one cache, not two)",
    "validation": "evaluation.tasks_per_batch, evaluation.episodes_per_task, rollout.max_context_tokens",
    "update": "update.micro_batch_size, model.policy.gradient_checkpointing: true, rollout.max_context_tokens, "
              "model.engine.cache_memory (the rollout's caches, kept beside the update)",
}


def memory_error_within(err: BaseException) -> BaseException | None:
    """The accelerator out-of-memory error ``err`` is or wraps (torch's compiler wraps errors raised while it
    compiles or captures a graph), else None: a compile that ran out of memory must end as an out-of-memory error,
    not fall back to eager and fail again later."""
    import torch

    seen: set[int] = set()  # a chain that loops
    while err is not None and id(err) not in seen:
        if isinstance(err, torch.OutOfMemoryError):
            return err
        seen.add(id(err))
        nxt = getattr(err, "inner_exception", None) or err.__cause__  # not __context__ in general: an error raised
        # while another was handled is not that error; but dynamo re-raises an error met while tracing ``from None``
        if nxt is None and isinstance(err, torch._dynamo.exc.TorchDynamoException) and err.__suppress_context__:
            nxt = err.__context__
        err = nxt
    return None


def summary(err: BaseException) -> str:
    """``err`` in a warning's words: its type and the first line of its message (at most 200 characters)."""
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {first}"


def reraise_out_of_memory(phase: str, err: BaseException, step: int) -> None:
    """Raise :func:`out_of_memory`'s error when ``err`` is or wraps an out-of-memory error (else ``err`` itself)."""
    oom = memory_error_within(err)
    if oom is None:
        raise err
    raise out_of_memory(phase, oom, step) from None


def out_of_memory(phase: str, err: BaseException, step: int) -> OutOfMemory:
    """The one-line error for an out-of-memory ``err`` in ``phase`` (rollout, validation, update) of step ``step``."""
    what = str(err).split("\n")[0].split(". ")[0][:160]
    return OutOfMemory(f"out of accelerator memory in the {phase} of step {step} ({what}): lower {SHRINKS[phase]}")


def nonfinite_stop(limit: int, step: int, path) -> str:
    """Why a run stopped itself after ``limit`` non-finite updates in a row at ``step``, its state saved in ``path``."""
    return (f"stopped after {limit} consecutive non-finite updates (update.max_consecutive_skips={limit}) at step "
            f"{step}; last good adapters saved in {path}. Lower the learning rate, set grpo.max_grad_norm, or check "
            f"the rollouts' log-prob gap.")


def not_writable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written (its deepest existing ancestor is tried), or None.  Nothing is left
    behind: the probe is an empty folder, removed at once."""
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=".sglightning-write-check-", dir=existing)
    except OSError as err:
        return f"{existing} does not take new folders ({err.strerror or type(err).__name__})"
    os.rmdir(probe)
    return None


def check_number(key: str, value: float | None, low: float, strict: bool = False, null: bool = False) -> None:
    """``ValueError`` naming ``key`` unless ``value`` is a finite number ≥ ``low`` (> with ``strict``), or None where
    ``null`` allows it.  NaN passes every ``<`` test: a NaN temperature or clip norm would pass a plain check, and
    YAML's ``.nan`` is a float.

    Args:
        key: the config key as the user writes it (``rollout.temperature``).
        value: the value given.
        low: the bound.
        strict: the bound itself is refused.
        null: None is allowed (the key's "off").
    """
    if value is None and null:
        return
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if strict else value >= low)):
        bound = "" if low == -math.inf else f" {'>' if strict else '>='} {low:g}"
        raise ValueError(f"{key}: must be a finite number{bound}{' or null' if null else ''}, got {value!r}")


def exit_process(code: int) -> NoReturn:
    """End the process with status ``code``: what a normal exit does, then ``os._exit`` instead of teardown.

    Two endings need it.  A process that ran a process group: destroying a group frees nothing while something still
    holds it (FSDP1 modules after a backward, DTensor's sharding cache under FSDP2).  Its gloo threads then meet
    interpreter teardown, where a run that succeeded can abort (SIGABRT, "terminate called without an active
    exception"; a race, seen on slow machines).  And a Ctrl-C: once a ``KeyboardInterrupt`` has left an ``exec`` of
    source text (``dataclasses`` makes methods so, while a module imports), CPython ends a ``python -m`` process by
    SIGINT at teardown, whatever status it exits with (-2, not 130).
    So: threading's exit hooks run and non-daemon threads joined, then exit hooks run, as ``sys.exit`` would, then logs
    and streams flushed, then exit before teardown.

    Args:
        code: the process's exit status.
    """
    # as the interpreter's exit does: the threading exit hooks (concurrent.futures' among them, which tells idle
    # pool workers, e.g. inductor's compile threads, to stop), then every non-daemon thread joined
    threading._shutdown()
    atexit._run_exitfuncs()  # every hook, last registered first, as at interpreter exit (logging's included)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
