"""The learning-curve runner: artefacts, skipping finished runs, resuming cut ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts import benchmark

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _runner():
    return benchmark("learning_curves")


@pytest.mark.slow
def test_runner_writes_curves_skips_finished_runs_and_resumes_cut_ones(tmp_path, capsys):
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
    first, last = run["curve"][0][1], run["curve"][-1][1]
    said = f"learning_curves: oracle seed 0: success {first:.3f} at step 0 -> {last:.3f} at step 2 ("
    out_text = capsys.readouterr().out
    assert said in out_text and "finished earlier" not in out_text and " min)" in out_text  # a run as it ends
    # trained with overrides after --: the arm is named with them
    named = "| oracle (rollout.max_steps=2 evaluation.num_tasks=2 evaluation.tasks_per_batch=2) | 1 |"
    assert named in (out / "curves.md").read_text()
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 1_000_000
    # a finished run is skipped: nothing is run again
    log = out / "oracle-seed0" / "run.log"
    before = log.read_text()
    lc.main([*args, "--steps", "2", *extra])
    assert log.read_text() == before
    assert said.replace(" (", " (finished earlier)") in capsys.readouterr().out
    (out / "curves.md").unlink()
    lc.main([*args, "--no-run"])  # artefacts from what is finished, nothing run
    assert log.read_text() == before and named in (out / "curves.md").read_text()
    # the run is not reused for a command that asks for something else (a thread count changes nothing)
    assert json.loads((out / "oracle-seed0" / "done.json").read_text())["settings"]["overrides"] == extra[1:]
    lc.main([*args, "--steps", "2", *extra, "--threads", "1"])
    with pytest.raises(SystemExit, match=r"oracle-seed0 was run with .*max_steps=2.*use another --out"):
        lc.main([*args, "--steps", "2", *extra, "--model.grpo.kl_coef=0.5"])
    assert log.read_text() == before
    # more steps: the finished run trains on from its last checkpoint instead of starting over
    lc.main([*args, "--steps", "3", *extra])
    assert "resuming from" in log.read_text()
    curve = json.loads((out / "curves.json").read_text())["runs"][0]["curve"]
    assert [s for s, _ in curve] == [0, 1, 2, 3]


def test_summary_table_and_figure_over_arms_and_seeds(tmp_path):
    lc = _runner()
    results = [{"arm": "grpo", "seed": s, "curve": [[0, 0.1], [5, v]], "guide": {"train_success": v, "lambda": 0.5}}
               for s, v in ((1, 0.4), (0, 0.2))]
    results.append({"arm": "oracle", "seed": 0, "curve": [[0, 0.1], [5, 0.5]],
                    "guide": {"train_success": 0.6, "label_accuracy": 1.0, "constant_accuracy": 0.7,
                              "label_auroc": 0.75, "positive": 0.3, "lambda": 0.25}})
    data, table = lc.summarise(results)
    assert data["runs"] == results
    assert ("| grpo | 2 | 0.100 ± 0.000 | 0.300 ± 0.141 | 0: 0.200, 1: 0.400 | 5 | 0.30 | – | – | – | – | 0.50 |"
            in table)
    assert ("| oracle | 1 | 0.100 ± 0.000 | 0.500 ± 0.000 | 0: 0.500 | 5 | 0.60 | 1.00 | 0.70 | 0.75 | 0.30 | 0.25 |"
            in table)
    assert lc.plot(results, tmp_path / "c.png") == ["validation success vs GRPO step"]  # no final: one panel
    assert (tmp_path / "c.png").stat().st_size > 1000
    # a seed trained on to step 10 (--steps 10 --seeds 2): the arm is compared where every seed is, at step 5
    results.append({"arm": "grpo", "seed": 2, "curve": [[0, 0.1], [5, 0.3], [10, 0.9]], "guide": {}})
    _, table = lc.summarise(results)
    assert "| grpo | 3 | 0.100 ± 0.000 | 0.300 ± 0.100 | 0: 0.200, 1: 0.400, 2: 0.300 | 5 (some runs go on to 10) |" \
        in table


def test_the_figure_shows_on_and_off_after_training_when_runs_have_both(tmp_path):
    lc = _runner()
    results = [{"arm": "sg_gr", "seed": s, "curve": [[0, 0.1], [4, 0.3]], "guide": {}, "final": {"sg": on, "nosg": off}}
               for s, on, off in ((1, 0.25, 0.5), (0, 0.125, 0.0))]
    results.append({"arm": "grpo", "seed": 0, "curve": [[0, 0.0], [4, 0.2]], "guide": {}})  # validated one way only
    results.append({"arm": "oracle", "seed": 2, "curve": [[0, 0.0], [4, 0.2]], "guide": {}, "final": {"sg": 0.5}})
    assert lc.final_pairs(results) == {("sg_gr", ()): [(0, 0.125, 0.0), (1, 0.25, 0.5)]}  # by seed; incomplete: out
    titles = lc.plot(results, tmp_path / "c.png")
    assert len(titles) == 2 and "on vs off" in titles[1] and (tmp_path / "c.png").stat().st_size > 1000


def test_an_arm_trained_with_overrides_is_named_with_them():
    lc = _runner()
    tuned = {"config": "c.yaml", "overrides": ["--model.grpo.calibration=0.1"]}
    results = [{"arm": "sg_gr_cal", "seed": s, "curve": [[0, 0.1], [4, 0.2]], "guide": {}, "settings": tuned}
               for s in (0, 1)]
    results.append({"arm": "grpo", "seed": 0, "curve": [[0, 0.0], [4, 0.2]], "guide": {},
                    "settings": {"config": "c.yaml", "overrides": []}})
    _, table = lc.summarise(results)
    assert "| sg_gr_cal (grpo.calibration=0.1) | 2 |" in table and "| grpo | 1 |" in table
    # runs of one arm trained differently (one borrowed from a study of the default) keep the bare name
    mixed = results[:1] + [{**results[1], "settings": {"config": "c.yaml", "overrides": []}}]
    assert lc.arm_name("sg_gr_cal", mixed) == "sg_gr_cal"
    assert lc.arm_name("sg_gr_cal", results[:2]) == "sg_gr_cal (grpo.calibration=0.1)"


def test_the_final_pairs_are_summed_over_seeds_and_say_when_some_lack_them():
    lc = _runner()
    paired = [{"pairs": 32, "only_sg": 0, "only_nosg": 4, "sign_test_p": 0.125},
              {"pairs": 32, "only_sg": 1, "only_nosg": 2, "sign_test_p": 1.0}, None]
    results = [{"arm": "sg_gr", "seed": s, "curve": [[0, 0.1], [8, 0.2]], "guide": {},
                "final": {"sg": 0.2, "nosg": 0.3}, **({"final_paired": p} if p else {})} for s, p in enumerate(paired)]
    _, table = lc.summarise(results)
    # 1 against 6 over the two seeds that hold pairs: p = 2 * (1 + 7) / 128
    assert "| 1 / 6 (p = 0.125) (n=2) |" in table


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


def test_settings_leave_out_the_thread_count_only():
    lc = _runner()
    a = lc.settings_of("./configs/x.yaml", None, 4, ["--threads", "2", "--model.grpo.kl_coef=0.1"])
    b = lc.settings_of("configs/x.yaml", None, 4, ["--threads=auto", "--model.grpo.kl_coef=0.1"])
    assert a == b == {"config": "configs/x.yaml", "steps": None, "eval_every": 4,
                      "overrides": ["--model.grpo.kl_coef=0.1"]}
    assert lc.settings_of("configs/x.yaml", 8, 4, []) != lc.settings_of("configs/x.yaml", None, 4, [])


def _fake_fit(lc, monkeypatch, out: Path, max_steps: int, validated: list[int]) -> None:
    """one_run without a model: the fit only leaves a saved config and validations at the given steps."""
    def fit(args, log, program=None):
        version = out / "grpo-seed0" / "version_0"
        version.mkdir(parents=True, exist_ok=True)
        (version / "config.yaml").write_text(f"# package versions of this run\ntrainer:\n  max_steps: {max_steps}\n")

    scalars = [{"val/nosg/success_rate": {i: 0.25 for i in range(len(validated))},
                "val/global_step": dict(enumerate(validated)), "rollout/success_rate": {0: 0.5}}]
    monkeypatch.setattr(lc, "run_cli", fit)
    monkeypatch.setattr(lc, "run_scalars", lambda run: scalars)
    (out / "zero_shot-noguide.json").write_text(json.dumps({"success": 0.0, "by": "grpo"}))


def test_a_fit_stopped_before_its_last_step_is_not_recorded_as_finished(tmp_path, monkeypatch):
    """SIGTERM to the fit alone ends it with exit 0 after saving: its curve stops early, and it must resume."""
    lc = _runner()
    _fake_fit(lc, monkeypatch, tmp_path, max_steps=8, validated=[4])
    with pytest.raises(SystemExit, match="stopped after step 4 of 8.*the same command resumes it"):
        lc.one_run(TINY, "grpo", 0, None, 4, tmp_path, [])
    assert not (tmp_path / "grpo-seed0" / "done.json").exists()
    _fake_fit(lc, monkeypatch, tmp_path, max_steps=8, validated=[4, 8])
    result = lc.one_run(TINY, "grpo", 0, None, 4, tmp_path, [])
    assert result["curve"] == [[0, 0.0], [4, 0.25], [8, 0.25]]
    assert json.loads((tmp_path / "grpo-seed0" / "done.json").read_text())["settings"]["eval_every"] == 4
    # a cut run is checked against the settings it started with
    (tmp_path / "grpo-seed0" / "done.json").unlink()
    with pytest.raises(SystemExit, match="grpo-seed0 was run with"):
        lc.one_run(TINY, "grpo", 0, None, 2, tmp_path, [])
    # asking for more steps than a finished run took trains it on (the fit runs again) rather than refusing it
    lc.one_run(TINY, "grpo", 0, None, 4, tmp_path, [])
    _fake_fit(lc, monkeypatch, tmp_path, max_steps=12, validated=[4, 8, 12])
    assert lc.one_run(TINY, "grpo", 0, 12, 4, tmp_path, [])["curve"][-1] == [12, 0.25]
    assert lc.one_run(TINY, "grpo", 0, 8, 4, tmp_path, [])["curve"][-1] == [12, 0.25]  # fewer: it is done


def test_artefacts_cover_every_finished_run_in_the_study(tmp_path):
    """A study continued arm by arm: the table is never narrowed to the last command's arms and seeds."""
    lc = _runner()
    for arm, seed in (("oracle", 1), ("grpo", 2), ("grpo", 0), ("sg_gr", 0)):
        (tmp_path / f"{arm}-seed{seed}").mkdir()
        (tmp_path / f"{arm}-seed{seed}" / "done.json").write_text(json.dumps(
            {"arm": arm, "seed": seed, "curve": [[0, 0.0], [4, 0.5]], "guide": {}}))
    (tmp_path / "notes-seedx").mkdir()  # not a run folder
    lc.main(["--config", TINY, "--arms", "grpo", "--seeds", "0", "--out", str(tmp_path), "--no-run"])
    runs = json.loads((tmp_path / "curves.json").read_text())["runs"]
    assert [(r["arm"], r["seed"]) for r in runs] == [("grpo", 0), ("grpo", 2), ("sg_gr", 0), ("oracle", 1)]
    assert "| grpo | 2 |" in (tmp_path / "curves.md").read_text()


def test_sigterm_to_the_runner_reaches_the_command_and_stops_the_study(tmp_path):
    """The fit gets the signal (and saves); the runner exits 143 instead of dying with the fit still running."""
    import os
    import signal
    import sys
    import threading
    import time

    lc = _runner()
    log = tmp_path / "run.log"
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(0)))\n"
             "print('ready', flush=True)\ntime.sleep(20)\n")

    done = threading.Event()  # set when the run has ended: a late SIGTERM would land on pytest's default handler

    def stop_when_ready():
        deadline = time.time() + 15
        while time.time() < deadline and not done.is_set() and not (log.exists() and "ready" in log.read_text()):
            time.sleep(0.05)
        if not done.is_set() and log.exists() and "ready" in log.read_text():
            os.kill(os.getpid(), signal.SIGTERM)

    seen = []  # the test's own handler: without the runner's, the signal would land here and the child run on

    def ours(*a):
        seen.append(a)

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        threading.Thread(target=stop_when_ready, daemon=True).start()
        t0 = time.time()
        with pytest.raises(SystemExit) as err:
            lc.run_cli(["fit"], log, program=[sys.executable, "-c", child])
        assert err.value.code == 143 and time.time() - t0 < 15
        assert "saved" in log.read_text() and not seen
        assert signal.getsignal(signal.SIGTERM) is ours  # the handler before run_cli is back
    finally:
        done.set()
        signal.signal(signal.SIGTERM, previous)


def test_signal_stats_count_the_groups_trained_on():
    """The share of degenerate groups and of steps with none informative, from a run's scalars: with dynamic
    sampling the trained batch's groups count (not the first round's), and a resumed run's later version wins a step
    both versions logged."""
    lc = _runner()
    first = {"rollout/degenerate_groups": {1: 4.0, 2: 4.0}, "rollout/groups": {1: 4.0, 2: 4.0},
             "rollout/dynamic_sampling_groups": {1: 0.0, 2: 2.0},
             # step 1's are step 0's repeated (events written before 996e0b1): no group was added at step 1
             "dynamic_sampling/degenerate_groups": {1: 0.0, 2: 4.0}, "dynamic_sampling/groups": {1: 9.0, 2: 6.0}}
    resumed = {"rollout/degenerate_groups": {2: 4.0, 3: 0.0}, "rollout/groups": {2: 4.0, 3: 4.0},
               "rollout/dynamic_sampling_groups": {2: 0.0, 3: 0.0}}
    # step 1: 4 of 4 (none informative); step 2, resumed without dynamic sampling: 4 of 4; step 3: 0 of 4
    assert lc.signal_stats([first, resumed]) == {"degenerate_share": 8 / 12, "still_steps": 2 / 3}
    # step 2 as the first version logged it: dynamic sampling added two informative groups
    assert lc.signal_stats([first]) == {"degenerate_share": 8 / 10, "still_steps": 1 / 2}
    assert lc.signal_stats([{"rollout/success_rate": {1: 0.5}}]) == {}  # not logged: nothing to say


@pytest.mark.slow
def test_the_calibrated_arm_and_the_final_validation_with_guidance_on_and_off(tmp_path):
    """``sg_gr_cal`` trains with the hindsight label loss (logged, so its mean is in the guide statistics), and
    ``--final-both`` validates the last checkpoint with self-guidance on and off once, recorded and tabled."""
    lc = _runner()
    out = tmp_path / "curves"
    extra = ["--", "--model.rollout.max_steps=2", "--model.evaluation.num_tasks=2",
             "--model.evaluation.tasks_per_batch=2"]
    args = ["--config", TINY, "--arms", "sg_gr_cal", "--seeds", "0", "--eval-every", "2", "--out", str(out),
            "--steps", "2", "--final-both"]
    lc.main([*args, *extra])
    done = json.loads((out / "sg_gr_cal-seed0" / "done.json").read_text())
    assert done["guide"]["calibration_loss"] > 0 and done["guide"]["update_s"] > 0
    assert set(done["final"]) == {"sg", "nosg"} and all(0.0 <= v <= 1.0 for v in done["final"].values())
    table = (out / "curves.md").read_text()
    kept = set(lc.FINAL_LABEL_KEYS) | {"balanced_accuracy", "progress_kinds"}
    assert {"positive", "neutral", "negative"} <= set(done["final_labels"]) <= kept
    assert "final, SG on | final, SG off | final, won only on / only off" in table and table.count("|---") == 18
    assert 0.0 <= done["guide"]["degenerate_share"] <= 1.0 and 0.0 <= done["guide"]["still_steps"] <= 1.0
    assert set(done["final_paired"]) == {"pairs", "only_sg", "only_nosg", "sign_test_p"}
    log = out / "sg_gr_cal-seed0" / "run.log"
    before = log.read_text()
    lc.main([*args, *extra])  # finished and validated: nothing runs again
    assert log.read_text() == before


def test_with_adds_another_studys_runs_that_this_one_lacks_and_marks_them(tmp_path):
    """--with: the paper's arms from an earlier study beside a new arm, taken only where this study has no run of
    that arm × seed, marked as borrowed; one recorded with another config stops the command with one line."""
    lc = _runner()
    study, earlier = tmp_path / "study", tmp_path / "earlier"

    def done(folder, arm, seed, last, **extra):
        (folder / f"{arm}-seed{seed}").mkdir(parents=True)
        (folder / f"{arm}-seed{seed}" / "done.json").write_text(json.dumps(
            {"arm": arm, "seed": seed, "curve": [[0, 0.1], [8, last]], "guide": {}, **extra}))

    done(study, "sg_gr_cal", 0, 0.3, final={"sg": 0.3, "nosg": 0.2})
    done(study, "sg_gr", 0, 0.4, final={"sg": 0.4, "nosg": 0.3})
    done(earlier, "sg_gr", 0, 0.9)  # the study has its own seed 0: not taken
    done(earlier, "sg_gr", 1, 0.5)
    done(earlier, "grpo", 0, 0.6, settings={"config": Path(TINY).as_posix(), "steps": None, "eval_every": 4,
                                           "overrides": []})
    done(earlier, "adaptive", 0, 0.2)  # not among --arms: not taken
    lc.main(["--config", TINY, "--out", str(study), "--no-run", "--arms", "grpo", "sg_gr", "sg_gr_cal", "--with",
             str(earlier)])
    runs = json.loads((study / "curves.json").read_text())["runs"]
    assert [(r["arm"], r["seed"], r.get("from")) for r in runs] == [
        ("grpo", 0, earlier.as_posix()), ("sg_gr", 0, None), ("sg_gr", 1, earlier.as_posix()),
        ("sg_gr_cal", 0, None)]
    table = (study / "curves.md").read_text()
    assert "| sg_gr | 2 | 0.100 ± 0.000 | 0.450 ± 0.071 | 0: 0.400, 1: 0.500 |" in table
    assert "0.400 ± 0.000 (n=1) | 0.300 ± 0.000 (n=1) |" in table  # one of its two seeds validated on and off
    assert f"From `{earlier.as_posix()}` (`--with`): grpo seeds 0; sg_gr seeds 1." in table
    assert not (study / "grpo-seed0").exists()  # nothing copied into the study
    (earlier / "grpo-seed0" / "done.json").write_text(json.dumps(
        {"arm": "grpo", "seed": 0, "curve": [[0, 0.1], [8, 0.6]], "guide": {},
         "settings": {"config": "configs/other.yaml", "steps": None, "eval_every": 4, "overrides": []}}))
    with pytest.raises(SystemExit, match="grpo-seed0 was run with --config configs/other.yaml"):
        lc.main(["--config", TINY, "--out", str(study), "--no-run", "--with", str(earlier)])
    with pytest.raises(SystemExit):
        lc.main(["--config", TINY, "--out", str(study), "--no-run", "--with", str(tmp_path / "missing")])


def test_an_arm_trained_with_other_overrides_stands_beside_the_default_from_another_study(tmp_path):
    """A study of ``sg_gr`` under another setting (overrides after ``--``) and an earlier study of the default: with
    ``--with``, both are rows and curves of their own, never averaged together; the earlier study's seed is taken
    although this study has a run of that arm and seed."""
    lc = _runner()
    study, earlier = tmp_path / "study", tmp_path / "earlier"
    tuned = ["--model.grpo.adv_scale=none"]

    def done(folder, arm, seed, last, overrides):
        (folder / f"{arm}-seed{seed}").mkdir(parents=True)
        (folder / f"{arm}-seed{seed}" / "done.json").write_text(json.dumps(
            {"arm": arm, "seed": seed, "curve": [[0, 0.1], [8, last]], "guide": {},
             "settings": {"config": Path(TINY).as_posix(), "steps": None, "eval_every": 4, "overrides": overrides}}))

    for seed, last in ((0, 0.5), (1, 0.7)):
        done(study, "sg_gr", seed, last, tuned)
        done(earlier, "sg_gr", seed, last - 0.4, [])
    done(earlier, "grpo", 0, 0.2, [])
    lc.main(["--config", TINY, "--out", str(study), "--no-run", "--arms", "grpo", "sg_gr", "--with", str(earlier)])
    runs = json.loads((study / "curves.json").read_text())["runs"]
    assert [(r["arm"], r["seed"], "from" in r) for r in runs] == [
        ("grpo", 0, True), ("sg_gr", 0, True), ("sg_gr", 1, True), ("sg_gr", 0, False), ("sg_gr", 1, False)]
    table = (study / "curves.md").read_text()
    assert "| sg_gr | 2 | 0.100 ± 0.000 | 0.200 ± 0.141 | 0: 0.100, 1: 0.300 |" in table
    assert "| sg_gr (grpo.adv_scale=none) | 2 | 0.100 ± 0.000 | 0.600 ± 0.141 | 0: 0.500, 1: 0.700 |" in table
    assert "| sg_gr | 4 |" not in table  # the control: never one row of four runs
    assert [k for k in lc.final_pairs(runs)] == []  # no final validations: no second panel
    if (study / "curves.png").exists():  # matplotlib installed: one curve a variant
        titles = lc.plot(runs, tmp_path / "c.png")
        assert titles == ["validation success vs GRPO step"]


def test_a_final_validation_recorded_before_its_label_statistics_gets_them_from_its_report(tmp_path):
    """Runs validated on and off before done.json kept the labels' statistics and the on/off pairs: filled in from
    the final validation's report when the study is read, written back once, and tabled (the labels per seed with the
    best constant label's; the pairs summed over seeds)."""
    lc = _runner()
    run = tmp_path / "sg_gr_cal-seed0"
    run.mkdir()
    (run / "done.json").write_text(json.dumps({"arm": "sg_gr_cal", "seed": 0, "curve": [[0, 0.1], [8, 0.3]],
                                               "guide": {}, "final": {"sg": 0.3, "nosg": 0.2}}))
    report = tmp_path / "sg_gr_cal-seed0-final" / "version_0" / "validation_report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"modes": {
        "sg": {"rollout/success_rate": 0.3, "guidance/label_accuracy": 0.62, "guidance/label_accuracy_constant": 0.65,
               "guidance/label_neutral": 0.9, "guidance/precision_neutral": 0.7},
        "nosg": {"rollout/success_rate": 0.2}},
        # pairs (z_t, p_{t−1}): (positive, 0) wrong, (neutral, +1) wrong, (neutral, 0) right; the label after the
        # unmeasured step has no pair.  Signs {0, +}: K = 2; recall 1/2 and 0/1 -> balanced 0.25
        # and a report from before its `paired` section: the pairs from its episodes (task 1 won only without)
        "episodes": {"sg": [{"labels": ["positive", "positive", "neutral", "neutral", "positive"],
                             "progress": [0.0, 1.0, 0.0, None, 0.0], "seed": 1, "task_id": "a", "won": False}],
                     "nosg": [{"seed": 1, "task_id": "a", "won": True}]}}))
    done = lc.load_done(run)
    assert done["final_labels"] == {"label_accuracy": 0.62, "constant_accuracy": 0.65, "neutral": 0.9,
                                    "balanced_accuracy": 0.25, "progress_kinds": 2}
    assert done["final_paired"] == {"pairs": 1, "only_sg": 0, "only_nosg": 1, "sign_test_p": 1.0}
    written = json.loads((run / "done.json").read_text())  # written back
    assert written["final_labels"]["label_accuracy"] == 0.62 and written["final_paired"]["only_nosg"] == 1
    _, table = lc.summarise(lc.finished_runs(tmp_path))
    assert "| 0.300 ± 0.000 | 0.200 ± 0.000 | 0 / 1 (p = 1.000) | 0.62 (0.65) | 0.25 (0.50) |" in table
    # a report from before the best constant label's accuracy was logged: taken from its episodes (signs 0, +, 0)
    older = json.loads(report.read_text())
    del older["modes"]["sg"]["guidance/label_accuracy_constant"]
    report.write_text(json.dumps(older))
    (run / "done.json").write_text(json.dumps({"arm": "sg_gr_cal", "seed": 0, "curve": [[0, 0.1], [8, 0.3]],
                                               "guide": {}, "final": {"sg": 0.3, "nosg": 0.2}}))
    assert lc.load_done(run)["final_labels"]["constant_accuracy"] == pytest.approx(2 / 3)
    assert "sg_gr_cal" not in lc.DEFAULT_ARMS and set(lc.DEFAULT_ARMS) < set(lc.ARMS)  # named arms only


def test_a_fit_stopped_in_its_last_validation_is_validated_not_stuck(tmp_path, monkeypatch):
    """Stopped in the validation after its last step, a fit's checkpoint holds every step: `fit --ckpt_path last` has
    nothing to train and exits 0, so rerunning the study never finished the run. The runner validates it instead."""
    import torch

    from sglightning.checkpointing import atomic_torch_save

    lc = _runner()
    _fake_fit(lc, monkeypatch, tmp_path, max_steps=8, validated=[4])
    progress = {"total": {"ready": 3, "started": 3, "processed": 2, "completed": 2},
                "current": {"ready": 1, "started": 1, "processed": 0, "completed": 0}, "is_last_batch": False}
    ckpt = tmp_path / "grpo-seed0" / "version_0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    loops = {"fit_loop": {"epoch_loop.val_loop.batch_progress": progress}}
    atomic_torch_save({"global_step": 8, "sglightning": {}, "loops": loops}, ckpt)
    scalars = [{"val/nosg/success_rate": {0: 0.25}, "val/global_step": {0: 4}}]
    calls = []

    def cli(args, log, program=None):
        calls.append(args[0])
        if args[0] == "validate":  # a version of its own, at the checkpoint's step
            assert f"--ckpt_path={ckpt}" in args and "--trainer.logger.init_args.name=grpo-seed0" in args
            scalars.append({"val/nosg/success_rate": {0: 0.5}, "val/global_step": {0: 8}})

    monkeypatch.setattr(lc, "run_cli", cli)
    monkeypatch.setattr(lc, "run_scalars", lambda run: scalars)
    (ckpt.parent.parent / "config.yaml").write_text("trainer:\n  max_steps: 8\n")
    result = lc.one_run(TINY, "grpo", 0, None, 4, tmp_path, [])
    assert calls == ["fit", "validate"] and result["curve"] == [[0, 0.0], [4, 0.25], [8, 0.5]]
    # the control: a checkpoint whose validation finished is a fit stopped early, resumed by the same command
    (tmp_path / "grpo-seed0" / "done.json").unlink()
    progress["current"].update(processed=1, completed=1)
    atomic_torch_save(torch.load(ckpt, weights_only=True) | {"global_step": 4}, ckpt)
    scalars[1:] = []
    with pytest.raises(SystemExit, match="stopped after step 4 of 8"):
        lc.one_run(TINY, "grpo", 0, None, 4, tmp_path, [])


def test_versions_are_read_in_number_order(tmp_path):
    """A run resumed or validated ten times: as text, version_10 sorted before version_9, so an older report or
    config was taken for the newest and an older validation overwrote a newer one."""
    lc = _runner()
    for v in (2, 10, 9):
        (tmp_path / f"version_{v}").mkdir()
        (tmp_path / f"version_{v}" / "config.yaml").write_text(f"trainer:\n  max_steps: {v}\n")
    assert [p.name for p in lc.in_versions(tmp_path)] == ["version_2", "version_9", "version_10"]
    assert lc.max_steps_of(tmp_path) == 10
