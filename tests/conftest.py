"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# Imported up front, not at the end of the session: CPython 3.11's `ast` module keeps one process-wide recursion
# counter, and tracebacks formatted concurrently in env worker threads (a killed JVM's py4j errors) can leave it off;
# hypothesis's pytest plugin then imports hypothesis at the terminal summary and the AST compile of its source fails
# with "SystemError: AST constructor recursion depth mismatch" (seen with `pytest tests/test_faults.py` alone).
import hypothesis  # noqa: F401
import pytest

from sglightning import distributed, errors

_SUITE_PID = os.getpid()


def _only_outside_the_suite(name: str, real):
    """``real`` (an exit) as it is in forked children and subprocesses, and a ``RuntimeError`` in the pytest process
    itself, where it would end the whole session with that status and no report (CI once ended with 130 at 58 %: an
    in-process test reached the CLI's Ctrl-C ending).  So that one test fails instead."""

    def guarded(code: int) -> None:
        if os.getpid() == _SUITE_PID:
            raise RuntimeError(f"{name}({code}) called in the pytest process: run this path in a subprocess")
        real(code)

    return guarded


os._exit = _only_outside_the_suite("os._exit", os._exit)
# exit_process runs the exit hooks (atexit, threading's: ThreadPoolExecutor refuses work after them) before os._exit:
# there the guard above would fire too late, every later test broken.  Patched before anything imports it by name
# (cli, entry), so it fails that one test at once.
errors.exit_process = _only_outside_the_suite("exit_process", errors.exit_process)


@pytest.fixture(scope="session")
def alfworld_data(tmp_path_factory) -> Path:
    """The hand-written ALFWorld fixture games, turned into playable games by ``alfworld-generate`` once per test
    session (~3 s)."""
    from alfworld_games import build_alfworld_fixture

    return build_alfworld_fixture(tmp_path_factory.mktemp("alfworld"))


@pytest.fixture(autouse=True)
def _same_random_start():
    """Every test starts from the same global random state.  torch seeds its default generator from the OS at start
    (``torch.initial_seed()`` differs per process), so a test that builds LoRA adapters or draws without its own
    seed saw other numbers in every run (a learning test failed about one run in five)."""
    import random

    import torch

    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture(autouse=True)
def _no_released_group_left():
    """A test that releases a process group in-process (``distributed.release_process_group``) must not leave the
    flag set: ``cli.main`` would then end every later in-process run through ``exit_process``."""
    yield
    distributed._GROUP_RELEASED = False


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The CLI sets torch's thread count for its process (``--threads``), and ``OMP_NUM_THREADS`` for ranks it starts;
    tests that run it in-process must not leave the rest of the session (and every later subprocess) on another
    count than it started with.  (``monkeypatch.delenv`` of an absent variable records nothing to undo.)"""
    import torch

    before, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp
