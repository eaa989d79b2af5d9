"""One environment in a process of its own, behind :class:`TextEnv`: a hung call can be killed, and simulators that
hold the GIL step in parallel.

Why.  The env pool calls each slot's env from a thread.  That suits JVM benchmarks (the simulator is already a
process) and fast pure-Python envs.  It fails two others.  A pure-Python simulator that hangs cannot be stopped from
another thread: its thread is abandoned.  ALFWorld is worse: its simulator runs under one process-wide lock
(textworld's parser breaks under threads), so one hung call blocks every ALFWorld slot for the rest of the run.  And
a simulator that holds the GIL steps one slot at a time, however many cores the machine has.

:class:`ProcessEnv` runs the env in a child process and forwards ``reset``, ``step``, ``expert_action`` and
``close`` over a socket.  Closing it while a call is in flight kills the child, which ends the hung call in the
parent with an error (the pool's timeout does this).  The env is built in the child as the first call runs, so a
constructor that hangs is under the same timeout.

The child imports the env's module, not torch or the trainer.  It sees the parent's ``sys.path`` (the parent's
environment variables are passed unchanged).  It runs in a session of its own, so Ctrl-C reaches the trainer only,
which closes it.  Linux kills it when the parent dies, even while a call holds the GIL (the parent-death signal;
it follows the thread that started the child, so one long-lived thread starts them all).  Its stdout and stderr go to
a temporary file: the run prints nothing of it, and an unexpected end of the child reports that file's last line.
Exceptions come back with their type and message (the cause appended); one that cannot travel, or a
``KeyboardInterrupt``/``SystemExit`` inside the env, comes back as ``RuntimeError("<Type>: <message>")``.

Cost: one Python process per slot and its start-up (ALFWorld: ~70 MB and ~0.8 s; ``docs/environments.md``), paid
again each time a failure rebuilds the slot.  ``rollout.env_processes`` chooses (null: the env class's
``own_process``, true for ALFWorld).
"""

from __future__ import annotations

import ctypes
import functools
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglightning.envs import build_env, env_class_of
from sglightning.envs.base import ResetResult, StepResult, TextEnv, reset_in_split

_HEADER = struct.Struct("!Q")
#: attributes the rollout and the reports read off an env; copied from the child's env once it is built
_ATTRIBUTES = ("name", "splits", "action_help")
#: the child's first lines: the parent's import path (argv[3:]) before any import a file in the folder could shadow
_BOOT = ("import sys; sys.path[:] = sys.argv[3:]; from sglightning.envs.process import serve; "
         "serve(int(sys.argv[1]), int(sys.argv[2]))")
#: starts every child and lives as long as the process: the parent-death signal follows the starting thread, and a
#: pool slot's thread ends while its env is still being closed (which cut the env's own close short).  Made on first
#: use and again after a fork (a forked process has the executor but not its thread: a build waited for ever)
_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglightning-env-spawner")
        return _SPAWNER


def _forget_spawner() -> None:
    global _SPAWNER, _SPAWNER_LOCK
    _SPAWNER, _SPAWNER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_spawner)


def portable(env: Any) -> Any:
    """What builds ``env``, without what a config parser wraps around it.

    jsonargparse hands over ``partial(<its instantiator>, <parser state>, cls, **init_args)``; the parser state holds
    the whole run (the model too) and does not pickle.  This returns ``partial(cls, *args, **init_args)``, its
    arguments made portable too (an init argument that takes a class, as ``FaultyEnv``'s ``env``, is such a
    partial).  Any other callable, a user's partial included, is returned as it is.

    Args:
        env: the configured env, or one of its arguments.
    """
    if isinstance(env, (list, tuple)):
        return type(env)(portable(v) for v in env)
    if isinstance(env, dict):
        return {k: portable(v) for k, v in env.items()}
    if isinstance(env, functools.partial) and getattr(env.func, "__module__", "").startswith("jsonargparse"):
        cls = env_class_of(env)
        if isinstance(cls, type) and cls in env.args:
            args = [portable(a) for a in env.args[env.args.index(cls) + 1:]]
            return functools.partial(cls, *args, **{k: portable(v) for k, v in env.keywords.items()})
    return env


def travels(env: Any) -> bool:
    """Whether a child process can build ``env``: what builds it is not defined in ``__main__`` (a script or a
    notebook), which the child does not have."""
    spec = portable(env)
    parts = [spec, env_class_of(spec)]
    if isinstance(spec, functools.partial):
        parts.append(spec.func)
    return all(getattr(p, "__module__", None) != "__main__" for p in parts)


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _receive(sock: socket.socket) -> Any:
    """One message; ``EOFError`` when the other side has gone."""
    size = _HEADER.unpack(_exactly(sock, _HEADER.size))[0]
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side of the env socket closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class ProcessEnv(TextEnv):
    """An env built and played in a child process (see the module docstring).

    Args:
        env: what builds the env: a ``TextEnv`` class or a ``functools.partial`` of one (what a config's ``env``
            becomes). It must pickle, so it cannot be defined in ``__main__`` or inside a function.
        close_timeout_s: how long ``close`` waits for the env's own ``close`` before it kills the child.
    """

    def __init__(self, env: Any, close_timeout_s: float = 10.0):
        spec = portable(env)
        target = env_class_of(spec)
        self.wrapped: type = target if isinstance(target, type) else type(self)  # the class the child plays
        why = None if travels(spec) else "it is defined in __main__, which a child process does not import"
        try:
            payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing to the user
            why = why or str(err)
        if why:
            name = getattr(target, "__qualname__", repr(env))
            raise ValueError(f"rollout.env_processes: the env {name} cannot be sent to a process ({why}); define it "
                             f"in an importable module, or set rollout.env_processes false")
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Lock()  # held for the length of one call
        self._closing = threading.Lock()  # one close at a time
        self._closed = False
        self._attributes: dict[str, Any] | None = None  # the child's env's name, splits, action_help once built
        self._unbuilt: Exception | None = None  # what the env's constructor raised (raised again by every call)
        self._output = tempfile.TemporaryFile(prefix="sglightning-env-")  # the child's stdout and stderr
        mine, theirs = socket.socketpair()
        self._sock = mine
        path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        try:
            self._proc = _spawner().submit(
                subprocess.Popen, [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid()), *path],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=self._output, stderr=self._output,
                start_new_session=True).result()
            mine.sendall(_frame(("build", (payload,))))  # answered before the first call's answer
        except BaseException:
            mine.close()
            self._output.close()
            raise
        finally:
            theirs.close()

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    # the attributes a config check, the rollout and the reports read: the child's env's own, once it is built
    @property
    def name(self) -> str:  # type: ignore[override]
        return self._built()["name"]

    @property
    def splits(self) -> tuple[str, ...]:  # type: ignore[override]
        return self._built()["splits"]

    @property
    def action_help(self) -> str:  # type: ignore[override]
        return self._built()["action_help"]

    def _built(self) -> dict[str, Any]:
        """The built env's attributes; waits for the build and raises what the env's constructor raised."""
        if self._attributes is None:
            self._call("attributes")
        assert self._attributes is not None
        return self._attributes

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the env process was closed (ProcessEnv.{method} after close)")
            ok, value = True, None
            try:
                if self._attributes is None and self._unbuilt is None:  # the build's answer comes first
                    built, answer = _receive(self._sock)
                    if built:
                        self._attributes = answer
                    else:
                        self._unbuilt = answer
                if self._unbuilt is None and method != "attributes":
                    self._sock.sendall(_frame((method, args)))
                    ok, value = _receive(self._sock)
            except (EOFError, OSError):  # the socket's failure, not the env's (its errors arrive as answers)
                if self._closed:  # close() killed the child under this call
                    self._sock.close()
                raise RuntimeError(f"the env process ended during {method} ({self._ending()})") from None
        if self._unbuilt is not None:
            raise self._unbuilt
        if not ok:
            raise value
        return value

    def _ending(self) -> str:
        if self._closed:
            return "it was closed: a timeout or the end of the run"
        try:
            code = self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "its socket closed"
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"{how}: {last_line}" if (last_line := self._last_output()) else how

    def _last_output(self) -> str:
        """The last line the child wrote (an import error, a crash), for the one-line error."""
        try:
            size = os.fstat(self._output.fileno()).st_size
            self._output.seek(max(0, size - 4096))
            lines = self._output.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return ""
        return lines[-1][:300] if lines else ""

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        return self._call("reset", seed, split)

    def step(self, action: str) -> StepResult:
        return self._call("step", action)

    def expert_action(self) -> str | None:
        return self._call("expert_action")

    def close(self) -> None:
        """Close the env and end the child: politely when no call is running, else (a hung call) by killing it."""
        with self._closing:
            if self._closed:
                return
            polite = self._lock.acquire(blocking=False)
            deadline = time.monotonic() + self.close_timeout_s  # one wait in all before the kill
            try:
                if polite and self._attributes is not None:
                    try:
                        self._sock.settimeout(self.close_timeout_s)
                        self._sock.sendall(_frame(("close", ())))
                        _receive(self._sock)
                    except Exception:  # noqa: BLE001 - a dead or stuck child is killed below
                        pass
                self._closed = True
                try:
                    waited = polite and self._attributes is not None
                    self._proc.wait(timeout=max(0.0, deadline - time.monotonic()) if waited else 0)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                try:  # wakes a call blocked on the socket in another thread (it then raises)
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            finally:
                if polite:
                    self._lock.release()
            if polite or self._lock.acquire(timeout=self.close_timeout_s):  # the woken call has returned
                try:
                    self._sock.close()
                finally:
                    if not polite:
                        self._lock.release()
            self._output.close()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------------------------------------------------------
# the child


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the thread that started it (the parent's spawner, which lives as long
    as the parent) ends, even while a call holds the GIL.  Elsewhere, and for a parent that died before this line, a
    thread polls."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _answer(sock: socket.socket, method: str, ok: bool, value: Any) -> None:
    """Send one answer; an error, or a value, that cannot travel is sent as an error that can."""
    if not ok:
        cause = value.__cause__ or (None if value.__suppress_context__ else value.__context__)
        if not isinstance(value, Exception):  # KeyboardInterrupt, SystemExit inside the env
            value = RuntimeError(f"{type(value).__name__}: {value}")
        elif cause is not None:
            value.args = (f"{value} (from {type(cause).__name__}: {cause})",) if len(value.args) <= 1 else value.args
        value.__traceback__ = value.__cause__ = value.__context__ = None
    try:
        frame = _frame((ok, value))
        if not ok:
            pickle.loads(frame[_HEADER.size:])  # the parent must be able to build it again
    except Exception as err:  # noqa: BLE001
        what = f"{type(value).__name__}: {value}" if not ok else f"{method} returned a value that cannot travel ({err})"
        frame = _frame((False, RuntimeError(what) if not ok else TypeError(what)))
    sock.sendall(frame)


def serve(fd: int, parent: int) -> None:
    """The child's loop: build the env from the first message, then answer calls until ``close`` or the parent's
    end.

    Args:
        fd: the child's end of the socket.
        parent: the parent's process id.
    """
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent closes us
    sock = socket.socket(fileno=fd)
    env: TextEnv | None = None
    while True:
        try:
            method, args = _receive(sock)
        except (EOFError, OSError):  # the parent has gone: no one to answer
            sock.close()
            return
        if method == "close":
            break
        try:
            if method == "build":
                env = build_env(pickle.loads(args[0]), processes=False)
                value = {key: getattr(env, key) for key in _ATTRIBUTES}
            elif method == "reset":
                value = reset_in_split(env, *args)
            else:
                value = getattr(env, method)(*args)
        except BaseException as err:  # noqa: BLE001 - the env's own error, raised again in the parent
            _answer(sock, method, False, err)
            continue
        _answer(sock, method, True, value)
    try:  # the env's own close, one answer, then the end of the process
        if env is not None:
            env.close()
        _answer(sock, "close", True, None)
    except BaseException as err:  # noqa: BLE001
        try:
            _answer(sock, "close", False, err)
        except OSError:
            pass
    sock.close()
