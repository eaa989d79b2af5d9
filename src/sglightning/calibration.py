r"""Is the guidance informative?  Agreement of the self-assessment labels with the progress the environment measured.

Self-guidance can only help when its labels carry information about progress.  Two questions, answered from episodes
alone (pure Python; used for the training logs and the validation reports):

**Does the label describe the progress so far?**  The label z_t is written before action a_t and rates the trajectory
up to observation o_t, i.e. (for t ≥ 1) the effect of the previous action a_{t−1}.  An environment that can tell
reports that effect as ``StepResult.progress`` (> 0 closer to the goal, 0 no change, < 0 farther; the household env:
the fall of its expert's distance-to-goal; envs with a 0–100 score: the score change, taken by the rollout when the
env gives no ``progress``).  With v(positive) = +1, v(neutral) = 0, v(negative) = −1 and the pairs
P = {(z_t, p_{t−1}) : t ≥ 1, z_t parsed, p_{t−1} known}:

    accuracy       = |{(z, p) ∈ P : v(z) = sign(p)}| / |P|
    precision(ℓ)   = |{(z, p) ∈ P : z = ℓ, v(ℓ) = sign(p)}| / |{(z, p) ∈ P : z = ℓ}|
    constant       = max_ℓ |{(z, p) ∈ P : v(ℓ) = sign(p)}| / |P|     (the best single label, chosen in hindsight)
    balanced       = (1/K) Σ_{s ∈ S} |{(z, p) ∈ P : v(z) = s = sign(p)}| / |{(z, p) ∈ P : sign(p) = s}|
                     (S the K signs that occur: the mean recall over the kinds of progress)

The accuracy of a guide says something only above ``constant``: when most actions change nothing, a guide that always
says "neutral" is right most of the time and tells the actor nothing.  ``balanced`` does not reward the majority:
a constant label scores 1/K where its sign occurs (else 0), a guide that tells every kind of progress apart
scores 1.

**Does the label know the outcome?**  AUROC of the step labels, as an ordinal score v(z_t), against the eventual
success of their episode (every parsed label of every guided episode; ties count ½):

    AUROC = P(v(z) > v(z') ) + ½ P(v(z) = v(z')),   z from a won episode, z' from a lost one

0.5 = the labels say nothing about success; a constant label (a 135M model says "positive" ~94 % of the time) gives
exactly 0.5 whatever the episodes.  Each number is absent (not 0) when its denominator is empty.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from sglightning.guidance import LABELS

#: the ordinal value of each label
LABEL_VALUE = {"positive": 1, "neutral": 0, "negative": -1}


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def label_progress_pairs(episodes: Sequence) -> list[tuple[str, float]]:
    """(z_t, p_{t−1}) for t ≥ 1 of every guided episode, where the label was parsed and the progress is known."""
    pairs = []
    for ep in episodes:
        if not ep.guided:
            continue
        for prev, cur in zip(ep.steps, ep.steps[1:]):
            if cur.label in LABELS and prev.progress is not None:
                pairs.append((cur.label, prev.progress))
    return pairs


def auroc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """P(x > y) + ½ P(x = y) for x from ``positives``, y from ``negatives`` (Mann–Whitney); None if either is empty."""
    if not positives or not negatives:
        return None
    neg = sorted(negatives)
    wins = 0.0
    for x in positives:
        below = bisect.bisect_left(neg, x)
        ties = bisect.bisect_right(neg, x) - below
        wins += below + 0.5 * ties
    return wins / (len(positives) * len(neg))


def constant_accuracy(pairs: Sequence[tuple[str, float]]) -> float | None:
    """The accuracy of the best single label on ``pairs`` (chosen in hindsight: the commonest sign of progress);
    None for no pairs."""
    signs = [_sign(p) for _, p in pairs]
    return max(signs.count(v) for v in (-1, 0, 1)) / len(signs) if signs else None


def balanced_accuracy(pairs: Sequence[tuple[str, float]]) -> float | None:
    """The mean over the signs of progress that occur in ``pairs`` ((z_t, p_{t−1}), as :func:`label_progress_pairs`)
    of the share of their labels that name them; None for no pairs.  A constant label scores 1/K where its sign
    occurs, else 0."""
    recalls = []
    for sign in (-1, 0, 1):
        mine = [LABEL_VALUE[z] == sign for z, p in pairs if _sign(p) == sign]
        if mine:
            recalls.append(sum(mine) / len(mine))
    return sum(recalls) / len(recalls) if recalls else None


def calibration_stats(episodes: Sequence) -> dict[str, float]:
    """``guidance/label_accuracy``, ``guidance/label_accuracy_constant`` (the best single label's),
    ``guidance/label_balanced_accuracy`` (the mean recall over the kinds of progress: 1/K for a constant label),
    ``guidance/precision_<label>``, ``guidance/label_auroc_success`` and the counts behind them
    (``guidance/calibration_pairs``, ``guidance/auroc_labels``); a number whose denominator is empty is left out."""
    out: dict[str, float] = {}
    pairs = label_progress_pairs(episodes)
    out["guidance/calibration_pairs"] = float(len(pairs))
    if pairs:
        hits = [LABEL_VALUE[z] == _sign(p) for z, p in pairs]
        out["guidance/label_accuracy"] = sum(hits) / len(hits)
        out["guidance/label_accuracy_constant"] = constant_accuracy(pairs)
        out["guidance/label_balanced_accuracy"] = balanced_accuracy(pairs)
        for label in LABELS:
            mine = [h for (z, _), h in zip(pairs, hits) if z == label]
            if mine:
                out[f"guidance/precision_{label}"] = sum(mine) / len(mine)
    won, lost = [], []
    for ep in episodes:
        if ep.guided:
            vals = [float(LABEL_VALUE[s.label]) for s in ep.steps if s.label in LABELS]
            (won if ep.won else lost).extend(vals)
    out["guidance/auroc_labels"] = float(len(won) + len(lost))
    area = auroc(won, lost)
    if area is not None:
        out["guidance/label_auroc_success"] = area
    return out


def label_progress_moments(episodes: Sequence) -> list[float]:
    """``[n, Σx, Σy, Σx², Σy², Σxy]`` of the pairs (x = v(z_t), y = sign(p_{t−1})): sums, so that they add up over
    steps and ranks (:func:`sglightning.grpo.label_reliability` turns them into a correlation)."""
    out = [0.0] * 6
    for z, p in label_progress_pairs(episodes):
        x, y = float(LABEL_VALUE[z]), float(_sign(p))
        for k, v in enumerate((1.0, x, y, x * x, y * y, x * y)):
            out[k] += v
    return out
