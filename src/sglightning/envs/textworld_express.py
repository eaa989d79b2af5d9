"""TextWorldExpress (``textworld-express==1.1.0``, Java 17): fast, real text games — the default place to run learning
experiments on a CPU.

Install: ``pip install "sglightning[twx]"`` (the wheel ships its jar; needs a Java 17 runtime on ``PATH``).

* Games: ``twc`` (TextWorld Commonsense: put household objects where they belong; the ALFWorld-like one), ``coin``,
  ``cookingworld``, ``mapreader``, ``arithmetic``, ``sorting``, ``simonsays``, ``peckingorder``; ``game_params``
  is the simulator's parameter string (e.g. ``numLocations=3,numItemsToPutAway=3,includeDoors=0,limitInventorySize=0``).
* Splits map to the simulator's seed folds: ``train`` → its train seeds (0…999), ``dev`` → 10000…, ``test`` → 20000….
  ``reset(seed, split)`` plays fold seed ``seeds[seed % len(seeds)]``: every integer is valid and the same (seed,
  split) is the same game.
* Admissible actions come back with every step (``validActions``); the simulator's "Unknown action" answer and any
  action outside the list count as invalid.
* Score: the simulator's normalised score × 100, reported at reset too (so the first action's progress is measured);
  success = ``tasksuccess``; reward = 1.0 on the winning step (the simulator's own reward is a score delta that is 0 on
  the last step of some games, so success is the sparse reward).
* One JVM per env instance (≈100–200 MB); ``close()`` ends it.  The simulator's own step limit is set above the
  rollout's ``max_steps`` so the rollout, not the simulator, ends episodes.
* ``expert_action()`` follows the simulator's gold path while the agent has followed it too.
"""

from __future__ import annotations

from sglightning.envs.base import ResetResult, StepResult
from sglightning.envs.jvm import JvmGoldPathEnv

GAMES = ("cookingworld", "twc", "coin", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder")
DEFAULT_PARAMS = {
    "twc": "numLocations=3,numItemsToPutAway=3,includeDoors=0,limitInventorySize=0",
    "coin": "numLocations=5,numDistractorItems=2,includeDoors=1,limitInventorySize=0",
}
_UNKNOWN = "unknown action"


def _require_twx():
    try:
        from textworld_express import TextWorldExpressEnv
    except ImportError as err:
        raise ValueError(
            f"env: TextWorldExpress is not installed ({err}); install the extra: pip install \"sglightning[twx]\" "
            "(textworld-express==1.1.0, needs a Java 17 runtime)"
        ) from err
    return TextWorldExpressEnv


def _score(info: dict) -> float:
    """The simulator's normalised score as 0-100 (never below 0)."""
    return 100.0 * max(0.0, float(info.get("score", 0.0)))


class TextWorldExpressEnv(JvmGoldPathEnv):
    name = "twx"
    packages = ("textworld-express",)
    action_help = "Answer with exactly one of the admissible actions."
    splits = ("train", "dev", "test")

    def __init__(self, game: str = "twc", game_params: str | None = None, env_step_limit: int = 1000):
        """One TextWorldExpress game (its Java simulator).

        Args:
            game: one of cookingworld, twc, coin, mapreader, arithmetic, sorting, simonsays, peckingorder.
            game_params: the simulator's parameter string (default: a small setting for twc and coin, the simulator's
                defaults otherwise).
            env_step_limit: the simulator's own limit (keep it above ``rollout.max_steps``).
        """
        if game not in GAMES:
            raise ValueError(f"env.init_args.game: {game!r} is not one of {', '.join(GAMES)}")
        if env_step_limit < 1:
            raise ValueError(f"env.init_args.env_step_limit: must be >= 1, got {env_step_limit}")
        game_params = DEFAULT_PARAMS.get(game, "") if game_params is None else game_params
        items = [s.strip() for s in str(game_params).split(",") if s.strip()]
        for item in items:
            key, _, value = item.partition("=")
            if not key.strip() or not value.strip().lstrip("-").isdigit():  # the simulator then plays no game at all
                raise ValueError(f"env.init_args.game_params: {item!r} is not key=integer (e.g. numLocations=3)")
        game_params = ",".join("=".join(part.strip() for part in item.partition("=")[::2]) for item in items)
        cls = _require_twx()
        super().__init__()
        self.game = game
        self.game_params = game_params
        self._env = cls(envStepLimit=env_step_limit)
        self._seeds = {
            "train": list(self._env.getValidSeedsTrain()),
            "dev": list(self._env.getValidSeedsDev()),
            "test": list(self._env.getValidSeedsTest()),
        }
        self._valid: list[str] = []

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        if split not in self._seeds:
            raise ValueError(f"twx: unknown split {split!r}; allowed: {', '.join(self.splits)}")
        fold = self._seeds[split]
        game_seed = int(fold[int(seed) % len(fold)])
        try:
            obs, info = self._env.reset(
                seed=game_seed, gameFold=split, gameName=self.game, gameParams=self.game_params, generateGoldPath=True
            )
        except ValueError as err:  # the simulator refused a parameter: say which key
            raise ValueError(f"env.init_args.game_params: {self.game_params!r}: {' '.join(str(err).split())}") from None
        gold = list(self._env.getGoldActionSequence())
        if gold and gold[0] == "look around":
            gold = gold[1:]  # the simulator's gold path starts with the look that reset already did
        self._start_episode(gold)
        self._valid = sorted(info.get("validActions", []))
        task = str(info.get("taskDescription", "")).strip()
        goal = task.removeprefix("Your task is to ").rstrip(".") or task
        return ResetResult(
            observation=f"{obs.strip()}\n{task}",
            task=goal,
            admissible_actions=list(self._valid),
            task_type=self.game,
            info={"task_id": f"{self.game}/{split}/{game_seed}", "game_seed": game_seed,
                  "gold_path_length": len(self._gold)},
            score=_score(info),  # the starting score: the first action's progress is measured against it
        )

    def step(self, action: str) -> StepResult:
        action = " ".join(str(action).split())
        invalid = action not in self._valid
        self._count_step(action)
        obs, _reward, done, info = self._env.step(action)
        invalid = invalid or _UNKNOWN in str(obs).lower()
        self._valid = sorted(info.get("validActions", []))
        won = bool(info.get("tasksuccess", False))
        done = bool(done) or won or bool(info.get("taskfailure", False))
        return StepResult(
            observation=str(obs).strip(),
            reward=1.0 if won else 0.0,
            done=done,
            won=won,
            score=_score(info),
            admissible_actions=list(self._valid),
            invalid_action=invalid,
            info={"moves": info.get("numMoves")},
        )
