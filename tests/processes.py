"""Processes of several ranks in tests: running a command that starts its own (Lightning's other ranks) to its end,
running the commands of several nodes at once, and joining and ending the gloo group of ranks a test spawned itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def run_whole(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``, the command in a session of its own.
    A timeout (or pytest-timeout's alarm) kills every process it started, not the launcher alone: Lightning's rank 1
    left running would compete with every later test for the two cores.

    Args:
        cmd: the command line.
        timeout: seconds before every process of the command is killed and ``TimeoutExpired`` raised.
        **kw: ``env``, ``cwd``: as for ``subprocess.Popen``.
    """
    env = kw.pop("env", None)
    return run_together([cmd], timeout, [env], **kw)[0]


def run_together(cmds: list[list[str]], timeout: float, envs: list[dict | None], **kw
                 ) -> list[subprocess.CompletedProcess]:
    """Run every command at once to its end (each in a session of its own), as the nodes of one job: a timeout, an
    error or pytest-timeout's alarm kills every process of every command.

    Args:
        cmds: the command lines.
        timeout: seconds for all of them together before every process is killed and ``TimeoutExpired`` raised.
        envs: each command's environment (None: this process's).
        **kw: ``cwd``: as for ``subprocess.Popen``.
    """
    from concurrent.futures import ThreadPoolExecutor

    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=env, **kw) for cmd, env in zip(cmds, envs, strict=True)]
    # several commands: every command's pipes read at once (one reader at a time would leave another's pipe full,
    # that process blocked, and the one read waiting on it in a collective)
    pool = ThreadPoolExecutor(len(procs)) if len(procs) > 1 else None
    try:
        if pool is None:
            outs = [procs[0].communicate(timeout=timeout)]
        else:
            outs = list(pool.map(lambda proc: proc.communicate(timeout=timeout), procs))
    except BaseException:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if pool is not None:
            pool.shutdown(wait=True)  # the readers end as their processes die; only then read here
        for proc in procs:
            with contextlib.suppress(ValueError, OSError):  # a command whose pipes were read to the end already
                proc.communicate()
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return [subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            for cmd, proc, (out, err) in zip(cmds, procs, outs)]


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, for a launcher that takes a port and no store file (another process may
    take it before the launcher does: rare, and why spawned tests use a store file instead)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, folder: str, seconds: float = 300) -> None:
    """Join a gloo group of two ranks through a store file in ``folder`` (the test's own), not a TCP port. A port
    picked free and released before use can be taken by another process in between; a file cannot.

    Args:
        rank: this process's rank (0 or 1).
        folder: a folder both ranks see and no other group uses.
        seconds: the group's timeout for any collective.
    """
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    store = Path(folder) / "gloo_store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=seconds))


def end_rank() -> None:
    """End a rank a test spawned (``mp.spawn``) as ``sglightning`` ends one: the group released, then no interpreter
    teardown.  Left to teardown, gloo's threads can abort the process (SIGABRT, "terminate called without an active
    exception"; an FSDP2 rank, whose modules still hold the group, did so once in a full run)."""
    from sglightning.distributed import release_process_group
    from sglightning.errors import exit_process

    release_process_group()
    exit_process(0)
