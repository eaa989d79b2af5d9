"""Processes of several ranks in tests: running a command that starts its own (Lightning's other ranks) to its end,
and ending a rank a test spawned itself."""

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
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def end_rank() -> None:
    """End a rank a test spawned (``mp.spawn``) as ``sglightning`` ends one: the group released, then no interpreter
    teardown.  Left to teardown, gloo's threads can abort the process (SIGABRT, "terminate called without an active
    exception"; an FSDP2 rank, whose modules still hold the group, did so once in a full run)."""
    from sglightning.distributed import release_process_group
    from sglightning.errors import exit_process

    release_process_group()
    exit_process(0)
