"""A pool of environment workers: concurrent ``reset``/``step`` across episodes, timeouts, clean shutdown.

One *slot* per concurrently played episode.  A slot is one environment instance (for ScienceWorld and
TextWorldExpress: one JVM) plus one daemon thread that makes every call on it; both live across steps, episodes and
rollout batches (never one env per sample: creating one per episode dominates rollout time).  A round of the lock-step
rollout hands every live episode's action to its slot at once and waits for all of them, so the wall time of a round
is the slowest step, not the sum.

Why threads: the expensive envs are JVMs behind py4j sockets — a step blocks on socket I/O with the GIL released,
so threads step JVMs truly in parallel, without pickling envs or re-importing the trainer in child processes.
Pure-Python envs (``household``) take microseconds per step; threads cost them nothing.  An env that holds the GIL
for long or can hang (ALFWorld) is a :class:`~sglightning.envs.process.ProcessEnv`: its slot's thread then waits on a
socket too.

Failure handling (each case fails *that episode only*, see :class:`CallOutcome`):

* the env raises (including a killed JVM: py4j raises on the dead socket) → ``error="step: <Type>: <message>"``;
* the env returns the wrong type → ``TypeError`` recorded the same way;
* the call does not return within the timeout (``step_timeout_s``; ``reset_timeout_s`` for create+reset) →
  ``error="step: timeout after X s"``.  The slot is retired: its env is closed from a helper thread (closing a JVM
  env kills the process, which also unblocks the stuck call) and the slot is rebuilt on its next use.  A pure-Python
  env that never returns cannot be interrupted from another thread; its daemon thread is abandoned (counted in
  ``abandoned_threads``) and dies with the process.  Such an env belongs in a process of its own
  (:mod:`sglightning.envs.process`, ``rollout.env_processes``): closing it kills the child and ends the call.

``close()`` closes every env (each with a deadline) and ends the worker threads; :func:`live_java_processes` lets
tests check that no JVM outlives its pool.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from sglightning.envs.base import ResetResult, StepResult, TextEnv, reset_in_split

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class CallOutcome:
    """Result of one pooled call: ``value`` or ``error`` (a one-line reason), never both."""

    value: Any = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class _Worker:
    """One env + the thread that makes every call on it.  A call runs only while holding one of the pool's
    ``permits`` (at most ``max_concurrency`` env calls at once); its timeout counts from that moment."""

    def __init__(self, factory: Callable[[], TextEnv], name: str, permits: threading.Semaphore):
        self.factory = factory
        self.permits = permits
        self.env: TextEnv | None = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.started: dict[int, float] = {}  # id(future) -> perf_counter at start (written by the worker thread)
        self._lock = threading.Lock()
        self._holding = False  # holds a permit right now
        self._stopped = False  # retired or closed: an env built from now on is closed by this thread, not kept
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.inbox.get()
            if job is _STOP:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            self.permits.acquire()
            with self._lock:
                self._holding = True
            self.started[id(fut)] = time.perf_counter()
            try:
                if self.env is None:
                    env = self.factory()
                    if not isinstance(env, TextEnv):
                        raise TypeError(f"the env factory built a {type(env).__name__}, not a sglightning TextEnv")
                    with self._lock:
                        kept = not self._stopped
                        if kept:
                            self.env = env
                    if not kept:  # built after the pool gave up on this worker (a slow start): nobody else closes it
                        _close_quietly(env)
                        raise RuntimeError("the env slot was retired while its env was being built")
                result, error = fn(self.env), None
            except BaseException as err:  # noqa: BLE001 - delivered to the caller, never lost
                result, error = None, err
            self.release()
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

    def release(self) -> None:
        """Give back the permit (once): by the worker when its call returns, or by the pool when it abandons a hung
        call, so that a hung env never starves the others."""
        with self._lock:
            if self._holding:
                self._holding = False
                self.permits.release()

    def submit(self, fn: Callable[[TextEnv], Any]) -> Future:
        fut: Future = Future()
        self.inbox.put((fn, fut))
        return fut

    def stop(self) -> TextEnv | None:
        """Stop the thread after its current call; returns the env to close (None: none built yet, and one built
        from now on is closed by the thread itself)."""
        with self._lock:
            self._stopped = True
            env = self.env
        self.inbox.put(_STOP)
        return env


def _reset(env: TextEnv, seed: int, split: str) -> ResetResult:
    res = reset_in_split(env, seed, split)
    if not isinstance(res, ResetResult):
        raise TypeError(f"reset returned {type(res).__name__}, expected ResetResult")
    _check_fields(res, ("observation", "task"))
    if res.action_help is not None and not isinstance(res.action_help, str):
        raise TypeError(f"malformed ResetResult: action_help {res.action_help!r} is not a str or None")
    _check_numbers(res, ("score",))
    return res


def _step(env: TextEnv, action: str) -> StepResult:
    res = env.step(action)
    if not isinstance(res, StepResult):
        raise TypeError(f"step returned {type(res).__name__}, expected StepResult")
    _check_fields(res, ("observation",))
    if not _finite(res.reward):  # a NaN would reach the advantages and stop the run
        raise ValueError(f"malformed StepResult: reward {res.reward!r} is not a finite number")
    _check_numbers(res, ("score", "progress"))  # a NaN progress read as a negative label's target
    return res


def _check_numbers(res: ResetResult | StepResult, names: tuple[str, ...]) -> None:
    """The optional numbers a rollout reads are finite where given: else the episode fails, naming the field."""
    for name in names:
        value = getattr(res, name)
        if value is not None and not _finite(value):
            raise ValueError(f"malformed {type(res).__name__}: {name} {value!r} is not a finite number or None")


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _check_fields(res: ResetResult | StepResult, texts: tuple[str, ...]) -> None:
    """The fields a rollout reads as text are text, the admissible actions a list of them (a string would be read
    letter by letter) and ``info`` a dict: else the episode fails, naming the field."""
    what = f"malformed {type(res).__name__}"
    for name in texts:
        if not isinstance(getattr(res, name), str):
            raise TypeError(f"{what}: {name} {getattr(res, name)!r} is not a str")
    actions = res.admissible_actions
    if actions is not None and (isinstance(actions, (str, bytes)) or not isinstance(actions, (list, tuple))
                                or not all(isinstance(a, str) for a in actions)):
        raise TypeError(f"{what}: admissible_actions {str(actions)[:80]!r} is not a list of str or None")
    if not isinstance(res.info, dict):  # read by key (truncated, command, task_id)
        raise TypeError(f"{what}: info {str(res.info)[:80]!r} is not a dict")


class EnvPool:
    """Slots of (env, thread); ``reset_many``/``step_many`` run calls on many slots concurrently.

    Args:
        factory: builds one environment (called in the slot's thread, so JVMs start in parallel too).
        step_timeout_s: a ``step`` taking longer fails its episode (``None``: wait forever).
        reset_timeout_s: the same for env creation + ``reset`` (JVM start and task loading can take seconds).
        concurrent: ``False`` runs every call in the caller's thread, one after another (the reference for the
            throughput benchmark and for debugging); timeouts are then not enforced.
        max_concurrency: env calls running at once (``None``: the number of CPU cores).  More threads than cores
            only add contention for CPU-bound simulators (measured: 16 TextWorldExpress JVMs stepped by 16 threads on 2
            cores ran at 0.6× the serial rate).  A call's timeout starts when it gets to run.
    """

    def __init__(
        self,
        factory: Callable[[], TextEnv],
        *,
        step_timeout_s: float | None = 60.0,
        reset_timeout_s: float | None = 300.0,
        concurrent: bool = True,
        max_concurrency: int | None = None,
    ):
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"EnvPool: max_concurrency must be >= 1 or None, got {max_concurrency}")
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        self._permits = threading.Semaphore(self.max_concurrency)
        self.factory = factory
        self.step_timeout_s = step_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self.concurrent = concurrent
        self._workers: dict[int, _Worker] = {}
        self._local_envs: dict[int, TextEnv] = {}
        self.errors = 0  # calls that failed (exception, wrong type or timeout)
        self.timeouts = 0
        self.replaced = 0  # slots rebuilt after a failure
        self._stuck: list[threading.Thread] = []  # threads of retired slots whose call was still running
        self._closers: list[threading.Thread] = []
        self._serial = 0

    # ------------------------------------------------------------------------------------------------------------------
    def env(self, slot: int) -> TextEnv:
        """The slot's environment, created now if needed (synchronously; raises what the factory raises)."""
        if not self.concurrent:
            if slot not in self._local_envs:
                self._local_envs[slot] = self._build()
            return self._local_envs[slot]
        w = self._worker(slot)
        if w.env is None:
            w.submit(lambda env: None).result()
        assert w.env is not None
        return w.env

    def peek(self, slot: int) -> TextEnv | None:
        """The slot's environment if it exists (never creates one)."""
        if not self.concurrent:
            return self._local_envs.get(slot)
        w = self._workers.get(slot)
        return w.env if w is not None else None

    def _build(self) -> TextEnv:
        env = self.factory()
        if not isinstance(env, TextEnv):
            raise TypeError(f"the env factory built a {type(env).__name__}, not a sglightning TextEnv")
        return env

    def _worker(self, slot: int) -> _Worker:
        w = self._workers.get(slot)
        if w is None:
            self._serial += 1
            w = self._workers[slot] = _Worker(self.factory, f"sglightning-env-{slot}-{self._serial}", self._permits)
        return w

    # ------------------------------------------------------------------------------------------------------------------
    def reset_many(self, calls: Sequence[tuple[int, int, str]]) -> list[CallOutcome]:
        """``calls``: (slot, seed, split) → one outcome per call, in order."""
        return self._run(
            [(slot, lambda env, s=seed, sp=split: _reset(env, s, sp)) for slot, seed, split in calls], "reset")

    def step_many(self, calls: Sequence[tuple[int, str]]) -> list[CallOutcome]:
        """``calls``: (slot, action) → one outcome per call, in order."""
        return self._run([(slot, lambda env, a=action: _step(env, a)) for slot, action in calls], "step")

    def _run(self, calls: list[tuple[int, Callable[[TextEnv], Any]]], what: str) -> list[CallOutcome]:
        if len({slot for slot, _ in calls}) != len(calls):
            raise ValueError("EnvPool: one call per slot per round")
        if not self.concurrent:
            return [self._run_local(slot, fn, what) for slot, fn in calls]
        timeout = self.step_timeout_s if what == "step" else self.reset_timeout_s
        t0 = time.perf_counter()
        workers = {slot: self._worker(slot) for slot, _ in calls}
        futures = {slot: workers[slot].submit(fn) for slot, fn in calls}
        outcome: dict[int, CallOutcome] = {}
        pending = dict(futures)
        while pending:
            # a call's timeout runs from its start (it may first wait for a permit)
            now = time.perf_counter()
            deadlines = []
            for slot, fut in list(pending.items()):
                started = workers[slot].started.get(id(fut))
                if fut.done() or timeout is None or started is None:
                    continue
                if now - started >= timeout:
                    del pending[slot]
                    self.timeouts += 1
                    workers[slot].release()
                    outcome[slot] = self._failed(slot, f"{what}: timeout after {timeout:g} s", retire=True)
                else:
                    deadlines.append(started + timeout - now)
            if not pending:
                break
            wait_s = min(deadlines) if deadlines else (None if timeout is None else 0.05)
            done, _ = wait(list(pending.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
            for slot, fut in list(pending.items()):
                if fut not in done:
                    continue
                del pending[slot]
                workers[slot].started.pop(id(fut), None)
                err = fut.exception()
                if err is not None:  # the env's exception fails its episode only
                    outcome[slot] = self._failed(slot, f"{what}: {type(err).__name__}: {err}", retire=True)
                else:
                    outcome[slot] = CallOutcome(value=fut.result(), seconds=time.perf_counter() - t0)
        return [outcome[slot] for slot, _ in calls]

    def _run_local(self, slot: int, fn: Callable[[TextEnv], Any], what: str) -> CallOutcome:
        t0 = time.perf_counter()
        try:
            return CallOutcome(value=fn(self.env(slot)), seconds=time.perf_counter() - t0)
        except Exception as err:  # noqa: BLE001
            return self._failed(slot, f"{what}: {type(err).__name__}: {err}", retire=True)

    def _failed(self, slot: int, reason: str, retire: bool) -> CallOutcome:
        self.errors += 1
        log.debug("env slot %d: %s", slot, reason)  # the rollout says it, once per kind of failure
        if retire:
            self.retire(slot)
        return CallOutcome(error=reason[:500])

    def retire(self, slot: int) -> None:
        """Close the slot's env (in the background, with a deadline) and forget it; the next call rebuilds it."""
        self.replaced += 1
        if not self.concurrent:
            env = self._local_envs.pop(slot, None)
            if env is not None:
                _close_quietly(env)
            return
        w = self._workers.pop(slot, None)
        if w is None:
            return
        env = w.stop()
        if env is not None:
            t = threading.Thread(target=_close_quietly, args=(env,), daemon=True,
                                 name=f"sglightning-env-close-{slot}")
            t.start()
            self._closers = [c for c in self._closers if c.is_alive()] + [t]  # finished ones are forgotten
        # the old thread ends after its current call returns (or never, for a hung pure-Python env); a call still
        # in flight (a timeout: its start is still noted) is what leaves a thread behind
        if w.thread.is_alive() and w.started:
            self._stuck.append(w.thread)

    @property
    def abandoned_threads(self) -> int:
        """Threads of retired slots still stuck in a call (a hung pure-Python env; a closed JVM or process env ends
        its call, and its thread)."""
        self._stuck = [t for t in self._stuck if t.is_alive()]
        return len(self._stuck)

    # ------------------------------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._workers) if self.concurrent else len(self._local_envs)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close every env (each in its own thread, all within ``timeout_s``) and stop the worker threads."""
        closers = []
        envs = [env for w in self._workers.values() if (env := w.stop()) is not None]
        for env in envs + list(self._local_envs.values()):
            t = threading.Thread(target=_close_quietly, args=(env,), daemon=True, name="sglightning-env-close")
            t.start()
            closers.append(t)
        deadline = time.perf_counter() + timeout_s
        for t in closers + self._closers:
            t.join(max(0.0, deadline - time.perf_counter()))
        for w in self._workers.values():
            w.thread.join(max(0.0, deadline - time.perf_counter()))
        self._workers.clear()
        self._local_envs.clear()
        self._closers = [t for t in self._closers if t.is_alive()]

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_quietly(env: TextEnv) -> None:
    try:
        env.close()
    except Exception as err:  # noqa: BLE001 - closing must not mask the real error
        log.warning("closing %s failed: %s", type(env).__name__, err)


def live_java_processes(parent: int | None = None) -> list[int]:
    """PIDs of ``java`` processes that are children of ``parent`` (default: this process). Linux /proc only."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0]
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == parent and state != "Z" and cmd.endswith(b"java"):
            pids.append(int(entry))
    return pids
