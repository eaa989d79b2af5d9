"""EnvPool: concurrent steps, timeouts, broken envs, clean shutdown (fake envs; the JVM cases live in
test_benchmark_envs.py)."""

from __future__ import annotations

import functools
import threading
import time

import pytest
from fakes import ScriptedLM, scripted_reply

from sglightning.data import RolloutConfig
from sglightning.embedded import build_tiny_tokenizer
from sglightning.envs.base import ResetResult, StepResult, TextEnv
from sglightning.envs.household import HouseholdEnv
from sglightning.envs.pool import EnvPool
from sglightning.guidance import GuidanceConfig
from sglightning.rollout import Rollout

RELEASE = threading.Event()  # set at the end of the module so that hung fake envs end their threads


class SleepyEnv(TextEnv):
    """Each step sleeps ``delay`` seconds (like a JVM env waiting on its socket, GIL released)."""

    def __init__(self, delay: float = 0.2):
        self.delay = delay
        self.closed = 0

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        return ResetResult(f"start {seed}", "wait", ["wait"], "sleepy")

    def step(self, action: str) -> StepResult:
        time.sleep(self.delay)
        return StepResult("waited", 0.0, False, admissible_actions=["wait"])

    def close(self) -> None:
        self.closed += 1


class HangingEnv(HouseholdEnv):
    """Hangs in ``step`` (until the module releases it) for seeds in ``bad_seeds``."""

    def __init__(self, bad_seeds=(1,), **kw):
        super().__init__(**kw)
        self.bad_seeds = bad_seeds

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        self._seed = seed
        return super().reset(seed, split)

    def step(self, action: str) -> StepResult:
        if self._seed in self.bad_seeds:
            RELEASE.wait(60)
        return super().step(action)


class GarbageStepEnv(HouseholdEnv):
    """For seed 1, a StepResult with one field wrong (``kind``: a reward that is no number, or NaN; admissible actions
    as one string, which a rollout would read letter by letter; no observation), or a plain string (``type``)."""

    def __init__(self, kind: str = "field", **kw):
        super().__init__(**kw)
        self.kind = kind

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        self._seed = seed
        res = super().reset(seed, split)
        if seed == 1 and self.kind == "help":
            res.action_help = 42  # type: ignore[assignment]
        return res

    def step(self, action: str) -> StepResult:
        res = super().step(action)
        if self._seed == 1:
            if self.kind == "type":
                return "garbage"  # type: ignore[return-value]
            bad = {"field": ("reward", "lots"), "nan": ("reward", float("nan")),
                   "letters": ("admissible_actions", "go"), "no_observation": ("observation", None),
                   "score": ("score", float("nan")), "progress": ("progress", float("inf")),
                   "info": ("info", ["truncated"])}[self.kind]
            setattr(res, *bad)
        return res


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_steps_of_different_slots_run_concurrently():
    with EnvPool(functools.partial(SleepyEnv, 0.3), max_concurrency=4) as pool:
        pool.reset_many([(i, i, "train") for i in range(4)])
        t0 = time.perf_counter()
        out = pool.step_many([(i, "wait") for i in range(4)])
        parallel = time.perf_counter() - t0
        assert all(o.ok for o in out) and parallel < 0.9  # 4 × 0.3 s serially
    with EnvPool(functools.partial(SleepyEnv, 0.3), concurrent=False) as pool:
        pool.reset_many([(i, i, "train") for i in range(4)])
        t0 = time.perf_counter()
        pool.step_many([(i, "wait") for i in range(4)])
        assert time.perf_counter() - t0 >= 1.2


def test_concurrency_limit_and_timeouts_count_from_the_start_of_a_call():
    # 4 calls of 0.6 s through 2 permits take two waves (~1.2 s); the second wave must not time out although it
    # finishes 1.2 s after submission, because its 0.9 s timeout runs from when it got a permit (0.3 s to spare
    # for a loaded box's thread wake-ups)
    with EnvPool(functools.partial(SleepyEnv, 0.6), max_concurrency=2, step_timeout_s=0.9) as pool:
        pool.reset_many([(i, i, "train") for i in range(4)])
        t0 = time.perf_counter()
        out = pool.step_many([(i, "wait") for i in range(4)])
        took = time.perf_counter() - t0
        assert all(o.ok for o in out) and 1.15 <= took < 3.0
    with pytest.raises(ValueError, match="max_concurrency"):
        EnvPool(SleepyEnv, max_concurrency=0)


def test_a_hung_call_gives_its_permit_back():
    class HangOnce(SleepyEnv):
        def step(self, action):
            if action == "hang":
                RELEASE.wait(60)
            return super().step(action)

    with EnvPool(functools.partial(HangOnce, 0.01), max_concurrency=1, step_timeout_s=0.3) as pool:
        pool.reset_many([(0, 0, "train"), (1, 1, "train")])
        out = pool.step_many([(0, "hang"), (1, "wait")])
        assert out[0].error == "step: timeout after 0.3 s" and out[1].ok  # slot 1 ran after slot 0 was abandoned
        assert all(o.ok for o in pool.step_many([(0, "wait"), (1, "wait")]))


def test_envs_are_reused_and_closed_once():
    with EnvPool(SleepyEnv) as pool:
        pool.reset_many([(0, 1, "train"), (1, 2, "train")])
        envs = [pool.peek(0), pool.peek(1)]
        pool.reset_many([(0, 3, "train"), (1, 4, "train")])
        assert [pool.peek(0), pool.peek(1)] == envs
    assert [e.closed for e in envs] == [1, 1]
    assert pool.size == 0


def test_a_hanging_step_times_out_and_fails_only_its_episode(tok):
    factory = functools.partial(HangingEnv, bad_seeds=(1,), difficulty=0, info_actions=False)
    cfg = RolloutConfig(group_size=2, max_steps=3, env_step_timeout_s=0.5)
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, factory, GuidanceConfig(), cfg)
    t0 = time.perf_counter()
    batch = r.run([1, 2])
    assert time.perf_counter() - t0 < 20
    bad = [e for e in batch.episodes if e.seed == 1]
    good = [e for e in batch.episodes if e.seed == 2]
    assert all(e.error == "step: timeout after 0.5 s" and e.done and not e.won for e in bad)
    assert all(e.error is None and len(e.steps) >= 1 for e in good)
    assert r.env_errors == 2 and r.pool.timeouts == 2 and r.pool.abandoned_threads == 2
    # the run goes on: the retired slots get fresh workers
    batch = r.run([2, 3])
    assert all(e.error is None for e in batch.episodes)
    r.close()


@pytest.mark.parametrize("kind, reason", [
    ("field", "reward 'lots' is not a finite number"), ("nan", "reward nan is not a finite number"),
    ("letters", "admissible_actions 'go' is not a list of str"), ("no_observation", "observation None is not a str"),
    ("type", "expected StepResult"), ("score", "score nan is not a finite number"),
    ("progress", "progress inf is not a finite number"), ("help", "action_help 42 is not a str"),
    ("info", "info \"['truncated']\" is not a dict")])  # a list read by key crashed the whole rollout
def test_garbage_step_results_fail_the_episode_with_a_reason(tok, kind, reason):
    factory = functools.partial(GarbageStepEnv, kind=kind, difficulty=0, info_actions=False)
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, factory, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([1, 2])
    bad = [e for e in batch.episodes if e.seed == 1]
    assert bad and all(e.error and reason in e.error for e in bad), [e.error for e in bad]
    assert all(e.error is None for e in batch.episodes if e.seed == 2)
    r.close()


def test_reset_that_hangs_past_its_timeout_fails_the_episode():
    class SlowReset(SleepyEnv):
        def reset(self, seed, split="train"):
            if seed == 1:
                RELEASE.wait(60)
            return super().reset(seed, split)

    with EnvPool(SlowReset, reset_timeout_s=0.3) as pool:
        out = pool.reset_many([(0, 1, "train"), (1, 2, "train")])
        assert out[0].error == "reset: timeout after 0.3 s" and out[1].ok


def test_an_env_built_after_its_slot_was_given_up_is_closed():
    """An env whose construction outlived reset_timeout_s (a JVM starting), or the pool's close, was stored by its
    worker after the pool had looked for it, and never closed: JVMs piled up, one per slow start."""
    built, closed = [], []

    class SlowStart(SleepyEnv):
        def __init__(self):
            super().__init__()
            time.sleep(0.5)
            built.append(self)

        def close(self):
            closed.append(self)

    with EnvPool(SlowStart, reset_timeout_s=0.2) as pool:
        assert pool.reset_many([(0, 1, "train")])[0].error == "reset: timeout after 0.2 s"
        _wait_for(lambda: len(closed) == 1)  # the slow env is built now, after its slot was retired
        assert len(built) == 1 and closed == built
        pool.reset_many([(1, 2, "train")])  # a second slot, still being built when the pool closes
    _wait_for(lambda: len(closed) == 2)
    assert len(built) == 2 and closed == built


def _wait_for(condition, seconds: float = 10.0) -> None:
    """Until ``condition()`` holds or ``seconds`` pass (a loaded box wakes threads late; a fixed sleep guessed)."""
    deadline = time.perf_counter() + seconds
    while not condition() and time.perf_counter() < deadline:
        time.sleep(0.02)


def test_failing_envs_leave_no_thread_behind_and_count_none_as_abandoned():
    """Each retired slot's closing thread was kept until close (one per failure, for the whole run), and a worker
    whose call had already failed counted as abandoned while its thread was still ending."""
    class Failing(SleepyEnv):
        def step(self, action):
            raise RuntimeError("boom")

    with EnvPool(Failing) as pool:
        for _ in range(20):
            pool.reset_many([(0, 1, "train")])
            assert "boom" in pool.step_many([(0, "wait")])[0].error
        time.sleep(0.1)
        assert pool.replaced == 20 and pool.abandoned_threads == 0 and len(pool._closers) <= 1


def test_split_reaches_envs_that_take_it_and_old_envs_still_train():
    class OldEnv(SleepyEnv):
        def reset(self, seed):  # a user env written before splits existed
            return ResetResult("s", "t", None)

    with EnvPool(OldEnv) as pool:
        assert pool.reset_many([(0, 1, "train")])[0].ok
        err = pool.reset_many([(0, 1, "dev")])[0].error
        assert "takes no split argument" in err and "'dev'" in err
    with EnvPool(functools.partial(HouseholdEnv, difficulty=0)) as pool:
        assert "unknown split 'valid_unseen'" in pool.reset_many([(0, 1, "valid_unseen")])[0].error


def test_one_call_per_slot_per_round():
    with EnvPool(SleepyEnv) as pool, pytest.raises(ValueError, match="one call per slot"):
        pool.step_many([(0, "a"), (0, "b")])


def test_close_ends_worker_threads():
    before = {t.name for t in threading.enumerate()}
    pool = EnvPool(SleepyEnv)
    pool.reset_many([(i, i, "train") for i in range(3)])
    assert sum(t.name.startswith("sglightning-env-") for t in threading.enumerate()) >= 3
    pool.close()
    time.sleep(0.1)
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith("sglightning-env-") and "close" not in n]
