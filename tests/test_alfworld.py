"""ALFWorldEnv on the real ALFWorld simulator: hand-written fixture games -> alfworld-generate -> play (with expert)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from alfworld_games import FIXTURES, fixture_games

import sglightning.envs.alfworld as alfworld_module
from sglightning.envs.alfworld import TASK_TYPE_NAMES, TASK_TYPES, ALFWorldEnv

FIXTURE_IDS = [p.relative_to(FIXTURES / "json_2.1.1").as_posix() for p in fixture_games()]
PICK2 = "valid_seen/pick_two_obj_and_place-CD-None-Shelf-901/trial_T20240101_000006_000001"
HEAT = "train/pick_heat_then_place_in_recep-Potato-None-DiningTable-901/trial_T20240101_000004_000001"  # 2 potatoes
# the tests that play generated games take ~8 s together (generation ~2.5 s of it)


@pytest.fixture
def env(alfworld_data):
    e = ALFWorldEnv(str(alfworld_data), max_steps=50)
    yield e
    e.close()


def _traj(folder: Path) -> dict:
    return json.loads((folder / "traj_data.json").read_text())


def test_fixtures_cover_the_task_types():
    types = {TASK_TYPE_NAMES[_traj(p)["task_type"]] for p in fixture_games()}
    assert len(FIXTURE_IDS) >= 4
    assert {"Pick", "Clean", "Heat", "Cool", "Look", "Pick2"} <= types
    assert {rel.split("/")[0] for rel in FIXTURE_IDS} == {"train", "valid_seen", "valid_unseen"}
    for p in fixture_games():  # nothing generated is committed
        assert sorted(f.name for f in p.iterdir()) == ["initial_state.pddl", "traj_data.json"]


@pytest.mark.slow
def test_generation_produced_a_solvable_game_for_every_fixture(alfworld_data):
    for rel in FIXTURE_IDS:
        game = alfworld_data / "json_2.1.1" / rel / "game.tw-pddl"
        assert game.is_file(), rel
        data = json.loads(game.read_text())
        assert data["solvable"] is True and data["walkthrough"], rel


@pytest.mark.slow
@pytest.mark.parametrize("rel", FIXTURE_IDS)
def test_expert_solves_every_fixture_game(env, alfworld_data, rel):
    split = rel.split("/")[0]
    gamefile = str(alfworld_data / "json_2.1.1" / rel / "game.tw-pddl")
    seed = env.games(split).index(gamefile)
    traj = _traj(FIXTURES / "json_2.1.1" / rel)
    r = env.reset(seed, split)
    assert r.info["gamefile"] == gamefile and r.info["task_id"] == f"{rel}/game.tw-pddl"
    assert r.task_type == TASK_TYPE_NAMES[traj["task_type"]]
    assert r.info["target_objects"][0] == traj["pddl_params"]["object_target"].lower()
    assert r.task and r.task in r.observation and "Welcome" not in r.observation
    steps, res = 0, None
    while res is None or not res.done:
        action = env.expert_action()
        assert action is not None, f"expert gave up after {steps} steps on {rel}"
        assert action in (res.admissible_actions if res else r.admissible_actions)
        res = env.step(action)
        steps += 1
        assert not res.invalid_action
    assert res.won and res.reward == 1.0 and not res.info["truncated"] and steps < 50
    assert env.expert_action() is None  # the episode is over
    assert r.score is None and res.score is None and res.progress is None  # ALFWorld measures no progress


@pytest.mark.slow
def test_same_seed_same_game_and_seed_mod_n(env, alfworld_data):
    games = env.games("train")
    n = len(games)
    assert n >= 4 and games == sorted(games)
    first = env.reset(1)
    assert first.info["gamefile"] == games[1]
    env.step("look")
    again = env.reset(1)
    assert (again.observation, again.task) == (first.observation, first.task)
    assert again.info["task_id"] == first.info["task_id"]
    assert env.reset(1 + 3 * n).info["task_id"] == first.info["task_id"]
    assert env.reset(-1).info["gamefile"] == games[-1]
    other = ALFWorldEnv(str(alfworld_data))  # a second env object agrees
    assert other.reset(1).observation == first.observation
    other.close()
    assert len({env.reset(s).info["task_id"] for s in range(n)}) == n


@pytest.mark.slow
def test_splits_give_games_from_their_own_folder(env, alfworld_data):
    seen = {}
    for split in env.splits:
        games = env.games(split)
        assert games
        for seed in range(len(games)):
            r = env.reset(seed, split)
            assert r.info["task_id"].startswith(f"{split}/")
            assert Path(r.info["gamefile"]).is_relative_to(alfworld_data / "json_2.1.1" / split)
            seen[r.info["task_id"]] = split
    assert len(seen) == len(FIXTURE_IDS)
    with pytest.raises(ValueError, match=r"'test'.*train, valid_seen, valid_unseen"):
        env.reset(0, "test")


@pytest.mark.slow
def test_invalid_action_is_flagged_and_the_episode_continues(env):
    r = env.reset(0)
    assert r.admissible_actions and all(isinstance(a, str) for a in r.admissible_actions)
    res = env.step("fly to the moon")
    assert res.invalid_action and res.observation == "Nothing happens." and not res.done and not res.won
    assert res.admissible_actions == r.admissible_actions
    go = next(a for a in r.admissible_actions if a.startswith("go to "))
    res = env.step(f"  {go.upper()}. ")  # case, spaces and a trailing period are forgiven
    assert not res.invalid_action and res.observation.startswith("You arrive at")
    assert res.info["steps"] == 2


@pytest.mark.slow
def test_put_alias_and_target_objects(env, alfworld_data):
    pick = "train/pick_and_place_simple-Apple-None-CounterTop-901/trial_T20240101_000001_000001"
    seed = env.games("train").index(str(alfworld_data / "json_2.1.1" / pick / "game.tw-pddl"))
    r = env.reset(seed)
    assert r.task_type == "Pick" and r.info["target_objects"] == ["apple", "countertop"]
    for action in ("go to diningtable 1", "take apple 1 from diningtable 1", "go to countertop 1"):
        assert not env.step(action).invalid_action
    res = env.step("put apple 1 in/on countertop 1")  # the pre-0.4 ALFWorld verb
    assert res.won and res.done and res.reward == 1.0 and res.info["command"] == "move apple 1 to countertop 1"


@pytest.mark.slow
def test_max_steps_truncates(alfworld_data):
    env = ALFWorldEnv(str(alfworld_data), max_steps=3)
    env.reset(0)
    results = [env.step("look") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].won and results[-1].reward == 0.0
    with pytest.raises(RuntimeError, match="done=True"):
        env.step("look")
    env.close()


@pytest.mark.slow
def test_task_type_filter(alfworld_data):
    env = ALFWorldEnv(str(alfworld_data), task_types=["Look", "Cool"])
    assert [env.reset(s).task_type for s in range(3)] == ["Look"] * 3
    assert env.reset(0, "valid_seen").task_type == "Cool"
    with pytest.raises(ValueError, match="valid_unseen"):
        env.reset(0, "valid_unseen")  # only a Pick game there
    env.close()
    with pytest.raises(ValueError, match=r"unknown task type.*'Sweep'.*Pick, Look, Clean, Heat, Cool, Pick2"):
        ALFWorldEnv(str(alfworld_data), task_types=["Sweep"])
    assert TASK_TYPES == ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2")


def test_missing_data_path_names_alfworld_data(monkeypatch, tmp_path):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(ValueError, match=r"env\.init_args\.data_path.*ALFWORLD_DATA.*alfworld-download"):
        ALFWorldEnv()
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(ValueError, match=r"ALFWORLD_DATA") as err:
        ALFWorldEnv()
    assert str(tmp_path) in str(err.value) and "alfworld-download" in str(err.value)
    with pytest.raises(ValueError, match=r"env\.init_args\.data_path"):
        ALFWorldEnv(str(tmp_path / "nowhere"))


@pytest.mark.slow
def test_env_var_and_json_root_are_accepted(monkeypatch, alfworld_data):
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    a = ALFWorldEnv()
    b = ALFWorldEnv(str(alfworld_data / "json_2.1.1"))
    assert a.games("valid_seen") == b.games("valid_seen")
    a.close()
    b.close()


@pytest.mark.slow
def test_close_twice_is_safe_and_reset_reopens(alfworld_data):
    env = ALFWorldEnv(str(alfworld_data), expert=False)
    r = env.reset(0)
    assert env.expert_action() is None  # expert=False
    env.close()
    env.close()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("look")
    assert env.reset(0).observation == r.observation
    env.close()


def test_package_versions():
    versions = ALFWorldEnv.package_versions()
    assert set(versions) == {"alfworld", "textworld"} and all(versions.values())


def _expert_run(env: ALFWorldEnv, seed: int, split: str, inject: dict[int, str] | None = None
                ) -> tuple[list[str], bool]:
    env.reset(seed, split)
    actions, res = [], None
    while res is None or not res.done:
        if inject and len(actions) in inject:
            assert env.step(inject.pop(len(actions))).invalid_action
        action = env.expert_action()
        assert action is not None
        actions.append(action)
        res = env.step(action)
    return actions, res.won


@pytest.mark.slow
def test_expert_is_deterministic_and_ignores_invalid_actions(env, alfworld_data):
    seed = env.games("valid_seen").index(str(alfworld_data / "json_2.1.1" / PICK2 / "game.tw-pddl"))
    plan, won = _expert_run(env, seed, "valid_seen")
    assert won and plan.count("look") <= 1  # ALFWorld 0.4.2's expert wanders (67 steps) on this game without the fix
    assert len(plan) <= 15
    assert _expert_run(env, seed, "valid_seen") == (plan, True)
    # junk actions (even one that looks like a "go to") are not executed and do not confuse the expert's tracker
    assert _expert_run(env, seed, "valid_seen", {2: "go to the moon", 5: "take the moon"}) == (plan, True)


def test_missing_packages_give_the_install_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "alfworld", None)
    monkeypatch.setitem(sys.modules, "textworld", None)
    spec = importlib.util.spec_from_file_location("alfworld_probe", alfworld_module.__file__)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)  # the module itself imports without alfworld/textworld
    with pytest.raises(ValueError, match=r'pip install "sglightning\[alfworld\]"'):
        probe.ALFWorldEnv(str(tmp_path))


@pytest.mark.slow
def test_expert_draws_from_the_episode_seed(env, alfworld_data):
    """The expert picks one of the two potatoes at random: the reset seed fixes which, in any thread."""
    n = len(env.games("train"))
    seed = env.games("train").index(str(alfworld_data / "json_2.1.1" / HEAT / "game.tw-pddl"))
    plans = {k: _expert_run(env, seed + k * n, "train") for k in range(6)}  # same game, 6 expert seeds
    assert all(won for _, won in plans.values())
    assert len({tuple(p) for p, _ in plans.values()}) > 1  # the seed matters, and fixes the plan in any thread:
    envs = [ALFWorldEnv(str(alfworld_data)) for _ in range(3)]
    got: dict[int, tuple[list[str], bool]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _expert_run(envs[i], seed + i * n, "train")))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: plans[i] for i in range(3)}
    for e in envs:
        e.close()



@pytest.mark.slow
def test_alfworld_plays_in_processes_of_its_own(alfworld_data):
    """Built as a config builds it, ALFWorld runs in a child process: the expert still wins, the seed still fixes the
    expert's plan, and retiring a slot (a failure) leaves neither a planner library mapped in the trainer's process
    nor a child behind."""
    import functools

    from sglightning.envs import build_env
    from sglightning.envs.pool import EnvPool
    from sglightning.envs.process import ProcessEnv

    spec = functools.partial(ALFWorldEnv, str(alfworld_data))
    here = ALFWorldEnv(str(alfworld_data))
    n = len(here.games("train"))
    seed = here.games("train").index(str(alfworld_data / "json_2.1.1" / HEAT / "game.tw-pddl"))
    there = build_env(spec)
    try:
        assert isinstance(there, ProcessEnv) and there.splits == ALFWorldEnv.splits
        for k in range(3):
            assert _expert_run(there, seed + k * n, "train") == _expert_run(here, seed + k * n, "train")
    finally:
        there.close()
        here.close()
    mapped = _downward_maps()
    with EnvPool(functools.partial(build_env, spec)) as pool:
        pids = []
        for _ in range(3):
            assert pool.reset_many([(0, seed, "train")])[0].ok
            pids.append(pool.peek(0).pid)
            pool.retire(0)
        assert _downward_maps() == mapped
    time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def _downward_maps() -> int:
    """How many mappings of fast-downward's library this process holds."""
    return sum("downward" in line for line in Path("/proc/self/maps").read_text().splitlines())
