"""Real subprocesses: SIGTERM (preemption) saves and exits 0, a SIGKILL during a checkpoint write never leaves a torn
``last.ckpt``, ``--ckpt_path last`` resumes in the same run folder and ends where a straight run ends; broken
checkpoint files give one error line naming the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from sglightning.checkpointing import CheckpointError, atomic_torch_save, load_checkpoint_file

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")

pytestmark = pytest.mark.slow


def _env() -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def _fit_cmd(root: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "sglightning.cli", "fit", "--config", TINY, f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
        "--trainer.enable_progress_bar=false", "--model.rollout.max_steps=2", "--model.evaluation.num_tasks=1",
        "--trainer.limit_val_batches=0", *extra,
    ]


def _lora(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_file(ckpt)["state_dict"]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.is_file():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {path} appeared:\n{proc.stderr.read()}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """Six steps without interruption: the reference."""
    root = tmp_path_factory.mktemp("straight")
    out = subprocess.run(_fit_cmd(root, 6), env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "tiny" / "version_0" / "checkpoints" / "last.ckpt"


def test_a_resume_with_nothing_left_to_train_says_so_and_writes_nothing(tmp_path, straight):
    """``--ckpt_path last`` on a run that already holds trainer.max_steps steps or more: one line, exit 0, and the
    run's folder untouched (Lightning rewrote its config.yaml with the new max_steps and added an events file)."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(straight.parents[3], root)
    run = root / "tiny" / "version_0"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for steps in (6, 3):  # the same command again (a requeue after the end), and fewer steps
        out = subprocess.run(_fit_cmd(root, steps, "--ckpt_path=last"), env=_env(), capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stderr.strip().splitlines() == [
            f"sglightning: {run / 'checkpoints' / 'last.ckpt'} holds 6 trained steps and trainer.max_steps is "
            f"{steps}: nothing to train (raise trainer.max_steps to train on)"], out.stderr
        assert out.stdout == ""
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
        assert sorted(p.name for p in (root / "tiny").iterdir()) == ["version_0"]


def test_sigterm_saves_exits_zero_and_resume_matches_a_straight_run(tmp_path, straight):
    ckpt = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(_fit_cmd(tmp_path, 6, "--model.rollout.max_steps=4"), env=_env(), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    _wait_for(ckpt, proc)  # at least one step done
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received" in err and "--ckpt_path last" in err
    assert "weights_only" not in err  # no library chatter about how the checkpoint is saved
    assert [line for line in err.splitlines() if line and not line.startswith("sglightning")] == []  # ours alone
    state = load_checkpoint_file(ckpt)
    done = state["sglightning"]["rollouts_done"]
    assert 1 <= done < 6 and state["global_step"] == done  # a whole number of steps: none half-applied

    # the same command + --ckpt_path last continues in the same run folder and finishes the 6 steps
    out = subprocess.run(_fit_cmd(tmp_path, 6, "--model.rollout.max_steps=4", "--ckpt_path=last"), env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from {ckpt.resolve()}" in out.stderr
    assert "Restor" not in out.stdout + out.stderr  # our one line, not Lightning's two more
    assert not (tmp_path / "tiny" / "version_1").exists()
    final = load_checkpoint_file(ckpt)
    assert final["sglightning"]["rollouts_done"] == 6 and final["global_step"] == 6


def _terminal_sigint() -> None:
    """In the child before it runs: SIGINT delivered and handled by default, as in a shell's foreground job."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """SIGINT (Ctrl-C) between steps: sglightning's one line (what was saved, how to resume), exit 130; Lightning's
    own "Detected KeyboardInterrupt" line and its blank line are dropped."""
    ckpt = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    # Ctrl-C as a terminal delivers it: a child inherits an ignored or blocked SIGINT, and a test session started in
    # the background by a script (`pytest &`, nohup) ignores it from its start (the run then finished and exited 0)
    proc = subprocess.Popen(_fit_cmd(tmp_path, 30), env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, preexec_fn=_terminal_sigint)
    _wait_for(ckpt, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglightning: interrupted after"), err
    assert "--ckpt_path last" in lines[0]


def test_ctrl_c_before_the_first_step_leaves_no_run_folder(tmp_path):
    """Stopped in the validation before the first step: nothing to resume, so the run's folder (config.yaml,
    hparams.yaml, an events file) goes, and the next run is version_0 again, not version_1."""
    config = tmp_path / "tiny" / "version_0" / "config.yaml"
    slow_start = ("--trainer.limit_val_batches=null", "--model.evaluation.num_tasks=64",
                  "--model.evaluation.tasks_per_batch=4")  # a long validation before the first step
    proc = subprocess.Popen(_fit_cmd(tmp_path, 30, *slow_start),
                            env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            preexec_fn=_terminal_sigint)
    _wait_for(config, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "interrupted before the first step completed" in err, err[-3000:]
    assert not (tmp_path / "tiny").exists(), list(tmp_path.rglob("*"))


INTERRUPT_IN_EXEC = """
import sys
from sglightning import callbacks
def interrupted(*args, **kwargs):  # a Ctrl-C that lands while a module imports, inside a dataclass being made
    exec("raise KeyboardInterrupt")
callbacks.RolloutCallback.on_train_batch_start = interrupted
from sglightning.cli import main
sys.argv = ["sglightning", *sys.argv[1:]]
raise SystemExit(main())
"""

ENTRY_INTERRUPT_IN_EXEC = """
import sys, types
cli = types.ModuleType("sglightning.cli")  # Ctrl-C while the CLI imports, inside an exec of source text
cli.main = lambda: exec("raise KeyboardInterrupt")
sys.modules["sglightning.cli"] = cli
from sglightning.entry import main
raise SystemExit(main())
"""


@pytest.mark.parametrize("script", ["INTERRUPT_IN_EXEC", "ENTRY_INTERRUPT_IN_EXEC"])
def test_ctrl_c_inside_an_exec_of_source_text_still_exits_130(tmp_path, script):
    """CPython ends a ``python -m`` process by SIGINT (-2), whatever status it exits with, once a KeyboardInterrupt
    has left an ``exec`` of source text. CI met it: Ctrl-C landed while a module imported."""
    (tmp_path / "ctrl_c_run.py").write_text(globals()[script])
    env = dict(_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), _env()["PYTHONPATH"]]))
    out = subprocess.run([sys.executable, "-m", "ctrl_c_run", *_fit_cmd(tmp_path, 3)[3:]], env=env,
                         capture_output=True, text=True, timeout=600)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 130 and len(lines) == 1 and lines[0].startswith("sglightning: interrupted"), out.stderr
    assert not (tmp_path / "tiny").exists(), list(tmp_path.rglob("*"))


def test_resume_after_sigkill_equals_the_straight_run(tmp_path, straight):
    ckpt = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(_fit_cmd(tmp_path, 6), env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    _wait_for(ckpt, proc)
    time.sleep(1.0)
    proc.kill()  # no handler runs: whatever is on disk must be usable
    proc.communicate(timeout=60)
    killed_at = load_checkpoint_file(ckpt)["sglightning"]["rollouts_done"]
    out = subprocess.run(_fit_cmd(tmp_path, 6, "--ckpt_path=last"), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed, ref = _lora(ckpt), _lora(straight)
    assert resumed.keys() == ref.keys() and killed_at <= 6
    for k in ref:
        assert torch.allclose(resumed[k], ref[k], atol=1e-6), (k, killed_at)


KILL_DURING_SAVE = """
import os, signal, sys, torch
import sglightning.checkpointing as ck
real_save, calls = torch.save, {"n": 0}
def dying_save(obj, f, *a, **k):
    calls["n"] += 1
    if calls["n"] == int(os.environ["KILL_AT_SAVE"]):
        f.write(b"PK\\x03\\x04 half a checkpoint")  # a torn write ...
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)    # ... and the process dies mid-save
    return real_save(obj, f, *a, **k)
ck.torch.save = dying_save
from sglightning.cli import main
sys.argv = ["sglightning", *sys.argv[1:]]
main()
"""


def test_kill_during_a_checkpoint_write_leaves_the_previous_last_intact(tmp_path):
    script = tmp_path / "dying_fit.py"
    script.write_text(KILL_DURING_SAVE)
    cmd = [sys.executable, str(script), *_fit_cmd(tmp_path, 5)[3:]]
    out = subprocess.run(cmd, env=dict(_env(), KILL_AT_SAVE="3"), capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    folder = tmp_path / "tiny" / "version_0" / "checkpoints"
    state = load_checkpoint_file(folder / "last.ckpt")  # complete and loadable
    assert state["sglightning"]["rollouts_done"] == 2  # the two saves before the killed one
    assert [p.name for p in folder.iterdir() if p.name.startswith(".last.ckpt.tmp-")]  # the torn temp file
    # the next run resumes from it and cleans the stale temp file up
    out = subprocess.run(_fit_cmd(tmp_path, 3, "--ckpt_path=last"), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert load_checkpoint_file(folder / "last.ckpt")["sglightning"]["rollouts_done"] == 3
    assert not [p for p in folder.iterdir() if p.name.startswith(".last.ckpt.tmp-")]


def test_ckpt_path_last_without_an_earlier_run_starts_fresh(tmp_path):
    out = subprocess.run(_fit_cmd(tmp_path, 1, "--ckpt_path=last"), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no last.ckpt from an earlier run of this config; starting fresh" in out.stderr


@pytest.mark.parametrize("kind", ["truncated", "foreign", "garbage", "bytes", "missing"])
def test_broken_checkpoint_gives_one_line_naming_the_file(tmp_path, kind, straight, capsys):
    """The truncated file through a real `sglightning fit` process; the other kinds through the same CLI in this
    process (the same code path, without a Lightning import per case).  One short line: no "resuming from" line
    first, and torch's paragraph about ``weights_only`` cut to its reason."""
    bad = tmp_path / f"{kind}.ckpt"
    if kind == "truncated":
        bad.write_bytes(straight.read_bytes()[:5000])
    elif kind == "foreign":
        atomic_torch_save({"state_dict": {"w": torch.zeros(2)}, "epoch": 3}, bad)
    elif kind == "garbage":
        bad.write_text("this is not a checkpoint\n")
    elif kind == "bytes":
        bad.write_bytes(bytes(range(128, 256)) * 8)  # an unpickler's unknown opcode
    with pytest.raises(CheckpointError, match=str(bad)):
        load_checkpoint_file(bad)
    cmd = _fit_cmd(tmp_path, 1, f"--ckpt_path={bad}")
    if kind == "truncated":
        out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        code, err = out.returncode, out.stderr
    else:
        from sglightning.cli import cli_main

        with pytest.raises(SystemExit) as stopped, warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            cli_main(cmd[3:])
        code, err = stopped.value.code, capsys.readouterr().err
        assert [str(w.message) for w in said if "pickle" in str(w.message)] == []  # torch's guess would print too
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("sglightning fit: error: checkpoint ") and str(bad) in line
    assert "Traceback" not in err and "PyTorch 2.6" not in line and len(line) < 250 + len(str(bad)), line


def test_a_broken_last_checkpoint_found_by_last_is_one_line(tmp_path, capsys):
    """``--ckpt_path last`` finding a garbage ``last.ckpt``: the one line naming the file, exit 2 (the check of the
    steps left reads it first and must not turn it into a traceback)."""
    from sglightning.cli import cli_main

    bad = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    bad.parent.mkdir(parents=True)
    bad.write_text("this is not a checkpoint\n")
    with pytest.raises(SystemExit) as stopped:
        cli_main(_fit_cmd(tmp_path, 1, "--ckpt_path=last")[3:])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert any(line.startswith("sglightning fit: error: checkpoint ") and str(bad) in line
               for line in err.strip().splitlines()), err


def test_a_finished_run_whose_last_validation_did_not_finish_says_how_to_play_it(tmp_path, capsys, straight):
    """SIGTERM during the validation at the last step leaves it pending; a resume has no step to train and Lightning
    would skip that validation: the line says so and how to play it."""
    from sglightning.preemption import _validation_pending
    from sglightning.runs import nothing_left_to_train

    state = load_checkpoint_file(straight)
    _validation_pending(state)
    ckpt = tmp_path / "pending.ckpt"
    atomic_torch_save(state, ckpt)
    with pytest.raises(SystemExit) as stopped:
        nothing_left_to_train(ckpt, {"max_steps": 6})
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 0 and "holds 6 trained steps" in line
    assert ("its validation at step 6 did not finish: sglightning validate with the same config and --ckpt_path "
            f"{ckpt}") in line
    nothing_left_to_train(ckpt, {"max_steps": 7})  # a step left: the run goes on (no exit)
    nothing_left_to_train(ckpt, {"max_steps": None})
    assert capsys.readouterr().err == ""


def test_a_finished_distributed_checkpoint_is_read_from_its_loop_state(tmp_path, capsys, straight):
    """A sharded ``last.ckpt/`` folder (FSDP) keeps its loop state in ``meta.pt``: a resume with no step left says so
    as for a file; a folder without that file is left to the run's own load."""
    from sglightning.runs import nothing_left_to_train

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    nothing_left_to_train(folder, {"max_steps": 1})  # no meta.pt: not ours to judge
    state = {k: v for k, v in load_checkpoint_file(straight).items() if k not in ("state_dict", "optimizer_states")}
    atomic_torch_save(state, folder / "meta.pt")
    nothing_left_to_train(folder, {"max_steps": 7})
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as stopped:
        nothing_left_to_train(folder, {"max_steps": 6})
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 0 and line.startswith(f"sglightning: {folder} holds 6 trained steps"), line


def test_resume_extends_a_finished_run(tmp_path):
    """A finished 2-step run resumed with max_steps 3 trains exactly one more step, in the same folder."""
    assert subprocess.run(_fit_cmd(tmp_path, 2), env=_env(), capture_output=True, timeout=600).returncode == 0
    out = subprocess.run(_fit_cmd(tmp_path, 3, "--ckpt_path=last"), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not resumable" not in out.stderr
    assert "the trust schedule keeps its horizon of 2 steps" in out.stderr  # λ is not rescaled by the new max_steps
    state = load_checkpoint_file(tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt")
    assert state["sglightning"]["rollouts_done"] == 3 and state["global_step"] == 3
    # the saved config says the horizon it kept (a fresh fit of it scheduled λ over 3 steps: other weights)
    import yaml

    text = (tmp_path / "tiny" / "version_0" / "config.yaml").read_text()
    assert yaml.safe_load(text)["model"]["grpo"]["total_steps"] == 2 and "# resumed from " in text


STOPPED_AT = """
import os, signal, sys
import sglightning.callbacks as cb
SIG, STEP, BATCH = getattr(signal, os.environ["KILL_SIGNAL"]), int(os.environ["KILL_AT_STEP"]), os.environ["KILL_AT"]
real_val, real_train = cb.RolloutCallback.on_validation_batch_start, cb.RolloutCallback.on_train_batch_start
def val_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
    # the signal arrives as validation batch KILL_AT of the evaluation at step KILL_AT_STEP (validate: step 0)
    # starts, before its first round
    if not trainer.sanity_checking and pl_module.rollouts_done == STEP and BATCH == str(batch_idx):
        os.kill(os.getpid(), SIG)
    return real_val(self, trainer, pl_module, batch, batch_idx, dataloader_idx)
def train_start(self, trainer, pl_module, batch, batch_idx):
    # KILL_AT=train: as the rollout of the step after KILL_AT_STEP starts
    if pl_module.rollouts_done == STEP and BATCH == "train":
        os.kill(os.getpid(), SIG)
    return real_train(self, trainer, pl_module, batch, batch_idx)
cb.RolloutCallback.on_validation_batch_start = val_start
cb.RolloutCallback.on_train_batch_start = train_start
from sglightning.cli import main
sys.argv = ["sglightning", *sys.argv[1:]]
main()
"""


def _stopped_at(tmp_path: Path, args: list[str], signal_name: str, step: int, at: str):
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_AT)
    env = dict(_env(), KILL_SIGNAL=signal_name, KILL_AT_STEP=str(step), KILL_AT=at)
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)


def _val_scalars(version: Path, tag: str) -> list[float]:
    """Every value the run logged under ``tag``, in logging order (all event files of the version folder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in sorted(version.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [e.value for e in acc.Scalars(tag)]
    return values


def test_sigterm_during_validate_stops_within_a_round_and_exits_143(tmp_path):
    """A standalone validate stops at the rollout's next round check (not after playing its batch out), reports
    nothing partial, and exits 143."""
    args = ["validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            "--model.rollout.max_steps=2", "--model.evaluation.num_tasks=2", "--model.evaluation.tasks_per_batch=2"]
    out = _stopped_at(tmp_path, args, "SIGTERM", 0, "0")
    assert out.returncode == 143, out.stderr[-3000:]
    assert "SIGTERM received; validation stopped before it finished" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("validation_report.json"))  # nothing partial reported
    assert not list(tmp_path.rglob("*.ckpt"))  # and nothing saved: validate trains nothing


VAL = ["--trainer.val_check_interval=2", "--model.evaluation.num_tasks=4", "--model.evaluation.tasks_per_batch=2",
       "--model.evaluation.self_guidance=on", "--trainer.limit_val_batches=1.0"]


@pytest.mark.parametrize("signal_name, at",
                         [("SIGTERM", "0"), ("SIGTERM", "1"), ("SIGKILL", "1"), ("SIGKILL", "train")])
def test_a_validation_cut_short_in_fit_runs_again_on_resume_and_only_then(tmp_path, signal_name, at):
    """Fit validates after steps 2 and 4 (2 batches each).  Stopped as batch 0 or 1 of the validation at step 2 starts
    (SIGTERM: saved at once, the evaluation abandoned rather than played out; SIGKILL: nothing runs), the resume plays
    that whole validation again before training on; stopped after it (SIGKILL as step 3's rollout starts), the resume
    does not play it twice."""
    out = _stopped_at(tmp_path, _fit_cmd(tmp_path, 4, *VAL)[3:], signal_name, 2, at)
    version = tmp_path / "tiny" / "version_0"
    ckpt = version / "checkpoints" / "last.ckpt"
    if signal_name == "SIGTERM":
        assert out.returncode == 0, out.stderr[-3000:]
        assert "SIGTERM received; stopped after 2 completed steps" in out.stderr
        assert "the validation at step 2 runs again" in out.stderr
    else:
        assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert load_checkpoint_file(ckpt)["sglightning"]["rollouts_done"] == 2
    done_before = [2] if at == "train" else []  # an abandoned validation logs nothing
    assert _val_scalars(version, "val/global_step") == done_before

    out = subprocess.run(_fit_cmd(tmp_path, 4, "--ckpt_path=last", *VAL), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # the validation at step 2 exactly once over both runs, whole (both batches: 4 tasks x 1 episode); then step 4's
    assert _val_scalars(version, "val/global_step") == [2, 4]
    assert _val_scalars(version, "val/sg/episodes") == [4, 4]
    assert load_checkpoint_file(ckpt)["sglightning"]["rollouts_done"] == 4


# ---------------------------------------------------------------------------------------- from a review of the saves
def _fake_trainer(root: Path | str, **kw):
    import types

    state = types.SimpleNamespace(fn=kw.pop("fn", "fit"))
    return types.SimpleNamespace(**{**dict(loggers=[], default_root_dir=str(root), checkpoint_callbacks=[],
                                           state=state, sanity_checking=False, fast_dev_run=False,
                                           is_global_zero=True), **kw})


def test_a_remote_run_folder_is_refused_naming_the_key(tmp_path):
    """AtomicCheckpointIO took `memory://bucket/run` for a local path: a folder `./memory:/bucket/run` was made."""
    from sglightning.checkpointing import check_run_dir
    from sglightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^trainer\.default_root_dir: memory://bucket/run is a remote folder"):
        check_run_dir(_fake_trainer("memory://bucket/run"))
    check_run_dir(_fake_trainer(tmp_path))  # the control: a local folder passes


def test_lightnings_own_logger_names_the_key_the_user_set(tmp_path):
    """`trainer.logger: true` puts Lightning's logger in default_root_dir; the error named the logger's save_dir."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from sglightning.checkpointing import check_run_dir
    from sglightning.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("")
    root = blocker / "sub"
    trainer = _fake_trainer(root, loggers=[TensorBoardLogger(save_dir=str(root), name="lightning_logs")])
    with pytest.raises(ConfigError, match=r"^trainer\.default_root_dir: cannot write"):
        check_run_dir(trainer)
    trainer.default_root_dir = str(tmp_path)  # a logger of the user's own: its key
    with pytest.raises(ConfigError, match=r"^trainer\.logger\.init_args\.save_dir: cannot write"):
        check_run_dir(trainer)


def test_a_sharded_checkpoint_folder_is_named_as_one(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="is a folder, a sharded checkpoint"):
        load_checkpoint_file(folder)


def test_an_interrupted_swap_puts_the_previous_folder_back(tmp_path, monkeypatch):
    from sglightning.checkpointing import swap_in_folder

    target, new = tmp_path / "adapter", tmp_path / ".adapter-new"
    target.mkdir()
    (target / "w").write_text("old")
    new.mkdir()
    (new / "w").write_text("new")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # Ctrl-C between moving the old version aside and moving the new one in
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        swap_in_folder(new, target)
    assert (target / "w").read_text() == "old"


def test_ctrl_c_counts_the_steps_the_file_holds_and_speaks_in_validate(tmp_path, capsys):
    import types

    from sglightning.preemption import PreemptionCheckpoint, _saved_steps

    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    atomic_torch_save({"sglightning": {"rollouts_done": 4}}, last)
    assert _saved_steps(last, 5) == 4  # Ctrl-C while step 5's save was written: the file holds 4
    assert _saved_steps(tmp_path, 5) == 5  # a folder (sharded): the module's count
    PreemptionCheckpoint._interrupted(_fake_trainer(tmp_path), types.SimpleNamespace(rollouts_done=5))
    assert "interrupted after 4 completed steps" in capsys.readouterr().err
    PreemptionCheckpoint._interrupted(_fake_trainer(tmp_path, fn="validate"), types.SimpleNamespace(rollouts_done=5))
    assert capsys.readouterr().err.strip() == ("sglightning: interrupted; the validation stopped before it finished: "
                                              "nothing was reported")


def test_sigterm_in_fast_dev_run_saves_nothing(tmp_path, capsys):
    import types

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from sglightning.preemption import PreemptionCheckpoint

    saved = []
    trainer = _fake_trainer(tmp_path, fast_dev_run=True, save_checkpoint=lambda *a, **k: saved.append(a))
    PreemptionCheckpoint().on_exception(trainer, types.SimpleNamespace(rollouts_done=1), SIGTERMException())
    assert saved == [] and "fast_dev_run stopped, nothing saved" in capsys.readouterr().err
    trainer.fast_dev_run = False  # the control: a real run saves
    PreemptionCheckpoint().on_exception(trainer, types.SimpleNamespace(rollouts_done=1), SIGTERMException())
    assert len(saved) == 1
