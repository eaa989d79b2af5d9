"""WebShop adapter: observation parsing and action formatting on text-mode strings written here, and episode
bookkeeping against a fake simulator with ``web_agent_site``'s interface (the real simulator cannot be installed
here)."""

from __future__ import annotations

import functools

import pytest
from fakes import ScriptedLM, scripted_reply
from hypothesis import given, settings
from hypothesis import strategies as st

from sglightning.data import RolloutConfig
from sglightning.diagnostics import episode_patterns
from sglightning.embedded import build_tiny_tokenizer
from sglightning.envs.webshop import (
    WebShopEnv,
    format_observation,
    instruction_of,
    normalise_action,
    parse_text_observation,
)
from sglightning.episodes import split_groups
from sglightning.guidance import GuidanceConfig, parse_action
from sglightning.rollout import Rollout

INSTR = "i need a red cotton t-shirt in size large, and price lower than 30.00 dollars"
START = f"WebShop [SEP] Instruction: [SEP] {INSTR} [SEP] Search"
RESULTS = (
    "Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B07XKQ8ZQ1 [SEP] Cotton Crew T-Shirt, Red "
    "[SEP] $12.99 [SEP] B09ABC1234 [SEP] Linen Shirt [SEP] $45.00"
)
ITEM = (
    "Back to Search [SEP] < Prev [SEP] size [SEP] small [SEP] large [SEP] color [SEP] red [SEP] blue [SEP] "
    "Cotton Crew T-Shirt, Red [SEP] Price: $12.99 [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews "
    "[SEP] Buy Now"
)


class FakeWebAgentTextEnv:
    """The slice of ``web_agent_site.envs.WebAgentTextEnv`` the adapter uses; one product, scripted pages."""

    instances: list[FakeWebAgentTextEnv] = []

    def __init__(self, observation_mode="html", num_products=None, human_goals=True, **kw):
        assert observation_mode == "text"
        self.kwargs = dict(num_products=num_products, human_goals=human_goals, **kw)
        self.server = type("S", (), {"goals": [None] * 2000})()
        self.page = "start"
        self.sessions: list[int] = []
        self.closed = 0
        self.selected: set[str] = set()
        FakeWebAgentTextEnv.instances.append(self)

    @property
    def observation(self):
        return {"start": START, "results": RESULTS, "item": ITEM, "done": "Thank you for shopping with us!"}[self.page]

    @property
    def instruction_text(self):
        return f"Instruction: {INSTR}"

    def reset(self, session=None):
        self.sessions.append(session)
        self.page, self.selected = "start", set()
        return self.observation, None

    def get_available_actions(self):
        clickables = {
            "start": [],
            "results": ["back to search", "next >", "b07xkq8zq1", "b09abc1234"],
            "item": ["back to search", "< prev", "small", "large", "red", "blue", "description", "features",
                     "reviews", "buy now"],
            "done": [],
        }[self.page]
        return {"has_search_bar": self.page == "start", "clickables": clickables}

    def step(self, action):
        reward, done = 0.0, False
        if action.startswith("search["):
            self.page = "results"
        elif action == "click[back to search]":
            self.page = "start"
        elif action == "click[b07xkq8zq1]":
            self.page = "item"
        elif action in ("click[large]", "click[red]", "click[small]", "click[blue]"):
            self.selected.add(action[6:-1])
        elif action == "click[buy now]":
            self.page, done = "done", True
            reward = 1.0 if self.selected == {"large", "red"} else 0.5 if self.selected else 0.25
        return self.observation, reward, done, None

    def close(self):
        self.closed += 1


SIMULATOR = functools.partial(WebShopEnv, simulator=FakeWebAgentTextEnv)


def test_text_observation_parsing():
    assert parse_text_observation(START) == ["WebShop", "Instruction:", INSTR, "Search"]
    assert instruction_of(START) == INSTR
    assert instruction_of("Instruction: buy socks [SEP] Search") == "buy socks"
    assert instruction_of(RESULTS) == ""
    page = format_observation(RESULTS, {"has_search_bar": False, "clickables": ["back to search", "b07xkq8zq1"]})
    assert page.splitlines()[0] == "Back to Search" and "$12.99" in page.splitlines()
    assert page.endswith("Available actions: click[back to search], click[b07xkq8zq1]")
    start = format_observation(START, {"has_search_bar": True, "clickables": []})
    assert start.endswith("Available actions: search[<your query>]")


@pytest.mark.parametrize(
    "raw, page, expected",
    [
        ("search[ red  cotton\ntshirt ]", "start", "search[red cotton tshirt]"),
        ("SEARCH[red shirt]", "start", "search[red shirt]"),
        ("click[B07XKQ8ZQ1]", "results", "click[b07xkq8zq1]"),
        ("click[Buy Now]", "item", "click[buy now]"),
        ("search[red shirt]", "results", None),  # no search bar on a results page
        ("search[]", "start", None),
        ("search[<your query>]", "start", None),  # the template itself
        ("click[checkout]", "item", None),
        ("buy the red one", "item", None),
        ("click[large", "item", None),
    ],
)
def test_action_normalisation(raw, page, expected):
    env = FakeWebAgentTextEnv(observation_mode="text")
    env.page = page
    action, problem = normalise_action(raw, env.get_available_actions())
    assert action == expected
    assert (problem == "") == (expected is not None)


def test_paper_think_action_format_parses_to_an_action():
    out = "<think>the first result is a red cotton shirt</think><action>click[B07XKQ8ZQ1]</action>"
    assert parse_action(out).action == "click[B07XKQ8ZQ1]"


def test_episode_reward_score_and_purchase_flags():
    FakeWebAgentTextEnv.instances = []
    env = SIMULATOR(num_products=1000)
    r = env.reset(7, "test")
    simulator = FakeWebAgentTextEnv.instances[-1]
    assert simulator.sessions == [7] and simulator.kwargs["num_products"] == 1000
    assert r.task == INSTR and r.admissible_actions is None and r.info["task_id"] == "webshop/test/7"
    assert r.score == 0.0  # nothing bought yet: the purchase's progress is measured against it
    assert env.reset(7, "dev").info["session"] == 507 and env.reset(7, "train").info["session"] == 1507
    assert env.reset(600, "test").info["session"] == 100  # seed % 500 within the test goals
    s = env.step("search[red cotton t-shirt]")
    assert s.info["query"] == "red cotton t-shirt" and not s.invalid_action and "click[b07xkq8zq1]" in s.observation
    bad = env.step("search[again]")
    assert bad.invalid_action and "no search bar" in bad.observation and not bad.done
    env.step("click[b07xkq8zq1]")
    env.step("click[large]")
    env.step("click[red]")
    end = env.step("click[buy now]")
    assert end.done and end.won and end.reward == 1.0 and end.score == 100.0
    assert end.info["purchase"] and not end.info["premature_purchase"]
    env.reset(8, "test")
    env.step("search[shirt]")
    env.step("click[b07xkq8zq1]")
    end = env.step("click[buy now]")
    assert end.done and not end.won and end.score == 25.0 and end.info["premature_purchase"]
    with pytest.raises(ValueError, match="unknown split 'valid_seen'"):
        env.reset(1, "valid_seen")
    env.close()
    env.close()
    assert simulator.closed == 1


def test_missing_simulator_says_how_to_install():
    with pytest.raises(ValueError, match="web_agent_site.*not on PyPI.*pip install -e"):
        WebShopEnv()


def test_webshop_rollout_and_failure_patterns():
    tok = build_tiny_tokenizer()
    queries = iter(["search[shirt]", "click[b07xkq8zq1]", "click[back to search]"] * 5)
    script: dict[int, str] = {}

    def action(ctx: str) -> str:
        turn = ctx.count("Observation:")
        if turn not in script:
            script[turn] = next(queries)
        return script[turn]

    r = Rollout(ScriptedLM(tok, scripted_reply(action=action)), tok, SIMULATOR, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=9))
    batch = r.run([3])
    assert split_groups(batch.episodes) == []  # both members start on the same instruction page
    for ep in batch.episodes:
        assert ep.error is None and len(ep.steps) == 9 and not ep.won and ep.task == INSTR
        assert [s.invalid for s in ep.steps] == [False] * 9
        flags = episode_patterns(ep)
        assert flags["query_looping"] and flags["navigation_cycling"] and not flags["premature_purchase"]
        assert ep.initial_score == 0.0 and all(s.progress is None for s in ep.steps)  # browsing: nothing measured
    r.close()
    # a purchase is measured against the starting 0: its progress is the score it earned
    buy = iter(["search[shirt]", "click[b07xkq8zq1]", "click[large]", "click[red]", "click[buy now]"])
    script.clear()

    def buying(ctx: str) -> str:
        turn = ctx.count("Observation:")
        if turn not in script:
            script[turn] = next(buy)
        return script[turn]

    r = Rollout(ScriptedLM(tok, scripted_reply(action=buying)), tok, SIMULATOR, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=9))
    ep = r.run([3]).episodes[0]
    r.close()
    assert ep.won and ep.steps[-1].progress == 100.0


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.booleans(), st.lists(st.text(max_size=20), max_size=8))
def test_fuzz_webshop_text_handling_never_raises(text, search_bar, clickables):
    available = {"has_search_bar": search_bar, "clickables": clickables}
    action, problem = normalise_action(text, available)
    assert (action is None) == bool(problem)
    if action is not None:
        assert action.startswith(("search[", "click[")) and action.endswith("]")
    assert isinstance(instruction_of(text), str)
    assert isinstance(format_observation(text, available), str)
