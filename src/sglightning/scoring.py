r"""Scoring sampled tokens under the current weights (no Lightning import).

:func:`collate` pads a batch of :class:`~sglightning.episodes.Sample` into tensors; :func:`logprobs_from_logits` turns
the LM's logits at the policy positions into the log-probabilities of the sampled ids.

The policy that acted
---------------------
When the sampler restricted a token to a set A (a ``Choice`` among label words or admissible actions, a ``Free``
segment's banned tokens, top-k), the token was drawn from the renormalised distribution

    q_θ(y) = π_θ(y) / Z_θ(A),    Z_θ(A) = Σ_{a∈A} π_θ(a),

and that is the distribution scored here:  log q_θ(y) = log π_θ(y) − log Z_θ(A), with the same A for the sampler's
``old`` log-prob, the current weights and the reference model.  So the importance ratio is q_θ/q_old and the gradient
is ∇ log q_θ = ∇ log π_θ − ∇ log Z_θ: pushing up the chosen option relative to the *other options*, not relative to
the whole vocabulary.  Scoring the unrestricted π instead adds ∇ log Z_θ to every restricted token's gradient — a
push to move probability mass into A, which the environment's reward never asked for, largest exactly where Z is
small (a random model puts ~0.4 % of its mass on the three label words).  This is how invalid-action masking in
policy-gradient methods treats the masked softmax as the policy (Huang & Ontañón, "A Closer Look at Invalid Action
Masking in Policy Gradient Algorithms", 2020).  Unrestricted tokens have A = the vocabulary and Z = 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from sglightning.episodes import KIND_ACTION, KIND_GUIDANCE, Restriction
from sglightning.grpo import entropy_from_logits, masked_mean
from sglightning.prefixes import cluster_heads, microbatch_runs, shared_prefixes
from sglightning.traits import cache_argument_name, head_is_exact, head_logits


def complement_log_mass(lse: Tensor) -> Tensor:
    """log(1 − e^lse): the log-mass of everything but a set whose log-mass is ``lse`` (≤ 0), stable near both ends
    (the sampler and the trainer both use it for a ``Free`` segment's banned tokens)."""
    return torch.log(-torch.expm1(lse.clamp(max=-1e-20)))


def collate(samples: Sequence, pad_id: int, targets: bool = False) -> dict[str, Tensor]:
    """Right-pad samples into ``[S, L]`` tensors, each cut after its last policy token (the observation after the last
    action, which no policy token follows, cannot change any log-prob of a causal LM: it is not fed to the update).

    Keys: ``ids``, ``attn`` (1 = real token), ``mask`` (policy tokens), ``old_logp`` (sampler log q), ``full_logp``
    (sampler's unrestricted log π, diagnostic), ``kinds``, ``steps`` (the episode step of each token), ``episode`` [S],
    with ``targets`` the hindsight label targets ``target`` [S, L] (token id, −1 = none) and ``target_label`` [S, L]
    (which label each spells, index in LABELS, −1 = none), and the restrictions:
    ``restrict_index``
    [S, L] (row of the restriction table, −1 = unrestricted), ``restrict_ids`` [U, K] / ``restrict_valid`` [U, K]
    (each distinct restriction's token ids, padded) and ``restrict_exclude`` [U].
    """
    lengths = [scored_length(s) for s in samples]
    L = max(lengths)
    S = len(samples)
    ids = torch.full((S, L), pad_id, dtype=torch.long)  # [S, L]
    attn = torch.zeros(S, L, dtype=torch.long)  # [S, L]
    mask = torch.zeros(S, L, dtype=torch.bool)  # [S, L]
    old = torch.zeros(S, L, dtype=torch.float32)  # [S, L]
    full = torch.zeros(S, L, dtype=torch.float32)  # [S, L]
    kinds = torch.zeros(S, L, dtype=torch.long)  # [S, L]
    steps = torch.zeros(S, L, dtype=torch.long)  # [S, L] episode step of each token
    rindex = torch.full((S, L), -1, dtype=torch.long)  # [S, L]
    target = torch.full((S, L), -1, dtype=torch.long)  # [S, L]
    target_label = torch.full((S, L), -1, dtype=torch.long)  # [S, L]
    table: dict[Restriction, int] = {}
    seen: dict[int, int] = {}  # id(restriction) -> table row: the tokens of one segment share one object
    for i, s in enumerate(samples):
        n = lengths[i]
        ids[i, :n] = torch.tensor(s.ids[:n])
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.policy[:n])
        old[i, :n] = torch.tensor(s.logprobs[:n])
        full[i, :n] = torch.tensor(s.full_logprobs[:n])
        kinds[i, :n] = torch.tensor(s.kinds[:n])
        steps[i, :n] = torch.tensor(s.steps[:n])
        if targets:
            for pos, tok in s.targets.items():
                if pos < n:
                    target[i, pos] = tok
                    target_label[i, pos] = s.target_labels.get(pos, -1)
        for k, r in enumerate(s.restrictions[:n]):
            if r is not None:
                u = seen.get(id(r))
                if u is None:
                    u = seen[id(r)] = table.setdefault(r, len(table))
                rindex[i, k] = u
    K = max((len(r.ids) for r in table), default=1)
    rids = torch.zeros(len(table), K, dtype=torch.long)  # [U, K]
    rvalid = torch.zeros(len(table), K, dtype=torch.bool)  # [U, K]
    rexcl = torch.zeros(len(table), dtype=torch.bool)  # [U]
    for r, u in table.items():
        rids[u, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
        rvalid[u, : len(r.ids)] = True
        rexcl[u] = r.exclude
    episode = torch.tensor([s.episode for s in samples], dtype=torch.long)  # [S]
    extra = {"target": target, "target_label": target_label} if targets else {}
    return {**extra,
        "ids": ids, "attn": attn, "mask": mask, "old_logp": old, "full_logp": full, "kinds": kinds, "steps": steps,
        "episode": episode, "restrict_index": rindex, "restrict_ids": rids, "restrict_valid": rvalid,
        "restrict_exclude": rexcl,
    }


def scored_length(sample) -> int:
    """Tokens up to and including the sample's last policy token (all of them when it has none)."""
    last = max((k for k, p in enumerate(sample.policy) if p), default=len(sample.ids) - 1)
    return last + 1


def select_rows(data: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The samples ``rows`` (``[S]`` bool, or row indices in any order) of a collated batch; the restriction table
    is shared and kept whole."""
    shared = ("restrict_ids", "restrict_valid", "restrict_exclude")
    return {k: (v if k in shared else v[rows]) for k, v in data.items()}


def microbatch_rows(data: dict[str, Tensor] | None, size: int, max_tokens: int | None = None) -> list[slice]:
    """A step's micro-batches: runs of consecutive rows of ``data`` (collated, [S, L]), at most ``size`` rows each
    and, with ``max_tokens``, at most that many fed positions (rows × the longest row's length; a longer row goes
    alone).  Runs without a policy token are left out.  None (no rows): no micro-batches."""
    if data is None:
        return []
    lengths = data["attn"].sum(1).tolist()  # [S] each row's length (right padding)
    has_policy = data["mask"].any(1).tolist()  # [S]
    out = [slice(a, b) for a, b in microbatch_runs(lengths, size, max_tokens)]
    return [rows for rows in out if any(has_policy[rows])]


def microbatch(data: dict[str, Tensor], tok_adv: Tensor, rows: slice) -> dict[str, Tensor]:
    """Rows ``rows`` of a collated batch, cut to the longest of them (right padding beyond it is dropped): ``ids``,
    ``attn``, ``mask``, ``old_logp``, ``full_logp``, ``kinds``, ``adv`` (``tok_adv``'s rows), ``steps``, each
    ``[B, W]``, and ``restrict`` (:func:`restrictions_of`, its index cut the same way)."""
    width = int(data["attn"][rows].sum(1).max())
    cols = (rows, slice(0, width))
    out = {k: data[k][cols] for k in ("ids", "attn", "mask", "old_logp", "full_logp", "kinds")}
    for k in ("is_weight", "sampler_logp", "steps"):  # rollout correction (grpo.rollout_correction; steps: its turns)
        if k in data:
            out[k] = data[k][cols]
    out["adv"] = tok_adv[cols]
    restrict = restrictions_of(data, rows)
    restrict["index"] = restrict["index"][:, :width]
    for k in ("target", "target_label"):
        if k in restrict:
            restrict[k] = restrict[k][:, :width]
    out["restrict"] = restrict
    return out


def microbatch_stats(mb: dict, loss: Tensor, st: dict, logp: Tensor, ent: dict[str, Tensor], first_epoch: bool
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """The statistics one micro-batch logs: loss terms, ratio, entropies by token kind and, at the first PPO epoch,
    sampler-vs-trainer log-prob gap (≈0 unless the weights or the scoring drifted), the unrestricted log π of the
    sampled tokens and log Z(A) where sampling was restricted (how much of the model's own mass the allowed set held:
    0 = all of it).  Returns them and, for those averaged over some of its policy tokens only (a token kind, the
    restricted ones), how many: the step weighs each micro-batch by that count, else by its policy tokens."""
    m, kinds = mb["mask"], mb["kinds"]
    guide, act = m & (kinds == KIND_GUIDANCE), m & (kinds == KIND_ACTION)  # [B, W]
    weights = {"policy/entropy_guidance": float(guide.sum()), "policy/entropy_action": float(act.sum())}
    out = {
        "loss/total": float(loss.detach()),
        "loss/policy": float(st["policy_loss"]),
        "loss/kl": float(st["kl"]),
        "loss/clip_frac": float(st["clip_frac"]),
        "policy/ratio_mean": float(st["ratio_mean"]),
        # the entropy of the distribution each token was drawn from (over its restriction where sampling was
        # restricted: at a label token, the entropy of the label choice), and of the unrestricted π
        "policy/entropy": float(masked_mean(ent["sampled"], m)),
        "policy/entropy_guidance": float(masked_mean(ent["sampled"], guide)),
        "policy/entropy_action": float(masked_mean(ent["sampled"], act)),
        "policy/entropy_unrestricted": float(masked_mean(ent["unrestricted"], m)),
    }
    if "dual_clip_frac" in st:  # grpo.dual_clip set
        out["loss/dual_clip_frac"] = float(st["dual_clip_frac"])
    if first_epoch:
        old, full = mb["old_logp"], mb["full_logp"]
        sampler = mb.get("sampler_logp", old)  # with rollout correction `old` is the trainer's own recomputation
        out["policy/logprob_gap_sampler_trainer"] = float(masked_mean((logp.detach() - sampler).abs(), m))
        # the per-token ratio π_trainer / π_sampler of the first pass (1 where both compute the same thing; bf16
        # engines spread it): its mean, the share of tokens outside [0.9, 1.1], and the largest of r and 1/r
        if m.any():
            log_r = (logp.detach() - sampler)[m].float()  # [M]
            out["policy/sampler_ratio_mean"] = float(log_r.exp().mean())
            out["policy/sampler_ratio_outside_0.9_1.1"] = float(((log_r < math.log(0.9)) |
                                                                  (log_r > math.log(1.1))).float().mean())
            out["policy/sampler_ratio_max"] = float(log_r.abs().max().exp())
        known = m & torch.isfinite(full)  # an engine that returns only log q records NaN for the unrestricted log π
        if known.any():
            restricted = known & (mb["restrict"]["index"] >= 0)  # [B, W]
            out["policy/logprob_unrestricted"] = float(masked_mean(full.nan_to_num(0.0), known))
            out["policy/restricted_log_mass"] = float(masked_mean((full - sampler).nan_to_num(0.0), restricted))
            weights.update({"policy/logprob_unrestricted": float(known.sum()),
                            "policy/restricted_log_mass": float(restricted.sum())})
    return out, weights


def restrictions_of(data: dict[str, Tensor], rows: slice | None = None) -> dict[str, Tensor]:
    """The restriction tensors of a collated batch, for rows ``rows`` (the table itself is shared by all rows)."""
    index = data["restrict_index"] if rows is None else data["restrict_index"][rows]
    out = {"index": index, "ids": data["restrict_ids"], "valid": data["restrict_valid"],
           "exclude": data["restrict_exclude"]}
    for k in ("target", "target_label"):  # hindsight label targets (grpo.calibration): over the same restriction
        if k in data:
            out[k] = data[k] if rows is None else data[k][rows]
    return out


def restricted_log_mass(logp_sel: Tensor, valid: Tensor, exclude: Tensor) -> Tensor:
    """Log Z(A) per row from the log-probs of A's listed tokens.

    ``logp_sel`` [R, K]: log π of each row's listed ids (garbage where not ``valid``); ``valid`` [R, K];
    ``exclude`` [R]: A = the listed ids (False) or everything but them (True).  Returns [R].  Where A is everything
    but the listed ids and holds under half the mass, see :func:`heavy_banned_mass`."""
    neg_inf = torch.full((), float("-inf"), dtype=logp_sel.dtype, device=logp_sel.device)
    lse = torch.logsumexp(torch.where(valid, logp_sel, neg_inf), dim=-1)  # [R] log-mass of the listed ids
    return torch.where(exclude, complement_log_mass(lse), lse)  # [R]


def heavy_banned_mass(log_z: Tensor, logp: Tensor, rows: Tensor, ids: Tensor, valid: Tensor, exclude: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``log_z`` [R] (:func:`restricted_log_mass`) again, summed over A itself, where A is everything but banned ids
    and holds under half the mass.  There log Z = log(1 − e^lse) loses digits as 1/Z (lse's rounding near 0: an
    error of 1e-5 at Z ≈ 0.01, a positive log q below Z ≈ 1e-8), and its clamp cuts the gradient.  Elsewhere it is
    exact to rounding, and costs no [R, V] copy.

    ``logp`` [M, V]: log π; ``rows`` [R]: the rows of ``logp`` restricted; ``ids``, ``valid`` [R, K]: their listed ids;
    ``exclude`` [R].  Returns (log Z [R]; ``heavy`` [H], the rows summed over A; their banned ids as a [H, V] mask,
    None where H = 0: the entropy of those rows reads it)."""
    heavy = heavy_banned_rows(log_z, exclude)  # [H]
    if not heavy.numel():
        return log_z, heavy, None
    part = logp[rows[heavy]]  # [H, V]
    banned = listed_mask(ids[heavy], valid[heavy], part.shape[-1])  # [H, V]
    return log_z.index_put((heavy,), torch.logsumexp(part.masked_fill(banned, float("-inf")), dim=-1)), heavy, banned


def heavy_banned_rows(log_z: Tensor, exclude: Tensor) -> Tensor:
    """``[H]`` the rows whose set A is everything but banned ids and holds under half the mass (``log_z`` [R],
    ``exclude`` [R]): where sums over the banned ids lose digits, and sums over A itself are taken."""
    return (exclude & (log_z < -math.log(2.0))).nonzero().squeeze(-1)


def listed_mask(ids: Tensor, valid: Tensor, vocab: int) -> Tensor:
    """[R, V] bool: True at each row's listed ids.  ``ids``, ``valid`` [R, K] (padded entries: not ``valid``)."""
    listed = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)  # [R, V+1] (column V: padding)
    listed.scatter_(1, torch.where(valid, ids, vocab), True)
    return listed[:, :vocab]


class _RestrictedRows(NamedTuple):
    """The scored positions sampled from a restricted set A, as :func:`logprobs_from_logits` reads them again."""

    rows: Tensor  # [R] their rows of the [M, V] log-probs
    listed: Tensor  # [R, K] log π of each row's listed ids
    valid: Tensor  # [R, K]
    exclude: Tensor  # [R] A = everything but the listed ids
    log_z: Tensor  # [R] log Z(A)
    heavy: Tensor  # [H] the rows whose log Z was summed over A itself (:func:`heavy_banned_mass`)
    banned: Tensor | None  # [H, V] their banned ids; None where H = 0


def logprobs_from_logits(
    ids: Tensor, sel: Tensor, logits: Tensor, restrict: dict[str, Tensor] | None = None, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the sampled ids, of the distribution each was drawn from.

    ``ids`` [B, L]; ``sel`` [B, L-1]: the positions whose *next* token is scored (token i is predicted at i-1);
    ``logits`` [M, V]: the LM head at those positions, already divided by the temperature (M = sel.sum());
    ``restrict``: :func:`restrictions_of` for these rows (None = no restricted tokens).
    Returns (logp [B, L] — 0 where not scored — and, with ``entropy``, ``{"sampled": [B, L], "unrestricted": [B, L]}``:
    the entropy of the distribution each token was drawn from (q over its restriction A; π where unrestricted) and of
    the unrestricted π)."""
    logp_all = torch.log_softmax(logits, dim=-1)  # [M, V]
    tok = ids[:, 1:][sel]  # [M]
    logp_sel = logp_all.gather(-1, tok[:, None]).squeeze(-1)  # [M] log π(y)
    restricted = None
    if restrict is not None:
        ridx = restrict["index"].to(ids.device)[:, 1:][sel]  # [M] row of the restriction table or -1
        rows = (ridx >= 0).nonzero().squeeze(-1)  # [R]
        if rows.numel():
            u = ridx[rows]  # [R]
            table_ids = restrict["ids"].to(ids.device)[u]  # [R, K]
            listed = logp_all[rows[:, None], table_ids]  # [R, K] log π of the listed ids
            valid, exclude = restrict["valid"].to(ids.device)[u], restrict["exclude"].to(ids.device)[u]  # [R, K], [R]
            log_z, heavy, banned = heavy_banned_mass(restricted_log_mass(listed, valid, exclude), logp_all, rows,
                                                     table_ids, valid, exclude)  # [R], [H], [H, V] or None
            logp_sel = logp_sel.index_add(0, rows, -log_z)  # [M] log q(y) = log π(y) − log Z(A)
            restricted = _RestrictedRows(rows, listed, valid, exclude, log_z, heavy, banned)
    logp = torch.zeros(ids.shape, dtype=logp_sel.dtype, device=ids.device)  # [B, L]
    logp[:, 1:][sel] = logp_sel
    extras = {}
    if restrict is not None and "target" in restrict:
        extras["target_logq"] = _target_logq(ids, sel, logp_all, restrict["target"].to(ids.device), restricted)
    if not entropy:
        return logp, extras or None
    with torch.no_grad():
        h_pi = entropy_from_logits(logits.detach())  # [M] H(π)
        h_q = h_pi.clone()  # [M] H of the sampling distribution
        if restricted is not None:
            rows, listed, valid, exclude, log_z, heavy, banned = restricted
            listed, log_z = listed.detach(), log_z.detach()
            h_q[rows] = restricted_entropy(listed.float(), valid, exclude, log_z.float(), h_pi[rows])
            if banned is not None:  # banned ids hold most of π: (H(π) + Σ_B π log π) / Z cancels there,
                r = rows[heavy]  # so H(q) is summed over A itself, with the mask log Z was summed with
                logq = logp_all[r].detach().float().masked_fill(banned, float("-inf")) - log_z[heavy, None].float()
                h_q[r] = -torch.where(torch.isfinite(logq), logq.exp() * logq, 0.0).sum(-1)  # [H]
    out = dict(extras)
    for key, h in (("sampled", h_q), ("unrestricted", h_pi)):
        full = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # [B, L]
        full[:, 1:][sel] = h
        out[key] = full
    return logp, out


def _target_logq(ids: Tensor, sel: Tensor, logp_all: Tensor, target: Tensor, restricted: _RestrictedRows | None
                 ) -> Tensor:
    """Log q_θ(y*) at the positions with a hindsight target y* (``target`` [B, L], −1 = none): the target token's
    log-prob under the distribution the token there was drawn from (π renormalised over its restriction A; y* ∈ A),
    with gradient.  [B, L], 0 where there is no target."""
    out = torch.zeros(ids.shape, dtype=logp_all.dtype, device=ids.device)  # [B, L]
    tgt = target[:, 1:][sel]  # [M] the target at each scored position (−1 = none)
    if restricted is None or not bool((tgt >= 0).any()):
        return out
    rows, log_z = restricted.rows, restricted.log_z
    has = tgt[rows] >= 0  # [R] restricted positions with a target
    vals_sel = torch.zeros_like(tgt, dtype=logp_all.dtype)  # [M]
    r = rows[has]
    vals_sel = vals_sel.index_put((r,), logp_all[r, tgt[r]] - log_z[has])  # log π(y*) − log Z(A)
    out[:, 1:][sel] = vals_sel
    return out


def restricted_entropy(logp_listed: Tensor, valid: Tensor, exclude: Tensor, log_z: Tensor, h_full: Tensor) -> Tensor:
    """Entropy of q = π/Z(A) over its set A, per row.  ``logp_listed`` [R, K]: log π of the listed ids; ``valid``
    [R, K]; ``exclude`` [R]; ``log_z`` [R] = log Z(A); ``h_full`` [R] = H(π).

        A = the listed ids:           H(q) = −Σ_{a∈A} q_a log q_a,   log q_a = log π_a − log Z
        A = all but the listed ids B: H(q) = (H(π) + Σ_{b∈B} π_b log π_b) / Z + log Z

    Returns [R]."""
    zero = torch.zeros((), dtype=logp_listed.dtype, device=logp_listed.device)
    logq = logp_listed - log_z[:, None]  # [R, K]
    h_in = -torch.where(valid, logq.exp() * logq, zero).sum(-1)  # [R]
    pb_logpb = torch.where(valid, logp_listed.exp() * logp_listed, zero).sum(-1)  # [R] Σ_B π log π (≤ 0)
    h_out = (h_full + pb_logpb) / log_z.exp() + log_z  # [R]
    return torch.where(exclude, h_out, h_in)


def token_logprobs(
    policy: torch.nn.Module, ids: Tensor, attn: Tensor, mask: Tensor, temperature: float, *,
    whole_model: bool = False, entropy: bool = False, restrict: dict[str, Tensor] | None = None,
    share_prefix: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log q(ids[:, i] | ids[:, :i]) at the positions of ``mask`` [B, L] (0 elsewhere), at the sampling temperature,
    renormalised over each token's sampling restriction (``restrict``, from :func:`restrictions_of`).

    The LM head runs only on the needed positions: the decoder's hidden states are selected first, or with
    ``whole_model`` (FSDP: the root's forward is what gathers the weights, so the whole model is called) the model's
    ``logits_to_keep`` takes the positions any row reads.  With ``share_prefix`` the decoder runs through
    :func:`shared_prefix_hidden` (same values, a prefix shared by several rows computed once).  No KV cache is built
    (nothing decodes after a scoring pass; with gradient checkpointing transformers would drop it with a warning).
    Returns (logp [B, L], and with ``entropy`` the entropies of :func:`logprobs_from_logits`, else None)."""
    sel = mask[:, 1:]  # [B, L-1] token i is predicted at position i-1
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    whole_model = whole_model or not head_is_exact(policy)
    if share_prefix and not whole_model:
        hidden = shared_prefix_hidden(base.get_decoder(), ids, attn)  # [B, L, H]
        logits = head_logits(base, hidden[:, :-1][sel]).float() / temperature  # [M, V]
        return logprobs_from_logits(ids, sel, logits, restrict, entropy)
    if whole_model:
        # the LM head only at the positions some row reads (the policy tokens are a fraction of a long episode; with a
        # 150 k vocabulary, full logits are most of an FSDP update's time and memory)
        cols = sel.any(0).nonzero()[:, 0]  # [K] ascending
        logits_k = policy(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=cols).logits  # [B, K, V]
        logits = logits_k[sel[:, cols]].float() / temperature  # [M, V] (row-major: the order of [:, :-1][sel])
        return logprobs_from_logits(ids, sel, logits, restrict, entropy)
    hidden = base.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # [B, L, H]
    h = hidden[:, :-1][sel]  # [M, H]
    logits = head_logits(base, h).float() / temperature  # [M, V]
    return logprobs_from_logits(ids, sel, logits, restrict, entropy)


def shared_prefix_hidden(decoder: torch.nn.Module, ids: Tensor, attn: Tensor, min_shared: int = 8) -> Tensor:
    """The decoder's last hidden states ``[B, L, H]`` for right-padded rows ``ids`` / ``attn`` ``[B, L]``, computing a
    prefix that several rows share once (:func:`~sglightning.prefixes.shared_prefixes` on the rows' real tokens).

    Two passes, one graph:  the C distinct prefixes ``[C, P]`` (right-padded, positions 0…P_c−1) give hidden states
    and keys/values; the keys/values are indexed out to the B rows (a copy per row; autograd sums the rows' gradients
    back into the one prefix computation); the rest of each row ``[B, R]`` attends to its prefix through that cache at
    positions P_c…, the prefix's padding masked.  Every hidden state equals the unshared forward's up to float
    rounding, so the loss and every gradient do too (tests: 1e-5 in fp32).  Rows with nothing to share go through as
    their own cluster; with nothing shared at all this is one ordinary forward."""
    lengths = attn.sum(1).tolist()  # [B]
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    plan = shared_prefixes(rows, min_shared)
    if plan is None:
        return decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    cluster_of, cut = plan
    reps = cluster_heads(cluster_of)  # [C] one row per cluster
    dev = ids.device
    P = max(cut[i] for i in reps)
    pre_ids = torch.zeros(len(reps), P, dtype=ids.dtype, device=dev)  # [C, P]
    pre_attn = torch.zeros(len(reps), P, dtype=attn.dtype, device=dev)  # [C, P]
    for c, i in enumerate(reps):
        pre_ids[c, : cut[i]] = ids[i, : cut[i]]
        pre_attn[c, : cut[i]] = 1
    pos = torch.arange(P, device=dev).expand(len(reps), P)  # [C, P] (pads: masked, any position)
    out = decoder(input_ids=pre_ids, attention_mask=pre_attn, position_ids=pos, use_cache=True)
    index = torch.tensor(cluster_of, device=dev)  # [B]
    hidden_pre = out.last_hidden_state[index]  # [B, P, H]
    rest = [n - k for n, k in zip(lengths, cut)]
    R = max(rest)
    if R == 0:
        return _assemble(hidden_pre, None, cut, rest, ids.shape[1])
    cache_arg = cache_argument_name(decoder)
    cache = getattr(out, cache_arg)
    cache.batch_select_indices(index)  # every row its own copy of its prefix's keys/values: [B, heads, P, d]
    rest_ids = torch.zeros(len(rows), R, dtype=ids.dtype, device=dev)  # [B, R]
    rest_attn = torch.zeros(len(rows), R, dtype=attn.dtype, device=dev)  # [B, R]
    rest_pos = torch.zeros(len(rows), R, dtype=torch.long, device=dev)  # [B, R]
    for i, (k, r) in enumerate(zip(cut, rest)):
        rest_ids[i, :r] = ids[i, k : k + r]
        rest_attn[i, :r] = 1
        rest_pos[i] = k + torch.arange(R, device=dev)
    hidden_rest = decoder(input_ids=rest_ids, attention_mask=torch.cat([pre_attn[index], rest_attn], dim=1),
                          position_ids=rest_pos, use_cache=True, **{cache_arg: cache}).last_hidden_state  # [B, R, H]
    return _assemble(hidden_pre, hidden_rest, cut, rest, ids.shape[1])


def _assemble(pre: Tensor, rest: Tensor | None, cut: list[int], rest_len: list[int], L: int) -> Tensor:
    """Row i: its prefix's first ``cut[i]`` hidden states, then its own ``rest_len[i]``, zero-padded to ``L``."""
    out = []
    for i, (k, r) in enumerate(zip(cut, rest_len)):
        parts = [pre[i, :k]] + ([rest[i, :r]] if r else [])
        h = torch.cat(parts, dim=0)  # [k + r, H]
        out.append(torch.nn.functional.pad(h, (0, 0, 0, L - h.shape[0])))
    return torch.stack(out)  # [B, L, H]
