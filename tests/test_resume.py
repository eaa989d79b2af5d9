"""Resume: 4 steps straight == 2 steps, checkpoint, fresh process state, 2 more steps (same parameters, same
metrics)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch
import tqdm.std
from lightning.pytorch import Callback
from tiny import tiny_module, tiny_trainer

from sglightning.cli import cli_main
from sglightning.grpo import GRPOConfig
from sglightning.module import SelfGuideModule

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

KEYS = ("rollout/success_rate", "reward/internal_sum", "reward/lambda", "loss/policy", "loss/kl", "tokens/policy")


def adamw(lr: float):
    """An AdamW factory at ``lr`` (a config's ``model.optimizer``)."""
    return lambda params: torch.optim.AdamW(params, lr=lr)


def _lora(module):
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_resume_from_checkpoint_is_exact(tmp_path, dropout):
    """With LoRA dropout too: its masks come from torch's global generator, which no checkpoint holds; the update
    seeds it from (rollout.seed, step, rank), so the resumed process (another global state) draws the same masks."""
    from sglightning.models import PolicyConfig

    policy = PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, lora_dropout=dropout)
    cfg = dict(grpo=GRPOConfig(kl_coef=0.01, total_steps=4), policy=policy)
    torch.manual_seed(0)
    straight = tiny_module(**cfg)
    tiny_trainer(tmp_path / "a", steps=4).fit(straight)

    torch.manual_seed(0)
    first = tiny_module(**cfg)
    trainer = tiny_trainer(tmp_path / "b", steps=2)
    trainer.fit(first)
    ckpt = tmp_path / "b" / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    # the checkpoint is plain tensors and containers: loadable with weights_only=True
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["sglightning"]["rollouts_done"] == 2 and all("lora_" in k for k in state["state_dict"])

    torch.manual_seed(123)  # a different process state: nothing may depend on it
    resumed = tiny_module(**cfg)
    tiny_trainer(tmp_path / "c", steps=4).fit(resumed, ckpt_path=str(ckpt))

    assert resumed.rollouts_done == 4
    a, b = _lora(straight), _lora(resumed)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-6), n
    # the checkpoint keeps the per-step logs: the resumed fit's history (its summary) covers all 4 steps
    for h_straight, h_resumed in zip(straight.history, resumed.history, strict=True):
        for k in KEYS:
            assert h_straight[k] == h_resumed[k] or abs(h_straight[k] - h_resumed[k]) < 1e-6, k
    assert resumed.history[0].keys() == straight.history[0].keys()


def test_a_report_in_a_checkpoint_holds_plain_types_only(tmp_path):
    """A custom env's task id of its own type (numpy's here) in the checkpointed "before" report made every later
    checkpoint unloadable with weights_only: the run could not resume."""
    import numpy as np

    from sglightning.checkpointing import atomic_torch_save, load_checkpoint_file
    from sglightning.report import plain

    report = {"step": 0, "episodes": {"sg": [{"task_id": np.int64(7), "won": np.bool_(True)}]}}
    atomic_torch_save({"sglightning": {"val_report_before": plain(report)}, "state_dict": {}}, tmp_path / "c.ckpt")
    loaded = load_checkpoint_file(tmp_path / "c.ckpt", require_sglightning=False)
    assert loaded["sglightning"]["val_report_before"]["episodes"]["sg"] == [{"task_id": "7", "won": "True"}]


def test_a_resumed_fits_summary_covers_the_whole_run_and_its_validation_before(tmp_path, capsys):
    """The summary a resumed fit printed covered only the steps of its own process ("2 GRPO steps" of 4) and lost
    the validation before training (evaluation.before_fit ran in the first process): the checkpoint keeps both."""
    from sglightning.callbacks import FitSummary
    from sglightning.data import EvalConfig

    cfg = dict(grpo=GRPOConfig(kl_coef=0.01, total_steps=4), evaluation=EvalConfig(num_tasks=2, before_fit=True))
    first = tiny_module(**cfg)
    trainer = tiny_trainer(tmp_path, steps=2, num_sanity_val_steps=-1, limit_val_batches=None)
    trainer.fit(first)
    assert first.val_report_before is not None
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    capsys.readouterr()
    resumed = tiny_module(**cfg)
    tiny_trainer(tmp_path, steps=4, num_sanity_val_steps=-1, limit_val_batches=None,
                 callbacks=[FitSummary()]).fit(resumed, ckpt_path=str(ckpt))
    out = capsys.readouterr().out
    assert len(resumed.history) == 4 and "sglightning fit: 4 GRPO steps" in out
    assert resumed.val_report_before == first.val_report_before and resumed.val_report["step"] == 4
    assert " before " in out and " -> after " in out


class _StopAfter(Callback):
    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.rollouts_done >= self.steps:
            trainer.should_stop = True


def test_a_resume_with_another_max_steps_keeps_the_trust_schedule(tmp_path, capsys):
    """λ(u)'s fractional breakpoints refer to the horizon the run started with: resumed with trainer.max_steps 8, the
    steps of a 4-step run keep λ = 1 and 0.5 (not 0, as a horizon of 8 would give), and one line says so; an explicit
    grpo.total_steps changes the horizon."""
    torch.manual_seed(0)
    first = tiny_module()
    trainer = tiny_trainer(tmp_path / "a", steps=4, callbacks=[_StopAfter(2)])
    trainer.fit(first)
    assert [h["reward/lambda"] for h in first.history] == [0.0, 0.0] and first.rollouts_done == 2
    ckpt = tmp_path / "a" / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    capsys.readouterr()

    resumed = tiny_module()
    tiny_trainer(tmp_path / "b", steps=4).fit(resumed, ckpt_path=str(ckpt))  # same horizon: nothing to say
    assert [h["reward/lambda"] for h in resumed.history[2:]] == [1.0, 0.5]
    assert "horizon" not in capsys.readouterr().err

    longer = tiny_module()
    tiny_trainer(tmp_path / "c", steps=8).fit(longer, ckpt_path=str(ckpt))
    assert [h["reward/lambda"] for h in longer.history[2:4]] == [1.0, 0.5]  # the 4-step schedule, kept
    err = capsys.readouterr().err
    assert err.count("sglightning:") == 1 and "keeps its horizon of 4 steps (set grpo.total_steps" in err

    explicit = tiny_module(grpo=GRPOConfig(kl_coef=0.01, total_steps=8))
    tiny_trainer(tmp_path / "d", steps=8).fit(explicit, ckpt_path=str(ckpt))
    assert [h["reward/lambda"] for h in explicit.history[2:4]] == [0.0, 0.0]  # λ of an 8-step schedule at steps 2, 3
    assert "grpo.total_steps=8: λ(u) is rescaled" in capsys.readouterr().err


class _Terminal(io.StringIO):
    """Standard output as a terminal (the progress bar draws itself there)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A 2-step tiny fit through the CLI, then ``--ckpt_path last --trainer.max_steps=4`` (the finished run, taken
    further) on a terminal, under a clock that moves 1 s per training step and stands still otherwise.  Returns the
    resumed CLI, the save_dir and what the resumed run wrote on the terminal."""
    out = tmp_path_factory.mktemp("resume")
    args = ["fit", "--config", TINY, f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}"]
    cli_main([*args, "--trainer.max_steps=2"])
    clock = [1000.0]
    real_step = SelfGuideModule.training_step

    def one_second_step(self, *a, **kw):
        clock[0] += 1.0
        return real_step(self, *a, **kw)

    terminal = _Terminal()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tqdm.std, "time", lambda: clock[0])
        mp.setattr(SelfGuideModule, "training_step", one_second_step)
        mp.setattr(sys, "stdout", terminal)
        cli = cli_main([*args, "--trainer.max_steps=4", "--ckpt_path=last"])
    return cli, out, terminal.getvalue()


@pytest.mark.slow
def test_the_progress_bar_after_a_resume_counts_on_from_the_restored_step(resumed):
    """After ``--ckpt_path last`` the bar reads ``fit: k/N`` (it read ``Training 4/?``: Lightning's label, no total)
    and its rate is over the steps this process ran (2 steps in 2 s: 1.00 s/step; the restored steps counted in gave
    0.50)."""
    cli, _, text = resumed
    assert cli.trainer.global_step == 4
    frames = [f.strip() for f in text.replace("\n", "\r").split("\r") if "/step" in f]
    assert frames and all(f.startswith("fit: ") for f in frames), frames
    assert "Training" not in text
    assert any(" 3/4 " in f for f in frames) and " 4/4 " in frames[-1], frames
    assert "1.00s/step" in frames[-1], frames[-1]
    assert "validation:" in text and "DataLoader" not in text  # one dataloader: Lightning's label says nothing


def test_tensorboard_keeps_every_step_once_across_a_resume(resumed):
    """Step k's scalars and its trajectory text sit at step k (the scalars were one behind), each validation at the
    step it evaluated, and the resumed run goes on at 3, 4 (it logged its first step where step 2 already was, and
    TensorBoard dropped what came after)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = resumed
    acc = EventAccumulator(str(out / "tiny" / "version_0"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for tag in ("rollout/success_rate", "loss/policy", "reward/lambda", "time/update_s"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    text = next(t for t in acc.Tags()["tensors"] if t.startswith("rollout/trajectory"))
    assert [e.step for e in acc.Tensors(text)] == [1, 2, 3, 4]
    assert [(e.step, e.value) for e in acc.Scalars("val/global_step")] == [(2, 2.0), (4, 4.0)]
    assert [e.step for e in acc.Scalars("val/sg/success_rate")] == [2, 4]


def test_a_terminal_that_reports_no_width_gets_plain_lines():
    """A pseudo-terminal whose size nobody set (``script`` without one) reports 0 columns, where tqdm drew the bar as
    nothing at all: such a terminal gets the plain lines; one with a width gets the bar."""
    import fcntl
    import struct
    import termios

    from sglightning.console import is_terminal

    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        assert tty.isatty() and os.get_terminal_size(slave).columns == 0  # a new pty has no size
        assert not is_terminal(tty)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        assert is_terminal(tty)
    os.close(master)
    assert is_terminal(_Terminal()) and not is_terminal(io.StringIO())


def test_a_resumed_runs_config_starts_fresh_when_run_again(resumed):
    """The resumed run's config.yaml kept ``ckpt_path``: a fit of it resumed that checkpoint again (in a new folder) or
    found nothing left to train.  It names the checkpoint in a comment instead."""
    import yaml

    _, out, _ = resumed
    text = (out / "tiny" / "version_0" / "config.yaml").read_text()
    assert yaml.safe_load(text)["ckpt_path"] is None
    assert "# resumed from " in text and "last.ckpt" in text and " in version_0 " in text
    # nor the version folder the resume continued in: a fresh fit of the file wrote into this run's folder
    assert yaml.safe_load(text)["trainer"]["logger"]["init_args"]["version"] is None


def test_a_resume_trains_with_the_configs_optimiser_settings(tmp_path, capsys):
    """Torch's optimiser ``load_state_dict`` put the checkpoint's learning rate back: a resume with another
    ``model.optimizer.lr`` trained at the old one, silently.  The config's applies, and one line says so."""
    tiny_trainer(tmp_path, steps=1, enable_checkpointing=True).fit(tiny_module(optimizer=adamw(1e-2)))
    ckpt = str(tmp_path / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    same = tiny_trainer(tmp_path, steps=2, enable_checkpointing=True)
    same.fit(tiny_module(optimizer=adamw(1e-2)), ckpt_path=ckpt)
    assert "optimiser settings" not in capsys.readouterr().err  # nothing changed: nothing said
    other = tiny_trainer(tmp_path, steps=3, enable_checkpointing=True)
    other.fit(tiny_module(optimizer=adamw(1e-3)), ckpt_path=ckpt)
    assert other.optimizers[0].param_groups[0]["lr"] == 1e-3
    assert "resumed with the config's optimiser settings: lr 0.001 (the checkpoint's 0.01)" in capsys.readouterr().err


def test_a_schedule_steps_once_an_optimiser_step_and_a_resume_continues_it(tmp_path, capsys):
    """``model.lr_scheduler`` steps once an optimiser step (``train/lr`` is the rate a step took); a resume continues
    the schedule where the checkpoint left it, and a new base rate in the config scales the schedule, not resets it.
    Before the base rate was compared with the scheduled one, so every resume under a schedule reset the rate."""
    import shutil

    def warmup(opt):  # the factor goes 0.25 -> 0.625 -> 1.0 over the first two optimiser steps
        return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2)

    def lrs(module):
        return [h["train/lr"] for h in module.history]

    straight = tiny_module(optimizer=adamw(1e-2), lr_scheduler=warmup)
    tiny_trainer(tmp_path / "a", steps=3).fit(straight)
    assert lrs(straight) == pytest.approx([2.5e-3, 6.25e-3, 1e-2])
    tiny_trainer(tmp_path / "b", steps=1, enable_checkpointing=True).fit(tiny_module(optimizer=adamw(1e-2),
                                                                                  lr_scheduler=warmup))
    ckpt = str(tmp_path / "step1.ckpt")  # kept: the resumes below write their own last.ckpt
    shutil.copy(tmp_path / "b" / "checkpoints" / "last.ckpt", ckpt)
    capsys.readouterr()
    resumed = tiny_module(optimizer=adamw(1e-2), lr_scheduler=warmup)
    tiny_trainer(tmp_path / "b", steps=3, enable_checkpointing=True).fit(resumed, ckpt_path=ckpt)
    assert lrs(resumed) == pytest.approx(lrs(straight))
    assert "optimiser settings" not in capsys.readouterr().err  # the base rate did not change: nothing said
    rebased = tiny_module(optimizer=adamw(2e-2), lr_scheduler=warmup)
    tiny_trainer(tmp_path / "b", steps=3, enable_checkpointing=True).fit(rebased, ckpt_path=ckpt)
    assert lrs(rebased) == pytest.approx([2.5e-3, 1.25e-2, 2e-2])  # step 1 as trained; then 2e-2 × the factor
    assert "lr 0.02 (the checkpoint's 0.01)" in capsys.readouterr().err
    # a schedule given up on the resume: the config's constant rate from there on
    dropped = tiny_module(optimizer=adamw(1e-2))
    tiny_trainer(tmp_path / "b", steps=3, enable_checkpointing=True).fit(dropped, ckpt_path=ckpt)
    assert lrs(dropped) == pytest.approx([2.5e-3, 1e-2, 1e-2])
    said = capsys.readouterr().err
    assert "lr_scheduler none (the checkpoint's LRScheduler), lr 0.01 (the checkpoint's 0.00625)" in said
    # a schedule added on the resume of a run without one: it starts at the resumed step
    tiny_trainer(tmp_path / "c", steps=1, enable_checkpointing=True).fit(tiny_module(optimizer=adamw(1e-2)))
    added = tiny_module(optimizer=adamw(1e-2), lr_scheduler=warmup)
    tiny_trainer(tmp_path / "c", steps=3, enable_checkpointing=True).fit(
        added, ckpt_path=str(tmp_path / "c" / "checkpoints" / "last.ckpt"))
    assert lrs(added) == pytest.approx([1e-2, 2.5e-3, 6.25e-3])
    assert "lr_scheduler LinearLR (the checkpoint's none)" in capsys.readouterr().err


def test_config_settings_under_a_schedule_move_its_base_and_keep_its_progress():
    """:func:`take_config_settings` without Lightning: a constant rate is replaced; a scheduled one is compared by
    its base and scaled, and the schedule's own base follows."""
    import torch

    from sglightning.optimisation import take_config_settings

    p = torch.nn.Parameter(torch.zeros(1))
    plain = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0)
    assert take_config_settings([plain], [], {"lr": 1e-2, "weight_decay": 0.0}) == {}
    assert take_config_settings([plain], [], {"lr": 3e-3, "weight_decay": 0.1}) == {"lr": (1e-2, 3e-3),
                                                                                   "weight_decay": (0.0, 0.1)}
    assert plain.param_groups[0]["lr"] == 3e-3 and plain.param_groups[0]["weight_decay"] == 0.1
    opt = torch.optim.AdamW([p], lr=1e-2)
    schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
    opt.step()
    schedule.step()  # factor 0.4375
    assert take_config_settings([opt], [schedule], {"lr": 1e-2}) == {}  # the scheduled rate is not the base
    assert opt.param_groups[0]["lr"] == pytest.approx(4.375e-3)
    assert take_config_settings([opt], [schedule], {"lr": 2e-2}) == {"lr": (1e-2, 2e-2)}
    assert opt.param_groups[0]["lr"] == pytest.approx(8.75e-3) and schedule.base_lrs == [2e-2]
    for _ in range(4):
        opt.step()
        schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-2)  # the warm-up ends at the new base
