"""What the JVM-backed benchmark adapters (ScienceWorld, TextWorldExpress) share: the py4j simulator object, its
process, closing it once, and an expert that replays the simulator's gold path while the agent follows it."""

from __future__ import annotations

import subprocess
from typing import Any

from sglightning.envs.base import TextEnv


class JvmGoldPathEnv(TextEnv):
    """Base of adapters whose simulator (``self._env``) runs in a JVM behind py4j and can produce a gold action path."""

    _env: Any

    def __init__(self) -> None:
        self._gold: list[str] = []
        self._on_gold = False
        self._n = 0  # steps taken in this episode
        self._closed = False

    def _start_episode(self, gold: list[str]) -> None:
        """Reset the step counter and the gold path (empty: no expert for this episode)."""
        self._gold, self._on_gold, self._n = list(gold), bool(gold), 0

    def _count_step(self, action: str) -> None:
        """Record one agent step; the expert stays available only while the agent has followed the gold path."""
        if self._on_gold:
            self._on_gold = self._n < len(self._gold) and action == self._gold[self._n]
        self._n += 1

    def expert_action(self) -> str | None:
        if self._on_gold and self._n < len(self._gold):
            return self._gold[self._n]
        return None

    def process_id(self) -> int | None:
        """PID of this env's JVM (fault injection, leak checks)."""
        proc = getattr(getattr(self._env, "_gateway", None), "java_process", None)
        return getattr(proc, "pid", None)

    def close(self) -> None:
        """End the JVM and wait for it: the simulator's own ``__del__`` closes again at garbage collection and writes to
        the JVM's stdin while it still runs; a JVM that is shutting down has closed that pipe, and the write printed a
        ``BrokenPipeError`` traceback at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        self._env.close()
        proc = getattr(getattr(self._env, "_gateway", None), "java_process", None)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a JVM that will not exit is killed, never waited on forever
                proc.kill()
                proc.wait(timeout=10)
