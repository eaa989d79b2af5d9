"""A fault-injecting wrapper around any environment: chaos testing for the rollout's failure handling.

``FaultyEnv`` behaves like the wrapped env except for the task seeds listed in ``faults``, where it fails in one of
these ways (the kinds the worker pool must survive):

===============  ===================================================================================================
kind             what happens (for a listed seed)
===============  ===================================================================================================
``reset_raise``  ``reset`` raises ``RuntimeError``
``step_raise``   ``step`` number ``fault_step`` raises ``RuntimeError``
``hang``         ``step`` number ``fault_step`` sleeps ``hang_s`` seconds (past ``rollout.env_step_timeout_s``)
``garbage``      ``step`` number ``fault_step`` returns a string instead of a ``StepResult``
``bad_field``    ``step`` number ``fault_step`` returns a ``StepResult`` whose reward is not a number
``die``          before step number ``fault_step`` the env's process is SIGKILLed (the JVM of ScienceWorld /
                 TextWorldExpress via their ``process_id()``), then the step runs against the dead process; an env
                 without a process raises ``ProcessLookupError`` instead
===============  ===================================================================================================

YAML (the inner env is any env spec)::

    env:
      class_path: sglightning.envs.faults.FaultyEnv
      init_args:
        env: {class_path: sglightning.envs.household.HouseholdEnv, init_args: {difficulty: 0}}
        faults: {17: hang, 23: die}
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from sglightning.envs.base import ResetResult, StepResult, TextEnv
from sglightning.envs.household import HouseholdEnv

KINDS = ("reset_raise", "step_raise", "hang", "garbage", "bad_field", "die")


class FaultyEnv(TextEnv):
    def __init__(
        self,
        env: Callable[[], TextEnv] = HouseholdEnv,
        faults: dict[int, str] | None = None,
        fault_step: int = 1,
        hang_s: float = 3600.0,
    ):
        """Args:
        env: the wrapped environment (class or factory).
        faults: task seed -> fault kind (one of reset_raise, step_raise, hang, garbage, bad_field, die).
        fault_step: the step (1-based) at which step faults fire.
        hang_s: how long a ``hang`` sleeps.
        """
        faults = {int(k): str(v) for k, v in (faults or {}).items()}
        bad = sorted({v for v in faults.values() if v not in KINDS})
        if bad:
            raise ValueError(f"env.init_args.faults: unknown fault kind(s) {bad}; allowed: {', '.join(KINDS)}")
        if fault_step < 1:
            raise ValueError(f"env.init_args.fault_step: must be >= 1, got {fault_step}")
        self.inner = env()
        self.faults = faults
        self.fault_step = fault_step
        self.hang_s = hang_s
        self.name = f"faulty-{getattr(self.inner, 'name', 'env')}"
        self.splits = getattr(self.inner, "splits", TextEnv.splits)
        self.action_help = getattr(self.inner, "action_help", TextEnv.action_help)
        self._kind: str | None = None
        self._n = 0

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        self._kind, self._n = self.faults.get(int(seed)), 0
        if self._kind == "reset_raise":
            raise RuntimeError(f"injected fault: reset of seed {seed} raised")
        return self.inner.reset(seed, split=split)

    def step(self, action: str) -> StepResult:
        self._n += 1
        kind = self._kind if self._n == self.fault_step else None
        if kind == "step_raise":
            raise RuntimeError(f"injected fault: step {self._n} raised")
        if kind == "hang":
            time.sleep(self.hang_s)
        if kind == "garbage":
            return "injected garbage"  # type: ignore[return-value]
        if kind == "die":
            pid = self.inner.process_id() if hasattr(self.inner, "process_id") else None
            if pid is None:
                raise ProcessLookupError("injected fault: the env process died")
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        res = self.inner.step(action)
        if kind == "bad_field":
            res.reward = "a lot"  # type: ignore[assignment]
        return res

    def expert_action(self) -> str | None:
        return self.inner.expert_action()

    def close(self) -> None:
        self.inner.close()
