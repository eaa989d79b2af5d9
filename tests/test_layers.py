"""The layering is a check: the import-linter contracts in pyproject.toml pass on the tree, and each one fails when a
file breaks it (a lower layer importing a higher one, Lightning below the Lightning layer, the rollout engine
imported by a file that does not run rollouts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def _lint(cwd: Path, src: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src))  # before the editable install's path: the copy is analysed
    return subprocess.run([LINT, "--no-cache", "--no-logo"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_keeps_every_contract():
    res = _lint(ROOT, ROOT / "src")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 kept, 0 broken" in res.stdout


@pytest.mark.parametrize("file,line,contract", [
    ("grpo.py", "from sglightning import update  # noqa: F401", "layers: imports point down only"),  # upward
    ("rewards.py", "import lightning  # noqa: F401", "below the Lightning layer nothing imports Lightning"),
    ("metrics.py", "from sglightning import rollout  # noqa: F401",
     "the rollout engine is imported only by what runs rollouts"),
])
def test_a_violation_breaks_its_contract(tmp_path, file, line, contract):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "src" / "sglightning", tmp_path / "src" / "sglightning",
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "src" / "sglightning" / file
    target.write_text(target.read_text() + "\n" + line + "\n")
    res = _lint(tmp_path, tmp_path / "src")
    assert res.returncode != 0
    assert f"{contract} BROKEN" in res.stdout, res.stdout
    assert "2 kept, 1 broken" in res.stdout, res.stdout


def test_the_lightning_module_keeps_to_its_size():
    """module.py keeps what needs Lightning (forwards, backward, collectives, optimiser, hooks) in at most 500 lines;
    what needs no Lightning lives below it (DEVELOPERS.md's table)."""
    lines = (ROOT / "src" / "sglightning" / "module.py").read_text().count("\n")
    assert lines <= 500, f"module.py has {lines} lines: move what needs no Lightning to a lower layer"
