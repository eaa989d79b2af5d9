"""ProcessEnv: an env in a child process plays what it plays in-process, a hung call is killed without blocking the
other slots, errors come back with their type, and no child outlives its env or its parent."""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from fakes import ScriptedLM, scripted_reply
from process_envs import (
    RELEASE,
    BrokenEnv,
    ChattyEnv,
    LockedEnv,
    MarkedEnv,
    MissingAttributeEnv,
    MissingFileEnv,
    NoSplitEnv,
    NotAnEnv,
    OddErrorEnv,
    SlowBuildEnv,
)

from sglightning.data import RolloutConfig
from sglightning.embedded import build_tiny_tokenizer
from sglightning.envs import build_env, check_env
from sglightning.envs.household import HouseholdEnv
from sglightning.envs.pool import EnvPool
from sglightning.envs.process import ProcessEnv
from sglightning.errors import ConfigError
from sglightning.guidance import GuidanceConfig
from sglightning.rollout import Rollout

HOUSEHOLD = functools.partial(HouseholdEnv, difficulty=1)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``within_s`` seconds (asked at least once)."""
    deadline = time.perf_counter() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):  # gone, or reaped while read
            return True
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.05)


def test_a_process_env_plays_what_the_env_plays():
    here, there = HOUSEHOLD(), ProcessEnv(HOUSEHOLD)
    try:
        assert (there.name, there.splits, there.action_help) == (here.name, here.splits, here.action_help)
        for seed, split in ((3, "train"), (11, "dev")):
            first = here.reset(seed, split)
            assert there.reset(seed, split) == first
            for action in (first.admissible_actions or ["look"])[:4]:
                assert there.step(action) == here.step(action)
        assert there.expert_action() == here.expert_action()
    finally:
        there.close()
    assert there._proc.returncode == 0


def test_build_env_follows_the_env_and_the_config():
    from sglightning.envs.alfworld import ALFWorldEnv

    assert ALFWorldEnv.own_process and not HouseholdEnv.own_process
    assert type(build_env(HOUSEHOLD)) is HouseholdEnv
    assert type(build_env(HOUSEHOLD, False)) is HouseholdEnv
    env = build_env(HOUSEHOLD, True)
    try:
        assert isinstance(env, ProcessEnv) and env.reset(1).observation == HOUSEHOLD().reset(1).observation
    finally:
        env.close()


def test_a_hung_step_under_a_shared_lock_fails_only_its_episode():
    """ALFWorld's simulator runs under a process-wide lock: in threads, a hung step holds it and every other slot's
    steps time out behind it, round after round (the control). In processes, each slot has its own lock, and the
    pool's timeout kills the hung child."""
    def rounds(processes: bool) -> tuple[list[list[str | None]], EnvPool]:
        factory = functools.partial(build_env, functools.partial(LockedEnv, bad_seeds=(1,), difficulty=0),
                                    processes)
        pool = EnvPool(factory, step_timeout_s=1.0, max_concurrency=2)
        errors = []
        pool.reset_many([(0, 2, "train"), (1, 1, "train")])
        errors.append([o.error for o in pool.step_many([(0, "look"), (1, "look")])])
        pool.reset_many([(0, 2, "train"), (1, 3, "train")])
        errors.append([o.error for o in pool.step_many([(0, "look"), (1, "look")])])
        return errors, pool

    RELEASE.clear()
    errors, pool = rounds(False)
    try:  # the control: the good slot fails in one of the two rounds at least
        assert errors[0][1] == "step: timeout after 1 s"
        assert any(e[0] == "step: timeout after 1 s" for e in errors) or errors[1][1] is not None
    finally:
        RELEASE.set()
        pool.close()
    RELEASE.clear()
    errors, pool = rounds(True)
    with pool:
        assert errors == [[None, "step: timeout after 1 s"], [None, None]]
        deadline = time.perf_counter() + 5
        while pool.abandoned_threads and time.perf_counter() < deadline:  # the closer kills the child: the call ends
            time.sleep(0.05)
        assert pool.timeouts == 1 and pool.abandoned_threads == 0
    RELEASE.set()


def test_a_timed_out_child_is_killed_and_leaves_nothing_open():
    gc.collect()  # earlier tests' garbage (pipes, files) closed now, not while this test counts
    fds = set(os.listdir("/proc/self/fd"))
    pool = EnvPool(functools.partial(ProcessEnv, functools.partial(LockedEnv, difficulty=0)), step_timeout_s=0.5)
    with pool:
        for _ in range(3):
            pool.reset_many([(0, 1, "train")])
            pid = pool.peek(0).pid
            assert pool.step_many([(0, "look")])[0].error == "step: timeout after 0.5 s"
            assert _gone(pid)
        assert pool.reset_many([(0, 2, "train")])[0].ok and pool.peek(0).pid != pid  # the slot is rebuilt
    deadline = time.perf_counter() + 10
    while pool.abandoned_threads and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert pool.abandoned_threads == 0 and set(os.listdir("/proc/self/fd")) <= fds  # none left open


def test_errors_come_back_with_their_type_and_message():
    env = ProcessEnv(HOUSEHOLD)
    try:
        with pytest.raises(ValueError, match="unknown split 'nope'"):
            env.reset(1, "nope")
        assert env.reset(1).observation  # the env goes on after its error
    finally:
        env.close()
    odd = ProcessEnv(OddErrorEnv)
    try:
        odd.reset(1)
        with pytest.raises(RuntimeError, match="^TwoArgumentError: step: the simulator lost its map$"):
            odd.step("look")
    finally:
        odd.close()
    with pytest.raises(ConfigError, match="^env.init_args.level: 7 is not a level of BrokenEnv$"):
        check_env(functools.partial(build_env, BrokenEnv, True), {"rollout.split": "train"})
    not_an_env = ProcessEnv(NotAnEnv)  # built in the child as the first call runs: its error comes with that call
    try:
        for _ in range(2):
            with pytest.raises(TypeError, match="built a NotAnEnv, not a sglightning TextEnv"):
                not_an_env.reset(1)
    finally:
        not_an_env.close()


def test_an_env_that_cannot_travel_is_named_in_one_line():
    class Local(HouseholdEnv):
        pass

    with pytest.raises(ValueError, match="^rollout.env_processes: the env .*Local.* cannot be sent to a process"):
        ProcessEnv(Local)


def test_close_runs_the_envs_close_and_ends_the_child(tmp_path):
    marker = tmp_path / "marker"
    env = ProcessEnv(functools.partial(MarkedEnv, str(marker), difficulty=0))
    env.reset(1)
    env.close()
    env.close()  # twice is safe
    assert marker.read_text() == "closed" and env._proc.returncode == 0
    with pytest.raises(RuntimeError, match="closed"):
        env.step("look")


def test_ctrl_c_does_not_reach_the_child():
    env = ProcessEnv(HOUSEHOLD)
    try:
        env.reset(1)
        os.kill(env.pid, signal.SIGINT)
        time.sleep(0.2)
        assert env.step("look").observation
    finally:
        env.close()


def test_the_child_ends_with_its_parent(tmp_path):
    """A parent that dies (killed, a crash) while its env is stuck in a call that holds the GIL leaves no child
    behind (a watching thread in the child never runs then)."""
    script = textwrap.dedent("""
        import functools, os, sys, threading, time
        from process_envs import GreedyEnv
        from sglightning.envs.process import ProcessEnv
        env = ProcessEnv(functools.partial(GreedyEnv, difficulty=0))
        env.reset(1)
        threading.Thread(target=env.step, args=("look",), daemon=True).start()
        time.sleep(0.3)
        print(env.pid, flush=True)
        os._exit(0)
    """)
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])})
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.strip())
    try:
        assert _gone(child)
    finally:  # a child that outlived its parent spins for ever: end it here
        if not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


def test_a_rollout_plays_the_same_episodes_in_processes():
    tok = build_tiny_tokenizer()
    batches = []
    for processes in (False, True):
        cfg = RolloutConfig(group_size=2, max_steps=3, env_processes=processes)
        r = Rollout(ScriptedLM(tok, scripted_reply()), tok, functools.partial(build_env, HOUSEHOLD, processes),
                    GuidanceConfig(), cfg)
        try:
            batches.append(r.run([1, 2]))
            assert isinstance(r.pool.peek(0), ProcessEnv) == processes
        finally:
            r.close()
    threads, processes = ([(e.seed, e.env_return, [(s.action, s.observation) for s in e.steps])
                           for e in b.episodes] for b in batches)
    assert threads == processes and all(e.error is None for e in batches[1].episodes)


def test_a_configured_env_travels_without_the_parser_around_it():
    """A config's env is partial(<jsonargparse's instantiator>, <its state>, cls, **init_args); under the CLI that
    state holds the whole run (the model too) and does not pickle: the child gets partial(cls, **init_args)."""
    import json
    import threading
    from collections.abc import Callable

    from jsonargparse import ArgumentParser

    from sglightning.envs.base import TextEnv

    parser = ArgumentParser()
    parser.add_argument("--env", type=Callable[[], TextEnv])
    given = {"class_path": "sglightning.envs.household.HouseholdEnv", "init_args": {"difficulty": 1}}
    configured = parser.instantiate(parser.parse_args(["--env", json.dumps(given)])).env
    assert isinstance(configured, functools.partial) and configured.args[1] is HouseholdEnv
    heavy = functools.partial(configured.func, threading.Lock(), *configured.args[1:], **configured.keywords)
    env = ProcessEnv(heavy)
    try:
        assert env.reset(4) == HOUSEHOLD().reset(4) and env.wrapped is HouseholdEnv
    finally:
        env.close()
    mine = functools.partial(_make, HouseholdEnv, difficulty=1)  # a user's own partial is kept as it is
    env = ProcessEnv(mine)
    try:
        assert env.reset(4).observation == "made: " + HOUSEHOLD().reset(4).observation
    finally:
        env.close()


def _make(cls, **kw):
    """A user's env factory that changes what the class builds."""
    env = cls(**kw)
    reset = env.reset

    def made(seed, split="train"):
        first = reset(seed, split)
        return dataclasses.replace(first, observation="made: " + first.observation)

    env.reset = made
    return env


def test_an_env_without_splits_plays_train_and_refuses_the_others():
    env = ProcessEnv(functools.partial(NoSplitEnv, difficulty=0))
    try:
        assert env.reset(2) == NoSplitEnv(difficulty=0).reset(2)
        with pytest.raises(ValueError, match="NoSplitEnv.reset takes no split argument, so it cannot play split 'dev'"):
            env.reset(2, "dev")
    finally:
        env.close()


def test_a_script_env_stays_in_the_trainers_process():
    """A class defined in a script or a notebook (``__main__``) cannot be built in a child: its own_process gives
    way, and asking for processes outright is one line."""
    class ScriptEnv(HouseholdEnv):
        own_process = True

    ScriptEnv.__module__ = "__main__"
    assert type(build_env(ScriptEnv)) is ScriptEnv
    with pytest.raises(ValueError, match="^rollout.env_processes: the env .*ScriptEnv cannot be sent to a process "
                                         r"\(it is defined in __main__"):
        build_env(ScriptEnv, True)


def test_a_hung_constructor_is_killed_by_the_reset_timeout():
    with EnvPool(functools.partial(ProcessEnv, SlowBuildEnv), reset_timeout_s=1.0) as pool:
        assert pool.reset_many([(0, 1, "train")])[0].error == "reset: timeout after 1 s"
        deadline = time.perf_counter() + 5
        while pool.abandoned_threads and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert pool.abandoned_threads == 0


def test_the_childs_output_stays_out_of_the_run_and_names_its_crash(capfd):
    env = ProcessEnv(functools.partial(ChattyEnv, difficulty=0))
    try:
        env.reset(1)
        env.step("look")
        with pytest.raises(TypeError, match="^step returned a value that cannot travel"):
            env.step("lambda")
        with pytest.raises(RuntimeError, match="^KeyboardInterrupt: pressed inside the env$"):
            env.step("interrupt")
        with pytest.raises(ValueError, match=r"^no such room \(from KeyError: 'room'\)$"):
            env.step("chain")
        assert env.step("look").observation  # the child goes on after each
        with pytest.raises(RuntimeError, match=r"ended during step \(exit code 3: ChattyEnv: the simulator's map is "
                                               r"corrupt\)"):
            env.step("crash")
    finally:
        env.close()
    out, err = capfd.readouterr()
    assert "ChattyEnv" not in out + err


def test_a_poisoned_current_folder_does_not_reach_the_child(tmp_path, monkeypatch):
    """``python -m`` would put the current folder first on the child's path: a ``logging.py`` there broke it."""
    (tmp_path / "logging.py").write_text("raise ImportError('the wrong logging')\n")
    monkeypatch.chdir(tmp_path)
    env = ProcessEnv(HOUSEHOLD)
    try:
        assert env.reset(1).observation
    finally:
        env.close()


def test_the_split_error_names_the_env_not_its_wrapper():
    with pytest.raises(ConfigError, match="'valid_seen' is not a split of HouseholdEnv"):
        check_env(functools.partial(build_env, HOUSEHOLD, True), {"evaluation.split": "valid_seen"})


def test_two_closes_at_once_close_the_env_once_and_politely(tmp_path):
    import threading

    marker = tmp_path / "marker"
    env = ProcessEnv(functools.partial(MarkedEnv, str(marker), difficulty=0))
    env.reset(1)
    closers = [threading.Thread(target=env.close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
    assert marker.read_text() == "closed" and env._proc.returncode == 0 and env._sock.fileno() == -1


def test_the_pool_closes_the_env_itself_not_only_its_process(tmp_path):
    """The pool ends a slot's thread as it closes the slot's env: the child must not die with that thread before the
    env's own close has run."""
    markers = [tmp_path / f"marker{i}" for i in range(3)]
    with EnvPool(lambda: ProcessEnv(functools.partial(MarkedEnv, str(markers[len(made)]), difficulty=0))) as pool:
        made = []
        for slot in range(3):
            pool.env(slot)
            made.append(slot)
        pool.reset_many([(slot, slot, "train") for slot in range(3)])
    assert [m.read_text() if m.exists() else None for m in markers] == ["closed"] * 3


def test_a_constructors_own_error_comes_back_whatever_its_type():
    """An OSError of the env's constructor was taken for the socket's failure (its type and message lost, a second
    of waiting); an AttributeError made the config check skip the env, and its splits."""
    env = ProcessEnv(MissingFileEnv)
    try:
        t0 = time.perf_counter()
        for _ in range(2):
            with pytest.raises(FileNotFoundError, match="^no such game file: /games/kitchen.json$"):
                env.reset(1)
        assert time.perf_counter() - t0 < 5
    finally:
        env.close()
    for cls, line in ((MissingFileEnv, "FileNotFoundError: no such game file"),
                      (MissingAttributeEnv, "AttributeError: 'NoneType' object has no attribute 'rooms'")):
        with pytest.raises(ConfigError, match=f"^env: cannot create the environment: {line}"):
            check_env(functools.partial(build_env, cls, True), {"evaluation.split": "dev"})


def test_a_forked_process_builds_envs_too():
    """A process forked after a ProcessEnv was built (Lightning's ddp_fork, a notebook) had the spawner without its
    thread: every build waited for ever."""
    first = ProcessEnv(HOUSEHOLD)
    try:
        first.reset(1)
        child = os.fork()
        if child == 0:  # the forked process: build one, play one reset, report by the exit code
            code = 1
            try:
                env = ProcessEnv(HOUSEHOLD)
                code = 0 if env.reset(2).observation else 1
                env.close()
            finally:
                os._exit(code)
        deadline = time.perf_counter() + 30
        while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.perf_counter() < deadline:
            time.sleep(0.1)
        if done[0] == 0:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        first.close()


def test_an_env_that_takes_an_env_travels_too():
    """An init argument that takes a class (FaultyEnv's env) is a jsonargparse partial as well, with the parser's
    state inside: it is made portable too."""
    import json
    import threading
    from collections.abc import Callable

    from jsonargparse import ArgumentParser

    from sglightning.envs.base import TextEnv
    from sglightning.envs.faults import FaultyEnv

    parser = ArgumentParser()
    parser.add_argument("--env", type=Callable[[], TextEnv])
    given = {"class_path": "sglightning.envs.faults.FaultyEnv",
             "init_args": {"env": {"class_path": "sglightning.envs.household.HouseholdEnv",
                                   "init_args": {"difficulty": 1}}}}
    outer = parser.instantiate(parser.parse_args(["--env", json.dumps(given)])).env
    inner = outer.keywords["env"]
    assert isinstance(inner, functools.partial) and inner.args[1] is HouseholdEnv
    heavy = functools.partial(inner.func, threading.Lock(), *inner.args[1:], **inner.keywords)
    outer = functools.partial(outer.func, threading.Lock(), *outer.args[1:], **{**outer.keywords, "env": heavy})
    env = ProcessEnv(outer)
    try:
        assert env.wrapped is FaultyEnv and env.reset(4) == HOUSEHOLD().reset(4)
    finally:
        env.close()
