"""From played episodes to returns: the blended return of each episode, its per-step shares (what an advantage
estimator sees), and extra reward terms (no Lightning import).

    R_i = R_env,i − P_i + λ(u)·S_i + Σ_k w_k · term_k(episode_i)        (the maths is in :mod:`sglightning.grpo`)

with P_i = Σ_t c·[a_t invalid] (``grpo.invalid_action_penalty`` c), computed here and only here
(:func:`step_penalty`): the episode's return and its per-step shares use the same numbers.

A term is a :class:`RewardTerm` subclass in one file, named in the config (``model.reward_terms``, a list of
``class_path`` / ``init_args``, like ``env``); its mean is logged as ``reward/<name>``.  The paper uses none; they are
for experiments (e.g. dense progress where an environment reports a score).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import torch

from sglightning import grpo
from sglightning.calibration import label_progress_moments
from sglightning.episodes import Episode, StepRecord
from sglightning.errors import ConfigError


class RewardTerm(abc.ABC):
    """One extra reward per episode, computed from what the rollout recorded (steps, labels, score, info)."""

    #: the suffix of the logged ``reward/<name>``
    name: str = "term"

    def __init__(self, weight: float = 1.0):
        """Args:
        weight: multiplies the term before it is added to the return.
        """
        self.weight = float(weight)

    @abc.abstractmethod
    def value(self, episode: Episode) -> float:
        """The unweighted term of one episode."""

    def __call__(self, episode: Episode) -> float:
        return self.weight * float(self.value(episode))


class ScoreGain(RewardTerm):
    """Dense progress for environments with a 0-100 score (ScienceWorld, TextWorldExpress): the score gained during
    the episode, as a fraction (``score_gained / 100``; 0 for envs without a score)."""

    name = "score_gain"

    def value(self, episode: Episode) -> float:
        gained = episode.score_gained
        return 0.0 if gained is None else gained / 100.0


def distinct_terms(terms: Sequence[RewardTerm] | None) -> list[RewardTerm]:
    """``terms`` as a list, each name once: a term's value is logged and added under its ``name``, so a second term
    of the same name would be dropped from the return (``ConfigError`` naming ``model.reward_terms``)."""
    names = [t.name for t in terms or []]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"model.reward_terms: two terms are named {twice!r} (a term's value is added and logged "
                          "under its name): give each class its own name attribute, or one term its weight")
    return list(terms or [])


def step_penalty(step: StepRecord, penalty: float) -> float:
    """The invalid-action penalty of one step: ``penalty`` (c ≥ 0) for an invalid action, else 0."""
    return penalty if step.invalid else 0.0


def episode_returns(episodes: Sequence[Episode], lam: float, normalise: str = "sum", penalty: float = 0.0,
                    terms: Sequence[RewardTerm] = ()) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Blended returns R_i [N], internal returns S_i [N] (as blended: summed or averaged over steps) and each extra
    term's weighted values [N] by name.  ``penalty``: c, per invalid action."""
    env_ret = torch.tensor([e.env_return for e in episodes], dtype=torch.float32)  # [N]
    penalties = torch.tensor([sum(step_penalty(st, penalty) for st in e.steps) for e in episodes],
                             dtype=torch.float32)  # [N] P_i
    internal = [torch.tensor(e.internal_rewards, dtype=torch.float32) for e in episodes]
    s = grpo.internal_returns(internal, normalise=normalise)  # [N]
    values = {t.name: torch.tensor([t(e) for e in episodes], dtype=torch.float32) for t in terms}  # [N] each
    extra = torch.stack(list(values.values())).sum(0) if values else None  # [N]
    return grpo.blend(env_ret, s, lam, penalties, extra), s, values


def advantage_inputs(episodes: Sequence[Episode], returns: torch.Tensor, lam: float, terms: dict[str, torch.Tensor],
                     step_data: dict[str, torch.Tensor], cfg: grpo.GRPOConfig) -> grpo.AdvantageInputs:
    """What the advantage estimator sees: returns, groups, each step's share of the return (env reward − penalty +
    λ·r_t, the extra terms at the last step: the shares sum to R_i) and, per token, its episode and step."""
    extra = torch.stack(list(terms.values())).sum(0) if terms else torch.zeros(len(episodes))  # [N]
    step_returns = []
    for e, x in zip(episodes, extra.tolist()):
        scale = lam / len(e.steps) if cfg.internal_reward_norm == "mean" and e.steps else lam
        vals = [st.env_reward - step_penalty(st, cfg.invalid_action_penalty) + scale * st.internal_reward
                for st in e.steps]
        if vals:
            vals[-1] += x
        step_returns.append(torch.tensor(vals, dtype=torch.float32))  # [T_i]
    row = {e.index: k for k, e in enumerate(episodes)}
    return grpo.AdvantageInputs(
        returns=returns, group_ids=torch.tensor([e.group for e in episodes], dtype=torch.long),
        step_returns=step_returns,
        sample_episode=torch.tensor([row[int(e)] for e in step_data["episode"]], dtype=torch.long),  # [S]
        token_step=step_data["steps"], mask=step_data["mask"], eps=cfg.adv_eps, scale=cfg.adv_scale)


def informative_groups(episodes: Sequence[Episode], lam: float, normalise: str = "sum", penalty: float = 0.0,
                       terms: Sequence[RewardTerm] = (), drop_failed: bool = False) -> set[int]:
    """The groups whose blended returns are not all equal (the others get advantage 0 and carry no gradient); with
    ``drop_failed`` (``rollout.failed_episodes: drop_group``) none with a failed episode, which the update drops."""
    if not episodes:
        return set()
    returns, _, _ = episode_returns(episodes, lam, normalise, penalty, terms)
    flat = grpo.in_degenerate_group(returns, torch.tensor([e.group for e in episodes], dtype=torch.long))  # [N]
    failed = {e.group for e in episodes if e.error is not None} if drop_failed else set()
    return {e.group for e, no_signal in zip(episodes, flat.tolist()) if not no_signal and e.group not in failed}


class TrustMeter:
    """``grpo.trust_adaptive``: the factor on λ(u) — :func:`grpo.label_reliability` of the label/progress pairs of the
    last ``window`` steps (their moments summed over ranks by ``reduce``, so every rank uses the same λ)."""

    def __init__(self, window: int):
        self.window = window
        self.steps: list[list[float]] = []  # per step: the moments of its pairs (all ranks)
        self.reliability = 0.0

    def add(self, episodes: Sequence[Episode], reduce=lambda t: t) -> float:
        """One step's episodes in (their moments reduced over ranks by ``reduce``); returns the reliability."""
        moments = reduce(torch.tensor(label_progress_moments(episodes), dtype=torch.float64))
        self.steps = (self.steps + [[float(v) for v in moments]])[-self.window :]
        return self._measure()

    def _measure(self) -> float:
        """The reliability of the window's pairs (their moments summed over steps), kept as ``reliability``."""
        self.reliability = grpo.label_reliability([sum(col) for col in zip(*self.steps)]) if self.steps else 0.0
        return self.reliability

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [list(map(float, row)) for row in state.get("steps", [])][-self.window :]
        self._measure()


class Trust:
    """λ(u), the weight of the self-assessment reward, as a run keeps it: the schedule (:func:`grpo.trust_schedule`)
    over a horizon, times the labels' measured reliability with ``grpo.trust_adaptive`` (:class:`TrustMeter`).

    The horizon is the run's steps, or on a resume the checkpoint's: a resume with another ``trainer.max_steps``
    does not rescale λ mid-run (``grpo.total_steps`` set explicitly wins)."""

    def __init__(self, cfg: grpo.GRPOConfig):
        self.cfg = cfg
        self.meter = TrustMeter(cfg.trust_window)
        self.saved_horizon: int | None = None  # the checkpoint's, when it is kept

    def horizon(self, run_steps: int | Callable[[], int]) -> int:
        """The schedule's horizon: the checkpoint's where it is kept, else ``run_steps`` (called only then)."""
        if self.saved_horizon is not None:
            return self.saved_horizon
        return run_steps() if callable(run_steps) else int(run_steps)

    def scheduled(self, step: int, run_steps: int | Callable[[], int]) -> float:
        """λ(u) of the schedule alone at step ``step`` over :meth:`horizon` steps."""
        c = self.cfg
        return grpo.trust_schedule(step, self.horizon(run_steps), c.trust_breakpoints, constant=c.trust_constant)

    def restore(self, saved: int | None, current: int) -> str | None:
        """Keep the checkpoint's horizon ``saved`` unless ``grpo.total_steps`` sets one; returns the line to print
        when the horizon matters and differs from this run's ``current`` (else None)."""
        if saved is None:
            return None
        saved, explicit = int(saved), self.cfg.total_steps is not None
        self.saved_horizon = None if explicit else saved
        relative = self.cfg.trust_constant is None and max(self.cfg.trust_breakpoints) <= 1.0
        if saved == current or not relative:
            return None
        if explicit:
            return (f"the trust schedule's horizon changes from the checkpoint's {saved} steps to grpo.total_steps="
                    f"{current}: λ(u) is rescaled from here on")
        return (f"trainer.max_steps gives {current} steps, the checkpoint was trained for {saved}: the trust "
                f"schedule keeps its horizon of {saved} steps (set grpo.total_steps to change it)")
