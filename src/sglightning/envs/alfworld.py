"""ALFWorld (Shridhar et al., 2021) text games on the real ALFWorld/TextWorld simulator, behind :class:`TextEnv`.

Needs the optional extra (``pip install "sglightning[alfworld]"``: ``alfworld`` + ``textworld`` with its PDDL simulator)
and the games themselves, which no package ships.  ``alfworld`` and ``textworld`` are imported inside ``__init__``, so
this module imports without them.

Games.  ``data_path`` (default ``$ALFWORLD_DATA``) is the folder that holds ``json_2.1.1`` (a path to ``json_2.1.1``
itself is accepted too).  Each game is a folder ``json_2.1.1/<split>/<task>/<trial>/`` with ``traj_data.json``,
``initial_state.pddl`` and the playable ``game.tw-pddl``.  ``alfworld-download`` fetches all of them on a networked
machine; ``alfworld-generate --data_path <...>/json_2.1.1`` turns hand-written ``traj_data.json`` +
``initial_state.pddl`` folders into games (``tests/alfworld_games.py`` does this for the test fixtures).  The games
of a split are every ``game.tw-pddl`` under ``json_2.1.1/<split>/`` that has a ``traj_data.json`` beside it and was
marked ``"solvable": true`` by ``alfworld-generate`` (the rule of ALFWorld's ``AlfredTWEnv``; ``movable``/``Sliced``
folders are skipped as there), sorted by relative path.  ``reset(seed, split)`` plays ``games[seed % len(games)]``:
the seed alone picks the game.  A split's index is built on its first ``reset`` and cached.

Splits: ``train``, ``valid_seen`` (ALFWorld's in-distribution eval set), ``valid_unseen`` (out-of-distribution).

Task types (``ResetResult.task_type``, the paper's names; ``traj_data.json["task_type"]`` in brackets):
``Pick`` (pick_and_place_simple), ``Look`` (look_at_obj_in_light), ``Clean`` (pick_clean_then_place_in_recep),
``Heat`` (pick_heat_then_place_in_recep), ``Cool`` (pick_cool_then_place_in_recep), ``Pick2``
(pick_two_obj_and_place).  ``task_types=[...]`` keeps only those types.

Episode: ``reset`` returns ALFWorld's first observation (room overview + ``Your task is to: ...``), the goal text
as ``task``, the simulator's admissible commands, and ``info`` with ``task_id`` (game path relative to
``json_2.1.1``), ``gamefile`` (absolute path) and ``target_objects`` (object/receptacle/lamp targets of
``traj_data.json["pddl_params"]`` in the game's words, e.g. ``["apple", "countertop"]``).  ``step`` gives reward
1.0 and ``done=won=True`` when the simulator reports the goal reached, else 0.0; after ``max_steps`` steps an unsolved
episode ends with ``info["truncated"]=True``.  ``score`` is None (ALFWorld has no progress score).
``expert_action()`` is the next command of ALFWorld's handcoded expert (``HandCodedTWAgent``), which tracks the
episode from every executed step, so it can be asked from any state the agent reaches (it is a heuristic: not
optimal, not guaranteed to succeed).  The goal text is fixed in each game file by ``alfworld-generate`` (one of two
templates per task type, e.g. "put a apple in countertop" / "put some apple on countertop").

Simulator calls: ``textworld.envs.PddlEnv(textworld.EnvInfos(won=True, admissible_commands=True, extras=[...]))``
wrapped by ALFWorld's ``AlfredDemangler(shuffle=False)`` and ``AlfredInfos`` and (``expert=True``) a subclass of its
``AlfredExpert`` wrapper: the same stack ``alfworld-generate`` solves games with and ``AlfredTWEnv`` registers
through ``textworld.gym.register_games``.  One stack lives as long as the env; ``load`` runs only when the game
changes.  Each stack maps its own copy of fast-downward's library (textworld copies the 34 MB ``libdownward.so``
per ``PddlEnv``); ``close()`` frees the planner's task memory but leaves the copy mapped (unloading it with
``dlclose`` crashed a later load), so keep env objects long-lived (one per pool slot), not one per episode.
Simulator calls of all instances in a process run under one lock: textworld's PDDL text generator parses through a
single module-level tatsu parser that breaks when two threads use it (as a thread pool of envs would), so threads
give ALFWorld no parallel speed-up (the simulator is pure Python under the GIL anyway), only correctness.  Hence
``own_process``: built by a config, each ALFWorld env plays in a process of its own
(:mod:`sglightning.envs.process`), so envs step in parallel, a hung call is killed instead of holding the lock
for every slot, and a retired slot unmaps its planner library.  ``rollout.env_processes: false`` shares one process.

Departures from ALFWorld's ``AlfredTWEnv``:

* No ``textworld.gym`` batch env (one game per env object; the rollout batches environments) and no
  ``num_train_games`` truncation; the step limit is ``max_steps`` here, not textworld's ``max_episode_steps``.
* The first observation drops the ``-= Welcome to TextWorld, ALFRED! =-`` banner (as the ReAct/Reflexion prompts
  do).  Actions are lower-cased, whitespace-collapsed and lose a trailing ".", and the pre-0.4 ALFWorld form
  ``put X in/on Y`` (also ``in``/``on``) is accepted for the simulator's ``move X to Y``.
* An action that is not admissible is not sent to the simulator: the observation is ALFWorld's own
  ``Nothing happens.`` (what the simulator answers), the world is unchanged, and ``invalid_action=True``.  This also
  keeps junk text out of the expert's state tracker.
* Expert: (1) ALFWorld 0.4.2's tracker recognises only the old ``put`` verb, so after ``move X to Y`` it still
  believes it holds X and wanders on Pick2 tasks; it is shown ``put X in/on Y`` instead.  (2) Its random choices use
  a ``random.Random(seed)`` of the episode (thread-local) instead of the global ``random`` module: same seed, same
  plan.  (3) When it
  gives up (timeout / no subgoal left / internal error) ``expert_action()`` returns None instead of raising.
"""

from __future__ import annotations

import json
import operator
import os
import random
import re
import threading
from pathlib import Path
from typing import Any

from sglightning.envs.base import ResetResult, StepResult, TextEnv

#: traj_data.json task_type -> the paper's name
TASK_TYPE_NAMES = {
    "pick_and_place_simple": "Pick",
    "look_at_obj_in_light": "Look",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}
TASK_TYPES = tuple(TASK_TYPE_NAMES.values())
NOTHING_HAPPENS = "Nothing happens."
_BANNER = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_TASK = re.compile(r"Your task is to:\s*(.+?)\s*$", re.DOTALL)
_PUT = re.compile(r"^put (.+?) (?:in/on|in|on|into) (.+)$")
_MOVE = re.compile(r"^move (.+?) to (.+)$")
_INSTALL = 'pip install "sglightning[alfworld]"'
#: serialises every call into textworld/ALFWorld across instances (see the module docstring)
_SIMULATOR_LOCK = threading.RLock()


def normalize_action(action: str) -> str:
    """Lower-case, collapse whitespace, drop a trailing period."""
    return " ".join(str(action).lower().split()).rstrip(".").strip()


def _expert_view(command: str) -> str:
    """The command as the handcoded expert's tracker understands it (``move X to Y`` -> ``put X in/on Y``)."""
    m = _MOVE.match(command)
    return f"put {m.group(1)} in/on {m.group(2)}" if m else command


def _import_simulator() -> tuple[Any, Any, Any, Any]:
    """Import textworld + ALFWorld's wrappers; ``ValueError`` with the install line when they are missing."""
    saved = os.environ.get("ALFWORLD_DATA")
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredInfos,
        )
        from textworld.envs import PddlEnv
    except ImportError as err:
        raise ValueError(f"the alfworld environment needs the alfworld and textworld packages ({err}); "
                         f"install them with: {_INSTALL}") from err
    finally:
        # importing alfworld sets $ALFWORLD_DATA to ~/.cache/alfworld when unset; keep the caller's environment as is
        if saved is None:
            os.environ.pop("ALFWORLD_DATA", None)
    return textworld, PddlEnv, AlfredDemangler, AlfredInfos


class _EpisodeRandom:
    """Stands in for the ``random`` module inside ALFWorld's expert module: draws from the RNG of the episode the
    calling thread is computing an expert step for (thread-local, so envs stepped by a thread pool stay
    deterministic), and from the global ``random`` module otherwise."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(getattr(self.local, "rng", None) or random, name)


_EXPERT_CLASS: type | None = None


def _expert_wrapper_class() -> type:
    """``AlfredExpert`` (handcoded) with the three fixes listed in the module docstring (built once, lazily)."""
    global _EXPERT_CLASS
    if _EXPERT_CLASS is not None:
        return _EXPERT_CLASS
    import alfworld.agents.expert.handcoded_expert as handcoded
    from alfworld.agents.environment.alfred_tw_env import AlfredExpert
    from alfworld.agents.expert import HandCodedTWAgent

    if not isinstance(handcoded.random, _EpisodeRandom):
        handcoded.random = _EpisodeRandom()  # the expert draws from ``random.choice``: route it to the episode RNG
    episode_random: _EpisodeRandom = handcoded.random

    class SeededAlfredExpert(AlfredExpert):
        def __init__(self, env: Any = None, max_steps: int = 200):
            super().__init__(env, expert_type="handcoded")
            self.expert_max_steps = max_steps
            self.rng = random.Random(0)
            self.error: str | None = None

        def load(self, gamefile: str) -> None:
            super().load(gamefile)
            self._handcoded_expert = HandCodedTWAgent(max_steps=self.expert_max_steps)

        def reset(self) -> Any:
            self.error = None
            return super().reset()

        def _gather_infos(self) -> None:
            plan: list[str] = []
            if self.error is None:
                episode_random.local.rng = self.rng
                try:
                    if not self.prev_command:
                        self._handcoded_expert.observe(self.state["feedback"])
                        plan = ["look"]  # ALFWorld's expert always starts with "look"
                    else:
                        nxt = self._handcoded_expert.act(self.state, 0, self.state["won"],
                                                         _expert_view(self.prev_command))
                        plan = [nxt] if nxt in self.state["admissible_commands"] else ["look"]
                except Exception as err:  # HandCodedAgentTimeout/Failed, or a bug of one of its heuristics
                    self.error = f"{type(err).__name__}: {err}"
                finally:
                    episode_random.local.rng = None
            self.state["extra.expert_plan"] = plan

    _EXPERT_CLASS = SeededAlfredExpert
    return _EXPERT_CLASS


def _plain(name: str) -> str:
    return name.strip().lower()


class ALFWorldEnv(TextEnv):
    """ALFWorld text games (real simulator); see the module docstring for games, splits, task types and departures."""

    name = "alfworld"
    packages = ("alfworld", "textworld")
    splits = ("train", "valid_seen", "valid_unseen")
    own_process = True  # one hung call would block every slot (the lock above), and the simulator holds the GIL
    action_help = ("Answer with exactly one of the admissible actions, e.g. 'go to countertop 1', "
                   "'take apple 1 from countertop 1' or 'move apple 1 to fridge 1'.")

    def __init__(self, data_path: str | None = None, task_types: list[str] | None = None, max_steps: int = 50,
                 expert: bool = True):
        """ALFWorld's games of the given task types, from its data folder.

        Args:
            data_path: the folder holding json_2.1.1 (or json_2.1.1 itself); null: $ALFWORLD_DATA.
            task_types: task types to sample (Pick, Look, Clean, Heat, Cool, Pick2); null: all six.
            max_steps: end an unsolved episode after this many steps (truncated).
            expert: run ALFWorld's handcoded expert beside each game (expert_action: its next command).
        """
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"env.init_args.max_steps must be a positive integer (got {max_steps!r})")
        if task_types is not None:
            if isinstance(task_types, str) or not task_types:
                raise ValueError(f"env.init_args.task_types must be a non-empty list of: {', '.join(TASK_TYPES)} "
                                 f"(got {task_types!r})")
            unknown = [t for t in task_types if t not in TASK_TYPES]
            if unknown:
                raise ValueError(f"env.init_args.task_types: unknown task type(s) {unknown}; "
                                 f"allowed: {', '.join(TASK_TYPES)}")
        self.task_types = tuple(t for t in TASK_TYPES if t in task_types) if task_types else None
        self.max_steps, self.expert = max_steps, bool(expert)
        if data_path is not None and str(data_path).strip():
            raw, source = str(data_path), "env.init_args.data_path"
        else:  # read before importing alfworld: its import sets $ALFWORLD_DATA to a default cache folder
            raw, source = os.environ.get("ALFWORLD_DATA", ""), "$ALFWORLD_DATA"
        self._textworld, self._pddl_env_cls, self._demangler_cls, self._infos_cls = _import_simulator()
        self.json_root = self._find_json_root(raw, source)
        self._index: dict[str, list[tuple[Path, str, list[str]]]] = {}
        self._env: Any = None
        self._pddl: Any = None
        self._expert_env: Any = None
        self._loaded: Path | None = None
        self._state: Any = None
        self._done, self._steps = True, 0

    # ------------------------------------------------------------------ games
    @staticmethod
    def _find_json_root(raw: str, source: str) -> Path:
        how = ("set env.init_args.data_path or $ALFWORLD_DATA to the folder that contains json_2.1.1 "
               "(get the games with `alfworld-download` on a networked machine and copy that folder over, or "
               "build them from traj_data.json + initial_state.pddl folders with `alfworld-generate`)")
        if not raw.strip():
            raise ValueError(f"ALFWorld games not found: neither env.init_args.data_path nor $ALFWORLD_DATA is set; "
                             f"{how}")
        folder = Path(raw).expanduser()
        root = folder / "json_2.1.1"
        if not root.is_dir() and folder.name == "json_2.1.1":
            root = folder
        if root.is_dir():
            for split in ALFWorldEnv.splits:
                if next((root / split).rglob("game.tw-pddl"), None) is not None:
                    return root
        raise ValueError(f"ALFWorld games not found: no json_2.1.1/<split>/**/game.tw-pddl under {folder} "
                         f"(from {source}); {how}")

    def _games(self, split: str) -> list[tuple[Path, str, list[str]]]:
        """``(gamefile, task type, target objects)`` of every playable game of ``split``, sorted by path."""
        if split not in self.splits:
            raise ValueError(f"alfworld: unknown split {split!r}; allowed: {', '.join(self.splits)}")
        if split in self._index:
            return self._index[split]
        games = []
        for game in sorted((self.json_root / split).rglob("game.tw-pddl"), key=lambda p: p.as_posix()):
            rel = game.relative_to(self.json_root).as_posix()
            traj_file = game.with_name("traj_data.json")
            if "movable" in rel or "Sliced" in rel or not traj_file.is_file():
                continue
            traj = json.loads(traj_file.read_text())
            ttype = TASK_TYPE_NAMES.get(traj.get("task_type", ""))
            if ttype is None or (self.task_types is not None and ttype not in self.task_types):
                continue
            if not json.loads(game.read_text()).get("solvable"):
                continue
            params = traj.get("pddl_params", {})
            targets = [_plain(params[k]) for k in ("object_target", "mrecep_target", "parent_target", "toggle_target")
                       if isinstance(params.get(k), str) and params[k].strip()]
            games.append((game, ttype, targets))
        if not games:
            only = f" of task type(s) {list(self.task_types)}" if self.task_types else ""
            raise ValueError(f"alfworld: no playable (solvable) games{only} for split {split!r} under "
                             f"{self.json_root / split}")
        self._index[split] = games
        return games

    def games(self, split: str = "train") -> list[str]:
        """The game files of ``split`` in seed order (``reset(seed, split)`` plays ``games(split)[seed % n]``)."""
        return [str(g) for g, _, _ in self._games(split)]

    # ------------------------------------------------------------------ simulator
    def _make_env(self) -> None:
        extras = ["gamefile"] + (["expert_plan"] if self.expert else [])
        infos = self._textworld.EnvInfos(won=True, admissible_commands=True, extras=extras)
        self._pddl = self._pddl_env_cls(infos)  # loads a private copy of fast-downward's library (~34 MB)
        env = self._infos_cls(self._demangler_cls(self._pddl, shuffle=False))
        if self.expert:
            env = self._expert_env = _expert_wrapper_class()(env, max_steps=max(200, self.max_steps + 1))
        self._env, self._loaded = env, None

    # ------------------------------------------------------------------ episode API
    def reset(self, seed: int, split: str = "train") -> ResetResult:
        seed = operator.index(seed)
        games = self._games(split)
        game, ttype, targets = games[seed % len(games)]
        with _SIMULATOR_LOCK:
            if self._env is None:
                self._make_env()
            if self._loaded != game:
                self._loaded = None
                self._env.load(str(game))
                self._loaded = game
            if self._expert_env is not None:
                self._expert_env.rng.seed(seed)
            self._state = self._env.reset()
        self._done, self._steps = False, 0
        obs = _BANNER.sub("", self._state["feedback"]).strip()
        m = _TASK.search(obs)
        task = m.group(1).rstrip(".") if m else obs
        info = {"task_id": game.relative_to(self.json_root).as_posix(), "gamefile": str(game),
                "target_objects": list(targets), "split": split, "seed": seed}
        return ResetResult(obs, task, list(self._state["admissible_commands"]), ttype, info)

    def _command(self, action: str) -> str:
        act = normalize_action(action)
        m = _PUT.match(act)
        if m and act not in self._state["admissible_commands"]:
            alias = f"move {m.group(1)} to {m.group(2)}"
            if alias in self._state["admissible_commands"]:
                return alias
        return act

    def step(self, action: str) -> StepResult:
        if self._state is None:
            raise RuntimeError("ALFWorldEnv.step() called before reset(seed) (or after close())")
        if self._done:
            raise RuntimeError("ALFWorldEnv.step() called after the episode ended (done=True); call reset(seed) first")
        cmd = self._command(action)
        self._steps += 1
        admissible = cmd in self._state["admissible_commands"]
        if admissible:
            with _SIMULATOR_LOCK:
                self._state, _, _ = self._env.step(cmd)
            obs = self._state["feedback"].strip()
        else:
            obs = NOTHING_HAPPENS
        won = bool(self._state["won"])
        truncated = not won and self._steps >= self.max_steps
        self._done = won or truncated
        info = {"truncated": truncated, "steps": self._steps, "command": cmd}
        return StepResult(obs, 1.0 if won else 0.0, self._done, won, None, list(self._state["admissible_commands"]),
                          not admissible or obs == NOTHING_HAPPENS, info)

    def expert_action(self) -> str | None:
        if not self.expert or self._state is None or self._done:
            return None
        plan = self._state.get("extra.expert_plan") or []
        return plan[0] if plan else None

    def close(self) -> None:
        env, pddl, self._env, self._pddl, self._expert_env = self._env, self._pddl, None, None, None
        self._loaded, self._state, self._done = None, None, True
        with _SIMULATOR_LOCK:
            if env is not None:
                env.close()
            lib = getattr(pddl, "downward_lib", None)
            if lib is not None:  # textworld's PddlEnv.close() is a no-op: free the planner's task memory ourselves
                pddl.downward_lib = None
                lib.cleanup()
