"""The optimiser and its learning-rate schedule: built from the config, checked before a run starts, and put back to
the config's settings on a resume (no Lightning here; the module and a callback call these).

The schedule steps once an optimiser step, skipped updates included, so the rate at optimiser step k is the schedule's
k-th value whatever happened before.  A resume restores the schedule's progress from the checkpoint; a changed base
rate in the config moves the whole schedule (the rate now is the new base times the schedule's factor now).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from sglightning.errors import ConfigError

#: the optimiser settings a resume takes from the config rather than the checkpoint (the moments stay the checkpoint's)
SETTINGS = ("lr", "weight_decay", "betas", "eps", "momentum", "alpha", "dampening")


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW at lr 1e-5, used when the config names no ``model.optimizer``."""
    return torch.optim.AdamW(params, lr=1e-5)


def check(optimizer: Callable, lr_scheduler: Callable | None) -> None:
    """Build both on a dummy parameter: ``ConfigError`` naming ``model.optimizer`` or ``model.lr_scheduler`` when
    one cannot be built, or when the schedule needs a metric to step (``ReduceLROnPlateau``).

    Args:
        optimizer: the optimiser factory (parameters → optimiser).
        lr_scheduler: the schedule factory (optimiser → schedule), or None for a constant rate.
    """
    try:
        opt = optimizer([torch.nn.Parameter(torch.zeros(1))])
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.optimizer: {err}") from None
    if lr_scheduler is None:
        return
    try:
        schedule = lr_scheduler(opt)
    except (TypeError, ValueError, KeyError) as err:
        raise ConfigError(f"model.lr_scheduler: {err}") from None
    if isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError("model.lr_scheduler: ReduceLROnPlateau steps on a metric; a learning-rate schedule here "
                          "steps once an optimiser step (e.g. LinearLR for a warm-up, CosineAnnealingLR)")


def configure(params: list[torch.nn.Parameter], optimizer: Callable, lr_scheduler: Callable | None) -> Any:
    """What ``LightningModule.configure_optimizers`` returns: the optimiser, and its schedule stepped a step.

    Args:
        params: the trainable parameters (the adapters).
        optimizer: the optimiser factory.
        lr_scheduler: the schedule factory, or None.
    """
    opt = optimizer(params)
    if lr_scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": lr_scheduler(opt), "interval": "step"}}


def take_config_settings(optimizers: Sequence[torch.optim.Optimizer], schedules: Sequence[Any],
                         wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """On a resume, give the restored optimisers the config's settings; returns ``{key: (checkpoint's, config's)}``
    for each setting that changed.  Torch's ``load_state_dict`` puts back the checkpoint's.

    Under a schedule the base rate is compared, not the scheduled one: the schedule keeps its progress and its
    factor, and a new base rate scales the rate now and the schedule's base alike.  A schedule the checkpoint did
    not have starts now; one it had and the config has not ends, and the config's rate applies.

    Args:
        optimizers: the optimisers the checkpoint restored.
        schedules: their schedules (restored too), possibly none.
        wanted: the config's settings (a fresh optimiser's ``defaults``).
    """
    changed: dict[str, tuple[Any, Any]] = {}
    groups = [g for opt in optimizers for g in opt.param_groups]
    if not schedules and any("initial_lr" in g for g in groups):  # the checkpoint's schedule is not the config's
        changed["lr_scheduler"] = ("LRScheduler", "none")
        for group in groups:
            group.pop("initial_lr")  # the rate is compared and set as a constant one below
    for schedule in schedules:
        if hasattr(schedule, "get_last_lr") and any("initial_lr" not in g for g in schedule.optimizer.param_groups):
            # the checkpoint ran without one: the schedule starts now, from the rate it set when it was made
            changed["lr_scheduler"] = ("none", type(schedule).__name__)
            for group, base, last in zip(schedule.optimizer.param_groups, schedule.base_lrs, schedule.get_last_lr()):
                group["initial_lr"], group["lr"] = base, last
    for opt in optimizers:
        for group in opt.param_groups:
            for key in SETTINGS:
                if key not in wanted or key not in group:
                    continue
                scheduled = key == "lr" and "initial_lr" in group  # a schedule set it: the base is initial_lr
                now = group["initial_lr"] if scheduled else group[key]
                if now == wanted[key]:
                    continue
                changed[key] = (now, wanted[key])
                if scheduled:
                    group["lr"] = group["lr"] * wanted["lr"] / now
                    group["initial_lr"] = wanted["lr"]
                else:
                    group[key] = wanted[key]
    for schedule in schedules:
        if hasattr(schedule, "base_lrs"):
            schedule.base_lrs = [g.get("initial_lr", g["lr"]) for g in schedule.optimizer.param_groups]
    return changed
