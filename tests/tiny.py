"""The tiny module and trainer the tests train (the one place they are defined): a randomly initialised
``embedded:tiny`` policy with LoRA on the easiest household tasks, and a Lightning Trainer that writes nothing."""

from __future__ import annotations

import functools

import torch
from lightning.pytorch import Trainer

from sglightning.data import EvalConfig, RolloutConfig
from sglightning.envs.household import HouseholdEnv
from sglightning.grpo import GRPOConfig
from sglightning.guidance import GuidanceConfig
from sglightning.models import PolicyConfig
from sglightning.module import SelfGuideModule
from sglightning.rollout import Rollout
from sglightning.update import UpdateConfig


def tiny_module(**over) -> SelfGuideModule:
    """A :class:`SelfGuideModule` on ``embedded:tiny``: 2 groups × 2 episodes × 2 env steps, admissible actions, a
    KL term, micro-batches of 2.  ``over`` replaces any constructor argument (a whole config)."""
    kw = dict(
        policy=PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8),
        env=functools.partial(HouseholdEnv, difficulty=0, info_actions=False),
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_steps=2),
        guidance=GuidanceConfig(action_decoding="admissible", max_guidance_tokens=4, max_action_tokens=4),
        grpo=GRPOConfig(kl_coef=0.01),
        update=UpdateConfig(micro_batch_size=2),
        evaluation=EvalConfig(num_tasks=2, tasks_per_batch=2),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    kw.update(over)
    return SelfGuideModule(**kw)


def tiny_trainer(tmp_path, steps: int = 2, **kw) -> Trainer:
    """A CPU Trainer for ``steps`` steps: no logger, checkpoints, progress bar or validation unless ``kw`` says so."""
    args = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path)
    args.update(kw)
    return Trainer(**args)


def rollout(module: SelfGuideModule) -> Rollout:
    """The rollout the module's rollout callback would play (call ``module.configure_model()`` first)."""
    return module.rollout_callback().rollout_for(module)
