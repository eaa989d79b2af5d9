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

_SUITE_PID = os.getpid()
_real_exit = os._exit


def _exit_outside_the_suite(code: int) -> None:
    """``os._exit`` in the test process itself ends the whole session with that status and no report (CI once ended
    with 130 at 58 %: an in-process test reached the CLI's Ctrl-C ending).  Here it fails that one test instead;
    forked children and subprocesses exit as usual."""
    if os.getpid() == _SUITE_PID:
        raise RuntimeError(f"os._exit({code}) called in the pytest process: run this path in a subprocess")
    _real_exit(code)


os._exit = _exit_outside_the_suite


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
def _keep_torch_threads():
    """The CLI sets torch's thread count for its process (``--threads``); tests that run it in-process must not leave
    the rest of the session on another count than it started with."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
