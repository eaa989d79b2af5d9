"""ScienceWorld (``scienceworld==1.2.3``, Java 17): 30 elementary-science tasks, free-form actions, score 0–100.

Install: ``pip install "sglightning[scienceworld]"`` (the wheel ships its jar; needs a Java 17 runtime on ``PATH``).

* Tasks: the 30 ScienceWorld tasks (``task_names`` restricts them; see :data:`TASK_NAMES`).  Each task has train / dev /
  test variations.  ``reset(seed, split)`` plays task ``tasks[seed % n_tasks]``, variation
  ``variations[(seed // n_tasks) % n_variations]`` of ``split`` — every integer is valid, and the same
  (seed, split) is the same episode.
* Actions are free-form (there are often > 100 valid ones, as the paper notes): ``admissible_actions`` is ``None`` and
  the actor prompt gets the action grammar and the room list (``ResetResult.action_help``) instead.
* Fast stepping: the package's ``env.step`` rebuilds a dict with the full valid-action list on every call
  (22–78 ms here); we call the simulator directly (``server.step`` + score + completion, ~10× faster) because the
  list is never shown to the agent.
* Score = the simulator's 0–100 score (negative = task failed, e.g. focusing on the wrong object; reported as 0);
  success = the task completed with score 100; reward = 1.0 on the winning step (sparse, like the paper).  Some
  variations start above 0 (50, 8, 7 on dev variations seen here): the reset reports that score
  (``ResetResult.score``) and episodes report the score *gained* (``rollout/score_gained``) beside the raw one.
  ``info["score_delta"]`` keeps the dense score change.
* The package's default ``envStepLimit=100`` would force completion mid-episode; we set it far above any
  ``rollout.max_steps`` so the rollout decides when an episode ends.
* One JVM per env instance (≈190 MB); ``close()`` ends it.
* ``gold_path=True`` asks the simulator for its gold action sequence at every load (+1–2 s per load) and enables
  ``expert_action()`` while the agent follows it (tests, sanity checks).
* Invalid actions: the simulator's "No known action matches that input." / "Unknown action." answers.  An ambiguous
  action gets ScienceWorld's numbered disambiguation question; the agent answers it with the number (a valid step).
"""

from __future__ import annotations

from sglightning.envs.base import ResetResult, StepResult
from sglightning.envs.jvm import JvmGoldPathEnv

TASK_NAMES = (
    "boil", "change-the-state-of-matter-of", "chemistry-mix", "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color", "find-animal", "find-living-thing", "find-non-living-thing", "find-plant",
    "freeze", "grow-fruit", "grow-plant", "identify-life-stages-1", "identify-life-stages-2",
    "inclined-plane-determine-angle", "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces", "lifespan-longest-lived", "lifespan-longest-lived-then-shortest-lived",
    "lifespan-shortest-lived", "measure-melting-point-known-substance", "measure-melting-point-unknown-substance",
    "melt", "mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant", "power-component",
    "power-component-renewable-vs-nonrenewable-energy", "test-conductivity", "test-conductivity-of-unknown-substances",
    "use-thermometer",
)
ROOMS = ("kitchen", "bathroom", "workshop", "art studio", "greenhouse", "outside", "foundry", "bedroom", "living room",
         "hallway")

ACTION_GRAMMAR = """\
Write one action in words (OBJ = an object or place you can see; use the names from the observations):
look around | look at OBJ | look in OBJ | inventory | task (repeat the task)
go to ROOM (through an open door) | open OBJ | close OBJ
pick up OBJ | put down OBJ | move OBJ to OBJ | pour OBJ in OBJ | dunk OBJ in OBJ | mix OBJ
activate OBJ | deactivate OBJ | use OBJ on OBJ | connect OBJ to OBJ | disconnect OBJ
eat OBJ | flush OBJ | read OBJ | wait (10 steps) | wait1 (1 step)
focus on OBJ (declares the object your task is about: focusing on the wrong object fails the task)
If asked to choose between numbered options, answer with the number only."""

_INVALID = ("no known action matches that input", "unknown action")


def _require_scienceworld():
    try:
        from scienceworld import ScienceWorldEnv as _SW
    except ImportError as err:
        raise ValueError(
            f"env: ScienceWorld is not installed ({err}); install the extra: pip install \"sglightning[scienceworld]\" "
            "(scienceworld==1.2.3, needs a Java 17 runtime)"
        ) from err
    return _SW


class ScienceWorldEnv(JvmGoldPathEnv):
    name = "scienceworld"
    packages = ("scienceworld",)
    splits = ("train", "dev", "test")
    action_help = ACTION_GRAMMAR

    def __init__(
        self,
        task_names: list[str] | None = None,
        simplifications: str = "",
        gold_path: bool = False,
        env_step_limit: int = 100_000,
    ):
        """ScienceWorld's tasks (its Java simulator).

        Args:
            task_names: tasks to sample from (default: all 30, in :data:`TASK_NAMES` order).
            simplifications: ScienceWorld's simplification string, e.g. ``"easy"`` or ``"openDoors,teleportAction"``.
            gold_path: generate the gold action sequence at each load (enables ``expert_action``; slower loads).
            env_step_limit: the simulator's own move limit (keep it above ``rollout.max_steps``).
        """
        names = tuple(task_names) if task_names else TASK_NAMES
        unknown = [t for t in names if t not in TASK_NAMES]
        if unknown:
            raise ValueError(f"env.init_args.task_names: unknown task(s) {unknown}; allowed: {', '.join(TASK_NAMES)}")
        if env_step_limit < 1:
            raise ValueError(f"env.init_args.env_step_limit: must be >= 1, got {env_step_limit}")
        cls = _require_scienceworld()
        super().__init__()
        self.task_names = names
        self.simplifications = simplifications
        self.gold_path = bool(gold_path)
        self._env = cls("", envStepLimit=env_step_limit)
        self._variations: dict[tuple[str, str], list[int]] = {}
        self._loaded: tuple[str, int] | None = None
        self._score = 0

    def _split_variations(self, task: str, split: str) -> list[int]:
        key = (task, split)
        if key not in self._variations:
            if self._loaded is None or self._loaded[0] != task:
                self._load(task, 0)
            getter = {"train": self._env.get_variations_train, "dev": self._env.get_variations_dev,
                      "test": self._env.get_variations_test}[split]
            self._variations[key] = sorted(int(v) for v in getter())
        return self._variations[key]

    def _load(self, task: str, variation: int) -> None:
        self._env.load(task, variation, self.simplifications, generateGoldPath=self.gold_path)
        self._loaded = (task, variation)

    def task_of(self, seed: int, split: str = "train") -> tuple[str, int]:
        """The (task name, variation index) that ``reset(seed, split)`` plays."""
        if split not in self.splits:
            raise ValueError(f"scienceworld: unknown split {split!r}; allowed: {', '.join(self.splits)}")
        n = len(self.task_names)
        task = self.task_names[int(seed) % n]
        variations = self._split_variations(task, split)
        if not variations:
            raise ValueError(f"scienceworld: task {task!r} has no {split} variations")
        return task, variations[(int(seed) // n) % len(variations)]

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        task, variation = self.task_of(seed, split)
        if self._loaded != (task, variation) or self.gold_path:
            self._load(task, variation)
        obs, _info = self._env.reset()
        self._score = int(round(100 * float(self._env.server.getScore())))  # some tasks start above 0
        self._start_episode(list(self._env.get_gold_action_sequence()) if self.gold_path else [])
        desc = str(self._env.get_task_description()).strip()
        goal = desc.removeprefix("Your task is to ")
        rooms = "Rooms: " + ", ".join(ROOMS) + "."
        return ResetResult(
            observation=f"{desc}\n{str(obs).strip()}",
            task=goal,
            admissible_actions=None,
            task_type=task,
            info={"task_id": f"{task}/{split}/{variation}", "variation": variation,
                  "gold_path_length": len(self._gold)},
            action_help=f"{ACTION_GRAMMAR}\n{rooms}",
            score=float(max(0, self._score)),
        )

    def step(self, action: str) -> StepResult:
        action = " ".join(str(action).split())
        self._count_step(action)
        server = self._env.server
        obs = str(server.step(action))
        score = int(round(100 * float(server.getScore())))
        completed = bool(server.getCompleted()) or score < 0
        delta, self._score = score - self._score, score
        won = completed and score >= 100
        invalid = any(m in obs.lower() for m in _INVALID)
        return StepResult(
            observation=obs.strip(),
            reward=1.0 if won else 0.0,
            done=completed,
            won=won,
            score=float(max(0, score)),
            admissible_actions=None,
            invalid_action=invalid,
            info={"score_delta": delta, "raw_score": score},
        )

