"""ProcessEnv: an env in a child process plays what it plays in-process, a hung call is killed without blocking the
other slots, errors come back with their type, and no child outlives its env or its parent."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from fakes import ScriptedLM, scripted_reply
from process_envs import RELEASE, BrokenEnv, LockedEnv, MarkedEnv, NotAnEnv, OddErrorEnv

from sglightning.data import RolloutConfig
from sglightning.envs import build_env, check_env
from sglightning.envs.household import HouseholdEnv
from sglightning.envs.pool import EnvPool
from sglightning.envs.process import ProcessEnv
from sglightning.errors import ConfigError
from sglightning.guidance import GuidanceConfig
from sglightning.models import build_tiny_tokenizer
from sglightning.rollout import Rollout

HOUSEHOLD = functools.partial(HouseholdEnv, difficulty=1)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``within_s`` seconds."""
    deadline = time.perf_counter() + within_s
    while time.perf_counter() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


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
    fds = len(os.listdir("/proc/self/fd"))
    pool = EnvPool(functools.partial(ProcessEnv, functools.partial(LockedEnv, difficulty=0)), step_timeout_s=0.5)
    with pool:
        for _ in range(3):
            pool.reset_many([(0, 1, "train")])
            pid = pool.peek(0).pid
            assert pool.step_many([(0, "look")])[0].error == "step: timeout after 0.5 s"
            assert _gone(pid)
        assert pool.reset_many([(0, 2, "train")])[0].ok and pool.peek(0).pid != pid  # the slot is rebuilt
    time.sleep(0.2)
    assert pool.abandoned_threads == 0 and len(os.listdir("/proc/self/fd")) == fds


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
    with pytest.raises(TypeError, match="built a NotAnEnv, not a sglightning TextEnv"):
        ProcessEnv(NotAnEnv)


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
    """A parent that dies (killed, a crash) while its env is stuck in a call leaves no child behind."""
    script = textwrap.dedent("""
        import functools, os, sys, threading, time
        from process_envs import LockedEnv
        from sglightning.envs.process import ProcessEnv
        env = ProcessEnv(functools.partial(LockedEnv, difficulty=0))
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
    assert _gone(int(out.stdout.strip()))


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


def _instantiate(parser_state, cls, *args, **kwargs):
    return cls(*args, **kwargs)


def test_a_configured_env_travels_without_the_parser_around_it():
    """A config hands over partial(instantiator, <parser state>, cls, **init_args); the parser's state holds the
    whole run (the model too) and does not pickle: the child gets partial(cls, **init_args)."""
    import threading

    configured = functools.partial(_instantiate, threading.Lock(), HouseholdEnv, difficulty=1)
    env = ProcessEnv(configured)
    try:
        assert env.reset(4) == configured().reset(4)
    finally:
        env.close()
