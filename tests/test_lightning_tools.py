"""The Lightning tools a user knows, on this trainer: their own ModelCheckpoint, loggers (CSV, several, none),
fast_dev_run, a progress bar of their own, EarlyStopping, seed_everything true, a sanity check; each either works as
in Lightning or is refused in one line (exit 2) naming the key.  Tiny config, in-process, a few seconds a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sglightning.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
MONITOR = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
           "--trainer.callbacks.monitor=val/sg/success_rate", "--trainer.callbacks.mode=max",
           "--trainer.callbacks.save_top_k=1"]


def fit(root: Path, *args: str, steps: int = 2):
    return cli_main(["fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={root}",
                     f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}", *args])


def refused(capsys, *args: str, before: str | None = None) -> str:
    """The one stderr line of a command that must exit 2 (after a line starting with ``before``, if given)."""
    with pytest.raises(SystemExit) as exc:
        cli_main(list(args))
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    if before is not None:
        assert lines[0].startswith(before), lines
        lines = lines[1:]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.slow
def test_a_users_own_model_checkpoint_keeps_its_top_k_and_the_run_still_resumes(tmp_path, capsys):
    """A ModelCheckpoint monitoring a metric keeps no last.ckpt: the run's own joins it (it used to be left out, so
    --ckpt_path last resumed an older run, and a SIGTERM saved nothing)."""
    run = Path(fit(tmp_path, *MONITOR).trainer.log_dir)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "last.ckpt" in names and any(n.startswith("epoch=") for n in names), names
    fit(tmp_path, *MONITOR, steps=3)  # a second, fresh run: the newest last.ckpt is now its own
    capsys.readouterr()
    cli = fit(tmp_path, *MONITOR, "--ckpt_path=last", steps=4)
    assert "resuming from " + str(tmp_path / "tiny" / "version_1" / "checkpoints" / "last.ckpt") in \
        capsys.readouterr().err
    assert cli.model.rollouts_done == 4 and Path(cli.trainer.log_dir).name == "version_1"


@pytest.mark.slow
def test_fast_dev_run_writes_nothing(tmp_path, capsys):
    """Lightning says logging and checkpointing are off in fast_dev_run: no checkpoint, adapter or report either."""
    fit(tmp_path, "--trainer.fast_dev_run=true", "--trainer.callbacks+=sglightning.callbacks.StepProfile",
        "--trainer.callbacks.step=1")  # a profile too: shown, not written
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))
    out = capsys.readouterr().out
    assert "1 GRPO steps" in out and "TensorBoard" not in out and "adapter " not in out
    assert "Profile of training step 1" in out and "(fast_dev_run: no profile written)" in out
    cli_main(["validate", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
              f"--trainer.default_root_dir={tmp_path}", "--trainer.fast_dev_run=true"])
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))  # the validation report is shown, not written
    assert "success" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_without_a_logger_does_not_overwrite_an_earlier_one(tmp_path, capsys):
    args = ["fit", "--config", TINY, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=1"]
    cli_main(args)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    line = refused(capsys, *args)
    assert f"trainer.default_root_dir: {tmp_path} holds an earlier run" in line and "--ckpt_path last" in line
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing touched
    assert cli_main([*args[:-1], "--trainer.max_steps=2", "--ckpt_path=last"]).model.rollouts_done == 2
    config = (tmp_path / "config.yaml").read_text()  # a validate of that run keeps the fit's config beside its own
    cli_main(["validate", *args[1:-1], "--ckpt_path=last"])
    assert (tmp_path / "config.yaml").read_text() == config and (tmp_path / "validate_config.yaml").is_file()
    # a folder that holds a config.yaml alone (the user's own config, say) is refused too: the run overwrote it
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.yaml").write_text("# my config\n")
    capsys.readouterr()
    line = refused(capsys, *args[:4], f"--trainer.default_root_dir={own}", "--trainer.max_steps=1")
    assert "holds an earlier run or a config.yaml" in line and (own / "config.yaml").read_text() == "# my config\n"


def test_a_csv_logger_resumed_keeps_its_earlier_metrics_and_no_tensorboard_line_is_printed(tmp_path, capsys):
    csv = ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
           "--trainer.logger.name=exp"]
    cli_main(["fit", "--config", TINY, *csv, "--trainer.max_steps=2"])
    assert "tensorboard --logdir" not in capsys.readouterr().out  # no TensorBoard logger: no command to open it
    folder = tmp_path / "exp" / "version_0"
    first = (folder / "metrics.csv").read_text()
    cli_main(["fit", "--config", TINY, *csv, "--trainer.max_steps=3", "--ckpt_path=last"])
    assert (folder / "metrics.1.csv").read_text() == first  # Lightning's CSVLogger would have deleted it
    assert (folder / "metrics.csv").is_file() and "Previous log files" not in capsys.readouterr().err


def test_a_number_a_step_did_not_measure_has_no_value_in_the_logger(tmp_path):
    """Lightning logs each key again at every later step of its epoch with its last value, and a fit is one epoch. A
    step whose rows were all left out (every group's returns equal, no KL) measures no loss and no entropy: its
    logged row must leave them empty, not repeat the step before's. Every training row of metrics.csv holds exactly
    the keys the step measured (the summary's history)."""
    import csv

    args = ["fit", "--config", TINY, "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}", "--trainer.logger.name=exp", "--trainer.limit_val_batches=0",
            "--trainer.max_steps=3", "--model.grpo.kl_coef=0",  # rows with advantage 0 are left out
            "--model.grpo.trust_breakpoints=[0, 0, 0.5, 0.5]"]  # λ 1, 1, 0: the tiny model never wins, so the last
    cli = cli_main(args)  # step's returns are all 0 and it has no row to update
    hist = cli.model.history
    assert "policy/entropy" in hist[0] and "policy/entropy" not in hist[-1], [sorted(h) for h in hist]
    with open(tmp_path / "exp" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/success_rate")]
    assert len(rows) == len(hist) == 3
    for step, (row, measured) in enumerate(zip(rows, hist), 1):
        logged = {k for k, v in row.items() if v != ""} - {"epoch", "step"}
        assert logged == set(measured), (step, sorted(logged ^ set(measured)))


def test_several_loggers_resume_in_the_first_ones_folder(tmp_path):
    """The first logger's folder is the run's: a resume continues there, with any TensorBoard or CSV logger of the
    same save_dir and name; a logger with a root of its own starts a version of its own (its version_0 may be
    another run's)."""
    def logger(kind: str, root: str) -> dict:
        return {"class_path": f"lightning.pytorch.loggers.{kind}",
                "init_args": {"save_dir": str(tmp_path / root), "name": "exp"}}

    config = tmp_path / "loggers.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"logger": [
        logger("TensorBoardLogger", "runs"), logger("CSVLogger", "runs"), logger("CSVLogger", "csv")]}}))
    args = ["fit", "--config", TINY, "--config", str(config), f"--trainer.default_root_dir={tmp_path}"]
    cli_main([*args, "--trainer.max_steps=2"])
    cli = cli_main([*args, "--trainer.max_steps=3", "--ckpt_path=last"])
    assert cli.model.rollouts_done == 3 and cli.model._checkpoint_step == 2  # resumed, not started afresh
    assert [Path(lg.log_dir).name for lg in cli.trainer.loggers] == ["version_0", "version_0", "version_1"]
    assert (tmp_path / "runs" / "exp" / "version_0" / "metrics.csv").is_file()


def test_a_progress_bar_of_ones_own_replaces_sglightnings(tmp_path):
    from lightning.pytorch.callbacks import TQDMProgressBar

    cli = fit(tmp_path, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar", steps=1)
    assert type(cli.trainer.progress_bar_callback) is TQDMProgressBar


def test_seed_everything_true_draws_a_seed_and_records_it(tmp_path):
    cli = fit(tmp_path, "--seed_everything=true", "--trainer.limit_val_batches=0", steps=1)
    seed = yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())["seed_everything"]
    assert isinstance(seed, int) and seed != 0  # Lightning's seed_everything(None) sets 0 (1 in 2**31 to fail)


def test_a_sanity_check_is_not_the_validation_before_training(tmp_path, capsys):
    """trainer.num_sanity_val_steps plays a few validation batches; only model.evaluation.before_fit is "before"."""
    cli = fit(tmp_path, "--trainer.num_sanity_val_steps=1", "--model.evaluation.tasks_per_batch=2")
    out = capsys.readouterr().out
    assert cli.model.val_report_before is None and "before training" not in out and " before " not in out


def test_early_stopping_on_a_metric_never_logged_is_one_line_after_the_steps_are_saved(tmp_path, capsys):
    line = refused(capsys, "fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--trainer.max_steps=1", "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
                   "--trainer.callbacks.monitor=val/sg/succes_rate")
    assert "EarlyStopping monitors 'val/sg/succes_rate', which is not logged; did you mean val/sg/success_rate?" \
        in line and "holds the last whole step" in line


def test_a_checkpoint_of_another_policy_is_one_line(tmp_path, capsys):
    ckpt = Path(fit(tmp_path, steps=1).trainer.log_dir) / "checkpoints" / "last.ckpt"
    capsys.readouterr()
    line = refused(capsys, "validate", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--model.policy.lora_r=4", f"--ckpt_path={ckpt}")
    assert "lora_A.default.weight is [8, 64], this config's is [4, 64]: it was trained with another model.policy" \
        in line


def test_a_model_checkpoint_of_ones_own_without_a_metric_is_kept_too(tmp_path):
    """Not only one that monitors: any ModelCheckpoint a user set up (here every step, every file kept) stays, and
    last.ckpt is written beside it (one that looks like Lightning's default is replaced by the run's own)."""
    run = Path(fit(tmp_path, "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
                   "--trainer.callbacks.filename={step}").trainer.log_dir)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step=1.ckpt", "step=2.ckpt"]


def test_any_setting_makes_a_model_checkpoint_ones_own():
    """Only 11 settings were compared: a ModelCheckpoint(save_on_exception=True) counted as Lightning's default and
    was replaced, without a word (Lightning's line saying so is filtered as noise)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from sglightning.callbacks import _as_made

    assert _as_made(ModelCheckpoint())  # the control
    for own in (dict(save_on_exception=True), dict(verbose=True), dict(enable_version_counter=False),
                dict(auto_insert_metric_name=False), dict(every_n_train_steps=1), dict(save_top_k=-1)):
        assert not _as_made(ModelCheckpoint(**own)), own


def test_a_logger_without_a_folder_of_its_own_gets_one_run_folder_per_run(tmp_path, monkeypatch):
    """W&B and MLflow loggers have a save_dir, a project name and a run id, no log_dir: every run's adapter, reports
    and profiles went to the shared save_dir (the next run overwrote them), apart from its last.ckpt; its config.yaml
    was never written, and a temporary copy was left in the save_dir."""
    from fakes import RunIdLogger
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from sglightning.checkpointing import checkpoint_dir, run_dir

    folders = []
    for run_id in ("run1", "run2"):
        keeper = ModelCheckpoint(save_last=True, save_top_k=0)
        trainer = Trainer(logger=RunIdLogger(str(tmp_path), run_id), callbacks=[keeper], enable_progress_bar=False)
        keeper.setup(trainer, None, "fit")  # where Lightning puts the checkpoints
        folders.append(run_dir(trainer))
        assert checkpoint_dir(trainer) == run_dir(trainer) / "checkpoints" == Path(keeper.dirpath)
    assert folders == [tmp_path / "project" / "run1", tmp_path / "project" / "run2"]
    # such a logger knows its run id on rank 0 alone: every rank takes rank 0's folder, pinned at setup
    from sglightning.checkpointing import pin_run_dir

    logger = RunIdLogger(str(tmp_path), "run3")
    trainer = Trainer(logger=logger, enable_progress_bar=False)
    pin_run_dir(trainer)
    logger.run_id = None  # what another rank's logger says
    assert run_dir(trainer) == tmp_path / "project" / "run3"
    monkeypatch.chdir(tmp_path)  # W&B's default save_dir is the working directory
    cli_main(["fit", "--config", TINY, "--trainer.logger.class_path=fakes.RunIdLogger", "--trainer.max_steps=1",
              f"--trainer.logger.init_args.save_dir={tmp_path / 'wb'}", "--trainer.logger.init_args.run_id=abc"])
    run = tmp_path / "wb" / "project" / "abc"
    assert (run / "config.yaml").is_file() and (run / "adapter").is_dir()
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert sorted(p.name for p in (tmp_path / "wb").iterdir()) == ["project"]  # no temporary config left


def test_one_callback_given_alone_in_a_config_file(tmp_path):
    config = tmp_path / "bar.yaml"
    config.write_text("trainer:\n  callbacks:\n    class_path: lightning.pytorch.callbacks.TQDMProgressBar\n")
    cli = fit(tmp_path, "--config", str(config), steps=1)
    assert type(cli.trainer.progress_bar_callback).__name__ == "TQDMProgressBar"


def test_a_checkpoint_with_other_lora_targets_is_one_line(tmp_path, capsys):
    ckpt = Path(fit(tmp_path, steps=1).trainer.log_dir) / "checkpoints" / "last.ckpt"
    capsys.readouterr()
    line = refused(capsys, "validate", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--model.policy.lora_target_modules=[q_proj]", f"--ckpt_path={ckpt}")
    assert "k_proj.lora_A.default.weight is not in this config's model: it was trained with another model.policy" \
        in line


def test_config_yaml_is_swapped_in_whole(tmp_path):
    """A resume rewrites the run's only config.yaml.  Written in place, a failure (or a kill) between Lightning's
    write and the package-version comments left a different file; now a temp file is completed, then swapped in."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import Trainer

    from sglightning.cli import VersionedSaveConfig

    parser = ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False)
    previous = "lr: 0.5\n# package versions of this run (written by sglightning):\n#   torch: x\n"
    (tmp_path / "config.yaml").write_text(previous)

    class Failing:
        def package_versions(self):
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        VersionedSaveConfig(parser, parser.parse_args([]), overwrite=True).setup(trainer, Failing(), "fit")
    assert (tmp_path / "config.yaml").read_text() == previous

    class Module:
        def package_versions(self):
            return {"torch": "2.x"}

    VersionedSaveConfig(parser, parser.parse_args(["--lr", "0.2"]), overwrite=True).setup(trainer, Module(), "fit")
    text = (tmp_path / "config.yaml").read_text()
    assert yaml.safe_load(text) == {"lr": 0.2} and text.endswith("#   torch: 2.x\n")
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # the failed write's temp file is gone


def test_a_remote_run_folder_is_refused_in_one_line_before_anything_is_written(capsys, tmp_path, monkeypatch):
    """Checkpoints are written atomically and the adapter exported to local folders: on fsspec's memory:// (as on
    s3://) the checkpoint IO made a local folder named ``memory:``, and Lightning left config.yaml's temp file."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    line = refused(capsys, "fit", "--config", TINY, "--trainer.logger=false",
                   "--trainer.default_root_dir=memory://sgl-remote-run")
    assert line.startswith("sglightning fit: error: trainer.default_root_dir: memory://sgl-remote-run is a remote")
    assert not fsspec.filesystem("memory").exists("/sgl-remote-run") and list(tmp_path.iterdir()) == []


def test_a_write_that_fails_midway_keeps_the_previous_file(tmp_path):
    """Reports and configs go through one atomic writer: a write torn by a failure (or a kill) leaves the previous
    file whole and no temp file behind."""
    from sglightning.files import atomic_write, atomic_write_text
    from sglightning.report import write_validation_report

    path = tmp_path / "validation_report.json"
    atomic_write_text(path, '{"old": 1}')

    def torn(f):
        f.write(b'{"new"')
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(path, torn)
    assert path.read_text() == '{"old": 1}' and [p.name for p in tmp_path.iterdir()] == [path.name]
    json_path, text = write_validation_report({"modes": {}}, tmp_path)
    assert json_path == path and yaml.safe_load(path.read_text())["modes"] == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["validation_report.json", "validation_report.md"]


def test_lightnings_default_logger_resumes_in_its_run_folder(tmp_path, capsys):
    """``trainer.logger: true`` (Lightning's TensorBoardLogger under lightning_logs/): ``--ckpt_path last`` found the
    run's checkpoint but wrote the rest of the run to a new version_1 (a second config, events, adapter)."""
    args = ["fit", "--config", TINY, "--trainer.logger=true", f"--trainer.default_root_dir={tmp_path}",
            "--model.evaluation.num_tasks=1"]
    cli_main([*args, "--trainer.max_steps=1"])
    cli = cli_main([*args, "--trainer.max_steps=2", "--ckpt_path=last"])
    assert cli.trainer.global_step == 2
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    run = tmp_path / "lightning_logs" / "version_0"
    assert len(list(run.glob("events.out.tfevents.*"))) == 2 and "# resumed from " in (run / "config.yaml").read_text()


def test_a_refused_resume_leaves_the_runs_config_as_it_was(tmp_path, capsys):
    """The resume's config.yaml was swapped in before the checkpoint restored: a refused resume (another
    model.policy) rewrote the file its own error line tells the user to use."""
    run = Path(fit(tmp_path, steps=1).trainer.log_dir)
    before = (run / "config.yaml").read_text()
    capsys.readouterr()
    line = refused(capsys, "fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=2", "--model.policy.lora_r=4",
                   "--ckpt_path=last")
    assert "it was trained with another model.policy" in line
    assert (run / "config.yaml").read_text() == before and "lora_r: 8" in before
    assert not [p.name for p in run.iterdir() if p.name.startswith(".config")]  # no temp file left either
    fit(tmp_path, "--ckpt_path=last", f"--trainer.logger.init_args.version={run.name}", steps=2)  # the control
    assert (run / "config.yaml").read_text() != before and "# resumed from" in (run / "config.yaml").read_text()


@pytest.mark.parametrize("args, needle", [
    (["--ckpt_path=best"], "--ckpt_path: 'best' is Lightning's, and sglightning keeps no such checkpoint"),
    (["--ckpt_path=hpc"], "--ckpt_path: 'hpc' is Lightning's"),
    (["--trainer.devices=abc"], "trainer.devices: `devices` selected with `CPUAccelerator` should be an int > 0"),
])
def test_lightnings_own_refusals_are_one_line(args, needle, tmp_path, capsys):
    line = refused(capsys, "fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                   f"--trainer.default_root_dir={tmp_path}", *args)
    assert needle in line and line.startswith("sglightning fit: error: ")
    assert list(tmp_path.iterdir()) == []


def test_a_config_that_is_not_text_is_one_line(tmp_path, capsys):
    config = tmp_path / "weights.yaml"
    config.write_bytes(bytes(range(128, 256)))
    line = refused(capsys, "fit", "--config", str(config))
    assert line == f"sglightning fit: error: {config}: cannot be read as a YAML config (UnicodeDecodeError)"


def test_ctrl_c_before_the_run_starts_is_one_line(monkeypatch, capsys):
    """Interrupted while torch imported or the config parsed: a 110-line traceback, nothing written."""
    import sglightning.cli
    from sglightning import entry

    def interrupted():
        raise KeyboardInterrupt

    def exit_process(code):  # the real one ends this process (pytest's) by os._exit
        raise SystemExit(code)

    monkeypatch.setattr(sglightning.cli, "main", interrupted)
    monkeypatch.setattr(entry, "exit_process", exit_process)
    monkeypatch.setattr("sys.argv", ["sglightning", "fit", "--config", TINY])
    with pytest.raises(SystemExit) as ended:
        entry.main()
    assert ended.value.code == 130
    assert capsys.readouterr().err == "sglightning: interrupted before the run started; nothing was written\n"


def test_a_resume_from_a_model_checkpoints_own_folder_continues_in_its_run_folder(tmp_path):
    """`--ckpt_path last` finds last.ckpt in a ModelCheckpoint's own dirpath, but that folder says nothing of the
    run's version folder: the resume started version_1, splitting the curve, the adapter and the reports in two."""
    own = ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
           f"--trainer.callbacks.dirpath={tmp_path / 'mine'}", "--trainer.callbacks.save_last=true",
           "--trainer.callbacks.save_top_k=0"]
    first = Path(fit(tmp_path, *own, steps=1).trainer.log_dir)
    assert (tmp_path / "mine" / "last.ckpt").is_file() and first.name == "version_0"
    second = fit(tmp_path, *own, "--ckpt_path=last", steps=2)
    assert Path(second.trainer.log_dir) == first and second.model.rollouts_done == 2
    assert not (first.parent / "version_1").exists()
