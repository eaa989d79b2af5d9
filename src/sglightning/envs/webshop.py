"""WebShop adapter (text mode of the ``web_agent_site`` package from the WebShop repository).

Not on PyPI: PyPI's ``webshop`` is an empty shell.  Users install the real environment themselves (on a networked
machine: clone the WebShop repository, run its ``setup.sh`` — product data, search index, spaCy model — and
``pip install -e .`` it so that ``import web_agent_site`` works).  Without it, constructing :class:`WebShopEnv` raises a
``ValueError`` that says exactly that.

**What has been run here:** the observation parsing, action normalisation, admissibility checks, purchase bookkeeping
and failure-pattern flags, against observation strings in WebShop's text format written in the tests and a fake
simulator with ``web_agent_site``'s interface.  **Not run here:** the real WebShop simulator (no product data can be
downloaded on these machines).

Interface used (``web_agent_site.envs.WebAgentTextEnv``, ``observation_mode="text"``): ``reset(session=i)`` →
``(observation, info)``, ``step(action)`` → ``(observation, reward, done, info)``, ``get_available_actions()`` →
``{"has_search_bar": bool, "clickables": [...]}``, ``instruction_text``.  Text observations join page elements with
``" [SEP] "``.

* Actions: ``search[<query>]`` (only on a page with a search bar) and ``click[<clickable>]`` (one of the page's
  clickables; case-insensitive).  How the actor writes its answer is ``guidance.actor_format`` (the paper's WebShop
  format, ``think_tags`` = ``<think>…</think><action>…</action>``, is what ``configs/paper/webshop_*.yaml`` use; the
  action parser reads any of the formats).  Anything else is an invalid action: the page does not change.
* ``admissible_actions`` is ``None`` (search queries are free text); every observation ends with the list of available
  actions instead, e.g. ``search[<your query>]`` or ``click[back to search], click[b09kp78g37], …``.
* Splits follow verl-agent's goal split: ``test`` = goals 0–499, ``dev`` = 500–1499, ``train`` = 1500 onwards;
  ``reset(seed, split)`` plays goal ``start + seed % size``.
* Reward (0–1 attribute/option/price match of the purchased item) → ``score = 100 × reward``; success = reward 1.
  Episodes end on purchase (``click[buy now]``) or at ``rollout.max_steps`` (paper: 15).
* ``StepResult.info`` records ``query`` (search steps), ``back_to_search`` and, for a purchase, ``purchase`` with
  ``premature_purchase`` = the product page offered options and none was selected — the inputs of the WebShop
  failure patterns (see :mod:`sglightning.diagnostics`).
"""

from __future__ import annotations

import re
from typing import Any

from sglightning.envs.base import ResetResult, StepResult, TextEnv, installed_versions

SEP = " [SEP] "
#: clickables of a product page that are navigation, not product options
NAVIGATION = frozenset({"back to search", "< prev", "next >", "description", "features", "reviews", "attributes",
                        "buy now"})
SPLITS = {"test": (0, 500), "dev": (500, 1500), "train": (1500, None)}
ACTION_HELP = ("Actions: search[<your query>] on a page with a search bar, or click[<button>] with one of the buttons "
               "listed.")
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)


def _require_web_agent_site():
    try:
        from web_agent_site.envs import WebAgentTextEnv
    except ImportError as err:
        raise ValueError(
            f"env: WebShop's simulator (the `web_agent_site` package) is not installed ({err}). It is not on PyPI "
            "(PyPI's `webshop` is an empty shell): on a networked machine clone "
            "https://github.com/princeton-nlp/WebShop, "
            "run its setup.sh (product data + search index), then `pip install -e .` in that folder so that "
            "`import web_agent_site` works."
        ) from err
    return WebAgentTextEnv


def parse_text_observation(obs: str) -> list[str]:
    """Split a text-mode observation into its page elements."""
    return [p.strip() for p in str(obs).split("[SEP]") if p.strip()]


def instruction_of(obs: str) -> str:
    """The shopping instruction from a page's text (the element after ``Instruction:``), or ``""``."""
    parts = parse_text_observation(obs)
    for i, p in enumerate(parts):
        if p.lower().rstrip(":") == "instruction" and i + 1 < len(parts):
            return parts[i + 1]
        if p.lower().startswith("instruction:") and len(p) > len("instruction:"):
            return p.split(":", 1)[1].strip()
    return ""


def format_observation(obs: str, available: dict[str, Any]) -> str:
    """A page as one element per line, then the actions available on it."""
    lines = parse_text_observation(obs)
    return "\n".join(lines) + "\nAvailable actions: " + ", ".join(available_actions(available))


def available_actions(available: dict[str, Any]) -> list[str]:
    acts = ["search[<your query>]"] if available.get("has_search_bar") else []
    return acts + [f"click[{c}]" for c in available.get("clickables", [])]


def normalise_action(action: str, available: dict[str, Any]) -> tuple[str | None, str]:
    """``(canonical action, problem)``: ``search[q]`` with a collapsed query, or ``click[x]`` with ``x`` spelled as the
    page's clickable.  ``None`` and a reason when the action is malformed or not available on this page."""
    m = _ACTION.match(str(action))
    if not m:
        return None, "not of the form search[...] or click[...]"
    kind, arg = m.group(1).lower(), " ".join(m.group(2).split())
    if kind == "search":
        if not available.get("has_search_bar"):
            return None, "no search bar on this page"
        if not arg or arg == "<your query>":
            return None, "empty search query"
        return f"search[{arg}]", ""
    by_key = {c.lower(): c for c in available.get("clickables", [])}
    if arg.lower() not in by_key:
        return None, f"{arg!r} is not a button on this page"
    return f"click[{by_key[arg.lower()]}]", ""


class WebShopEnv(TextEnv):
    name = "webshop"
    splits = tuple(SPLITS)
    action_help = ACTION_HELP

    def __init__(
        self,
        num_products: int | None = None,
        human_goals: bool = True,
        file_path: str | None = None,
        simulator: Any = None,
    ):
        """WebShop's simulated shop.

        Args:
            num_products: products loaded by the simulator (``None``: all; WebShop's small set is 1000).
            human_goals: the human-written instructions (the paper's setting) rather than synthetic ones.
            file_path: the product file (``None``: the simulator's default).
            simulator: a class with ``web_agent_site``'s ``WebAgentTextEnv`` interface (tests); default: the real one.
        """
        cls = simulator if simulator is not None else _require_web_agent_site()
        kwargs: dict[str, Any] = {"observation_mode": "text", "human_goals": human_goals}
        if num_products is not None:
            kwargs["num_products"] = num_products
        if file_path is not None:
            kwargs["file_path"] = file_path
        self._env = cls(**kwargs)
        self._available: dict[str, Any] = {}
        self._options: list[str] = []  # option buttons of the product page being viewed
        self._selected: set[str] = set()
        self._closed = False

    @classmethod
    def package_versions(cls) -> dict[str, str]:
        # the simulator is installed from the WebShop repository under one of these names: record the first found
        return dict(list(installed_versions(("web_agent_site", "webshop")).items())[:1])

    def _num_goals(self) -> int | None:
        server = getattr(self._env, "server", None)
        goals = getattr(server, "goals", None)
        return len(goals) if goals is not None else None

    def session_of(self, seed: int, split: str = "train") -> int:
        if split not in SPLITS:
            raise ValueError(f"webshop: unknown split {split!r}; allowed: {', '.join(SPLITS)}")
        start, end = SPLITS[split]
        total = self._num_goals()
        if end is None:
            end = total if total is not None else start + 10_000
        if total is not None:
            end = min(end, total)
        if end <= start:
            raise ValueError(f"webshop: split {split!r} (goals {start}..) is empty: the simulator has {total} goals")
        return start + int(seed) % (end - start)

    def _refresh(self) -> None:
        self._available = dict(self._env.get_available_actions())
        clickables = [str(c) for c in self._available.get("clickables", [])]
        self._available["clickables"] = clickables
        if "buy now" in {c.lower() for c in clickables}:
            options = [c for c in clickables if c.lower() not in NAVIGATION and not _is_asin(c)]
            if options != self._options:  # a new product page
                self._options, self._selected = options, set()
        else:
            self._options, self._selected = [], set()

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        session = self.session_of(seed, split)
        out = self._env.reset(session=session)
        obs = out[0] if isinstance(out, tuple) else out
        self._options, self._selected = [], set()
        self._refresh()
        instruction = str(getattr(self._env, "instruction_text", "") or instruction_of(obs)).strip()
        instruction = instruction.removeprefix("Instruction:").strip()
        return ResetResult(
            observation=format_observation(obs, self._available),
            task=instruction,
            admissible_actions=None,
            task_type="webshop",
            info={"task_id": f"webshop/{split}/{session}", "session": session},
            score=0.0,  # nothing bought yet: the purchase's progress is measured against it
        )

    def step(self, action: str) -> StepResult:
        canonical, problem = normalise_action(action, self._available)
        if canonical is None:
            page = format_observation(getattr(self._env, "observation", "") or "", self._available)
            return StepResult(
                observation=f"Invalid action ({problem}). {page}".strip(),
                reward=0.0,
                done=False,
                invalid_action=True,
                info={"problem": problem},
            )
        info: dict[str, Any] = {}
        arg = canonical[canonical.index("[") + 1 : -1]
        if canonical.startswith("search["):
            info["query"] = arg.lower()
        elif arg.lower() == "back to search":
            info["back_to_search"] = True
        elif arg.lower() == "buy now":
            info["purchase"] = True
            info["premature_purchase"] = bool(self._options) and not self._selected
        elif arg in self._options:
            self._selected.add(arg)
        obs, reward, done, _ = self._env.step(canonical)
        reward = float(reward or 0.0)
        self._refresh()
        won = bool(done) and reward >= 1.0
        return StepResult(
            observation=format_observation(obs, self._available),
            reward=1.0 if won else 0.0,
            done=bool(done),
            won=won,
            score=100.0 * reward if done else None,
            admissible_actions=None,
            invalid_action=False,
            info=info | {"webshop_reward": reward},
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self._env, "close", None)
        if callable(close):
            close()


def _is_asin(text: str) -> bool:
    """Product ids on result pages (``b09kp78g37``) are clickables but not options."""
    return bool(re.fullmatch(r"[a-z0-9]{10}", text.lower())) and any(ch.isdigit() for ch in text)
