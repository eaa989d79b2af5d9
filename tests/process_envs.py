"""Environments for the process-env tests, in a module of their own: a child process imports it to build them (it
imports sglightning's env layer only, not torch)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sglightning.envs.base import ResetResult, StepResult
from sglightning.envs.household import HouseholdEnv

#: held around every step of every LockedEnv in a process, as ALFWorld holds its simulator lock
SIMULATOR_LOCK = threading.Lock()
#: set by a test to let the hung steps of in-process LockedEnvs end
RELEASE = threading.Event()


class LockedEnv(HouseholdEnv):
    """Household steps under one process-wide lock; a step of a seed in ``bad_seeds`` hangs while holding it (until
    ``RELEASE`` is set, which a child process never sees)."""

    def __init__(self, bad_seeds: tuple[int, ...] = (1,), **kw):
        super().__init__(**kw)
        self.bad_seeds = tuple(bad_seeds)

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        self._seed = seed
        return super().reset(seed, split)

    def step(self, action: str) -> StepResult:
        with SIMULATOR_LOCK:
            while self._seed in self.bad_seeds and not RELEASE.is_set():
                time.sleep(0.01)
            return super().step(action)


class MarkedEnv(HouseholdEnv):
    """Writes ``closed`` into ``marker`` when closed."""

    def __init__(self, marker: str, **kw):
        super().__init__(**kw)
        self.marker = marker

    def close(self) -> None:
        Path(self.marker).write_text("closed")
        super().close()


class TwoArgumentError(Exception):
    """An exception that pickles but cannot be built again from its pickle (two required arguments)."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")


class OddErrorEnv(HouseholdEnv):
    def step(self, action: str) -> StepResult:
        raise TwoArgumentError("step", "the simulator lost its map")


class BrokenEnv(HouseholdEnv):
    def __init__(self, **kw):
        raise ValueError("env.init_args.level: 7 is not a level of BrokenEnv")


class NotAnEnv:
    def __init__(self, **kw):
        pass


class GreedyEnv(HouseholdEnv):
    """A step that never ends and never lets go of the GIL (a regular expression that backtracks for ever)."""

    def step(self, action: str) -> StepResult:
        import re

        re.match(r"(a+)+$", "a" * 64 + "b")
        return super().step(action)


class NoSplitEnv(HouseholdEnv):
    """Written before splits existed: ``reset(seed)``."""

    def reset(self, seed: int) -> ResetResult:  # type: ignore[override]
        return super().reset(seed)


class SlowBuildEnv(HouseholdEnv):
    """A constructor that never returns (a simulator that waits for a licence server)."""

    def __init__(self, **kw):
        while True:
            time.sleep(1)


class ChattyEnv(HouseholdEnv):
    """Prints while it builds and steps; ``crash`` in an action prints a reason and ends the process; ``interrupt``
    raises KeyboardInterrupt; ``chain`` raises a ValueError from a KeyError; ``lambda`` returns what cannot pickle."""

    def __init__(self, **kw):
        print("ChattyEnv: building", flush=True)
        import sys

        print("ChattyEnv: a warning", file=sys.stderr, flush=True)
        super().__init__(**kw)

    def step(self, action: str) -> StepResult:
        import os
        import sys

        print("ChattyEnv: stepping", flush=True)
        if action == "crash":
            print("ChattyEnv: the simulator's map is corrupt", file=sys.stderr, flush=True)
            os._exit(3)
        if action == "interrupt":
            raise KeyboardInterrupt("pressed inside the env")
        if action == "chain":
            try:
                {}["room"]
            except KeyError as err:
                raise ValueError("no such room") from err
        res = super().step(action)
        if action == "lambda":
            res.info["callback"] = lambda: None
        return res


class MissingFileEnv(HouseholdEnv):
    """A constructor that raises an OSError (a game file not there)."""

    def __init__(self, **kw):
        raise FileNotFoundError("no such game file: /games/kitchen.json")


class MissingAttributeEnv(HouseholdEnv):
    """A constructor that raises an AttributeError (a bug in the env's own code)."""

    def __init__(self, **kw):
        raise AttributeError("'NoneType' object has no attribute 'rooms'")
