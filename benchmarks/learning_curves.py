r"""Seeded learning curves: train each arm × seed, evaluate every k steps on fixed held-out tasks, plot the bands.

    python benchmarks/learning_curves.py --config configs/quickstart.yaml --seeds 0 1 2 --eval-every 5 \
        --out runs/curves                                  # the six arms of the paper's study (the default)
    python benchmarks/learning_curves.py --config configs/tiny.yaml --arms grpo sg_gr --seeds 0 --steps 4 \
        --eval-every 2 --out /tmp/curves -- --model.rollout.max_steps=3   # extra CLI overrides after --

Arms (each is the config plus a few overrides; validation plays the arm's own guidance mode):

    grpo        no self-guidance (plain GRPO; validation with guidance off)
    sg          guidance in the prompts, no internal reward (λ ≡ 0): the paper's "GRPO w/ SG"
    sg_gr       the paper's trust schedule λ(u): "GRPO w/ SG & GR"
    full_trust  λ ≡ 1 from step 0 (the paper's ablation)
    oracle      labels from the environment's measured progress (guidance.source: oracle), paper schedule
    adaptive    the paper schedule × the labels' measured reliability (grpo.trust_adaptive)
    sg_gr_cal   sg_gr with the hindsight label loss (grpo.calibration: 1.0): the guide trained toward the sign of
                the progress the env measured
    sg_gr_cal_bal   sg_gr_cal with each target label weighted equally (grpo.calibration_balance): the majority
                label stops being the cheap answer

The calibration arms run only when named in ``--arms``; the default is the first six.

``--final-both`` also validates every finished run's last checkpoint with self-guidance on and off on the same
episodes (``final`` in done.json; four more columns in curves.md: success on and off, the labels' accuracy and
balanced accuracy in that validation; a second panel in curves.png: each seed's on and off): does self-guidance help
the trained policy?

A seed sets ``seed_everything`` (adapter initialisation) and ``model.rollout.seed`` (training tasks and sampling).
Each arm × seed is one ``sglightning fit`` in ``<out>/<arm>-seed<s>/`` with ``trainer.val_check_interval`` = k;
its step 0 is one ``sglightning validate`` of the untrained model, shared by every seed and by the arms that
validate alike (``zero_shot-<kind>.json``).  A cut run is resumed with ``--ckpt_path last``; a finished one
(``done.json``) is skipped, so the same command line continues a study over several sittings; a larger ``--steps``
trains finished runs on from their last checkpoint.  A run counts as finished only when its last validation is at
the run's ``trainer.max_steps``: a fit stopped early (SIGTERM exits 0, like any preemption) is left to resume.
SIGTERM to this runner is passed to the fit it is running, which saves its last step; the runner then exits 143.
Every run records its settings (config, steps, evaluation interval, the overrides after ``--`` except
``--threads``); a command whose settings differ from a run already in ``<out>`` stops with one line naming the run
and both settings instead of reusing it.  ``<out>/.gitignore`` keeps only the small JSON files and the artefacts
below under version control, so a study committed from one machine continues on another (a cut run there starts
over).  Writes, over every finished run in ``<out>`` (also those of earlier commands with other ``--arms`` or
``--seeds``), ``<out>/curves.json`` (every evaluation), ``<out>/curves.md`` (success at step 0 and at the last step,
mean ± std over seeds and each seed's, per arm) and ``<out>/curves.png`` (success vs step, mean ± std band per arm;
needs matplotlib: ``pip install -e ".[curves]"``).  ``--with DIR`` adds to those artefacts the finished runs of
another study folder of the ``--arms``, for each arm × seed this one lacks (same config; marked with their folder
in curves.json and under the table): a new arm next to the arms an earlier study ran, without running them again.
An arm trained with overrides after ``--`` is a variant of its own, in its own row and curve, named with them: a
study of ``sg_gr`` under another setting, run with ``--no-run --arms grpo sg_gr --with <the earlier study>``
afterwards, shows that setting beside the default and plain GRPO.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml

from sglightning.calibration import balanced_accuracy, constant_accuracy
from sglightning.guidance import LABELS
from sglightning.report import SIGNAL_KEYS, episode_pairs, group_signal, paired_outcomes, sign_test

ARMS: dict[str, list[str]] = {
    "grpo": ["--model.guidance.enabled=false", "--model.evaluation.self_guidance=off"],
    "sg": ["--model.grpo.trust_constant=0.0", "--model.evaluation.self_guidance=on"],
    "sg_gr": ["--model.evaluation.self_guidance=on"],
    "full_trust": ["--model.grpo.trust_constant=1.0", "--model.evaluation.self_guidance=on"],
    "oracle": ["--model.guidance.source=oracle", "--model.evaluation.self_guidance=on"],
    "adaptive": ["--model.grpo.trust_adaptive=true", "--model.evaluation.self_guidance=on"],
    "sg_gr_cal": ["--model.grpo.calibration=1.0", "--model.evaluation.self_guidance=on"],
    "sg_gr_cal_bal": ["--model.grpo.calibration=1.0", "--model.grpo.calibration_balance=true",
                      "--model.evaluation.self_guidance=on"],
}
#: what a study runs unless --arms says otherwise: the paper's arms and ablation, and two controls (oracle, adaptive)
DEFAULT_ARMS = ["grpo", "sg", "sg_gr", "full_trust", "oracle", "adaptive"]
METRIC = "rollout/success_rate"


def mode_of(arm: str) -> str:
    return "nosg" if arm == "grpo" else "sg"


def zero_shot_kind(arm: str) -> str:
    """Arms whose untrained model plays the same validation share one zero-shot evaluation: λ only acts in training,
    so sg, sg_gr, full_trust and adaptive validate identically at step 0 (guidance from the model), and the
    evaluation's random draws do not depend on the training seed (``evaluation.seed``)."""
    return {"grpo": "noguide", "oracle": "oracle"}.get(arm, "model")


# Written into <out>: git keeps the study's small results (a cut study continues in a fresh checkout from them) and
# ignores the TensorBoard events, checkpoints and logs.
KEEP_RESULTS_ONLY = "*\n!.gitignore\n!*/\n!*/done.json\n!zero_shot-*.json\n!curves.json\n!curves.md\n!curves.png\n"


SGLIGHTNING = [sys.executable, "-m", "sglightning.cli"]


def run_cli(args: list[str], log: Path, program: list[str] = SGLIGHTNING) -> None:
    """One ``sglightning`` command; its output goes to ``log``; a failure stops the study with the log's tail.
    SIGTERM received meanwhile is passed on to the command (a fit saves its last step and exits 0); the study then
    stops with exit 143, recording nothing for the run."""
    stopped = []

    def forward(signum, frame):  # the child may have exited already: then there is nothing to forward
        stopped.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    with open(log, "a") as f:
        f.write("$ sglightning " + " ".join(args) + "\n")
        f.flush()
        proc = subprocess.Popen([*program, *args], stdout=f, stderr=subprocess.STDOUT)
        previous = signal.signal(signal.SIGTERM, forward)
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if stopped:
        print(f"learning_curves: SIGTERM: stopped `sglightning {args[0]}` (exit {code}); run the same command "
              "again to continue the study", file=sys.stderr)
        raise SystemExit(143)
    if code != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"learning_curves: `sglightning {' '.join(args[:3])} …` failed (exit {code}); "
                         f"log {log}:\n{tail}")


def in_versions(folder: Path, pattern: str = "") -> list[Path]:
    """``folder/version_*/pattern`` oldest first, by version number (as text, version_10 sorts before version_9)."""
    found = folder.glob(f"version_*/{pattern}" if pattern else "version_*")
    return sorted(found, key=lambda p: int(p.relative_to(folder).parts[0].split("_", 1)[1]))


def run_scalars(run: Path) -> list[dict[str, dict[int, float]]]:
    """Every scalar of the run's TensorBoard events, one ``{tag: {logger step: value}}`` per version folder (a
    resumed run's too), read once for :func:`val_curve` and :func:`guide_stats`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    versions = []
    for version in in_versions(run):
        acc = EventAccumulator(str(version), size_guidance={"scalars": 0})
        acc.Reload()
        versions.append({tag: {ev.step: float(ev.value) for ev in acc.Scalars(tag)}
                         for tag in acc.Tags().get("scalars", [])})
    return versions


def val_curve(scalars: list[dict[str, dict[int, float]]], mode: str) -> list[tuple[int, float]]:
    """(step, success) of every validation in a run's scalars (:func:`run_scalars`)."""
    tag = f"val/{mode}/success_rate"
    points: dict[int, float] = {}
    for version in scalars:
        if tag in version and "val/global_step" in version:
            # the logger's step is Lightning's count at logging time; val/global_step says how many optimiser steps
            # the evaluated adapters had taken (GRPO steps × grpo.ppo_epochs: the GRPO steps at ppo_epochs 1, as in
            # every study here; the unit of trainer.max_steps, --steps and --eval-every)
            trained = {step: int(value) for step, value in version["val/global_step"].items()}
            for step, value in version[tag].items():
                points[trained[step]] = value
    return sorted(points.items())


# training scalars averaged over a run's steps: is the guide informative, what does the reward channel pay?
GUIDE_TAGS = {
    "train_success": "rollout/success_rate",
    "label_accuracy": "guidance/label_accuracy",  # label vs the progress the env measured for the previous action
    "constant_accuracy": "guidance/label_accuracy_constant",  # the best single label's, on the same pairs
    "balanced_accuracy": "guidance/label_balanced_accuracy",  # mean recall over the kinds of progress (1/K: constant)
    "label_auroc": "guidance/label_auroc_success",  # labels vs the episode's success (0.5: uninformative)
    "positive": "guidance/label_positive",
    "negative": "guidance/label_negative",
    "lambda": "reward/lambda",
    "episode_length": "rollout/episode_length",
    "calibration_loss": "loss/calibration",
    "rollout_s": "time/rollout_s",
    "update_s": "time/update_s",
}


def guide_stats(scalars: list[dict[str, dict[int, float]]]) -> dict[str, float]:
    """Means over the training steps of :data:`GUIDE_TAGS` in a run's scalars (:func:`run_scalars`; those the run
    logged, NaN steps left out)."""
    values: dict[str, dict[int, float]] = {}
    for version in scalars:
        for key, tag in GUIDE_TAGS.items():
            if tag in version:
                values.setdefault(key, {}).update({k: v for k, v in version[tag].items() if v == v})
    stats = {k: statistics.mean(v.values()) for k, v in values.items() if v}
    stats.update(signal_stats(scalars))
    if not stats.get("positive") and not stats.get("negative"):  # no labels (plain GRPO): λ weighs nothing
        for key in ("positive", "negative", "lambda"):
            stats.pop(key, None)
    return stats


def signal_stats(scalars: list[dict[str, dict[int, float]]]) -> dict[str, float]:
    """What the training steps had to learn from, in a run's scalars (:func:`sglightning.report.group_signal`):
    ``degenerate_share``, the share of the groups trained on whose returns were all equal (advantage 0), and
    ``still_steps``, the share of steps on which every group was so (no policy gradient).  Empty where not logged."""
    steps: dict[int, dict[str, float]] = {}
    for version in scalars:  # a resumed run's later version wins a step both logged
        logged = {step for tag in SIGNAL_KEYS for step in version.get(tag, {})}
        steps.update({step: {tag: version[tag][step] for tag in SIGNAL_KEYS if step in version.get(tag, {})}
                      for step in logged})
    if (signal := group_signal(list(steps.values()))) is None:
        return {}
    degenerate, groups, still, counted = signal
    return {"degenerate_share": degenerate / groups, "still_steps": still / counted}


# extra options that change how fast a run goes, not what it computes: left out of the recorded settings
SPEED_ONLY = ("--threads",)


def settings_of(config: str, steps: int | None, every: int, extra: list[str]) -> dict:
    """What makes two runs of one arm and seed comparable: recorded in ``done.json``, checked before reusing a run."""
    kept, skip = [], False
    for a in extra:
        if skip:
            skip = False
        elif a.split("=")[0] in SPEED_ONLY:
            skip = "=" not in a  # `--threads 2`: its value is the next argument
        else:
            kept.append(a)
    return {"config": Path(config).as_posix(), "steps": steps, "eval_every": every, "overrides": kept}


def check_settings(folder: Path, recorded: dict | None, wanted: dict) -> None:
    """A run made with other settings is not this command's run: say so rather than mix it into the study (runs
    recorded before settings existed are taken as they are).  More steps are not other settings: the run goes on."""
    def same(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "steps"}

    if recorded is not None and same(recorded) != same(wanted):
        raise SystemExit(f"learning_curves: {folder} was run with {json.dumps(recorded)}; this command asks for "
                         f"{json.dumps(wanted)}: use another --out (or delete {folder} to run it again)")


# the guide's statistics in the final validation with self-guidance on (``final_labels`` in done.json)
FINAL_LABEL_KEYS = {
    "label_accuracy": "guidance/label_accuracy",
    "constant_accuracy": "guidance/label_accuracy_constant",
    "label_auroc": "guidance/label_auroc_success",
    "positive": "guidance/label_positive",
    "neutral": "guidance/label_neutral",
    "negative": "guidance/label_negative",
}


def final_labels(report: dict) -> dict[str, float]:
    """The labels' statistics of a validation report's self-guided mode (:data:`FINAL_LABEL_KEYS` it holds), and
    from its episodes the balanced accuracy and the number K of kinds of progress they met (a constant label's
    balanced accuracy is 1/K) — also for reports written before the balanced accuracy (or the best constant label's
    accuracy) was logged."""
    sg = report["modes"].get("sg", {})
    out = {k: sg[tag] for k, tag in FINAL_LABEL_KEYS.items() if tag in sg}
    pairs = []  # (z_t, p_{t−1}) of every guided episode, as the trainer pairs them
    for ep in report.get("episodes", {}).get("sg", []):
        labels, progress = ep.get("labels") or [], ep.get("progress") or []
        pairs += [(z, p) for z, p in zip(labels[1:], progress) if z in LABELS and p is not None]
    if pairs:
        out["balanced_accuracy"] = balanced_accuracy(pairs)
        out["progress_kinds"] = len({(p > 0) - (p < 0) for _, p in pairs})
        out.setdefault("constant_accuracy", constant_accuracy(pairs))  # reports from before it was logged
    return out


def final_paired(report: dict) -> dict | None:
    """The final validation's on/off pairs: the report's ``paired`` section, or for reports written before it
    existed the same computed from their episodes (``None``: not both modes)."""
    if "paired" in report:
        return report["paired"]
    pairs = episode_pairs(report.get("episodes", {}))
    return paired_outcomes(pairs) if pairs is not None else None


def load_done(folder: Path) -> dict:
    """A finished run's ``done.json`` (the guide statistics filled in from its events, and the final validation's
    label statistics and on/off pairs from its report, if it predates them)."""
    done = folder / "done.json"
    result = json.loads(done.read_text())
    changed = False
    if ("guide" not in result or "degenerate_share" not in result["guide"]) and any(folder.glob("version_*")):
        # written before these statistics existed, and the run's events are still here
        result["guide"] = guide_stats(run_scalars(folder))
        changed = True
    if "final" in result and (not {"balanced_accuracy", "constant_accuracy"} <= set(result.get("final_labels", {}))
                              or "final_paired" not in result):
        # validated on and off before these statistics were kept
        reports = in_versions(folder.parent / f"{folder.name}-final", "validation_report.json")
        if reports:
            report = json.loads(reports[-1].read_text())
            result["final_labels"] = final_labels(report)
            result["final_paired"] = final_paired(report)
            changed = True
    if changed:
        done.write_text(json.dumps(result))
    return result


def max_steps_of(run: Path) -> int | None:
    """``trainer.max_steps`` of a run's newest version, from the config.yaml the CLI saved there."""
    configs = in_versions(run, "config.yaml")
    if not configs:
        return None
    return (yaml.safe_load(configs[-1].read_text()).get("trainer") or {}).get("max_steps")


def last_validation_cut(run: Path, target: int) -> bool:
    """Whether the run's newest ``last.ckpt`` holds all ``target`` steps and a validation it did not finish (a stop
    in the last validation: ``fit --ckpt_path last`` then has nothing to train and exits)."""
    from sglightning.checkpointing import CheckpointError, load_checkpoint_file
    from sglightning.preemption import validation_pending

    ckpts = in_versions(run, "checkpoints/last.ckpt")
    try:
        state = load_checkpoint_file(ckpts[-1], mmap=True) if ckpts else None
    except CheckpointError:
        return False
    return state is not None and state.get("global_step", 0) >= target and validation_pending(state)


def one_run(config: str, arm: str, seed: int, steps: int | None, every: int, out: Path, extra: list[str]) -> dict:
    name = f"{arm}-seed{seed}"
    folder = out / name
    wanted = settings_of(config, steps, every, extra)
    started = folder / "settings.json"  # written when a run starts, so a cut run is checked too
    if (folder / "done.json").is_file():
        result = load_done(folder)
        check_settings(folder, result.get("settings"), wanted)
        if steps is None or result["curve"][-1][0] >= steps:
            return result
        # asked for more steps than it ran: the run continues from its last checkpoint
    else:
        check_settings(folder, json.loads(started.read_text()) if started.is_file() else None, wanted)
    folder.mkdir(parents=True, exist_ok=True)
    started.write_text(json.dumps(wanted))
    log = folder / "run.log"
    common = ["--config", config, *ARMS[arm], f"--seed_everything={seed}", f"--model.rollout.seed={seed}",
              "--trainer.logger.class_path=lightning.pytorch.loggers.TensorBoardLogger",
              f"--trainer.logger.init_args.save_dir={out}", "--trainer.enable_progress_bar=false",
              "--model.evaluation.before_fit=false", *extra]  # step 0 is the shared zero-shot evaluation
    # evaluation draws do not depend on the training seed: an untrained model scores the same for every seed
    zero = out / f"zero_shot-{zero_shot_kind(arm)}.json"
    untrained = {k: wanted[k] for k in ("config", "overrides")}  # steps and interval do not touch step 0
    if zero.is_file():
        check_settings(zero, json.loads(zero.read_text()).get("settings"), untrained)
    else:
        zname = zero.stem
        run_cli(["validate", *common, f"--trainer.logger.init_args.name={zname}"], log)
        reports = in_versions(out / zname, "validation_report.json")
        report = json.loads(reports[-1].read_text())
        zero.write_text(json.dumps({"success": report["modes"][mode_of(arm)][METRIC], "by": arm,
                                    "settings": untrained}))
    limit = [f"--trainer.max_steps={steps}"] if steps is not None else []  # in every config.yaml the run writes
    fit = ["fit", *common, f"--trainer.logger.init_args.name={name}", f"--trainer.val_check_interval={every}",
           "--ckpt_path=last", *limit]
    run_cli(fit, log)
    scalars = run_scalars(out / name)
    trained = val_curve(scalars, mode_of(arm))
    if not trained or trained[-1][0] == 0:
        raise SystemExit(f"learning_curves: {name}: the fit recorded no validation after training (log {log}); "
                         "nothing written for it")
    target = max_steps_of(out / name)
    if target is not None and trained[-1][0] < target and last_validation_cut(out / name, target):
        # stopped in the validation after its last step: the fit has nothing left to train, validate plays it
        run_cli(["validate", *common, f"--trainer.logger.init_args.name={name}", *limit,
                 f"--ckpt_path={in_versions(out / name, 'checkpoints/last.ckpt')[-1]}"], log)
        scalars = run_scalars(out / name)
        trained = val_curve(scalars, mode_of(arm))
    if target is not None and trained[-1][0] < target:  # stopped early (SIGTERM to the fit alone): not finished
        raise SystemExit(f"learning_curves: {name}: the fit stopped after step {trained[-1][0]} of {target} "
                         f"(log {log}); nothing written for it: the same command resumes it")
    # as lists, the form done.json reads back in: a result is the same object fresh or loaded
    curve = [[0, json.loads(zero.read_text())["success"]]] + [[step, v] for step, v in trained]
    result = {"arm": arm, "seed": seed, "curve": curve, "guide": guide_stats(scalars), "settings": wanted}
    (folder / "done.json").write_text(json.dumps(result))
    return result


def final_both(config: str, arm: str, seed: int, out: Path, extra: list[str], result: dict) -> dict:
    """Validate a finished run's last checkpoint with self-guidance on and off (the same episodes), once; stored as
    ``final`` in its done.json."""
    if "final" in result:
        return result
    name = f"{arm}-seed{seed}"
    ckpts = in_versions(out / name, "checkpoints/last.ckpt")
    if not ckpts:
        raise SystemExit(f"learning_curves: {name}: no last.ckpt to validate")
    fname = f"{name}-final"
    args = ["validate", "--config", config, *ARMS[arm], f"--seed_everything={seed}", f"--model.rollout.seed={seed}",
            "--trainer.logger.class_path=lightning.pytorch.loggers.TensorBoardLogger",
            f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={fname}",
            "--trainer.enable_progress_bar=false", "--model.evaluation.self_guidance=both", *extra,
            f"--ckpt_path={ckpts[-1]}"]
    run_cli(args, out / name / "run.log")
    report = json.loads(in_versions(out / fname, "validation_report.json")[-1].read_text())
    result["final"] = {mode: report["modes"][mode][METRIC] for mode in ("sg", "nosg")}
    result["final_labels"] = final_labels(report)
    result["final_paired"] = final_paired(report)
    (out / name / "done.json").write_text(json.dumps(result))
    return result


def finished_runs(out: Path) -> list[dict]:
    """Every finished run in ``out``, arms in :data:`ARMS` order, then by seed."""
    found = []
    for done in out.glob("*-seed*/done.json"):
        arm, _, seed = done.parent.name.rpartition("-seed")
        if arm in ARMS and seed.isdigit():
            found.append((list(ARMS).index(arm), int(seed), done.parent))
    return [load_done(folder) for _, _, folder in sorted(found)]


def variant(run: dict) -> tuple[str, tuple[str, ...]]:
    """A run's arm and the overrides after ``--`` it was trained with: the runs averaged together in one row and
    one curve.  The same arm trained with other overrides is another variant (a run recorded before settings were
    kept counts as trained with none)."""
    return run["arm"], tuple((run.get("settings") or {}).get("overrides") or ())


def borrow_runs(results: list[dict], others: list[str], config: str, arms: list[str]) -> list[dict]:
    """The study's runs plus, from each folder in ``others``, the finished runs of ``arms`` for a variant × seed
    the study lacks (marked ``from``: the folder): a new arm, or an arm trained with other overrides, shown beside
    the runs another study made with the same config, without running them again.  A borrowed run recorded with
    another config stops the command with one line."""
    have = {(variant(r), r["seed"]) for r in results}
    merged = list(results)
    for other in others:
        for r in finished_runs(Path(other)):
            if r["arm"] not in arms or (variant(r), r["seed"]) in have:
                continue
            recorded = (r.get("settings") or {}).get("config")
            if recorded is not None and recorded != Path(config).as_posix():
                raise SystemExit(f"learning_curves: --with {other}: {r['arm']}-seed{r['seed']} was run with "
                                 f"--config {recorded}, this study with {config}")
            merged.append({**r, "from": Path(other).as_posix()})
            have.add((variant(r), r["seed"]))
    return sorted(merged, key=lambda r: (list(ARMS).index(r["arm"]), variant(r)[1], r["seed"]))


def arm_name(arm: str, runs: list[dict]) -> str:
    """The arm as the table and the figure name it: followed by the overrides after ``--`` that all its runs were
    trained with, if any (``sg_gr_cal (grpo.calibration=0.1)``), so that a study of another setting does not pass
    for the arm's default; runs trained with different overrides leave the bare name (a row and a curve hold one
    :func:`variant`, so only a caller that mixes them sees it)."""
    kinds = {tuple(r.get("settings", {}).get("overrides", [])) for r in runs}
    if len(kinds) != 1 or not (overrides := next(iter(kinds))):
        return arm
    return f"{arm} ({' '.join(o.removeprefix('--model.') for o in overrides)})"


def shared_last_step(runs: list[dict]) -> int:
    """The last step every run of ``runs`` validated at (step 0 at least)."""
    return max(set.intersection(*({step for step, _ in r["curve"]} for r in runs)))


def summarise(results: list[dict]) -> tuple[dict, str]:
    """curves.json content and the Markdown table: validation success at step 0 and at the last step (mean ± std
    over seeds, then each seed's: with few seeds the spread says more than a mean), then training means over steps
    and seeds — training success, the labels' accuracy against measured progress (and the best single label's on the
    same pairs: the labels inform only above it), their AUROC against success, the
    share of positive labels, the mean trust weight λ ("–": not logged, e.g. no labels in plain GRPO), the share of
    degenerate groups (equal returns, advantage 0) and, in brackets, of steps on which every group was so; with
    ``--final-both`` runs, success with self-guidance on and off after training, the episodes of those validations
    won only with guidance and only without it, summed over seeds, with the exact sign test over them, and, per seed,
    the labels' accuracy in that validation (the best single label's in brackets) and their balanced accuracy (a
    constant label's, 1/K, in brackets)."""
    by_arm: dict[tuple, list[dict]] = {}
    for r in results:
        by_arm.setdefault(variant(r), []).append(r)
    finals = any("final" in r for r in results)
    rows = ["| arm | seeds | success at step 0 | success at the last step | by seed | last step | train success | "
            "label accuracy | one constant label | label AUROC | positive labels | mean λ | degenerate groups "
            "(steps with none informative) |"
            + (" final, SG on | final, SG off | final, won only on / only off (sign test p) | final label accuracy "
               "(one constant label) | final balanced accuracy (one constant label: 1/K) |" if finals else ""),
            "|---" * (18 if finals else 13) + "|"]

    def ms(vals: list[float]) -> str:
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{statistics.mean(vals):.3f} ± {sd:.3f}"

    def over(vals: list, runs: list[dict]) -> str:  # runs that predate a statistic lack it: say over how many
        return "" if len(vals) == len(runs) else f" (n={len(vals)})"

    def guide(runs: list[dict], key: str) -> str:
        vals = [r["guide"][key] for r in runs if key in r.get("guide", {})]
        return f"{statistics.mean(vals):.2f}{over(vals, runs)}" if vals else "–"

    for (arm, _), runs in by_arm.items():
        first = [r["curve"][0][1] for r in runs]
        step = shared_last_step(runs)  # runs extended to different lengths are compared where they all are
        last = [dict(r["curve"])[step] for r in runs]
        cells = [guide(runs, k) for k in ("train_success", "label_accuracy", "constant_accuracy", "label_auroc",
                                          "positive", "lambda")]
        cells.append(f"{guide(runs, 'degenerate_share')} ({guide(runs, 'still_steps')})"
                     if any("degenerate_share" in r.get("guide", {}) for r in runs) else "–")
        each = ", ".join(f"{r['seed']}: {dict(r['curve'])[step]:.3f}" for r in sorted(runs, key=lambda r: r["seed"]))
        ends = sorted({r["curve"][-1][0] for r in runs} - {step})
        step_cell = f"{step}" + (f" (some runs go on to {', '.join(map(str, ends))})" if ends else "")
        if finals:
            for mode in ("sg", "nosg"):
                vals = [r["final"][mode] for r in runs if "final" in r]
                cells.append(ms(vals) + over(vals, runs) if vals else "–")
            paired = [r["final_paired"] for r in runs if r.get("final_paired")]
            a, b = sum(x["only_sg"] for x in paired), sum(x["only_nosg"] for x in paired)
            cells.append(f"{a} / {b} (p = {sign_test(a, b):.3f})" + over(paired, [r for r in runs if "final" in r])
                         if paired else "–")  # summed over seeds: a test of "no effect in any seed"
            labels = [r["final_labels"] for r in runs if "label_accuracy" in r.get("final_labels", {})]
            cells.append(", ".join(f"{x['label_accuracy']:.2f}" + (f" ({x['constant_accuracy']:.2f})"
                                                                    if "constant_accuracy" in x else "")
                                   for x in labels) or "–")  # per seed: the spread says more than a mean
            cells.append(", ".join(f"{x['balanced_accuracy']:.2f} ({1 / x['progress_kinds']:.2f})"
                                   for x in (r.get("final_labels", {}) for r in runs if "final" in r)
                                   if "balanced_accuracy" in x) or "–")
        rows.append(f"| {arm_name(arm, runs)} | {len(runs)} | {ms(first)} | {ms(last)} | {each} | "
                    f"{step_cell} | " + " | ".join(cells) + " |")
    sources: dict[str, dict[str, list[int]]] = {}
    for r in results:
        if "from" in r:
            sources.setdefault(r["from"], {}).setdefault(arm_name(r["arm"], [r]), []).append(r["seed"])
    for folder, arms in sources.items():
        seeds = "; ".join(f"{arm} seeds {', '.join(map(str, sorted(s)))}" for arm, s in arms.items())
        rows.append(f"\nFrom `{folder}` (`--with`): {seeds}.")
    return {"metric": METRIC, "runs": results}, "\n".join(rows) + "\n"


def final_pairs(results: list[dict]) -> dict[tuple, list[tuple[int, float, float]]]:
    """(seed, success with self-guidance, without) of every run validated both ways after training
    (``--final-both``), by :func:`variant` in the order they first appear."""
    pairs: dict[tuple, list[tuple[int, float, float]]] = {}
    for r in results:
        final = r.get("final") or {}
        if "sg" in final and "nosg" in final:
            pairs.setdefault(variant(r), []).append((r["seed"], final["sg"], final["nosg"]))
    return {arm: sorted(v) for arm, v in pairs.items()}


def plot(results: list[dict], path: Path) -> list[str]:
    """The curves (success vs step, mean ± std over seeds, per arm) and, when runs were validated both ways after
    training, a second panel: each seed's success with self-guidance and without it on the same episodes, one line
    per seed, the arm's mean as the large markers.  Returns the panels' titles (empty: no matplotlib, no PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("learning_curves: matplotlib is not installed (pip install -e '.[curves]'); no PNG written")
        return []
    pairs = final_pairs(results)
    if pairs:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.4, 4.0), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    by_arm: dict[tuple, list[dict]] = {}
    for r in results:
        by_arm.setdefault(variant(r), []).append(r)
    colour = {}
    for key, runs in by_arm.items():
        steps = sorted(set.intersection(*({s for s, _ in r["curve"]} for r in runs)))  # every run's: one n
        means, lows, highs, xs = [], [], [], []
        for s in steps:
            vals = [v for r in runs for t, v in r["curve"] if t == s]
            m = statistics.mean(vals)
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            xs.append(s)
            means.append(m)
            lows.append(m - sd)
            highs.append(m + sd)
        borrowed = [Path(r["from"]).name for r in runs if "from" in r]  # --with: say where they come from
        where = f", {len(borrowed)} from {', '.join(sorted(set(borrowed)))}" if borrowed else ""
        name = textwrap.fill(f"{arm_name(key[0], runs)} (n={len(runs)}{where})", 48, subsequent_indent="  ")
        (line,) = ax.plot(xs, means, marker="o", label=name)  # a long variant's name wrapped: the legend fits
        colour[key] = line.get_color()
        ax.fill_between(xs, lows, highs, alpha=0.2)
    ax.set_xlabel("optimiser step (the GRPO step at grpo.ppo_epochs 1)")
    ax.set_ylabel("validation success rate")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    titles = ["validation success vs GRPO step"]
    if pairs:
        ax.set_title(titles[0], fontsize=9)
        ticks, labels = [], []
        for i, (key, seeds) in enumerate(pairs.items()):
            x_on, x_off = 3 * i, 3 * i + 1
            for _, on, off in seeds:
                ax2.plot([x_on, x_off], [on, off], color=colour.get(key), alpha=0.45, marker=".")
            ax2.plot([x_on, x_off], [statistics.mean(p[1] for p in seeds), statistics.mean(p[2] for p in seeds)],
                     color=colour.get(key), marker="o", markersize=8, linewidth=2.5)
            ticks += [x_on, x_off]
            labels += ["on", "off"]
            ax2.text(x_on + 0.5, -0.11, arm_name(key[0], by_arm[key]), transform=ax2.get_xaxis_transform(),
                     ha="center", va="top", fontsize=8, color=colour.get(key))
        ax2.set_xticks(ticks, labels, fontsize=8)
        ax2.set_xlim(-0.6, 3 * len(pairs) - 1.4)
        ax2.set_ylim(bottom=0)
        ax2.grid(alpha=0.3, axis="y")
        titles.append("after training: self-guidance on vs off, same episodes (a line per seed)")
        ax2.set_title("after training: self-guidance on vs off\n(same episodes; a line per seed, mean bold)",
                      fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return titles


def run_line(result: dict) -> str:
    """One finished run in words: its validation success from step 0 to its last step, and with self-guidance on
    and off after training when it was validated both ways."""
    (first_step, first), (last_step, last) = result["curve"][0], result["curve"][-1]
    line = f"success {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}"
    final = result.get("final") or {}
    if "sg" in final and "nosg" in final:
        line += f"; after training, self-guidance on {final['sg']:.3f}, off {final['nosg']:.3f}"
    return line


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, extra = argv[:k], argv[k + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, help="trainer.max_steps (default: the config's)")
    ap.add_argument("--eval-every", type=int, default=5,
                    help="validate every k optimiser steps (GRPO steps at grpo.ppo_epochs 1)")
    ap.add_argument("--out", default="runs/curves")
    ap.add_argument("--final-both", action="store_true",
                    help="validate each finished run's last checkpoint with self-guidance on and off")
    ap.add_argument("--no-run", action="store_true",
                    help="run nothing: write the artefacts from the finished runs in --out (a partial study, or "
                         "one that another process is still running)")
    ap.add_argument("--with", dest="others", nargs="+", default=[], metavar="DIR",
                    help="also put in the table and figure the finished runs of another study's --out (same "
                         "config) of the --arms, for each arm, overrides and seed this study lacks, marked as taken "
                         "from there")
    args = ap.parse_args(argv)
    if args.eval_every < 1:
        ap.error("--eval-every: must be >= 1")
    for other in args.others:
        if not Path(other).is_dir():
            ap.error(f"--with: no such folder: {other}")
    if not Path(args.config).is_file():
        ap.error(f"--config: no such file: {args.config}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / ".gitignore").exists():
        (out / ".gitignore").write_text(KEEP_RESULTS_ONLY)
    if not args.no_run:
        for seed in args.seeds:  # seed-major: a cut study has whole seeds of every arm first
            for arm in args.arms:
                print(f"learning_curves: {arm} seed {seed}", flush=True)
                done = out / f"{arm}-seed{seed}" / "done.json"
                before = done.stat().st_mtime_ns if done.is_file() else None
                start = time.monotonic()
                result = one_run(args.config, arm, seed, args.steps, args.eval_every, out, extra)
                if args.final_both:
                    result = final_both(args.config, arm, seed, out, extra, result)
                took = "finished earlier" if done.stat().st_mtime_ns == before else \
                    f"{(time.monotonic() - start) / 60:.0f} min"
                print(f"learning_curves: {arm} seed {seed}: {run_line(result)} ({took})", flush=True)
    results = finished_runs(out)  # the whole study, not only this command's arms and seeds
    results = borrow_runs(results, args.others, args.config, args.arms)
    if not results:
        raise SystemExit(f"learning_curves: no finished run in {out}")
    data, table = summarise(results)
    (out / "curves.json").write_text(json.dumps(data, indent=1))
    (out / "curves.md").write_text(table)
    plotted = plot(results, out / "curves.png")
    print(table)
    files = [out / "curves.json", out / "curves.md"] + ([out / "curves.png"] if plotted else [])
    print("learning_curves: " + ", ".join(map(str, files)))


if __name__ == "__main__":
    main()
