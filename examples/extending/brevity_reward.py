"""A new reward term in one file: a bonus for solving a task in few steps."""

from __future__ import annotations

from sglightning.episodes import Episode
from sglightning.rewards import RewardTerm


class BrevityBonus(RewardTerm):
    """``(1 − steps / max_steps)`` for a won episode, 0 otherwise (times ``weight``)."""

    name = "brevity"

    def __init__(self, weight: float = 1.0, max_steps: int = 8):
        super().__init__(weight)
        self.max_steps = max_steps

    def value(self, episode: Episode) -> float:
        return max(0.0, 1.0 - len(episode.steps) / self.max_steps) if episode.won else 0.0
