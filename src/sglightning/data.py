"""What the Trainer iterates, and where each step's episodes come from (no model in here): the configs of the training
episodes (:class:`RolloutConfig`) and of the evaluation episodes (:class:`EvalConfig`), the batches the loaders yield,
task seeds and sampling generators.

Data flows one way, visibly: the train loader yields one :class:`StepBatch` per GRPO step;
:class:`~sglightning.callbacks.RolloutCallback` plays that step's episodes and puts them on the batch
(``batch.rollout``) in ``on_train_batch_start``; ``training_step`` consumes them.  Validation likewise: the val loader
yields this rank's :class:`EvalBatch` es of evaluation seeds, the callback fills ``batch.rollouts`` (one
:class:`~sglightning.episodes.RolloutBatch` per self-guidance mode) and ``validation_step`` consumes them.

Task seeds and sampling generators are pure functions of (``rollout.seed``, step, rank): a resumed run replays exactly
the steps it would have played.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from sglightning.episodes import RolloutBatch
from sglightning.errors import check_number
from sglightning.traits import drops_out


@dataclass
class RolloutConfig:
    """Training episodes: how many per step, from which tasks, how they are played."""

    groups_per_step: int = 2
    """task groups per training step (N); each group is G episodes of one task seed"""
    group_size: int = 4
    """episodes per group (G); GRPO needs >= 2"""
    max_steps: int = 8
    """environment steps per episode"""
    temperature: float = 1.0
    """sampling temperature of training rollouts (the trainer scores tokens at the same temperature)"""
    top_k: int = 0
    """sample among the k most likely tokens only (0 = off); the set is recorded and scored like any restriction"""
    max_context_tokens: int = 4096
    """context cap: a single-stream episode that would grow past it is truncated (counted); two_call prompts drop
    their oldest steps to fit (counted)"""
    reuse_prefix: bool = True
    """two_call: each call keeps its KV cache across env steps, so a row computes only what its new prompt adds (two
    caches held)"""
    seed: int = 0
    """base of all randomness (task seeds, sampling)"""
    split: str = "train"
    """the env split training tasks come from"""
    env_step_timeout_s: float | None = 60.0
    """an env step slower than this fails its episode (seconds; null = wait forever)"""
    env_reset_timeout_s: float | None = 300.0
    """the same for creating an env + ``reset`` (JVM start, task loading)"""
    env_parallel: bool = True
    """step the envs of all live episodes concurrently (one worker thread + env per episode slot); false = serially,
    with no env timeouts"""
    env_processes: bool | None = None
    """one process per env slot (a hung env is killed; GIL-bound envs step in parallel); null: the env's choice
    (ALFWorld: yes)"""
    failed_episodes: Literal["keep", "drop_group"] = "keep"
    """a group with an episode the env failed: keep trains on it (the failed episode keeps the return it reached);
    drop_group leaves the group out"""
    dynamic_sampling_rounds: int = 0
    """DAPO's dynamic sampling: up to this many extra rounds of new tasks, adding groups whose returns differ until
    groups_per_step are informative; 0 = off"""
    env_max_concurrency: int = 0
    """env calls running at once; 0 = the number of CPU cores (right for CPU-bound envs); raise it for envs that mostly
    wait (remote servers)"""

    @property
    def drops_failed_groups(self) -> bool:
        """``failed_episodes`` is ``drop_group``: a group with an episode the env failed is left out of the update."""
        return self.failed_episodes == "drop_group"

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size: must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.groups_per_step < 1:
            raise ValueError(f"rollout.groups_per_step: must be >= 1, got {self.groups_per_step}")
        if self.max_steps < 1:
            raise ValueError(f"rollout.max_steps: must be >= 1, got {self.max_steps}")
        check_number("rollout.temperature", self.temperature, 0, strict=True)
        if self.max_context_tokens < 64:
            raise ValueError(f"rollout.max_context_tokens: must be >= 64, got {self.max_context_tokens}")
        if self.failed_episodes not in ("keep", "drop_group"):
            raise ValueError(f"rollout.failed_episodes: {self.failed_episodes!r} is not one of keep, drop_group")
        if self.dynamic_sampling_rounds < 0:
            raise ValueError(f"rollout.dynamic_sampling_rounds: must be >= 0, got {self.dynamic_sampling_rounds}")
        if self.env_max_concurrency < 0:
            raise ValueError(
                f"rollout.env_max_concurrency: must be >= 0 (0 = CPU cores), got {self.env_max_concurrency}")
        for key in ("env_step_timeout_s", "env_reset_timeout_s"):  # null: no timeout
            check_number(f"rollout.{key}", getattr(self, key), 0, strict=True, null=True)


@dataclass
class EvalConfig:
    """``validate`` (and validation during fit): a fixed, seeded set of evaluation episodes."""

    num_tasks: int = 16
    """evaluation tasks (seeds ``seed_offset + i``); every one is played in every guidance mode"""
    episodes_per_task: int = 1
    """episodes per task; above 1 the report adds pass@k, the share of tasks solved within k tries"""
    tasks_per_batch: int = 16
    """tasks per validation batch (all their episodes are played in lock-step)"""
    temperature: float = 0.4
    """sampling temperature of evaluation episodes (the paper: 0.4)"""
    self_guidance: Literal["on", "off", "both"] = "both"
    """on, off or both (side by side on the same episodes)"""
    seed_offset: int = 1_000_000
    """evaluation task seeds are ``seed_offset + i`` (disjoint from training seeds, which are < seed_offset)"""
    seed: int = 0
    """seed of the evaluation episodes' sampling, not rollout.seed: runs trained with different seeds are validated on
    the same tasks and draws"""
    split: str = "dev"
    """the env split evaluated (e.g. dev/test; ALFWorld: valid_seen/valid_unseen)"""
    before_fit: bool = False
    """fit: also validate before the first step (on a resume, the resumed adapters), to show before and after training;
    costs one more validation"""

    def __post_init__(self) -> None:
        if self.self_guidance not in ("on", "off", "both"):
            raise ValueError(f"evaluation.self_guidance: {self.self_guidance!r} is not one of on, off, both")
        for key in ("num_tasks", "episodes_per_task", "tasks_per_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"evaluation.{key}: must be >= 1, got {getattr(self, key)}")
        check_number("evaluation.temperature", self.temperature, 0, strict=True)

    @property
    def modes(self) -> list[str]:
        """The self-guidance modes played: ``sg`` (on) and/or ``nosg`` (off)."""
        return {"on": ["sg"], "off": ["nosg"], "both": ["sg", "nosg"]}[self.self_guidance]


class StepBatch:
    """One GRPO step: its index in the loader's pass, and the rollout the callback collects for it."""

    __slots__ = ("index", "rollout")

    def __init__(self, index: int):
        self.index = index
        self.rollout: RolloutBatch | None = None


class EvalBatch:
    """Evaluation task seeds, and the rollouts the callback plays on them per mode (``sg`` / ``nosg``)."""

    __slots__ = ("seeds", "rollouts")

    def __init__(self, seeds: list[int]):
        self.seeds = list(seeds)
        self.rollouts: dict[str, RolloutBatch] = {}


class _Batches(IterableDataset):
    """A fixed list as an iterable dataset (Lightning leaves iterables alone under DDP: no sampler, no padding);
    each pass makes fresh batch objects."""

    def __init__(self, items: list, make):
        self.items, self.make = items, make

    def __iter__(self):
        return (self.make(x) for x in self.items)

    def __len__(self) -> int:
        return len(self.items)


class _StepLoader(DataLoader):
    """The train loader's items are only a step clock: what a step plays comes from the module's ``rollouts_done``
    (restored from the checkpoint), so resuming mid-epoch needs no loader state.  Declaring that (``state_dict``)
    tells Lightning the loader is resumable."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


def _identity(x):
    return x


def train_loader(total_steps: int) -> DataLoader:
    """One :class:`StepBatch` per step.  An iterable (not a map-style dataset), so Lightning adds no
    DistributedSampler: every rank walks all steps and collects its own share of groups at each."""
    return _StepLoader(_Batches(list(range(total_steps)), StepBatch), batch_size=None, collate_fn=_identity)


def val_loader(num_tasks: int, seed_offset: int, tasks_per_batch: int, rank: int, world: int) -> DataLoader:
    """This rank's share of the evaluation seeds (``seed_offset + i``; chunks ``rank::world``): every episode is
    played exactly once across ranks, with no DistributedSampler padding; ranks get equally many batches (empty ones
    pad), since under FSDP every rollout is a collective."""
    seeds = [seed_offset + i for i in range(num_tasks)]
    chunks = [seeds[i : i + tasks_per_batch] for i in range(0, len(seeds), tasks_per_batch)]
    mine = chunks[rank::world]
    mine += [[]] * (-(-len(chunks) // world) - len(mine))
    return DataLoader(_Batches(mine, EvalBatch), batch_size=None, collate_fn=_identity)


def task_seeds(seed: int, step: int, groups_per_step: int, rank: int, world: int, seed_offset: int) -> list[int]:
    """This rank's training task seeds at ``step``: ``world × groups_per_step`` distinct seeds below ``seed_offset``
    (the evaluation seeds start there) drawn from a pure function of (seed, step) — disjoint across ranks,
    reproducible on resume — sliced by rank."""
    rng = random.Random(seed * 1_000_003 + step)
    seeds = rng.sample(range(seed_offset), world * groups_per_step)
    return seeds[rank * groups_per_step : (rank + 1) * groups_per_step]


def sampling_generator(seed: int, step: int, rank: int, salt: int = 0, *, device: torch.device | str
                       ) -> torch.Generator:
    """The sampling generator of (seed, step, rank, salt), on ``device`` (the model's: torch draws on CUDA tensors
    only with a CUDA generator, so every caller names it)."""
    return torch.Generator(device=torch.device(device)).manual_seed(_seed_of(seed, step, rank, salt))


def _seed_of(seed: int, step: int, rank: int, salt: int) -> int:
    return seed * 7_919 + step * 104_729 + salt + rank * 15_485_863


@contextlib.contextmanager
def seeded_dropout(model: torch.nn.Module, seed: int, step: int, rank: int, device: torch.device) -> Iterator[None]:
    """Inside: torch's global generators (the CPU's, ``device``'s) seeded from (seed, step, rank), as the sampling
    generators are; after: their earlier states back.  Dropout draws its masks there, so a resumed run's update
    draws a straight run's masks, and nothing else sees a change.

    Args:
        model: the policy; without dropout (:func:`sglightning.traits.drops_out`) nothing is done.
        seed: ``rollout.seed``.
        step: the optimiser steps taken (``global_step``: GRPO steps × ``grpo.ppo_epochs``).
        rank: this process's rank.
        device: the model's device.
    """
    if not drops_out(model):
        yield
        return
    value = _seed_of(seed, step, rank, salt=1)  # salt 1 at a training step: no sampling generator's value
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.default_generator.manual_seed(value)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(value)  # this device's only
        yield
