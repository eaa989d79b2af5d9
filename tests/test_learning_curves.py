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
    args = ["--config", TINY, "--arms", "oracle", "--seeds", "0", "--eval-every", "1", "--out", str(out)]
    lc.main([*args, "--steps", "2", *extra])
    data = json.loads((out / "curves.json").read_text())
    (run,) = data["runs"]
    assert run["arm"] == "oracle" and [s for s, _ in run["curve"]] == [0, 1, 2]  # zero-shot, then every step
    # the oracle's labels are the env's measured progress: they agree with it wherever it could tell
    assert run["guide"]["label_accuracy"] == 1.0 and 0.0 <= run["guide"]["train_success"] <= 1.0
    assert all(0.0 <= v <= 1.0 for _, v in run["curve"])
    assert "| oracle | 1 |" in (out / "curves.md").read_text()
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 1_000_000
    # a finished run is skipped: nothing is run again
    log = out / "oracle-seed0" / "run.log"
    before = log.read_text()
    lc.main([*args, "--steps", "2", *extra])
    assert log.read_text() == before
    (out / "curves.md").unlink()
    lc.main([*args, "--no-run"])  # artefacts from what is finished, nothing run
    assert log.read_text() == before and "| oracle | 1 |" in (out / "curves.md").read_text()
    # a cut run (no done.json) continues from its last checkpoint instead of starting over
    (out / "oracle-seed0" / "done.json").unlink()
    lc.main([*args, "--steps", "3", *extra])
    assert "resuming from" in log.read_text()
    curve = json.loads((out / "curves.json").read_text())["runs"][0]["curve"]
    assert [s for s, _ in curve] == [0, 1, 2, 3]


def test_summary_table_and_figure_over_arms_and_seeds(tmp_path):
    lc = _runner()
    results = [{"arm": "grpo", "seed": s, "curve": [[0, 0.1], [5, v]], "guide": {"train_success": v, "lambda": 0.5}}
               for s, v in ((0, 0.2), (1, 0.4))]
    results.append({"arm": "oracle", "seed": 0, "curve": [[0, 0.1], [5, 0.5]],
                    "guide": {"train_success": 0.6, "label_accuracy": 1.0, "label_auroc": 0.75, "positive": 0.3,
                              "lambda": 0.25}})
    data, table = lc.summarise(results)
    assert data["runs"] == results
    assert "| grpo | 2 | 0.100 ± 0.000 | 0.300 ± 0.141 | 5 | 0.30 | – | – | – | 0.50 |" in table
    assert "| oracle | 1 | 0.100 ± 0.000 | 0.500 ± 0.000 | 5 | 0.60 | 1.00 | 0.75 | 0.30 | 0.25 |" in table
    assert lc.plot(results, tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size > 1000


def test_no_run_with_nothing_finished_says_so(tmp_path):
    lc = _runner()
    with pytest.raises(SystemExit, match="no finished run"):
        lc.main(["--config", TINY, "--out", str(tmp_path), "--no-run"])


def test_runner_rejects_a_missing_config(tmp_path, capsys):
    lc = _runner()
    with pytest.raises(SystemExit) as err:
        lc.main(["--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    assert err.value.code == 2 and "--config: no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_arms_that_validate_alike_share_one_zero_shot_and_git_keeps_only_the_results(tmp_path):
    import subprocess

    lc = _runner()
    out = tmp_path / "curves"
    lc.main(["--config", TINY, "--arms", "sg", "full_trust", "--seeds", "0", "--steps", "1", "--eval-every", "1",
             "--out", str(out), "--", "--model.rollout.max_steps=2", "--model.evaluation.num_tasks=2",
             "--model.evaluation.tasks_per_batch=2"])
    logs = [(out / f"{arm}-seed0" / "run.log").read_text() for arm in ("sg", "full_trust")]
    assert sum(log.count("$ sglightning validate") for log in logs) == 1  # λ differs, step 0 does not
    curves = {r["arm"]: r["curve"] for r in json.loads((out / "curves.json").read_text())["runs"]}
    assert curves["sg"][0] == curves["full_trust"][0] and len(curves["sg"]) == 2
    # the study folder under git: the small results are kept, the run folders (events, checkpoints, logs) are not
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    listed = subprocess.run(["git", "-C", str(tmp_path), "status", "--porcelain", "-uall"], capture_output=True,
                            text=True, check=True).stdout
    kept = sorted(line[3:] for line in listed.splitlines())
    assert kept == sorted(["curves/.gitignore", "curves/curves.json", "curves/curves.md", "curves/curves.png",
                           "curves/full_trust-seed0/done.json", "curves/sg-seed0/done.json",
                           "curves/zero_shot-model.json"]), kept
