"""Failure patterns (the paper's Appendix B) on hand-written action sequences, and their rates in the validate
report."""

from __future__ import annotations

import pytest

from sglightning.diagnostics import (
    episode_patterns,
    failure_pattern_rates,
    looping,
    max_run,
    redundant_exploration,
    wrong_object_focus,
)
from sglightning.episodes import Episode, StepRecord
from sglightning.report import report_markdown


def ep(actions, won=False, targets=None, infos=None, task_type="default"):
    e = Episode(index=0, group=0, seed=0, won=won, task_type=task_type)
    e.steps = [StepRecord(observation="", action=a, info=(infos or {}).get(i, {})) for i, a in enumerate(actions)]
    if targets is not None:
        e.info = {"target_objects": targets}
    return e


@pytest.mark.parametrize(
    "actions, expected",
    [
        (["look"] * 5, True),  # 5 in a row
        (["look"] * 4 + ["go to desk 1"], True),  # 4 of 5 = 80 % of steps
        (["a", "b", "a", "c", "a", "d"], True),  # 50 % of steps
        (["a", "b", "a", "c", "d", "e", "f"], False),
        (["a", "a"], False),  # too short for the share rule
        ([], False),
    ],
)
def test_looping(actions, expected):
    assert looping(actions) is expected


def test_max_run():
    assert max_run(["a", "a", "b", "b", "b", "a"]) == 3 and max_run([]) == 0


def test_redundant_exploration():
    tour = [f"go to {p}" for p in ["desk 1", "shelf 1", "bed 1"] * 4]  # 12 moves, 9 revisits
    assert redundant_exploration(tour)
    assert not redundant_exploration(tour[:10])  # 7 revisits
    assert redundant_exploration(["examine drawer 1", "look"] * 5)  # one object examined 5 times
    assert not redundant_exploration(["examine drawer 1", "examine drawer 2"] * 2)


def test_wrong_object_focus():
    targets = ["apple", "fridge"]
    assert wrong_object_focus(["examine mug 1"] * 4, targets)
    assert not wrong_object_focus(["examine apple 1"] * 6, targets)  # the target itself
    assert wrong_object_focus(
        [f"take {o} 1 from desk 1" for o in ["mug", "pen", "book", "cd", "key", "cup", "box"]], targets)
    assert not wrong_object_focus(["take apple 1 from desk 1"] * 9, targets)
    assert wrong_object_focus(["examine mug 1"] * 4, None) is None  # no targets known: not judged


def test_webshop_patterns_only_on_webshop_episodes():
    infos = {3: {"purchase": True, "premature_purchase": True}}
    e = ep(["search[red shirt]", "click[b07xkq8zq1]", "click[back to search]", "click[buy now]"], infos=infos)
    flags = episode_patterns(e)
    assert flags["premature_purchase"] and not flags["query_looping"] and not flags["navigation_cycling"]
    cyc = ep(["search[a]", "click[back to search]"] * 3)
    assert episode_patterns(cyc)["navigation_cycling"] and episode_patterns(cyc)["query_looping"]
    household = episode_patterns(ep(["go to desk 1", "look"]))
    assert household["query_looping"] is None and household["premature_purchase"] is None


def test_rates_are_over_failed_episodes_and_skip_unjudgeable_ones():
    eps = [
        ep(["look"] * 6, targets=["apple"]),  # failed, looping
        ep(["go to desk 1", "take mug 1 from desk 1"], targets=["apple"]),  # failed, nothing
        ep(["look"] * 6, won=True),  # won: not counted even though it loops
        ep(["examine pen 1"] * 4),  # failed, loops, no targets: wrong-object focus not judged
    ]
    rates = failure_pattern_rates(eps)
    assert rates["failed_episodes"] == 3
    assert rates["looping"] == pytest.approx(2 / 3)
    assert rates["wrong_object_focus"] == 0.0  # judged on the 2 failed episodes with targets only
    assert "query_looping" not in rates  # no WebShop episode
    assert failure_pattern_rates([ep(["a"], won=True)]) == {"failed_episodes": 0}
    crashed = ep([])
    crashed.error = "reset: timeout after 1 s"  # the env failed it: no steps, nothing the policy did to judge
    assert failure_pattern_rates(eps + [crashed]) == rates


def test_report_markdown_has_the_paper_tables():
    report = {
        "split": "dev",
        "config": {"model": "m", "env": "E"},
        "versions": {"scienceworld": "1.2.3"},
        "modes": {
            "sg": {"episodes": 4, "rollout/success_rate": 0.5, "per_task_type_success": {"Pick": 1.0, "Clean": 0.0},
                   "failure_patterns": {"failed_episodes": 2, "looping": 0.5, "redundant_exploration": 0.0}},
            "nosg": {"episodes": 4, "rollout/success_rate": 0.25, "per_task_type_success": {"Pick": 0.5, "Clean": 0.0},
                     "failure_patterns": {"failed_episodes": 3, "looping": 1.0, "redundant_exploration": 1 / 3}},
        },
    }
    md = report_markdown(report)
    assert "(dev split)" in md and "| on | 4 | 0.500 |" in md and "| off | 4 | 0.250 |" in md
    assert "| self-guidance | Clean | Pick |" in md and "| on | 0.00 | 1.00 |" in md
    assert "| self-guidance | failed | looping | redundant exploration |" in md
    assert "| off | 3 | 1.00 | 0.33 |" in md
    assert "Versions: scienceworld 1.2.3" in md


def test_an_episode_the_env_failed_shows_no_pattern_in_the_report_either():
    """The rates leave out an episode the env failed (it is no policy failure); its report line still listed
    `looping`, so the report's episodes and its table disagreed."""
    from sglightning.diagnostics import episode_summary

    broken = ep(["look"] * 6)
    broken.error = "env: step raised RuntimeError"
    assert episode_summary(broken)["patterns"] == [] and failure_pattern_rates([broken]) == {"failed_episodes": 0}
    assert episode_summary(ep(["look"] * 6))["patterns"] == ["looping"]  # the control: lost by the policy


def test_pass_at_k_is_the_mean_over_every_k_subset_of_a_tasks_tries():
    """The unbiased pass@k equals, per task, the share of its k-subsets of tries with a win, averaged over tasks; by
    hand for three tasks of four tries, and against enumeration for random outcomes."""
    import itertools
    import random

    from sglightning.episodes import Episode
    from sglightning.report import pass_at_k

    def episodes(outcomes):
        eps = []
        for seed, wins in enumerate(outcomes):
            for w in wins:
                ep = Episode(index=len(eps), group=seed, seed=seed)
                ep.won = bool(w)
                eps.append(ep)
        return eps

    assert pass_at_k(episodes([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])) == pytest.approx(
        {"1": 5 / 12, "2": 0.5, "4": 2 / 3})
    assert pass_at_k(episodes([[1], [0]])) == {}  # one try a task: the success rate says it
    from sglightning.report import build_report, validation_line

    four = episodes([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    line = validation_line(build_report(3, 1, "dev", {}, {"sg": ({"rollout/success_rate": 5 / 12}, four)}))
    assert line == "validation at step 3: self-guidance on success=0.417 pass@4=0.667 (12 episodes)"
    rng = random.Random(0)
    outcomes = [[rng.random() < 0.3 for _ in range(6)] for _ in range(5)]
    got = pass_at_k(episodes(outcomes))
    assert set(got) == {"1", "2", "4", "6"}
    for k in (1, 2, 4, 6):
        subsets = [[any(c) for c in itertools.combinations(w, k)] for w in outcomes]
        assert got[str(k)] == pytest.approx(sum(sum(s) / len(s) for s in subsets) / len(outcomes))
