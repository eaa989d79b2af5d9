"""The LightningModule: the policy (one model, LoRA adapters) and the GRPO update over self-guided rollouts.

One training step u (one :class:`~sglightning.data.StepBatch` of the train loader) reads top to bottom:
  1. :class:`~sglightning.callbacks.RolloutCallback` plays ``rollout.groups_per_step`` groups of
     ``rollout.group_size`` episodes with the current adapters and puts them on the batch (``batch.rollout``);
  2. ``training_step``: λ(u) (the trust schedule, × the labels' reliability with ``grpo.trust_adaptive``) →
     :func:`~sglightning.update.prepare_update` (pure: blended returns, token advantages, the rows to score) →
     :meth:`update` (scores the sampled ids under the current weights with :mod:`sglightning.scoring` and minimises
     the clipped surrogate + β·KL by manual optimisation: micro-batches accumulate the gradient of one token-mean loss
     over the whole step, all ranks; ``grpo.ppo_epochs`` optimiser steps per rollout, default 1: on-policy) → log
     (:func:`~sglightning.metrics.step_logs`, merged over ranks).
The reference policy is the same module with adapters disabled (never a second copy); its pass is skipped when
``grpo.kl_coef == 0``.  A loss or gradient that is not finite skips the update, warns and is counted.
Distributed plumbing (FSDP units, gathered weights, gradient sync, merged logs): :mod:`sglightning.distributed`.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from sglightning import data, distributed, optimisation, report, rewards, scoring, strategies
from sglightning.callbacks import RolloutCallback, default_callbacks
from sglightning.chat import pad_token_id
from sglightning.checkpointing import check_shapes, stop_nonfinite, use_atomic_io
from sglightning.compiling import compiled_layers
from sglightning.console import quiet
from sglightning.data import EvalConfig, RolloutConfig
from sglightning.engines import EngineConfig, engine_class, make_engine
from sglightning.envs import build_env, check_env, env_class_of, stack_versions
from sglightning.envs.base import TextEnv
from sglightning.envs.household import HouseholdEnv
from sglightning.episodes import Episode
from sglightning.errors import ConfigError, reraise_out_of_memory
from sglightning.grpo import GRPOConfig, StepCounts
from sglightning.guidance import GuidanceConfig, check_calibration
from sglightning.memory import PhasePeak
from sglightning.metrics import SUM_KEYS, EpisodeMetrics, step_logs
from sglightning.models import PolicyConfig, check_adapter_folder, check_model_source, load_policy
from sglightning.profiling import phase, phase_logs, timing
from sglightning.rewards import RewardTerm
from sglightning.traits import drops_out, eval_mode, head_is_exact, sliding_window, warn_low_precision_adapters
from sglightning.update import (
    RolloutCorrection,
    StepStats,
    UpdateBatch,
    UpdateConfig,
    microbatch_objective,
    prepare_update,
    rollout_correction_mode,
)

quiet()
_COUNTERS = ("rollouts_done", "skipped_updates", "consecutive_skips")  # the run's counters a checkpoint keeps


class SelfGuideModule(LightningModule):
    def __init__(
        self,
        policy: PolicyConfig = PolicyConfig(),
        env: Callable[[], TextEnv] = HouseholdEnv,
        rollout: RolloutConfig = RolloutConfig(),
        guidance: GuidanceConfig = GuidanceConfig(),
        grpo: GRPOConfig = GRPOConfig(),
        update: UpdateConfig = UpdateConfig(),
        evaluation: EvalConfig = EvalConfig(),
        optimizer: OptimizerCallable | None = None,
        adapter_path: str | None = None,
        reward_terms: list[RewardTerm] | None = None,
        engine: EngineConfig = EngineConfig(),
        lr_scheduler: LRSchedulerCallable | None = None,
    ):
        """What is trained, on which environment, and how (each argument is a section of ``model``).

        Args:
            policy: which LM and how to adapt it (LoRA/QLoRA).
            env: the environment: ``class_path`` (a ``TextEnv`` subclass; bare class names of imported envs work)
                and ``init_args``; called once per episode slot, instances are reused across steps.
            rollout: groups per step, group size, max env steps, temperature.
            guidance: self-guidance prompts and decoding modes.
            grpo: the algorithm: blended return, trust schedule, advantages, loss.
            update: how the update is computed (micro-batches, shared prefixes, skipping zero-advantage rows).
            evaluation: the validation episode set.
            optimizer: optimiser for the adapter parameters (default: AdamW, lr 1e-5).
            adapter_path: start from a saved peft adapter folder (its own LoRA rank, alpha, dropout and targets).
            reward_terms: extra per-episode rewards added to the return (``sglightning.rewards.RewardTerm``
                subclasses; none by default, as in the paper).
            engine: where rollouts are generated: ``backend: builtin`` (batched forwards of the policy in this
                process), ``vllm`` (a vLLM server launched from ``engine.python`` or reached at ``engine.url``; the
                adapter is synced every step) or an engine class path.
            lr_scheduler: learning-rate schedule, stepped once an optimiser step (skipped updates too); default:
                none, a constant rate. E.g. ``torch.optim.lr_scheduler.LinearLR`` for a warm-up.
        """
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "reward_terms"])
        self.policy_cfg, self.env_class, self.rollout_cfg = policy, env, rollout
        self.guidance_cfg, self.grpo_cfg, self.update_cfg, self.eval_cfg = guidance, grpo, update, evaluation
        self.optimizer_factory = optimizer if optimizer is not None else optimisation.default_optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.adapter_path, self.engine_cfg = adapter_path, engine
        self.reward_terms = rewards.distinct_terms(reward_terms)
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the adapters only
        self.policy, self.tokenizer, self._env_checked = None, None, False
        self.rollouts_done = self.skipped_updates = self.consecutive_skips = 0  # _COUNTERS
        self.stop_reason: str | None = None  # set when the run stopped itself (e.g. repeated non-finite updates)
        self._stop_pending = 0  # max_consecutive_skips was reached in this step: stop at its end
        self.history: list[dict[str, float]] = []  # per-step summary for the end-of-run report
        self.train_metrics = EpisodeMetrics()
        self.validation = report.Validation()  # one validation's episodes, by self-guidance mode
        self.val_report = self.val_report_before = None  # reports: the last validation's, evaluation.before_fit's
        self.trust = rewards.Trust(self.grpo_cfg)  # λ(u): the schedule, its horizon, the labels' reliability
        self._checkpoint_step = 0  # the global step of the checkpoint loaded (validate reports it)

    # ------------------------------------------------------------------------------------------------------------------
    # model, env, engine
    @property
    def sharding(self) -> str | None:
        """``"fsdp2"``, ``"fsdp1"`` or ``None`` (one device, DDP)."""
        return strategies.sharding_of(self.trainer.strategy) if self._trainer is not None else None

    @property
    def peft_model(self):
        """The peft model itself (under FSDP1 ``self.policy`` is its ``FullyShardedDataParallel`` root wrapper)."""
        return distributed.unwrap(self.policy)

    def preflight(self, strategy=None) -> None:
        """Checks that take seconds, run by the CLI before anything starts (so a run that cannot start leaves no run
        folder): the environment and its splits, quantization under the trainer's ``strategy``, where the model comes
        from, the optimiser's arguments, no tensor parallelism. ``ConfigError`` naming the key."""
        self._check_env()
        strategies.check_quantization(self.policy_cfg.quantization, strategy)
        strategies.check_tensor_parallel(strategy)
        self.share_prefix(strategy)
        check_model_source(self.policy_cfg)
        check_adapter_folder(self.adapter_path)
        make_engine(self.engine_cfg).check(self.policy_cfg, self.rollout_cfg, self.grpo_cfg)  # what it cannot do
        check_calibration(self.grpo_cfg.calibration, self.guidance_cfg)
        optimisation.check(self.optimizer_factory, self.lr_scheduler_factory)

    def share_prefix(self, strategy=None) -> bool:
        """Whether the update shares prefixes (:func:`distributed.prefix_sharing`)."""
        sharding = strategies.sharding_of(strategy or getattr(self._trainer, "strategy", None))
        exact = bool(sharding) or self.policy is None or head_is_exact(self.policy)  # FSDP: no forward
        checkpointing, sliding = self.policy_cfg.gradient_checkpointing, bool(sliding_window(self.policy))
        return distributed.prefix_sharing(self.update_cfg.share_prefix, sharding, checkpointing, sliding, exact)

    def _check_env(self) -> None:
        if not self._env_checked:
            splits = {"rollout.split": self.rollout_cfg.split, "evaluation.split": self.eval_cfg.split}
            check_env(self.env_factory, splits)
            self._env_checked = True

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self._check_env()  # before the (slow) model load: a bad env config fails in a second
        strategies.check_quantization(self.policy_cfg.quantization, self._trainer and self._trainer.strategy)
        self.policy, self.tokenizer = load_policy(self.policy_cfg, self.device, self.adapter_path)
        self.policy.train()  # from_pretrained returns eval mode; the update runs in train mode (LoRA dropout)
        if self.sharding == "fsdp2":
            distributed.apply_fully_shard(self.policy, self.device_mesh)
        elif self.sharding == "fsdp1":
            self.policy = distributed.wrap_fsdp1(self.policy, self.trainer.strategy, self._world()[1])

    def on_fit_start(self) -> None:
        warn_low_precision_adapters(self.policy)  # after the precision plugin converted the model (bf16-true does)
        self.share_prefix()  # the model loaded: update.share_prefix: true is refused now where it cannot hold

    def generation_weights(self):
        """Rollouts: whole weights for the whole rollout under FSDP (:func:`distributed.generation_weights`)."""
        return distributed.generation_weights(self.policy, self.sharding)

    def env_factory(self) -> TextEnv:
        return build_env(self.env_class, self.rollout_cfg.env_processes)

    def env_name(self) -> str:
        target = env_class_of(self.env_class)
        return getattr(target, "__qualname__", repr(target))

    def package_versions(self) -> dict[str, str]:
        """The versions this run trains and evaluates with (recorded in its config and reports)."""
        return stack_versions(self.env_class)

    def rollout_callback(self) -> RolloutCallback:
        """The rollout collector for this module's configs (:func:`configure_callbacks` installs one)."""
        return RolloutCallback(self.rollout_cfg, self.eval_cfg, self.guidance_cfg, self.env_factory,
                               engine=make_engine(self.engine_cfg),
                               chat_template_kwargs=self.policy_cfg.chat_template_kwargs,
                               informative=self.informative_groups, policy=self.policy_cfg, grpo=self.grpo_cfg)

    def configure_callbacks(self):
        return default_callbacks(self.trainer if self._trainer is not None else None, self.rollout_callback())

    def setup(self, stage: str) -> None:
        use_atomic_io(self.trainer.strategy)
        if stage == "fit":  # this fit's validations only (not an earlier validate's); a resume then restores "before"
            self.val_report = self.val_report_before = None

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("no trainable parameters: check model.policy.lora_target_modules")
        return optimisation.configure(params, self.optimizer_factory, self.lr_scheduler_factory)

    # data ---------------------------------------------------------------------------------------------------------
    def total_steps(self, max_steps: int | None = None) -> int:
        """Steps of this run: ``grpo.total_steps``, else ``max_steps`` (default ``trainer.max_steps``) / ppo_epochs."""
        if self.grpo_cfg.total_steps:
            return self.grpo_cfg.total_steps
        epochs = self.grpo_cfg.ppo_epochs
        max_steps = max_steps if max_steps is not None else self.trainer.max_steps if self._trainer is not None else -1
        if max_steps is None or max_steps < 0 or max_steps % epochs:  # else the last rollout would run past it
            raise ConfigError(f"trainer.max_steps: {max_steps} is not a multiple of model.grpo.ppo_epochs ({epochs}), "
                              "each rollout's optimiser steps" if max_steps and max_steps > 0 else
                              "trainer.max_steps: must be set (or model.grpo.total_steps) for the trust schedule")
        return max(1, max_steps // epochs)

    def _world(self) -> tuple[int, int]:
        """(rank, world size): (0, 1) without a trainer or outside distributed runs."""
        return (0, 1) if self._trainer is None else (int(self.trainer.global_rank), int(self.trainer.world_size))

    def train_dataloader(self):
        return data.train_loader(self.total_steps())

    def val_dataloader(self):
        c = self.eval_cfg
        return data.val_loader(c.num_tasks, c.seed_offset, c.tasks_per_batch, *self._world())

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch  # plain Python (seeds, episodes): the step moves what it scores itself

    # ------------------------------------------------------------------------------------------------------------------
    # the update
    def trust_lambda(self, step: int | None = None) -> float:
        """λ(u) of the trust schedule at step ``step`` (default: the step being trained)."""
        return self.trust.scheduled(self.rollouts_done if step is None else step, self.total_steps)

    def informative_groups(self, episodes: list[Episode]) -> set[int]:
        """Groups whose returns differ (dynamic sampling); λ with trust_adaptive: × the last measured reliability."""
        c, drop = self.grpo_cfg, self.rollout_cfg.drops_failed_groups  # those the update drops: none
        lam = self.trust_lambda() * (self.trust.meter.reliability if c.trust_adaptive else 1.0)
        return rewards.informative_groups(episodes, lam, c.internal_reward_norm, c.invalid_action_penalty,
                                          self.reward_terms, drop_failed=drop)

    def token_logprobs(self, ids, attn, mask, temperature: float, entropy: bool = False, restrict=None):
        """:func:`scoring.token_logprobs` on this policy (through the FSDP root when sharded)."""
        sharded = self.sharding is not None  # FSDP: every forward is a collective, through the root
        return scoring.token_logprobs(self.policy if sharded else self.peft_model, ids, attn, mask, temperature,
                                      whole_model=sharded, entropy=entropy, restrict=restrict,
                                      share_prefix=self.share_prefix())

    def training_step(self, batch: data.StepBatch, batch_idx):
        """One GRPO step on the rollout the callback put on ``batch``: λ → prepare → update → log."""
        rb = batch.rollout
        if rb is None:
            raise RuntimeError("no rollout on this step's batch (is RolloutCallback installed?)")
        t0, step = time.perf_counter(), self.global_step  # the optimiser steps the rollout's weights had taken
        peak = PhasePeak(self.device)
        peak.start()
        # λ(u); with grpo.trust_adaptive × the labels' measured reliability (one all-reduce: the same on every rank)
        lam = schedule = self.trust_lambda()
        if self.grpo_cfg.trust_adaptive:
            lam = schedule * self.trust.meter.add(rb.episodes, lambda t: distributed.all_reduce(t.to(self.device)))
        # returns, advantages, the rows to score (pure, on the CPU)
        prepared = prepare_update(rb, lam, self.grpo_cfg, self.update_cfg, pad_token_id(self.tokenizer),
                                  reward_terms=self.reward_terms, share_prefix=self.share_prefix(),
                                  drop_failed_groups=self.rollout_cfg.drops_failed_groups)
        # grpo.ppo_epochs optimiser steps on it (every rank, with or without rows: the same collectives)
        try:
            dropout = data.seeded_dropout(self.policy, self.rollout_cfg.seed, step, self.global_rank, self.device)
            with timing() as times, phase("update"), compiled_layers(self.policy, self.update_cfg.compile), dropout:
                update_logs = self.update(prepared)
        except RuntimeError as err:  # out of memory, maybe wrapped by the compiler (a backward compiled lazily)
            reraise_out_of_memory("update", err, self.rollouts_done + 1)
        # the step's numbers, merged over ranks
        logs = step_logs(rb, prepared, step)
        # per-episode means through torchmetrics (under DDP over all ranks' episodes), of the policy's own draw
        self.train_metrics.update(rb.policy_round())
        logs.update(self.train_metrics.compute())
        self.train_metrics.reset()
        if self.grpo_cfg.trust_adaptive:
            logs.update({"reward/lambda_schedule": schedule, "guidance/reliability": self.trust.meter.reliability})
        logs.update(update_logs | phase_logs(times.seconds, "update"))
        logs["time/update_s"] = time.perf_counter() - t0
        logs.update(peak.read("update"))
        logs["train/skipped_updates"] = float(self.skipped_updates)
        self.rollouts_done += 1
        logs = distributed.reduce_logs(logs, SUM_KEYS, self._world()[1])
        self.history.append({k: float(v) for k, v in logs.items()})
        self._forget_last_step()
        self.log_dict(logs, on_step=True, on_epoch=False, prog_bar=False, batch_size=len(rb.episodes))
        self._log_at_global_step(on_step=True, on_epoch=False)
        self.log("success", logs["rollout/success_rate"], on_step=True, prog_bar=True, logger=False)
        self.log("lam", lam, on_step=True, prog_bar=True, logger=False)

    def update(self, prepared: UpdateBatch) -> dict[str, float]:
        """``grpo.ppo_epochs`` optimiser steps on the prepared rows (every rank, rows or not): their statistics."""
        # this step's policy tokens and sequences over all ranks: the loss is one mean over all of them
        totals = StepCounts.from_tensor(distributed.all_reduce(prepared.counts.to_tensor(self.device)))
        data = {k: v.to(self.device) for k, v in prepared.data.items()} if prepared.data is not None else None
        adv = prepared.adv.to(self.device) if prepared.adv is not None else None
        rows = scoring.microbatch_rows(data, self.update_cfg.micro_batch_size, self.update_cfg.micro_batch_tokens)
        # FSDP: every forward/backward is a collective, so ranks with fewer micro-batches pad with dummy ones
        pad = distributed.most_over_ranks(len(rows), self.device) - len(rows) if self.sharding else 0
        out: dict[str, float] = {}
        mode = self.correction_mode()  # its old log-probs from the first epoch's forward, or one pass with dropout
        correct = RolloutCorrection(data, mode, self.grpo_cfg.rollout_correction_cap) if mode and data else None
        data = correct.data if correct else data
        if mode and drops_out(self.policy) and (correct or self.sharding):  # FSDP: every rank runs its collectives
            with phase("update/correction"):
                out.update(self._rollout_correction(correct, rows, pad))
            correct = None  # every row passed: the epochs read its data
        for epoch in range(self.grpo_cfg.ppo_epochs):
            skipped = out.get("train/update_skipped", 0.0)  # 1 if any epoch skipped, not only the last
            out.update(self._optimiser_step(data, adv, rows, pad, totals, prepared.rows_left_out, self.optimizers(),
                                            first_epoch=epoch == 0, correct=correct))
            out["train/update_skipped"] = max(skipped, out["train/update_skipped"])
            out["train/lr"] = float(self.optimizers().param_groups[0]["lr"])  # the rate this optimiser step took
            if self.lr_schedulers() is not None:  # once an optimiser step, a skipped one too
                self.lr_schedulers().step()
            if correct and correct.complete:  # else a skipped step: the next epoch, same weights, passes again
                out.update(correct.stats())
                correct = None
        return out

    def correction_mode(self) -> str | None:
        """``grpo.rollout_correction`` resolved for this run (:func:`sglightning.update.rollout_correction_mode`)."""
        base = self.peft_model.get_input_embeddings().weight.dtype if self.policy is not None else torch.float32
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        engine = engine_class(self.engine_cfg)
        return rollout_correction_mode(self.grpo_cfg.rollout_correction, weights_dtype=base, precision=precision,
                                       engine_half=engine.samples_in_half_precision(self.engine_cfg),
                                       sliding=engine.pads_inside_rows and bool(sliding_window(self.policy)))

    @torch.no_grad()
    def _rollout_correction(self, correct: RolloutCorrection | None, rows: list[slice], pad: int) -> dict[str, float]:
        """The rollout correction by one no-grad pass, where the model drops out (eval mode, as the sampler ran): each
        micro-batch's log-probs feed ``correct`` as the first epoch's would; returns its statistics.  ``pad``: the
        empty forwards this rank adds under FSDP; ``correct`` None: this rank has no rows."""
        temp = self.rollout_cfg.temperature
        with eval_mode(self.policy):
            distributed.empty_forwards(pad, lambda i, a, m: self.token_logprobs(i, a, m, temp), self.device)
            if correct is None:
                return {}
            no_adv = torch.zeros_like(correct.data["old_logp"])  # [S, L] (scoring reads no advantage)
            for r in rows:
                mb = scoring.microbatch(correct.data, no_adv, r)  # [B, W] each
                correct.apply(mb, self.token_logprobs(mb["ids"], mb["attn"], mb["mask"], temp,
                                                      restrict=mb["restrict"])[0], r)
        return correct.stats()

    def _optimiser_step(self, step_data: dict[str, torch.Tensor] | None, tok_adv: torch.Tensor | None,
                        rows: list[slice], pad: int, totals: StepCounts, skipped: bool, opt, first_epoch: bool,
                        correct: RolloutCorrection | None = None) -> dict[str, float]:
        """One optimiser step on the whole step's batch: per micro-batch the forward passes here, its objective from
        :func:`sglightning.update.microbatch_objective` (pure), its backward here (gradients accumulate; under DDP one
        sum over ranks; under FSDP every rank runs as many micro-batches); then the gradient's norm and the optimiser.
        ``rows``: the micro-batches; ``pad``: the zero-weight dummy ones this rank adds under FSDP; ``totals``: the
        step's counts over ranks; ``skipped``: zero-advantage rows were left out; ``correct``: the rollout
        correction taken from this pass (its ``data`` is ``step_data``).  Returns the step's statistics."""
        c, temp, stats = self.grpo_cfg, self.rollout_cfg.temperature, StepStats(distributed.pool_weighted)
        finite, sharded = True, self.sharding is not None
        opt.zero_grad()
        distributed.dummy_microbatches(pad, lambda i, a, m: self.token_logprobs(i, a, m, temp),
                                       self.manual_backward, self.device, c.kl_coef > 0, self.policy.disable_adapter)
        for r in rows:
            mb = scoring.microbatch(step_data, tok_adv, r)  # [B, W] each
            ids, attn, m, restrict = mb["ids"], mb["attn"], mb["mask"], mb["restrict"]
            ref = None
            with phase("update/forward"):
                if c.kl_coef > 0:
                    with torch.no_grad(), self.policy.disable_adapter():
                        ref, _ = self.token_logprobs(ids, attn, m, temp, restrict=restrict)
                logp, ent = self.token_logprobs(ids, attn, m, temp, entropy=True, restrict=restrict)
            mb = correct.apply(mb, logp, r) if correct else mb
            part = microbatch_objective(mb, logp, ent, ref, totals, c, first_epoch)
            objective = part.objective
            if not torch.isfinite(objective):
                finite = False
                if not sharded:
                    break
                objective = objective.nan_to_num(0.0, 0.0, 0.0) * 0.0  # keep the backward collective; no update
            if sharded:  # FSDP averages gradients over ranks; the weights already are global shares
                objective = objective * self._world()[1]
            with distributed.no_sync(self.trainer.strategy.model if self._trainer is not None else None), \
                    phase("update/backward"):
                self.manual_backward(objective)
            stats.add(part)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if skipped:  # a skipped sample's gradient is an exact 0: the optimiser sees the same step (AdamW's momentum
            distributed.fill_missing_gradients(params)  # and weight decay move the weights when every sample was)
        norm = c.max_grad_norm if c.max_grad_norm is not None else float("inf")
        with phase("update/optimiser"):
            scaler = distributed.loss_scaler(self._trainer)  # 16-mixed: the gradients are still loss-scaled here
            finite, grad_norm = distributed.finish_gradients(self.policy, params, self.sharding, finite, norm, scaler)
            if not finite:  # under 16-mixed gradients past float16 are an overflow, while the scale can still fall
                overflow = scaler is not None and grad_norm is not None and scaler.get_scale() >= 1.0
                return self._skip_update(opt, params, scaler, overflow)
            self.consecutive_skips = 0
            opt.step()
        return {**stats.result(), "train/grad_norm": float(grad_norm), "train/update_skipped": 0.0}

    def _skip_update(self, opt, params: list, scaler, overflow: bool) -> dict[str, float]:
        """A non-finite loss or gradient: no parameter (or optimiser state) moves, the step still counts; after
        ``update.max_consecutive_skips`` in a row the run stops with a checkpoint and says why (the CLI exits 1).
        An ``overflow`` (16-mixed, scale ≥ 1: scaled gradients past float16) is the scaler's routine: not warned of."""
        self.skipped_updates += 1
        distributed.skip_optimiser_step(opt, params, scaler)  # a scaler's halves its scale
        if overflow:
            return {"train/update_skipped": 1.0}
        warnings.warn(f"step {self.rollouts_done + 1}: non-finite loss or gradient; update skipped "
                      f"({self.skipped_updates} skipped so far)", RuntimeWarning, stacklevel=2)
        self.consecutive_skips += 1
        limit = self.update_cfg.max_consecutive_skips
        if limit and self.consecutive_skips >= limit:
            self._stop_pending = limit
        return {"train/update_skipped": 1.0}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._stop_pending:  # saved at the step's end, its counters whole: a resume from it replays nothing
            self.stop_reason = stop_nonfinite(self.trainer, self._stop_pending, self.rollouts_done)
            self._stop_pending = 0

    # ------------------------------------------------------------------------------------------------------------------
    # validation (the callback plays the episodes; these hooks aggregate them)
    def on_validation_epoch_start(self) -> None:
        self.validation.reset()

    def validation_step(self, batch: data.EvalBatch, batch_idx):
        self.validation.add(batch.rollouts)

    def on_validation_epoch_end(self) -> None:
        modes = self.validation.merged(self.eval_cfg.modes, self._world()[1], self.device)
        # the optimiser steps the evaluated adapters had taken (validate restores no loop state: the checkpoint's)
        step = max(int(self.global_step), self._checkpoint_step)
        built = report.build_report(step, self._world()[1], self.eval_cfg.split, self.package_versions(), modes)
        if self.trainer.sanity_checking:  # a sanity check (trainer.num_sanity_val_steps) is not evaluation.before_fit
            # Lightning discards what a sanity check logs: the "before" validation goes to the loggers, at its step
            self.val_report_before = built if self.eval_cfg.before_fit else None
            for logger in self.trainer.loggers if self.eval_cfg.before_fit else []:
                logger.log_metrics(report.scalars(built), step=int(self.global_step))
            return
        self.val_report = built
        sync = distributed.process_group_up()  # the same values on every rank; unsynced, Lightning warns
        for key, value in report.scalars(self.val_report).items():
            self.log(key, value, on_epoch=True, batch_size=1, sync_dist=sync)
        self._log_at_global_step(step, on_epoch=True, sync_dist=sync)

    def _forget_last_step(self) -> None:
        """Lightning logs a key at every later step of its epoch (here the fit) with its last value: a number this step
        did not measure (no row to update: no loss) would repeat. Loggers get no point; callbacks keep the last."""
        if (results := getattr(self._trainer, "_results", None)) is not None:  # Lightning's own; a test checks it
            results.reset(metrics=False, fx="training_step")

    def _log_at_global_step(self, step: int | None = None, **kw) -> None:
        """The loggers' x-axis, logged as ``step``: optimiser steps taken (default ``global_step``; docs/metrics)."""
        self.log("step", float(self.global_step if step is None else step), prog_bar=False, batch_size=1, **kw)

    # ------------------------------------------------------------------------------------------------------------------
    # checkpoints: adapters (trainable parameters) only, plus the counters
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not strategies.writes_distributed_checkpoint(self.trainer.strategy):  # those keep the whole model
            checkpoint["state_dict"] = strategies.trainable_entries(checkpoint["state_dict"], self)  # adapters only
        checkpoint["sglightning"] = {**{k: getattr(self, k) for k in _COUNTERS},
                                     "trust_meter": self.trust.meter.state_dict(),
                                     "trust_horizon": None if self._trainer is None
                                     else self.trust.horizon(self.total_steps),
                                     "history": report.history_state(self.history),  # the fit summary's steps
                                     "val_report_before": report.plain(self.val_report_before)}
        # no config in the checkpoint: `validate --ckpt_path` uses the one given (LightningCLI would re-apply it)
        for key in ("hyper_parameters", "hparams_name"):
            checkpoint.pop(key, None)

    def adapter_state_dict(self, tree_names: bool = False) -> dict[str, torch.Tensor]:
        """The adapter as full CPU tensors on every rank (a collective under FSDP)."""
        return distributed.adapter_state_dict(self.policy, self.sharding, tree_names)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.sharding is None:  # a checkpoint of another model.policy: one line, not a wall of size mismatches
            check_shapes(checkpoint, dict(self.named_parameters()))
        state = checkpoint.get("sglightning", {})
        self._checkpoint_step = int(checkpoint.get("global_step", 0))
        for k in _COUNTERS:
            setattr(self, k, int(state.get(k, 0)))
        self.trust.meter.load_state_dict(state.get("trust_meter", {}))
        if self._trainer is None or self.trainer.state.fn != "fit":
            return  # validate needs neither the run's history nor the trust horizon
        self.history = report.history_from_state(state.get("history"))  # a resumed fit's summary covers every step
        self.val_report_before = state.get("val_report_before", self.val_report_before)
        line = None if (h := state.get("trust_horizon")) is None else self.trust.restore(h, self.total_steps())
        if line and self.trainer.global_rank == 0:
            print(f"sglightning: {line}", file=sys.stderr, flush=True)
