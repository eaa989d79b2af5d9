"""One environment in a process of its own, behind :class:`TextEnv`: a hung call can be killed, and simulators that
hold the GIL step in parallel.

Why.  The env pool calls each slot's env from a thread.  That suits JVM benchmarks (the simulator is already a
process) and fast pure-Python envs.  It fails two others.  A pure-Python simulator that hangs cannot be stopped from
another thread: its thread is abandoned.  ALFWorld is worse: its simulator runs under one process-wide lock
(textworld's parser breaks under threads), so one hung call blocks every ALFWorld slot for the rest of the run.  And
a simulator that holds the GIL steps one slot at a time, however many cores the machine has.

:class:`ProcessEnv` runs the env in a child process (``python -m sglightning.envs.process``) and forwards ``reset``,
``step``, ``expert_action`` and ``close`` over a socket.  Closing it while a call is in flight kills the child, which
ends the hung call in the parent with an error (the pool's timeout does this).  The child imports the env's module,
not torch or the trainer; it ignores Ctrl-C (the parent closes it) and exits when the parent dies.

Cost: one Python process per slot (measured for ALFWorld in ``docs/environments.md``) and a start-up of about a
second, paid once per slot.  Exceptions come back with their type and message; one that cannot be pickled comes
back as ``RuntimeError("<Type>: <message>")``.

``rollout.env_processes`` chooses (null: the env class's ``own_process``, true for ALFWorld).
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from sglightning.envs import env_class_of
from sglightning.envs.base import ResetResult, StepResult, TextEnv

_HEADER = struct.Struct("!Q")
#: attributes the rollout and the reports read off an env; copied from the child's env once it is built
_ATTRIBUTES = ("name", "splits", "action_help")


def portable(env: Any) -> Any:
    """What builds ``env``, without what a config parser wraps around it.

    jsonargparse hands over ``partial(instantiator, <parser state>, cls, **init_args)``; its parser state holds the
    whole run (the model too) and does not pickle.  This returns ``partial(cls, *args, **init_args)``; a plain class
    or callable is returned as it is."""
    if isinstance(env, functools.partial):
        cls = env_class_of(env)
        if isinstance(cls, type) and cls in env.args:
            after = env.args[env.args.index(cls) + 1:]
            return functools.partial(cls, *after, **env.keywords)
    return env


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


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
        try:
            payload = pickle.dumps(portable(env), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing to the user
            name = getattr(env_class_of(env), "__qualname__", repr(env))
            raise ValueError(f"rollout.env_processes: the env {name} cannot be sent to a process ({err}); define it "
                             f"in an importable module, or set rollout.env_processes false") from None
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Lock()  # held for the length of one call
        self._closed = False
        mine, theirs = socket.socketpair()
        self._sock = mine
        path = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "sglightning.envs.process", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        try:
            attributes = self._call("build", payload)
        except BaseException:
            self.close()
            raise
        for key, value in attributes.items():
            setattr(self, key, value)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the env process was closed (ProcessEnv.{method} after close)")
            try:
                _send(self._sock, (method, args))
                ok, value = _receive(self._sock)
            except (EOFError, OSError):
                if self._closed:  # close() killed the child under this call and left the socket to us
                    self._sock.close()
                raise RuntimeError(f"the env process ended during {method} ({self._ending()})") from None
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
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        return self._call("reset", seed, split)

    def step(self, action: str) -> StepResult:
        return self._call("step", action)

    def expert_action(self) -> str | None:
        return self._call("expert_action")

    def close(self) -> None:
        """Close the env and end the child: politely when no call is running, else (a hung call) by killing it."""
        if self._closed:
            return
        polite = self._lock.acquire(blocking=False)
        try:
            if polite:
                try:
                    self._sock.settimeout(self.close_timeout_s)
                    _send(self._sock, ("close", ()))
                    _receive(self._sock)
                except Exception:  # noqa: BLE001 - a dead or stuck child is killed below
                    pass
            self._closed = True
            try:
                self._proc.wait(timeout=self.close_timeout_s if polite else 0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            try:  # wakes a call blocked on the socket in another thread (it then raises)
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if polite:
                self._sock.close()
        finally:
            if polite:
                self._lock.release()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------------------------------------------------------
# the child


def _watch_parent(parent: int) -> None:
    """End this process when its parent has gone (the parent may die while this one is stuck in a call)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _reply(sock: socket.socket, ok: bool, value: Any) -> None:
    if not ok:
        try:  # the parent re-raises it, so it must survive the trip
            pickle.loads(pickle.dumps(value))
        except Exception:  # noqa: BLE001
            value = RuntimeError(f"{type(value).__name__}: {value}")
        value.__traceback__ = None
    _send(sock, (ok, value))


def serve(fd: int, parent: int) -> None:
    """The child's loop: build the env from the first message, then answer calls until ``close`` or the parent's
    end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent closes us
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
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
                env = pickle.loads(args[0])()
                if not isinstance(env, TextEnv):
                    raise TypeError(f"env: {args[0]!r} built a {type(env).__name__}, not a sglightning TextEnv")
                value = {key: getattr(env, key) for key in _ATTRIBUTES if hasattr(env, key)}
            else:
                value = getattr(env, method)(*args)
        except Exception as err:  # noqa: BLE001 - the env's own error, raised again in the parent
            _reply(sock, False, err)
            continue
        _reply(sock, True, value)
    try:  # the env's own close, one reply, then the end of the process
        if env is not None:
            env.close()
        _reply(sock, True, None)
    except Exception as err:  # noqa: BLE001
        _reply(sock, False, err)
    sock.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
