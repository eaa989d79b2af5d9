"""The learning-curve runner: artefacts, skipping finished runs, resuming cut ones."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _runner():
    spec = importlib.util.spec_from_file_location("learning_curves", ROOT / "benchmarks" / "learning_curves.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_runner_writes_curves_skips_finished_runs_and_resumes_cut_ones(tmp_path):
    lc = _runner()
    out = tmp_path / "curves"
    extra = ["--", "--model.rollout.max_steps=2", "--model.evaluation.num_tasks=2",
             "--model.evaluation.tasks_per_batch=2"]
    lc.main(["--config", TINY, "--arms", "grpo", "oracle", "--seeds", "0", "--steps", "2", "--eval-every", "1",
             "--out", str(out), *extra])
    data = json.loads((out / "curves.json").read_text())
    curves = {r["arm"]: r["curve"] for r in data["runs"]}
    assert set(curves) == {"grpo", "oracle"}
    for curve in curves.values():
        assert [s for s, _ in curve] == [0, 1, 2]  # zero-shot, then every step
        assert all(0.0 <= v <= 1.0 for _, v in curve)
    table = (out / "curves.md").read_text()
    assert "| grpo | 1 |" in table and "| oracle | 1 |" in table
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 1_000_000
    # a finished run is skipped: nothing is run again
    log = out / "grpo-seed0" / "run.log"
    before = log.read_text()
    lc.main(["--config", TINY, "--arms", "grpo", "--seeds", "0", "--steps", "2", "--eval-every", "1",
             "--out", str(out), *extra])
    assert log.read_text() == before
    # a cut run (no done.json) continues from its last checkpoint instead of starting over
    (out / "oracle-seed0" / "done.json").unlink()
    lc.main(["--config", TINY, "--arms", "oracle", "--seeds", "0", "--steps", "3", "--eval-every", "1",
             "--out", str(out), *extra])
    assert "resuming from" in (out / "oracle-seed0" / "run.log").read_text()
    curve = json.loads((out / "curves.json").read_text())["runs"][0]["curve"]
    assert [s for s, _ in curve] == [0, 1, 2, 3]


def test_runner_rejects_a_missing_config(tmp_path, capsys):
    lc = _runner()
    with pytest.raises(SystemExit) as err:
        lc.main(["--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    assert err.value.code == 2 and "--config: no such file" in capsys.readouterr().err
