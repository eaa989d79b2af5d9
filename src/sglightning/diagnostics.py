"""Failure patterns of failed episodes (the paper's Appendix B), computed from the actions taken.

Each pattern is a pure function of one episode's action list (plus the env's step info and target objects); a report
gives, per pattern, the share of *failed* episodes that show it.  A pattern that cannot be judged for an episode (no
target objects known; not a WebShop episode) is ``None`` and left out of that pattern's denominator.

=======================  ===================================================================================
pattern                  an episode shows it when
=======================  ===================================================================================
looping                  the same action ≥ 5 times in a row, or one action is ≥ 50 % of the steps
redundant_exploration    ≥ 8 revisits via movement (``go to X``/``move X`` to an X already visited), or one
                         object examined (``examine X``/``look at X``/``look in X``) ≥ 5 times
wrong_object_focus       an object that is not a task target examined ≥ 4 times, or ≥ 7 pick-ups
                         (``take X``/``pick up X``) of non-target objects (needs ``info["target_objects"]``)
query_looping            (WebShop) the same search query ≥ 3 times
navigation_cycling       (WebShop) ``click[back to search]`` ≥ 3 times in an episode that bought nothing
premature_purchase       (WebShop) bought on a product page that offered options without selecting any
=======================  ===================================================================================

Departure from the paper: the "≥ 50 % of the steps" looping rule only applies to episodes of ≥ 4 steps (otherwise
every 2-step failure with a repeated action would count as looping).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from sglightning.episodes import Episode

PATTERNS = ("looping", "redundant_exploration", "wrong_object_focus")
WEBSHOP_PATTERNS = ("query_looping", "navigation_cycling", "premature_purchase")

_MOVE = re.compile(r"^(?:go to|go|move|walk to|teleport to)\s+(.+)$")
_EXAMINE = re.compile(r"^(?:examine|look at|look in|inspect)\s+(.+)$")
_TAKE = re.compile(r"^(?:take|pick up|get)\s+(.+?)(?:\s+from\s+.+)?$")
_NUM = re.compile(r"\s+\d+$")


def _norm(action: str | None) -> str:
    return " ".join(str(action or "").lower().split())


def _is_target(obj: str, targets: Sequence[str]) -> bool:
    base = _NUM.sub("", obj)
    return any(t and (t in base or base in t) for t in targets)


def max_run(actions: Sequence[str]) -> int:
    """Length of the longest run of identical consecutive actions."""
    best = run = 0
    prev = None
    for a in actions:
        run = run + 1 if a == prev else 1
        prev = a
        best = max(best, run)
    return best


def looping(actions: Sequence[str]) -> bool:
    if not actions:
        return False
    if max_run(actions) >= 5:
        return True
    return len(actions) >= 4 and Counter(actions).most_common(1)[0][1] >= 0.5 * len(actions)


def redundant_exploration(actions: Sequence[str]) -> bool:
    seen: set[str] = set()
    revisits = 0
    examined: Counter[str] = Counter()
    for a in actions:
        m = _MOVE.match(a)
        if m:
            dest = m.group(1)
            revisits += dest in seen
            seen.add(dest)
        m = _EXAMINE.match(a)
        if m:
            examined[m.group(1)] += 1
    return revisits >= 8 or (bool(examined) and max(examined.values()) >= 5)


def wrong_object_focus(actions: Sequence[str], targets: Sequence[str] | None) -> bool | None:
    if not targets:
        return None
    targets = [_norm(t) for t in targets]
    examined: Counter[str] = Counter()
    wrong_takes = 0
    for a in actions:
        m = _EXAMINE.match(a)
        if m and not _is_target(m.group(1), targets):
            examined[m.group(1)] += 1
        m = _TAKE.match(a)
        if m and not _is_target(m.group(1), targets):
            wrong_takes += 1
    return (bool(examined) and max(examined.values()) >= 4) or wrong_takes >= 7


def webshop_patterns(ep: Episode) -> dict[str, bool]:
    actions = [_norm(s.action) for s in ep.steps]
    queries = Counter(a[len("search[") : -1] for a in actions if a.startswith("search[") and a.endswith("]"))
    bought = any(s.info.get("purchase") for s in ep.steps) or "click[buy now]" in actions
    backs = sum(a == "click[back to search]" for a in actions)
    return {
        "query_looping": bool(queries) and max(queries.values()) >= 3,
        "navigation_cycling": backs >= 3 and not bought,
        "premature_purchase": any(bool(s.info.get("premature_purchase")) for s in ep.steps),
    }


def is_webshop(ep: Episode) -> bool:
    return ep.task_type == "webshop" or any(_norm(s.action).startswith(("search[", "click[")) for s in ep.steps)


def episode_patterns(ep: Episode) -> dict[str, bool | None]:
    """Every pattern for one episode (``None`` = cannot be judged for it)."""
    actions = [_norm(s.action if s.action is not None else s.action_text) for s in ep.steps]
    out: dict[str, bool | None] = {
        "looping": looping(actions),
        "redundant_exploration": redundant_exploration(actions),
        "wrong_object_focus": wrong_object_focus(actions, ep.info.get("target_objects")),
    }
    if is_webshop(ep):
        out.update(webshop_patterns(ep))
    else:
        out.update({k: None for k in WEBSHOP_PATTERNS})
    return out


def failure_pattern_rates(episodes: Sequence[Episode]) -> dict[str, float | int]:
    """Share of failed episodes showing each pattern (patterns no failed episode can be judged on are omitted), plus
    ``failed_episodes``.  Failed: lost by the policy; an episode the env failed (no steps to judge) is not one."""
    failed = [e for e in episodes if not e.won and e.error is None]
    out: dict[str, float | int] = {"failed_episodes": len(failed)}
    if not failed:
        return out
    flags = [episode_patterns(e) for e in failed]
    for name in PATTERNS + WEBSHOP_PATTERNS:
        judged = [f[name] for f in flags if f[name] is not None]
        if judged:
            out[name] = sum(bool(v) for v in judged) / len(judged)
    return out


def episode_summary(ep: Episode) -> dict:
    """One evaluation episode as plain data for the validation report: what happened and which patterns it shows."""
    return {
        "seed": ep.seed,
        "task_id": ep.info.get("task_id"),
        "task_type": ep.task_type,
        "task": ep.task,
        "won": ep.won,
        "score": ep.score,
        "initial_score": ep.initial_score,
        "score_gained": ep.score_gained,
        "steps": len(ep.steps),
        "actions": [s.action if s.action is not None else s.action_text for s in ep.steps],
        "labels": [s.label for s in ep.steps] if ep.guided else None,
        "progress": [s.progress for s in ep.steps],  # what each action changed, as the env measured it (None: unknown)
        "invalid": [s.invalid for s in ep.steps],
        "format_ok": [s.format_ok for s in ep.steps],
        "error": ep.error,
        "truncated": ep.truncated,
        # as the rates count them: an episode the env failed is not judged
        "patterns": [k for k, v in episode_patterns(ep).items() if v] if not ep.won and ep.error is None else [],
    }
