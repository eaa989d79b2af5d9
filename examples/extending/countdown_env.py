"""A new environment in one file: count a number down to zero.

PYTHONPATH=examples/extending sglightning fit --config configs/tiny.yaml --config examples/extending/config.yaml
"""

from __future__ import annotations

from sglightning.envs import ResetResult, StepResult, TextEnv


class CountdownEnv(TextEnv):
    """Start at n (1..max_start, from the seed); 'subtract one' brings it closer, 'add one' moves away; reaching 0
    wins."""

    name = "countdown"
    splits = ("train", "dev")
    action_help = "Answer with one of the admissible actions."

    def __init__(self, max_start: int = 3):
        self.max_start = max_start
        self.n = 0

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        if split not in self.splits:
            raise ValueError(f"countdown: unknown split {split!r}")
        self.n = 1 + seed % self.max_start  # the rollout chooses the seed: every group member gets the same task
        return ResetResult(f"The number is {self.n}.", "bring the number to 0", self._actions(), "countdown",
                           score=0.0)

    def step(self, action: str) -> StepResult:
        if action not in self._actions():
            return StepResult(f"Nothing happens. The number is {self.n}.", 0.0, False, invalid_action=True,
                              admissible_actions=self._actions())
        self.n += -1 if action == "subtract one" else 1
        won = self.n == 0
        return StepResult(f"The number is {self.n}.", float(won), won, won, score=100.0 * won,
                          admissible_actions=self._actions())

    @staticmethod
    def _actions() -> list[str]:
        return ["subtract one", "add one"]

    def expert_action(self) -> str | None:
        return "subtract one" if self.n > 0 else None
