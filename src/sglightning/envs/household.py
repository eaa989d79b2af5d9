"""A small, deterministic, ALFWorld-like household text environment (stdlib only).

World: one room with numbered receptacles (``countertop 1``, ``cabinet 1..k``, ``drawer 1..k``, ``fridge 1``,
``microwave 1``, ``sinkbasin 1``, ``shelf 1``, ...) holding numbered objects (``apple 1``, ``mug 2``, ...).  Openable
receptacles (cabinet, drawer, fridge, microwave) may start closed; their contents are hidden until opened.  The agent
starts "in the middle of the room", holds at most one object and must ``go to`` a receptacle to interact with it.
Everything is drawn from ``random.Random(seed)`` inside ``reset(seed)``: same seed + constructor args = same episode.

Tasks (``task_type``: goal text):

* ``pick_and_place``:  "put a apple in fridge"        (any fridge/cabinet/... instance of the named type counts)
* ``clean_and_place``: "put a clean mug on shelf"     (``clean <obj> with sinkbasin 1`` first)
* ``heat_and_place``:  "put a hot egg on countertop"  (``heat <obj> with microwave 1``)
* ``cool_and_place``:  "put a cool tomato in cabinet" (``cool <obj> with fridge 1``)
* ``pick_two``:        "put two bowl in drawer"       (both in the *same* receptacle instance)
* ``pick_up``:         "pick up a bowl"              (holding one is success; the easiest type, for tiny models)

Actions (exact ALFWorld strings; input is lower-cased, whitespace-collapsed, a trailing "." dropped):
``go to <recep>``, ``open <recep>``, ``close <recep>``, ``take <obj> from <recep>``, ``put <obj> in/on <recep>``,
``clean <obj> with sinkbasin 1``, ``heat <obj> with microwave 1``, ``cool <obj> with fridge 1``, ``examine <recep>``,
``look``, ``inventory``.  ``admissible_actions`` lists exactly the actions executable now (sorted); anything else
returns "Nothing happens." with ``invalid_action=True`` and leaves the world unchanged (the step still counts).

Difficulty (``task_types`` overrides the task-type column, validated against the six names above):

====  ===========  ===========  ==============  =========================================  ====================
diff  receptacles  distractors  closed (p)      target object                              task types
====  ===========  ===========  ==============  =========================================  ====================
0     3-4          0-1          never           on an open surface; nothing closed          pick only
1     5-6          2-3          0.5             on a surface or in an open container        pick/clean/heat/cool
2     8-10         4-6          0.7             anywhere, possibly in a closed container    all five
3     15-20        8-12         always          anywhere (ALFWorld-sized room)              all five
====  ===========  ===========  ==============  =========================================  ====================

Rewards: 1.0 and ``done=won=True``, ``score=100`` on the step that completes the task, else 0.0.  ``score`` is a
monotone partial-progress score: 100*k/(n+1) with k of the task's n subgoals reached so far (pick_and_place: took a
target object; clean/heat/cool: took it, modified it; pick_two: took one, placed one).  With ``max_steps`` the env ends
an unsolved episode after that many steps (``done=True, won=False, info["truncated"]=True``).  ``expert_action()``
is a scripted solver that is correct from any reachable state.
"""

from __future__ import annotations

import random

from sglightning.envs.base import ResetResult, StepResult, TextEnv

TASK_TYPES = ("pick_and_place", "clean_and_place", "heat_and_place", "cool_and_place", "pick_two", "pick_up")
ALFWORLD_TYPES = TASK_TYPES[:5]  # the ALFWorld-like types the difficulty levels sample by default
OBJECTS = ("apple", "tomato", "potato", "egg", "mug", "cup", "plate", "bowl", "knife", "spoon", "lettuce", "bread")
_HEATABLE = ("apple", "tomato", "potato", "egg", "mug", "cup", "plate", "bowl", "bread")
_COOLABLE = ("apple", "tomato", "potato", "egg", "mug", "cup", "plate", "bowl", "lettuce", "bread")
OPENABLE = frozenset({"cabinet", "drawer", "fridge", "microwave"})
_SURFACES = frozenset({"countertop", "diningtable", "shelf", "sidetable", "stoveburner"})  # "on"; the rest "in"
_TARGETS = ("countertop", "diningtable", "shelf", "sidetable", "stoveburner", "garbagecan", "sinkbasin", "cabinet",
            "drawer", "fridge", "microwave")
# receptacle type -> max instances
_POOL = {"countertop": 2, "diningtable": 1, "shelf": 2, "sidetable": 1, "stoveburner": 2, "garbagecan": 1,
         "sinkbasin": 1, "cabinet": 6, "drawer": 4, "fridge": 1, "microwave": 1, "coffeemachine": 1, "toaster": 1}
_EASY_POOL = {"countertop": 1, "diningtable": 1, "shelf": 1, "sidetable": 1, "stoveburner": 1, "garbagecan": 1}
# task type -> (verb, appliance, property/adjective, objects)
_MODIFY = {"clean_and_place": ("clean", "sinkbasin 1", "clean", OBJECTS),
           "heat_and_place": ("heat", "microwave 1", "hot", _HEATABLE),
           "cool_and_place": ("cool", "fridge 1", "cool", _COOLABLE)}
_APPLIANCE_VERB = {"sinkbasin 1": "clean", "microwave 1": "heat", "fridge 1": "cool"}
_VERB_PROP = {"clean": "clean", "heat": "hot", "cool": "cool"}
# difficulty -> receptacles (min, max), distractors (min, max), P(openable starts closed), target may be hidden, pool
_LEVELS = {0: ((3, 4), (0, 1), 0.0, False, _EASY_POOL, TASK_TYPES[:1]),
           1: ((5, 6), (2, 3), 0.5, False, _POOL, TASK_TYPES[:4]),
           2: ((8, 10), (4, 6), 0.7, True, _POOL, ALFWORLD_TYPES),
           3: ((15, 20), (8, 12), 1.0, True, _POOL, ALFWORLD_TYPES)}


def _kind(name: str) -> str:
    """``"cabinet 3" -> "cabinet"``."""
    return name.rsplit(" ", 1)[0]


def _listing(names: list[str]) -> str:
    items = [f"a {n}" for n in names]
    if not items:
        return "nothing"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def normalize_action(action: str) -> str:
    """Lower-case, collapse whitespace, drop a trailing period."""
    return " ".join(action.lower().split()).rstrip(".").strip()


class HouseholdEnv(TextEnv):
    """ALFWorld-like household tasks; see the module docstring for world, actions, difficulty and rewards."""

    name = "household"
    action_help = "Answer with exactly one of the admissible actions, e.g. 'go to countertop 1'."

    def __init__(
        self,
        difficulty: int = 1,
        max_steps: int | None = None,
        task_types: list[str] | None = None,
        info_actions: bool = True,
        reveal_contents: bool = False,
    ):
        """A household task room of the given difficulty.

        Args:
            difficulty: 0-3: rooms of 3-4 up to 15-20 receptacles, more distractors, closed and hidden targets.
            max_steps: end an unsolved episode after this many steps (truncated); null: the rollout's limit alone.
            task_types: task kinds to sample (pick_and_place, clean/heat/cool_and_place, pick_two, pick_up); null: the
                level's.
            info_actions: keep look, inventory and examine (they never change the world; tiny models loop on them).
            reveal_contents: list what lies on every open receptacle in the overview (no search: a pure planning task).
        """
        if isinstance(difficulty, bool) or difficulty not in _LEVELS:
            raise ValueError(f"env.init_args.difficulty: must be one of 0, 1, 2, 3 (got {difficulty!r})")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"env.init_args.max_steps: must be a positive integer or None (got {max_steps!r})")
        if task_types is not None:
            if isinstance(task_types, str) or not task_types:
                allowed = ", ".join(TASK_TYPES)
                raise ValueError(
                    f"env.init_args.task_types: must be a non-empty list of: {allowed} (got {task_types!r})")
            unknown = [t for t in task_types if t not in TASK_TYPES]
            if unknown:
                raise ValueError(
                    f"env.init_args.task_types: unknown task type(s) {unknown}; allowed: {', '.join(TASK_TYPES)}")
        self.difficulty, self.max_steps, self.info_actions = difficulty, max_steps, bool(info_actions)
        self.reveal_contents = bool(reveal_contents)
        self.task_types = tuple(t for t in TASK_TYPES if t in task_types) if task_types else _LEVELS[difficulty][5]
        self._task: str | None = None
        self._done = True
        self._plan = 0  # the expert's distance to the goal from the current state (its plan's length)

    # ------------------------------------------------------------------ episode API
    def reset(self, seed: int, split: str = "train") -> ResetResult:
        """The task is a pure function of ``split`` and ``seed``.  Training and evaluation seeds are disjoint ranges,
        so ``train`` and ``dev`` share one generator; ``test`` has its own (else it replayed ``dev``'s tasks)."""
        if split not in self.splits:
            raise ValueError(f"household: unknown split {split!r}; allowed: {', '.join(self.splits)}")
        rng = random.Random(f"test:{seed}" if split == "test" else seed)
        (rmin, rmax), (dmin, dmax), p_closed, hidden_ok, pool, _ = _LEVELS[self.difficulty]
        ttype = rng.choice(self.task_types)
        verb, appliance, prop, objs = _MODIFY.get(ttype, (None, None, None, OBJECTS))
        target_obj = rng.choice(objs)
        app_kind = _kind(appliance) if appliance else None
        target_kind = rng.choice([k for k in _TARGETS if k in pool and k != app_kind])

        counts: dict[str, int] = {}

        def add(kind: str) -> str:
            counts[kind] = counts.get(kind, 0) + 1
            return f"{kind} {counts[kind]}"

        names = [add(target_kind)] + ([add(app_kind)] if app_kind else [])
        names.append(add(rng.choice(sorted(k for k in pool if k not in (target_kind, app_kind)))))
        for _ in range(rng.randint(rmin, rmax) - len(names)):
            slots = [k for k in pool for _ in range(pool[k] - counts.get(k, 0))]
            names.append(add(rng.choice(slots)))
        self._receps = sorted(names)
        self._closed = {r for r in self._receps if _kind(r) in OPENABLE and rng.random() < p_closed}
        self._contents: dict[str, list[str]] = {r: [] for r in self._receps}
        obj_counts: dict[str, int] = {}

        def place(kind: str, where: list[str], reveal: bool = False) -> None:
            obj_counts[kind] = obj_counts.get(kind, 0) + 1
            r = rng.choice(where)
            self._contents[r].append(f"{kind} {obj_counts[kind]}")
            if reveal:
                self._closed.discard(r)

        sources = [r for r in self._receps if _kind(r) != target_kind]
        for _ in range(2 if ttype == "pick_two" else 1):
            place(target_obj, sources, reveal=not hidden_ok)  # distractors may be hidden at any difficulty
        others = [o for o in OBJECTS if o != target_obj]
        for _ in range(rng.randint(dmin, dmax)):
            place(rng.choice(others), self._receps)
        for objs_here in self._contents.values():
            rng.shuffle(objs_here)
        self._props: dict[str, set[str]] = {o: set() for os_ in self._contents.values() for o in os_}
        self._at: str | None = None
        self._held: str | None = None
        self._type, self._obj, self._dest_kind = ttype, target_obj, target_kind
        self._verb, self._appliance, self._prop = verb, appliance, prop
        self._subgoals: set[str] = set()
        self._steps, self._done = 0, False
        adj = f"{prop} " if prop else ""
        prep = "on" if target_kind in _SURFACES else "in"
        art = "two" if ttype == "pick_two" else "a"
        self._task = f"put {art} {adj}{target_obj} {prep} {target_kind}"
        if ttype == "pick_up":
            self._task = f"pick up a {target_obj}"
        self._adm = self._admissible()
        plan_len = self._plan = self._plan_length()
        obs = f"{self._look()}\nYour task is to: {self._task}."
        info = {"seed": seed, "expert_plan_length": plan_len, "task_id": f"{ttype}-{seed}",
                "target_objects": [target_obj, target_kind] + ([_kind(appliance)] if appliance else [])}
        return ResetResult(obs, self._task, list(self._adm), ttype, info, score=self._score(False))

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("HouseholdEnv.step() called before reset(seed)")
        if self._done:
            raise RuntimeError("HouseholdEnv.step() called after the episode ended (done=True); call reset(seed) first")
        act = normalize_action(action)
        self._steps += 1
        invalid = act not in self._adm
        if invalid:
            obs = "Nothing happens."
        else:
            obs = self._execute(act)
            self._adm = self._admissible()
        won = self._won()
        truncated = not won and self.max_steps is not None and self._steps >= self.max_steps
        self._done = won or truncated
        before, self._plan = self._plan, (self._plan if invalid else 0 if won else self._plan_length())
        return StepResult(obs, 1.0 if won else 0.0, self._done, won, self._score(won), list(self._adm), invalid,
                          {"truncated": truncated, "steps": self._steps, "expert_plan_length": self._plan},
                          progress=float(before - self._plan))

    def expert_action(self) -> str | None:
        if self._task is None or self._done:
            return None
        return self._expert()

    # ------------------------------------------------------------------ world mechanics
    def _admissible(self) -> list[str]:
        acts = ["look", "inventory"] if self.info_actions else []
        acts += [f"go to {r}" for r in self._receps if r != self._at]
        r, held = self._at, self._held
        if r is not None:
            if self.info_actions:
                acts.append(f"examine {r}")
            if _kind(r) in OPENABLE:
                acts.append(f"{'open' if r in self._closed else 'close'} {r}")
            if r not in self._closed:
                acts += [f"take {o} from {r}" for o in self._contents[r]] if held is None else [f"put {held} in/on {r}"]
            if held is not None and r in _APPLIANCE_VERB:
                acts.append(f"{_APPLIANCE_VERB[r]} {held} with {r}")
        return sorted(acts)

    def _execute(self, act: str) -> str:
        verb, _, rest = act.partition(" ")
        if act == "look":
            return self._look()
        if act == "inventory":
            return f"You are carrying: a {self._held}." if self._held else "You are not carrying anything."
        if verb == "go":
            self._at = rest[3:]
            return f"You arrive at {self._at}. {self._describe(self._at)}"
        if verb == "examine":
            return self._describe(rest)
        if verb == "open":
            self._closed.discard(rest)
            return f"You open the {rest}. {self._describe(rest)}"
        if verb == "close":
            self._closed.add(rest)
            return f"You close the {rest}."
        if verb == "take":
            obj, recep = rest.split(" from ")
            self._contents[recep].remove(obj)
            self._held = obj
            if _kind(obj) == self._obj:
                self._subgoals.add("took")
            return f"You pick up the {obj} from the {recep}."
        if verb == "put":
            obj, recep = rest.split(" in/on ")
            self._contents[recep].append(obj)
            self._held = None
            if self._type == "pick_two" and self._best_dest_count() >= 1:
                self._subgoals.add("placed one")
            return f"You put the {obj} in/on the {recep}."
        obj, recep = rest.split(" with ")  # clean / heat / cool
        props = self._props[obj]
        props.add(_VERB_PROP[verb])
        props.discard({"hot": "cool", "cool": "hot"}.get(_VERB_PROP[verb], ""))
        if verb == self._verb and _kind(obj) == self._obj:
            self._subgoals.add("modified")
        return f"You {verb} the {obj} using the {recep}."

    def _look(self) -> str:
        if self._at is None:
            text = f"You are in the middle of a room. Looking quickly around you, you see {_listing(self._receps)}."
            if self.reveal_contents:
                shown = [r for r in self._receps if self._contents[r] and r not in self._closed]
                text += "".join(f" {self._describe(r)}" for r in shown)
            return text
        return f"You are facing the {self._at}. {self._describe(self._at)}"

    def _describe(self, r: str) -> str:
        if r in self._closed:
            return f"The {r} is closed."
        seen = _listing(self._contents[r])
        return f"The {r} is open. In it, you see {seen}." if _kind(r) in OPENABLE else f"On the {r}, you see {seen}."

    def _ok(self, obj: str) -> bool:
        return _kind(obj) == self._obj and (self._prop is None or self._prop in self._props[obj])

    def _best_dest_count(self) -> int:
        return max(sum(map(self._ok, self._contents[r])) for r in self._receps if _kind(r) == self._dest_kind)

    def _won(self) -> bool:
        if self._type == "pick_up":
            return self._held is not None and self._ok(self._held)
        return self._best_dest_count() >= (2 if self._type == "pick_two" else 1)

    def _score(self, won: bool) -> float:
        n = {"pick_up": 0, "pick_and_place": 1}.get(self._type, 2)
        return 100.0 if won else round(100.0 * len(self._subgoals) / (n + 1), 1)

    # ------------------------------------------------------------------ expert
    def _expert(self) -> str:
        dests = [r for r in self._receps if _kind(r) == self._dest_kind]
        if self._type == "pick_two":  # both objects must end in one instance: keep filling the fullest one
            dest = min(dests, key=lambda r: (-sum(map(self._ok, self._contents[r])), r))
        else:
            dest = min(dests, key=lambda r: (r in self._closed, r))
        at, held = self._at, self._held
        if held is not None:
            if _kind(held) != self._obj:  # a wrong object: put it down where we stand
                if at is None:
                    return f"go to {self._receps[0]}"
                return f"open {at}" if at in self._closed else f"put {held} in/on {at}"
            if not self._ok(held):
                return f"go to {self._appliance}" if at != self._appliance else f"{self._verb} {held} with {at}"
            if at != dest:
                return f"go to {dest}"
            return f"open {dest}" if dest in self._closed else f"put {held} in/on {dest}"
        where = {o: r for r, objs in self._contents.items() for o in objs if _kind(o) == self._obj}
        if self._type == "pick_two":
            where = {o: r for o, r in where.items() if r != dest}
        obj = min(where, key=lambda o: (not self._ok(o), where[o] in self._closed, where[o] != at, o))
        src = where[obj]
        if at != src:
            return f"go to {src}"
        return f"open {src}" if src in self._closed else f"take {obj} from {src}"

    def _plan_length(self, limit: int = 200) -> int:
        """Length of the expert's plan from the current state (the state is restored afterwards)."""
        saved = (self._at, self._held, set(self._closed), {r: list(o) for r, o in self._contents.items()},
                 {o: set(p) for o, p in self._props.items()}, set(self._subgoals))
        n = 0
        while not self._won():
            if n >= limit:
                raise RuntimeError(f"household expert did not finish within {limit} steps (task {self._task!r})")
            self._execute(self._expert())
            n += 1
        self._at, self._held, self._closed, self._contents, self._props, self._subgoals = saved
        return n


def _success(policy: str, difficulty: int, episodes: int, max_steps: int, seed: int) -> float:
    env, rng, wins = HouseholdEnv(difficulty, max_steps=max_steps), random.Random(seed), 0
    for ep in range(episodes):
        adm, done = env.reset(seed + ep).admissible_actions, False
        while not done:
            res = env.step(rng.choice(adm) if policy == "random" else env.expert_action())
            adm, done, wins = res.admissible_actions, res.done, wins + res.won
    return wins / episodes


def random_policy_success(difficulty: int, episodes: int, max_steps: int, seed: int = 0) -> float:
    """Success rate of uniformly random admissible actions on seeds ``seed .. seed+episodes-1`` (calibration)."""
    return _success("random", difficulty, episodes, max_steps, seed)


def expert_success(difficulty: int, episodes: int, max_steps: int, seed: int = 0) -> float:
    """Success rate of :meth:`HouseholdEnv.expert_action` on seeds ``seed .. seed+episodes-1``."""
    return _success("expert", difficulty, episodes, max_steps, seed)


if __name__ == "__main__":  # the numbers benchmarks/README.md quotes: python -m sglightning.envs.household
    for d in range(4):
        rates = {m: random_policy_success(d, 2000, m) for m in (6, 10, 30)}
        plans = [HouseholdEnv(d).reset(seed).info["expert_plan_length"] for seed in range(200)]
        print(f"difficulty {d}: random success {rates}, expert success (50 steps) {expert_success(d, 200, 50)}, "
              f"mean expert plan {sum(plans) / len(plans):.2f} steps")
