"""Callbacks: collect the rollouts each step trains on (and validation plays), show a trajectory per step, export
adapters, save on preemption, print a summary."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sglightning import distributed, memory, rewards
from sglightning.data import sampling_generator, task_seeds
from sglightning.distributed import clean_name
from sglightning.errors import ConfigError
from sglightning.memory import PhasePeak
from sglightning.rollout import Episode, Rollout, RolloutAborted, RolloutBatch


def run_dir(trainer: Trainer) -> Path:
    """The run directory: the first logger's version folder, else ``default_root_dir``.  Reads the logger directly
    (``trainer.log_dir`` broadcasts from rank 0, which deadlocks in code that only rank 0 runs)."""
    path = None
    if trainer.loggers:
        logger = trainer.loggers[0]
        path = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
    return Path(path or trainer.default_root_dir)


def trajectory_markdown(ep: Episode) -> str:
    """One episode as Markdown (observations, guidance, actions) for TensorBoard's text panel."""

    def quote(text: str) -> str:
        return "\n".join("    " + line for line in str(text).splitlines()) or "    (empty)"

    lines = [
        f"**task** ({ep.task_type}, seed {ep.seed}, group {ep.group}): {ep.task}",
        f"**result**: {'success' if ep.won else 'failure'}, env return {ep.env_return:g}, "
        f"{len(ep.steps)} steps" + (f", error: {ep.error}" if ep.error else "")
        + (", truncated" if ep.truncated else ""),
        "",
    ]
    for t, s in enumerate(ep.steps, start=1):
        lines.append(f"**step {t}** observation:")
        lines.append(quote(s.observation))
        if ep.guided:
            lines.append(f"guidance: label **{s.label or 'unparsed'}** (r={s.internal_reward:+g}), reason:")
            lines.append(quote(s.reason or s.guidance_text))
        flag = " (invalid)" if s.invalid else ""
        lines.append(f"action{flag}: `{(s.action or s.action_text or '').replace('`', '')}`")
        lines.append("")
    return "\n".join(lines)


class RolloutCallback(Callback):
    """Collects the group samples with self-guidance: owns the rollout engine (the decoder on the policy and one env
    worker per episode slot), chooses each step's task seeds, plays the episodes on the current adapters and puts
    them on the batch — ``batch.rollout`` before ``training_step``, ``batch.rollouts[mode]`` before
    ``validation_step``.  Also logs one trajectory per step as text and prints the end-of-fit summary."""

    def __init__(self, text_every_n_steps: int = 1):
        self.text_every_n_steps = text_every_n_steps
        self.engine: Rollout | None = None

    def engine_for(self, pl_module: LightningModule) -> Rollout:
        if self.engine is None:
            self.engine = pl_module.make_engine()
        return self.engine

    def collect(self, pl_module: LightningModule, trainer: Trainer | None = None) -> RolloutBatch:
        """Play this step's groups (step = the module's ``rollouts_done``) on this rank's task seeds."""
        cfg = pl_module.rollout_cfg
        step = pl_module.rollouts_done
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        seeds = task_seeds(cfg.seed, step, cfg.groups_per_step, rank, world, pl_module.eval_cfg.seed_offset)
        gen = sampling_generator(cfg.seed, step, rank, device=pl_module.device)
        stop = _sigterm_check(trainer)
        peak = PhasePeak(pl_module.device)
        peak.start()
        with pl_module.generation_weights():
            rb = self.engine_for(pl_module).run(
                seeds, generator=gen, policy_version=pl_module.global_step, should_stop=stop)
        for extra_round in range(1, cfg.dynamic_sampling_rounds + 1):
            if not self._top_up(pl_module, rb, step, extra_round, rank, world, stop):
                break
        rb.peak_memory = peak.read("rollout")
        return rb

    def _top_up(self, pl_module, rb: RolloutBatch, step: int, extra_round: int, rank: int, world: int, stop) -> bool:
        """One round of dynamic sampling: play new tasks for the informative groups this rank still misses and add
        the informative ones.  Every rank takes part while any rank misses groups (under FSDP gathering the weights
        for generation is a collective).  Returns whether the round ran."""
        cfg, c = pl_module.rollout_cfg, pl_module.grpo_cfg
        informative = rewards.informative_groups(rb.episodes, pl_module.trust_lambda(), c.internal_reward_norm,
                                                 pl_module.reward_terms)
        missing = max(0, cfg.groups_per_step - len(informative))
        most = distributed.all_reduce(torch.tensor([float(missing)], device=pl_module.device),
                                      op=torch.distributed.ReduceOp.MAX)
        if float(most.item()) == 0:
            return False
        # a seed stream of its own per round (still below the evaluation seeds), sliced by rank like the first
        seeds = task_seeds(cfg.seed + 1_000_033 * extra_round, step, cfg.groups_per_step, rank, world,
                           pl_module.eval_cfg.seed_offset)[:missing]
        gen = sampling_generator(cfg.seed, step, rank, salt=2 + extra_round, device=pl_module.device)
        with pl_module.generation_weights():
            if seeds:
                more = self.engine_for(pl_module).run(
                    seeds, generator=gen, policy_version=pl_module.global_step, should_stop=stop)
                found = rewards.informative_groups(more.episodes, pl_module.trust_lambda(), c.internal_reward_norm,
                                                   pl_module.reward_terms)
                rb.add_groups(more, set(sorted(found)[:missing]))
        return True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if agree_on_sigterm(trainer, pl_module.device):
            raise SIGTERMException()  # every rank, here, before this step's rollout
        try:
            batch.rollout = self.collect(pl_module, trainer)
        except RolloutAborted:
            # SIGTERM during the rollout: abandon this step (nothing was updated yet); PreemptionCheckpoint saves
            raise SIGTERMException() from None
        _none_started(batch.rollout, "rollout.split", pl_module.rollout_cfg.split)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rb, batch.rollout = batch.rollout, None  # free the buffers: nothing of a step outlives it
        if rb is None or not rb.episodes or (pl_module.rollouts_done - 1) % self.text_every_n_steps:
            return
        # show a successful episode when there is one (more informative), else the first
        ep = next((e for e in rb.episodes if e.won), rb.episodes[0])
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("rollout/trajectory", trajectory_markdown(ep), pl_module.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0
                                  ) -> None:
        """Play the batch's evaluation tasks in every configured guidance mode, on the same seeds."""
        if agree_on_sigterm(trainer, pl_module.device):
            raise SIGTERMException()  # every rank, here (ranks run equally many batches, padding ones included)
        cfg = pl_module.eval_cfg
        for mode in cfg.modes:
            # entered on every rank, padding batches included: under FSDP gathering the weights is a collective
            with pl_module.generation_weights():
                if not batch.seeds:  # a padding batch (ranks run equally many batches): nothing to play
                    batch.rollouts[mode] = RolloutBatch(episodes=[], group_size=cfg.episodes_per_task)
                    continue
                # seeded by evaluation.seed and the task, not by the training seed or the batch index; one
                # generator per rank
                gen = sampling_generator(cfg.seed, 10_000_000 + int(batch.seeds[0]), trainer.global_rank, salt=1)
                peak = PhasePeak(pl_module.device)
                peak.start()
                try:
                    batch.rollouts[mode] = self.engine_for(pl_module).run(
                        batch.seeds, group_size=cfg.episodes_per_task, temperature=cfg.temperature,
                        guided=mode == "sg", generator=gen, split=cfg.split, should_stop=_sigterm_check(trainer))
                except RolloutAborted:
                    # SIGTERM mid-evaluation: stop within a round rather than play the batch out.  In fit the saved
                    # checkpoint has this validation pending (Lightning runs it again on resume); a standalone
                    # validate stops with nothing reported (PreemptionCheckpoint says so)
                    raise SIGTERMException() from None
                batch.rollouts[mode].peak_memory = peak.read("validation")
            _none_started(batch.rollouts[mode], "evaluation.split", cfg.split)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.engine is not None:
            self.engine.close()  # every env worker (JVMs included)
            self.engine = None

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        print(format_summary(trainer, pl_module))


def _validation_pending(checkpoint: dict) -> None:
    """Edit a checkpoint being written so that its validation-loop progress reads "stopped mid-evaluation": the state
    in which Lightning's resume plays that validation again (from its first batch: the epoch hooks reset what the
    module accumulates) before training on.  Saved as they stand (a validation not yet started, or stopped in a
    batch's start hook, or between batches), the counters read "validation finished" and the resume would skip it.
    The current counts say "first batch started" so that the replay covers every batch (otherwise Lightning counts the
    batches done before the stop as fetched and ends the replay early)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.val_loop.batch_progress")
    if progress is None:
        return
    for key, ready in (("total", max(int(progress["total"]["ready"]), 1)), ("current", 1)):
        progress[key].update(ready=ready, started=ready, processed=ready - 1, completed=ready - 1)
    progress["is_last_batch"] = False


def _sigterm_check(trainer: Trainer | None):
    """What a rollout asks before each round: has this process received SIGTERM (Lightning's handler sets the flag;
    the default handler is replaced while the trainer runs)?  Only in a single process: under several, a rank that
    abandoned its rollout alone would leave the others waiting in the update's collectives, so the ranks stop
    together at the next step or validation batch (:func:`agree_on_sigterm`) and the rollout in progress plays out."""
    if trainer is None or trainer.world_size > 1:
        return None
    return lambda: bool(getattr(trainer, "received_sigterm", False))


def install_sigterm_notifier(trainer: Trainer) -> None:
    """Under several processes, replace what Lightning does on SIGTERM with: forward the signal to the processes this
    one launched (as Lightning does) and note it locally — nothing else.

    Lightning's handler also broadcasts from inside the signal handler, and its loops stop each rank on its own flag
    at the end of a step.  A signal handler runs between two Python bytecodes of whatever the rank is doing, so that
    broadcast lands in the middle of the rank's own sequence of collectives (rank 0 may be generating while rank 1
    waits in the update's gradient all-reduce), and ranks that stop at different steps wait forever on each other's
    collectives: both ways the run hangs instead of saving.  Here the ranks compare their notes in one all-reduce at
    points every rank reaches in the same order — the start of each training step and of each validation batch
    (:func:`agree_on_sigterm`) — and only then set Lightning's flag, so every rank stops at the same place.  Called
    from ``setup``: Lightning registers the handler afterwards and picks this one up."""
    conn = trainer._signal_connector
    conn.sglightning_sigterm = False
    if trainer.world_size <= 1:
        return  # Lightning's own handler: it sets the flag, and with one process there is no collective

    def note_sigterm(signum, frame) -> None:
        if not conn.sglightning_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (Lightning's subprocess launcher)
        conn.sglightning_sigterm = True

    conn._sigterm_notifier_fn = note_sigterm


def agree_on_sigterm(trainer: Trainer, device: torch.device | str = "cpu") -> bool:
    """Has any rank received SIGTERM?  Under several processes one all-reduce (max) of the ranks' notes, which every
    rank must call at the same point; when one has, Lightning's ``received_sigterm`` is set on every rank.  In a
    single process: Lightning's flag as it stands."""
    conn = trainer._signal_connector
    if trainer.world_size <= 1:
        return bool(conn.received_sigterm)
    noted = torch.tensor([1.0 if getattr(conn, "sglightning_sigterm", False) else 0.0], device=device)
    if float(distributed.all_reduce(noted, op=torch.distributed.ReduceOp.MAX).item()) > 0:
        conn.received_sigterm = True
    return bool(conn.received_sigterm)


def _none_started(rb: RolloutBatch, key: str, split: str) -> None:
    """Every episode of a batch failed in ``reset``: the split has no playable tasks (e.g. ALFWorld's valid_unseen
    when only train games were downloaded) — a configuration problem, not bad luck."""
    eps = rb.episodes
    if eps and all(e.error is not None and e.error.startswith("reset") for e in eps):
        raise ConfigError(f"{key}: no episode of split {split!r} could start ({len(eps)} tried); the environment said: "
                          f"{eps[0].error}")


class PreemptionCheckpoint(Callback):
    """SIGTERM (preemption): Lightning stops at the end of the current step, or the rollout abandons its step; then
    this saves ``last.ckpt`` (atomically) where ``--ckpt_path last`` finds it, exports the adapter, says how to
    resume, and the process exits 0.

    Validations inside fit are made resumable too: ``last.ckpt`` is written again as each one starts, marked
    "validation pending", and once more when it ends, unmarked.  A run stopped in between (SIGTERM, ``kill -9``,
    Ctrl-C) resumes by playing that validation again, so a learning curve loses no evaluation point; a run stopped
    after it does not play it twice."""

    def __init__(self) -> None:
        self._validating_in_fit = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        install_sigterm_notifier(trainer)

    @staticmethod
    def _last_path(trainer: Trainer) -> Path:
        """Where ``--ckpt_path last`` finds ``last.ckpt``: ModelCheckpoint's folder, else the run's ``checkpoints``."""
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        return (Path(dirpath) if dirpath else run_dir(trainer) / "checkpoints") / "last.ckpt"

    def _save_last(self, trainer: Trainer) -> None:
        """Rewrite ``last.ckpt`` (only when ModelCheckpoint keeps one: ``save_last``)."""
        if getattr(trainer.checkpoint_callback, "save_last", None):
            trainer.save_checkpoint(self._last_path(trainer), weights_only=False)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._validating_in_fit = True
            self._save_last(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validating_in_fit:
            self._validating_in_fit = False
            self._save_last(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if self._validating_in_fit:
            _validation_pending(checkpoint)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            self._interrupted(trainer, pl_module)
            return
        if not isinstance(exception, SIGTERMException):
            return
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            self._stopped_evaluating(trainer, pl_module)
            return
        path = self._last_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # full state (says so: Lightning logs the default)
        if trainer.is_global_zero:
            step = pl_module.rollouts_done
            pending = f" (the validation at step {step} runs again)" if self._validating_in_fit else ""
            print(
                f"sglightning: SIGTERM received; stopped after {step} completed steps, "
                f"saved {path}. "
                f"Resume with the same command plus --ckpt_path last{pending}",
                file=sys.stderr,
                flush=True,
            )

    @staticmethod
    def _stopped_evaluating(trainer: Trainer, pl_module: LightningModule) -> None:
        """SIGTERM while evaluating outside training (``validate``, or fit's evaluation before the first step):
        nothing was trained, so nothing is saved and no partial result is reported.  ``validate`` exits 143 (the
        evaluation did not finish); fit exits 0 like any preemption."""
        if trainer.state.fn != "fit":
            pl_module.interrupted = 128 + 15
        if trainer.is_global_zero:
            what = "validation" if trainer.state.fn != "fit" else "the evaluation before the first step"
            print(f"sglightning: SIGTERM received; {what} stopped before it finished: nothing was saved or reported. "
                  "Run the same command again to start over", file=sys.stderr, flush=True)

    @staticmethod
    def _interrupted(trainer: Trainer, pl_module: LightningModule) -> None:
        """Ctrl-C: the interrupted step may be half done, so nothing new is saved; ``last.ckpt`` (written after every
        completed step) is where ``--ckpt_path last`` resumes.  The CLI exits 130."""
        pl_module.interrupted = 130
        if not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        last = PreemptionCheckpoint._last_path(trainer)
        if last.exists():
            msg = (f"interrupted after {pl_module.rollouts_done} completed steps; {last} holds the last of them. "
                   "Resume with the same command plus --ckpt_path last")
        else:
            msg = "interrupted before the first step completed; nothing to resume"
        print(f"sglightning: {msg}", file=sys.stderr, flush=True)


class AdapterExport(Callback):
    """Writes the peft adapter (``PeftModel.from_pretrained`` format) to ``<run dir>/adapter`` atomically, at every
    checkpoint save and at the end of fit."""

    def __init__(self, dirname: str = "adapter"):
        self.dirname = dirname

    def export(self, trainer: Trainer, pl_module: LightningModule) -> Path | None:
        if pl_module.policy is None:
            return None
        if trainer.global_rank != 0 and not pl_module._sharded():
            return None  # only rank 0 writes; under FSDP the others still take part in the gather below
        # the adapter as full tensors (under FSDP a gather of the small adapter shards: a collective on every rank)
        # names as in the module tree: peft finds the adapter's entries by walking that tree (FSDP1 wrappers included)
        state = pl_module.adapter_state_dict(tree_names=True)
        if trainer.global_rank != 0:
            return None
        target = run_dir(trainer) / self.dirname
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.dirname}-", dir=target.parent))
        try:
            pl_module.peft_model.save_pretrained(tmp, state_dict=state)
            _strip_wrapper_names(tmp / "adapter_model.safetensors", pl_module.peft_model.active_adapter)
            (tmp / "sglightning.json").write_text(
                json.dumps({"global_step": int(pl_module.global_step), "rollouts_done": pl_module.rollouts_done})
            )
            old = target.with_name(target.name + ".old")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        pl_module.adapter_dir = str(target)
        return target

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.export(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.export(trainer, pl_module)


def _strip_wrapper_names(path: Path, adapter: str) -> None:
    """Rewrite a saved adapter whose keys still carry FSDP1 / activation-checkpointing wrapper names under the plain
    names ``PeftModel.from_pretrained`` expects.  peft finds the adapter's entries by walking the module tree, so it
    must be given the tree's names; it then drops the adapter name only where it ends the module path, which a
    wrapper (``lora_A.default._fsdp_wrapped_module.weight``) hides: both are undone here."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not path.is_file():
        return
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if all(clean_name(k) == k for k in keys):
            return
        meta = f.metadata()
        tensors = {}
        for k in keys:
            plain = clean_name(k)
            tensors[plain.replace(f".{adapter}.", ".") if plain != k else k] = f.get_tensor(k)
    save_file(tensors, str(path), metadata=meta)


def _phase_lines(hist: list[dict], mean) -> list[str]:
    """Label shares and episode length per phase of the trust weight λ: a constant positive label turns λ·Σr_t into a
    bonus for length, which shows here as longer episodes while λ > 0."""
    phases = {"λ = 0": [r for r in hist if r.get("reward/lambda", 0.0) == 0.0],
              "0 < λ < 1": [r for r in hist if 0.0 < r.get("reward/lambda", 0.0) < 1.0],
              "λ = 1": [r for r in hist if r.get("reward/lambda", 0.0) == 1.0]}
    cells = [f"{name}: {len(rows)} steps, positive {mean('guidance/label_positive', rows):.2f}, negative "
             f"{mean('guidance/label_negative', rows):.2f}, length {mean('rollout/episode_length', rows):.1f}"
             for name, rows in phases.items() if rows]
    return ["  by trust phase    " + " | ".join(cells)] if cells else []


def _guidance_lines(hist: list[dict], mean) -> list[str]:
    """The guidance labels' shares, their calibration against measured progress, and both per trust phase."""
    return [
        "  labels            "
        + "  ".join(f"{k} {mean('guidance/label_' + k):.2f}" for k in ("positive", "neutral", "negative", "unparsed")),
        f"  label calibration accuracy vs measured progress {mean('guidance/label_accuracy'):.2f}   AUROC vs "
        f"success {mean('guidance/label_auroc_success'):.2f}   (nan: the env or the episodes could not tell)",
        *_phase_lines(hist, mean),
    ]


def format_summary(trainer: Trainer, pl_module: LightningModule) -> str:
    hist = pl_module.history
    if not hist:
        return "sglightning: no training step ran"

    def mean(key: str, rows=hist) -> float:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    third = max(1, len(hist) // 3)  # the rise: first vs last third of the steps
    guided = any("guidance/label_positive" in r for r in hist)  # labels were measured (none without guidance)
    lines = [
        "",
        f"sglightning fit: {len(hist)} GRPO steps, {int(sum(r.get('rollout/episodes', 0) for r in hist))} episodes",
        f"  success rate      all {mean('rollout/success_rate'):.3f}"
        f" | first third {mean('rollout/success_rate', hist[:third]):.3f}"
        f" | last third {mean('rollout/success_rate', hist[-third:]):.3f}",
        f"  mean env return   {mean('rollout/env_return'):.3f}"
        + (f"   internal sum {mean('reward/internal_sum'):+.3f}" if guided else ""),
        *(_guidance_lines(hist, mean) if guided else []),
        f"  invalid actions   {mean('rollout/invalid_action_rate'):.3f}   skipped updates {pl_module.skipped_updates}",
        f"  time per step     rollout {mean('time/rollout_s'):.1f}s  update {mean('time/update_s'):.1f}s",
        *_memory_lines(hist),
    ]
    lines += _validation_lines(getattr(pl_module, "val_report_before", None), getattr(pl_module, "val_report", None))
    lines.append(f"  TensorBoard       tensorboard --logdir {run_dir(trainer)}")
    adapter = getattr(pl_module, "adapter_dir", None)
    lines.append(f"  adapter           {adapter or run_dir(trainer) / 'adapter'}")
    return "\n".join(lines)


def _memory_lines(hist: list[dict]) -> list[str]:
    """The largest per-phase peak of the run (host RSS of the trainer process; accelerator memory on CUDA)."""
    def peak(key: str) -> float | None:
        vals = [r[key] for r in hist if key in r]
        return max(vals) if vals else None

    def per_phase(key_of) -> list[str]:
        return [f"{phase} {v:.1f} GB" for phase in ("rollout", "update") if (v := peak(key_of(phase))) is not None]

    parts = per_phase(memory.rss_key)
    if not parts and (v := peak(memory.LIFETIME_RSS)) is not None:
        parts = [f"{v:.1f} GB (process lifetime; this system cannot reset the peak per phase)"]
    lines = [f"  peak memory       {'  '.join(parts)} (RSS of this process)"] if parts else []
    acc = per_phase(memory.accelerator_key)
    if acc:
        lines.append(f"  peak accelerator  {'  '.join(acc)} (allocated by torch)")
    return lines


def _validation_lines(before: dict | None, after: dict | None) -> list[str]:
    """One summary line per guidance mode: the success of the end-of-fit validation, preceded by the one before
    training when ``evaluation.before_fit`` ran it ("before 0.125 -> after 0.406", same held-out tasks)."""
    lines = []
    for mode in dict.fromkeys([*(before or {}).get("modes", {}), *(after or {}).get("modes", {})]):
        parts, episodes = [], 0
        for rep, word in ((before, "before"), (after, "after")):
            stats = (rep or {}).get("modes", {}).get(mode)
            if stats is None:
                continue
            rate = f"{stats.get('rollout/success_rate', float('nan')):.3f}"
            if before is not None:  # label the two numbers; a lone end-of-fit validation needs no label
                at = f" (step {rep['step']})" if word == "before" and rep.get("step") else ""
                rate = f"{word}{at} {rate}"
            parts.append(rate)
            episodes = stats.get("episodes", 0)
        guidance = "self-guidance on" if mode == "sg" else "self-guidance off"
        lines.append(f"  validation [{guidance}] success {' -> '.join(parts)} over {episodes} episodes")
    return lines


def default_callbacks(trainer: Trainer | None) -> list[Callback]:
    """The callbacks every run gets (``SelfGuideModule.configure_callbacks``): rollouts, adapter export, preemption
    checkpoints — those the trainer does not have yet (e.g. ``validate`` after ``fit``: kept, no override notice) — and,
    in place of Lightning's default checkpoint callback (not a user's), ``last.ckpt`` after every step (adapters +
    optimiser + counters: a killed or preempted run loses at most one step; ``--ckpt_path last`` resumes)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    present = {type(c) for c in trainer.callbacks} if trainer is not None else set()
    callbacks = [cb() for cb in (RolloutCallback, AdapterExport, PreemptionCheckpoint) if cb not in present]
    ckpt = trainer.checkpoint_callback if trainer is not None else None
    if type(ckpt) is ModelCheckpoint and ckpt.save_last is None and ckpt.dirpath is None and ckpt.monitor is None:
        callbacks.append(ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=1))
    return callbacks
