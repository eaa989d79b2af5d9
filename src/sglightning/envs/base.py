"""The text-environment protocol every benchmark adapter implements.

An environment is a plain Python object; the rollout owns episode bookkeeping (step limits, invalid-action penalties,
group seeding) so adapters stay thin.  Contract:

* ``reset(seed, split)`` starts the task identified by ``(split, seed)``.  The *rollout* chooses the seed and passes the
  same value to every member of a GRPO group (the group's shared baseline needs one task): an environment must never
  draw its own task inside ``reset``.  ``split`` is ``"train"`` for training rollouts and the evaluation split
  (``evaluation.split``, e.g. ``"dev"``, ``"valid_seen"``, ``"test"``) for validation; an env maps any integer seed
  into that split's task set (e.g. ``seed % len(variations)``) and raises ``ValueError`` for a split it does not have.
  Envs whose ``reset`` takes no ``split`` argument still work for training (seed only).
* ``step(action)`` takes the raw action text (already extracted from the model's output).  An action the environment
  cannot execute is not an error: it returns the environment's usual "nothing happens" observation with
  ``invalid_action=True``.
* ``close()`` releases processes/threads; environments are context managers.
"""

from __future__ import annotations

import abc
import functools
import importlib.metadata
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ResetResult:
    observation: str  # first observation shown to the agent (may repeat the task)
    task: str  # the goal in words, e.g. "put a clean apple in fridge"
    admissible_actions: list[str] | None = None  # None when the env has no list (free-form actions)
    task_type: str = "default"  # e.g. "pick_and_place"; used for per-type success
    #: conventional keys: "target_objects" (list of object names the task is about; enables the wrong-object-focus
    #: failure pattern), "task_id" (a stable name of the task instance), "gold_path_length"
    info: dict[str, Any] = field(default_factory=dict)
    #: per-task action help (e.g. ScienceWorld's grammar + room list); None = the env's ``action_help``
    action_help: str | None = None
    #: the env's 0-100 score at the start, where it has one (ScienceWorld starts some tasks above 0): the first
    #: action's progress is measured against it (left None, that action's progress is unknown), and episodes report
    #: the score gained from here beside the raw final score
    score: float | None = None


@dataclass
class StepResult:
    observation: str
    reward: float  # environment reward of this step (sparse envs: 1.0 on success, else 0.0)
    done: bool  # the episode ended (success, failure or the env's own limit)
    won: bool = False  # task solved
    score: float | None = None  # 0-100 progress score where the env has one
    admissible_actions: list[str] | None = None
    invalid_action: bool = False  # the action was malformed or not executable
    #: conventional keys: "truncated" (True: the env's own step limit ended the episode; counted in
    #: ``rollout/truncated_rate``), "command" (the admissible command the env ran for an alias it accepts)
    info: dict[str, Any] = field(default_factory=dict)
    #: how much closer to the goal this step brought the agent (> 0 closer, 0 no change, < 0 farther; e.g. the fall
    #: of an expert's distance-to-goal), where the env can tell; None = unknown (the rollout then uses the change of
    #: ``score`` where the env has one).  Used to measure whether the guidance labels describe progress
    progress: float | None = None


def installed_versions(dists: Iterable[str]) -> dict[str, str]:
    """``{distribution: version}`` for those of ``dists`` that are installed."""
    out = {}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class TextEnv(abc.ABC):
    """Base class of all environments (subclass it and name the subclass as ``model.env.class_path``)."""

    #: short name (reports, logs)
    name: str = "env"
    #: the splits ``reset`` accepts
    splits: tuple[str, ...] = ("train", "dev", "test")
    #: the action format the actor prompt should describe (one line of help text)
    action_help: str = "Answer with exactly one of the admissible actions."
    #: play each instance in a process of its own unless ``rollout.env_processes`` says otherwise: right for a
    #: pure-Python simulator that holds the GIL or can hang (:mod:`sglightning.envs.process`)
    own_process: bool = False

    @abc.abstractmethod
    def reset(self, seed: int, split: str = "train") -> ResetResult: ...

    @abc.abstractmethod
    def step(self, action: str) -> StepResult: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (processes, files). Safe to call twice."""

    #: distributions this env runs on; their installed versions are recorded in the run's config and reports
    packages: tuple[str, ...] = ()

    @classmethod
    def package_versions(cls) -> dict[str, str]:
        """Installed versions of :attr:`packages` (recorded in the run's config and reports)."""
        return installed_versions(cls.packages)

    def expert_action(self) -> str | None:
        """The next action of an expert solver from the current state, or None when the env has none."""
        return None

    def __enter__(self) -> TextEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def _accepts_split(env_type: type) -> bool:
    """Whether ``env_type.reset`` takes ``split`` (asked once per class, not on every reset)."""
    try:
        params = inspect.signature(env_type.reset).parameters
    except (TypeError, ValueError):
        return True
    return "split" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def reset_in_split(env: TextEnv, seed: int, split: str) -> ResetResult:
    """``env.reset(seed, split=split)``; an env written before splits existed (``reset(seed)``) plays ``train`` only.

    Args:
        env: the environment.
        seed: the task seed.
        split: the split to draw the task from.
    """
    if _accepts_split(type(env)):
        return env.reset(seed, split=split)
    if split == "train":
        return env.reset(seed)
    raise ValueError(f"{type(env).__name__}.reset takes no split argument, so it cannot play split {split!r}")
