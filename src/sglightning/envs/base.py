"""The text-environment protocol every benchmark adapter implements.

An environment is a plain Python object; the rollout owns episode bookkeeping (step limits, invalid-action penalties,
group seeding) so adapters stay thin.  Contract:

* ``reset(seed)`` starts the task identified by ``seed``.  The *rollout* chooses the seed and passes the same value to
  every member of a GRPO group (pitfalls §4): an environment must never draw its own task inside ``reset``.
* ``step(action)`` takes the raw action text (already extracted from the model's output).  An action the environment
  cannot execute is not an error: it returns the environment's usual "nothing happens" observation with
  ``invalid_action=True``.
* ``close()`` releases processes/threads; environments are context managers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ResetResult:
    observation: str  # first observation shown to the agent (may repeat the task)
    task: str  # the goal in words, e.g. "put a clean apple in fridge"
    admissible_actions: list[str] | None = None  # None when the env has no list (free-form actions)
    task_type: str = "default"  # e.g. "pick_and_place"; used for per-type success
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    observation: str
    reward: float  # environment reward of this step (sparse envs: 1.0 on success, else 0.0)
    done: bool  # the episode ended (success, failure or the env's own limit)
    won: bool = False  # task solved
    score: float | None = None  # 0-100 progress score where the env has one
    admissible_actions: list[str] | None = None
    invalid_action: bool = False  # the action was malformed or not executable
    info: dict[str, Any] = field(default_factory=dict)


class TextEnv(abc.ABC):
    """Base class of all environments (subclass it and register with :func:`sglightning.envs.register_env`)."""

    #: short name used in configs and metrics
    name: str = "env"
    #: the action format the actor prompt should describe (one line of help text)
    action_help: str = "Answer with exactly one of the admissible actions."

    @abc.abstractmethod
    def reset(self, seed: int) -> ResetResult: ...

    @abc.abstractmethod
    def step(self, action: str) -> StepResult: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (processes, files). Safe to call twice."""

    def expert_action(self) -> str | None:
        """The next action of an expert solver from the current state, or None when the env has none."""
        return None

    def __enter__(self) -> TextEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
