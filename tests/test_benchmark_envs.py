"""Real TextWorldExpress and ScienceWorld (JVM) episodes: gold paths, splits, invalid actions, rollouts through the
worker pool, no leaked JVMs, a JVM killed mid-episode.  Needs Java 17 and the ``benchmarks`` extra (CI installs
both)."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
from fakes import ScriptedLM, scripted_reply

from sglightning.data import RolloutConfig
from sglightning.embedded import build_tiny_tokenizer
from sglightning.envs.pool import EnvPool, live_java_processes
from sglightning.envs.scienceworld import ScienceWorldEnv
from sglightning.envs.textworld_express import TextWorldExpressEnv
from sglightning.episodes import split_groups
from sglightning.guidance import GuidanceConfig
from sglightning.rollout import Rollout

pytestmark = pytest.mark.jvm


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def twc():
    env = TextWorldExpressEnv("twc")
    yield env
    env.close()


@pytest.fixture(scope="module")
def sw():
    env = ScienceWorldEnv(["find-plant", "use-thermometer"], gold_path=True)
    yield env
    env.close()


def _play_expert(env, limit=200):
    res, n = None, 0
    while (a := env.expert_action()) is not None and n < limit:
        res = env.step(a)
        n += 1
        if res.done:
            break
    return res, n


def _wait_no_java(timeout=10.0) -> list[int]:
    deadline = time.time() + timeout
    while live_java_processes() and time.time() < deadline:
        time.sleep(0.2)
    return live_java_processes()


# ---------------------------------------------------------------------------------------------------------- TWX
@pytest.mark.parametrize("game", ["twc", "coin"])
@pytest.mark.parametrize("split", ["train", "dev"])
def test_twx_gold_path_wins(game, split):
    with TextWorldExpressEnv(game) as env:
        r = env.reset(7, split)
        assert r.task_type == game and r.admissible_actions and r.info["gold_path_length"] > 0
        res, n = _play_expert(env)
        assert res is not None and res.won and res.done and res.reward == 1.0 and res.score == 100.0
        assert n <= r.info["gold_path_length"]


def test_twx_seed_and_split_mapping(twc):
    a, b = twc.reset(3, "train"), twc.reset(3, "train")
    assert a.observation == b.observation and a.info["task_id"] == "twc/train/3"
    assert twc.reset(1003, "train").info["task_id"] == "twc/train/3"  # seed % 1000 within the fold
    assert twc.reset(3, "dev").info["task_id"] == "twc/dev/10003"
    assert twc.reset(3, "test").info["task_id"] == "twc/test/20003"
    with pytest.raises(ValueError, match="unknown split 'valid_seen'"):
        twc.reset(3, "valid_seen")


def test_twx_invalid_action_is_flagged_and_the_episode_goes_on(twc):
    r = twc.reset(5)
    res = twc.step("fly to the moon")
    assert res.invalid_action and not res.done and res.admissible_actions == sorted(r.admissible_actions)
    ok = twc.step(r.admissible_actions[0])
    assert not ok.invalid_action


def test_twx_bad_args_name_the_key():
    with pytest.raises(ValueError, match="env.init_args.game: 'chess' is not one of"):
        TextWorldExpressEnv("chess")
    # the simulator accepted these and played no game at all: every episode lost at 0 %, no error counted
    with pytest.raises(ValueError, match="env.init_args.game_params: 'numLocations=three' is not key=integer"):
        TextWorldExpressEnv("twc", game_params="numLocations=three")


def test_twx_a_parameter_the_simulator_refuses_names_the_key():
    env = TextWorldExpressEnv("coin", game_params="numLocations=1000")
    try:
        with pytest.raises(ValueError, match="env.init_args.game_params: 'numLocations=1000': Number of locations "
                                             "must be less than or equal to 11"):
            env.reset(1)
    finally:
        env.close()


@pytest.mark.slow
def test_twx_rollout_through_the_pool_and_no_jvm_left(tok):
    before = set(live_java_processes())
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, TextWorldExpressEnv, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=4))
    batch = r.run([11, 12])
    assert len(set(live_java_processes()) - before) == 4  # one JVM per episode slot
    for ep in batch.episodes:
        assert ep.error is None and len(ep.steps) >= 1 and ep.task
        assert all(not s.invalid for s in ep.steps)  # the first admissible action is always valid
    g0 = [e for e in batch.episodes if e.group == 0]
    assert g0[0].initial_observation == g0[1].initial_observation  # a group shares its task
    assert split_groups(batch.episodes) == []  # every group (rollout/split_groups stays 0 on a shipped env)
    r.run([13])  # workers are reused: no new JVMs
    assert len(set(live_java_processes()) - before) == 4
    r.close()
    assert not set(_wait_no_java()) - before


@pytest.mark.slow
def test_killed_jvm_fails_only_its_episode_and_the_worker_is_rebuilt(tok):
    before = set(live_java_processes())
    state = {"killed": None}

    def action(ctx: str) -> str:
        # at the second turn of some episode, kill one env's JVM (as an OOM killer or a crash would)
        if state["killed"] is None and ctx.count("Observation:") >= 2:
            pid = sorted(set(live_java_processes()) - before)[0]
            os.kill(pid, signal.SIGKILL)
            state["killed"] = pid
        found = ctx.rsplit("Admissible actions: ", 1)
        return found[1].split("; ")[0].split("\n")[0] if len(found) == 2 else "look around"

    r = Rollout(ScriptedLM(tok, scripted_reply(action=action)), tok, TextWorldExpressEnv, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=4, env_step_timeout_s=30))
    batch = r.run([21, 22])
    assert state["killed"] is not None
    failed = [e for e in batch.episodes if e.error]
    assert len(failed) == 1 and failed[0].error.startswith("step: ") and not failed[0].won
    assert all(len(e.steps) >= 2 for e in batch.episodes if not e.error)
    assert r.env_errors == 1
    batch = r.run([23, 24])  # the dead worker was replaced; the run goes on
    assert all(e.error is None for e in batch.episodes)
    r.close()
    assert not set(_wait_no_java()) - before


# ---------------------------------------------------------------------------------------------- ScienceWorld
def test_scienceworld_gold_path_wins_on_dev(sw):
    for seed in (0, 1):  # task 0 and task 1
        r = sw.reset(seed, "dev")
        assert r.admissible_actions is None and r.task_type in ("find-plant", "use-thermometer")
        res, _ = _play_expert(sw)
        assert res.won and res.score == 100.0 and res.reward == 1.0


def test_scienceworld_free_form_prompt_and_invalid_actions(sw):
    r = sw.reset(4, "train")
    assert r.score is not None and 0.0 <= r.score <= 100.0  # the score at reset (some variations start above 0)
    assert "focus on OBJ" in r.action_help and "Rooms:" in r.action_help and "greenhouse" in r.action_help
    assert r.task and r.task in r.observation
    res = sw.step("fly to the moon")
    assert res.invalid_action and not res.done and res.info["score_delta"] == 0
    res = sw.step("look around")
    assert not res.invalid_action and "This room is called" in res.observation


def test_scienceworld_splits_are_disjoint_and_seeded(sw):
    train = {sw.task_of(s, "train") for s in range(0, 40, 2)}  # task 0 (seeds with seed % 2 == 0)
    dev = {sw.task_of(s, "dev") for s in range(0, 40, 2)}
    assert train and dev and not train & dev
    assert sw.task_of(6, "test") == sw.task_of(6, "test")
    a, b = sw.reset(6, "test"), sw.reset(6, "test")
    assert a.observation == b.observation and a.info["task_id"] == b.info["task_id"]


def test_scienceworld_rollout_free_form_actions(tok):
    factory = functools.partial(ScienceWorldEnv, ["use-thermometer"])
    r = Rollout(ScriptedLM(tok, scripted_reply(action=lambda ctx: "look around")), tok, factory,
                GuidanceConfig(), RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([3])
    assert split_groups(batch.episodes) == []  # the group's members start in the same room
    for ep in batch.episodes:
        assert ep.error is None and len(ep.steps) == 2 and ep.truncated
        assert [s.action for s in ep.steps] == ["look around"] * 2 and not any(s.invalid for s in ep.steps)
        assert ep.score == 0.0 or ep.score is None or ep.score > 0
    r.close()


def test_scienceworld_bad_task_name():
    with pytest.raises(ValueError, match="env.init_args.task_names: unknown task"):
        ScienceWorldEnv(["boil-the-ocean"])


@pytest.mark.slow
def test_pool_closes_scienceworld_jvms():
    before = set(live_java_processes())
    pool = EnvPool(functools.partial(ScienceWorldEnv, ["find-plant"]))
    out = pool.reset_many([(0, 0, "train"), (1, 0, "train")])
    assert all(o.ok for o in out)
    assert len(set(live_java_processes()) - before) == 2
    pool.close()
    assert not set(_wait_no_java()) - before


def test_twx_close_ends_the_jvm_so_the_simulators_own_finaliser_stays_quiet():
    """After ``close()`` the JVM has exited, so the simulator's ``__del__`` (which closes again at garbage collection)
    writes nothing to a dead pipe — it printed a BrokenPipeError traceback at the end of every twc run."""
    env = TextWorldExpressEnv("twc")
    env.reset(0, "train")
    proc = env._env._gateway.java_process
    env.close()
    assert proc.poll() is not None
    env._env.close()  # what the simulator's __del__ does: no error


# ------------------------------------------------------------------------------------- the first action's progress
def _expert_only(cls, **kwargs):
    """``cls`` whose expert action is the only admissible one, so that a scripted first-admissible policy plays the
    gold path through the real rollout."""

    class ExpertOnly(cls):
        def reset(self, seed, split="train"):
            res = super().reset(seed, split)
            res.admissible_actions = [self.expert_action()]
            return res

        def step(self, action):
            res = super().step(action)
            nxt = self.expert_action()
            res.admissible_actions = [nxt] if nxt else res.admissible_actions
            return res

    return functools.partial(ExpertOnly, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("env", [
    _expert_only(TextWorldExpressEnv, game="twc"),
    _expert_only(ScienceWorldEnv, task_names=["find-plant"], gold_path=True),
], ids=["twx", "scienceworld"])
def test_the_first_actions_progress_is_measured(tok, env):
    """Both simulators have a score: the reset reports the starting one, so the progress of every action, the first
    included, is known (TextWorldExpress reported none at reset: the first action's progress was lost, and an oracle
    label or calibration pair with it)."""
    gc = GuidanceConfig(decoding="constrained", action_decoding="admissible")
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, env, gc, RolloutConfig(group_size=2, max_steps=6))
    try:
        batch = r.run([3, 4])
    finally:
        r.close()
    assert split_groups(batch.episodes) == []
    for ep in batch.episodes:
        assert ep.error is None and ep.initial_score is not None
        assert all(s.progress is not None for s in ep.steps), [s.progress for s in ep.steps]
    assert any(s.progress > 0 for ep in batch.episodes for s in ep.steps)  # the gold path scores
