"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def alfworld_data(tmp_path_factory) -> Path:
    """The hand-written ALFWorld fixture games, turned into playable games by ``alfworld-generate`` once per test
    session (~3 s)."""
    from alfworld_games import build_alfworld_fixture

    return build_alfworld_fixture(tmp_path_factory.mktemp("alfworld"))
