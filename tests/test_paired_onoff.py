"""benchmarks/paired_onoff.py: self-guidance on vs off read as pairs of the same episodes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("paired_onoff", ROOT / "benchmarks" / "paired_onoff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ep(seed: int, won: bool, actions=("look",), progress=(0.0,), labels=None) -> dict:
    return {"seed": seed, "task_id": f"t{seed}", "won": won, "actions": list(actions), "progress": list(progress),
            "labels": list(labels) if labels else None}


def test_the_sign_test_by_hand():
    ps = _script()
    assert ps.sign_test(0, 6) == pytest.approx(2 / 64)  # all six discordant pairs one way
    assert ps.sign_test(1, 2) == 1.0  # 2 * (1 + 3) / 8, capped
    assert ps.sign_test(1, 5) == pytest.approx(2 * (1 + 6) / 64)
    assert ps.sign_test(0, 0) == 1.0


def test_pairs_discordant_counts_and_setbacks(tmp_path, capsys):
    ps = _script()
    looping = _ep(9, False, actions=["take x", "put x in a", "take x", "put x in a"], progress=[50, -50, 50, -50],
                  labels=["neutral", "positive", "negative", "positive"])
    report = {"episodes": {
        # on: won 1 (seed 0); off: won seeds 0, 1, 2, listed in another order: pairs match by (seed, task)
        "sg": [_ep(0, True), _ep(1, False), _ep(2, False), looping],
        "nosg": [_ep(2, True), _ep(9, False, actions=["take x", "put x in a"], progress=[50, -50]),
                 _ep(0, True), _ep(1, True)],
    }}
    path = tmp_path / "arm-seed0-final" / "version_0" / "validation_report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(report))
    ps.main([str(path)])
    out = capsys.readouterr().out
    # 4 pairs; won 1 with, 3 without; 0 only with, 2 only without: p = 2 * 1/4 = 0.5; with guidance the first lost
    # action is put again later (1 of 2), without it never (0 of 1); the setback at step 1 was rated `negative`
    assert "| arm-seed0-final | 4 | 1 | 3 | 0 | 2 | 0.500 | 1 of 2 | 0 of 1 | negative 1 |" in out
    ps.main([str(path), str(path)])
    assert "| pooled | 8 | 2 | 6 | 0 | 4 | 0.125 | 2 of 4 | 0 of 2 | negative 2 |" in capsys.readouterr().out


def test_a_report_without_both_modes_is_one_line_naming_it(tmp_path):
    ps = _script()
    path = tmp_path / "validation_report.json"
    path.write_text(json.dumps({"episodes": {"sg": [_ep(0, True)]}}))
    with pytest.raises(SystemExit, match=r"validation_report.json: no episodes of both modes .*self_guidance=both"):
        ps.main([str(path)])
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="not a readable validation report"):
        ps.main([str(path)])
