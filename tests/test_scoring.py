"""The trainer scores the policy that acted: tokens sampled from a restricted set are scored (ratio and gradient)
under the same restricted, renormalised distribution; forced single-option tokens are not policy tokens."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import rollout, tiny_module, tiny_trainer

from sglightning import grpo, scoring
from sglightning.data import RolloutConfig
from sglightning.engines.builtin import DecodeSession
from sglightning.engines.draw import draw
from sglightning.engines.program import Choice
from sglightning.episodes import KIND_ACTION, Restriction, Sample
from sglightning.guidance import GuidanceConfig
from sglightning.module import SelfGuideModule

V = 11


def _sample_with(restrictions: dict[int, Restriction], ids: list[int]) -> Sample:
    s = Sample(0)
    s.extend_context(ids[:1])
    for k, t in enumerate(ids[1:], start=1):
        s.ids.append(t)
        s.policy.append(True)
        s.logprobs.append(0.0)
        s.full_logprobs.append(0.0)
        s.kinds.append(KIND_ACTION)
        s.steps.append(0)
        s.restrictions.append(restrictions.get(k))
    s.check()
    return s


def test_entropy_is_that_of_the_distribution_each_token_was_drawn_from():
    """At a restricted token the logged entropy is H(q) over its set A (a label choice among three words: at most
    log 3), not the vocabulary's; the unrestricted H(π) is kept beside it."""
    torch.manual_seed(1)
    ids = [0, 3, 5, 9, 2]
    allowed = Restriction((1, 3, 4))
    banned = Restriction((0, 5), exclude=True)
    data = scoring.collate([_sample_with({1: allowed, 3: banned}, ids)], pad_id=0)
    raw = torch.randn(4, V)
    _, ent = scoring.logprobs_from_logits(data["ids"], data["mask"][:, 1:], raw, scoring.restrictions_of(data),
                                          entropy=True)

    def h(row: torch.Tensor, support: list[int]) -> float:
        q = torch.softmax(row[support], dim=0)
        return float(-(q * q.log()).sum())

    everything = list(range(V))
    support = {0: [1, 3, 4], 1: everything, 2: [t for t in everything if t not in (0, 5)], 3: everything}
    for k in range(4):
        assert ent["sampled"][0, k + 1].item() == pytest.approx(h(raw[k], support[k]), abs=1e-5), k
        assert ent["unrestricted"][0, k + 1].item() == pytest.approx(h(raw[k], everything), abs=1e-5), k
    assert ent["sampled"][0, 1] <= math.log(3) + 1e-6 < ent["unrestricted"][0, 1]


def test_restricted_logprob_and_gradient_equal_a_hand_computed_restricted_softmax():
    """Log q(y) = l_y/T − log Σ_{a∈A} e^{l_a/T};  ∂ log q / ∂ l = (onehot_y − q_A) / T on A, 0 outside A."""
    torch.manual_seed(0)
    T = 0.7
    ids = [0, 3, 5, 9, 2]
    allowed = Restriction((1, 3, 4))  # token 1 (=3) drawn among {1, 3, 4}
    banned = Restriction((0, 5), exclude=True)  # token 3 (=9) drawn from everything but {0, 5}
    data = scoring.collate([_sample_with({1: allowed, 3: banned}, ids)], pad_id=0)
    raw = torch.randn(4, V, requires_grad=True)  # logits at positions 0..3, predicting tokens 1..4
    sel = data["mask"][:, 1:]
    logp, _ = scoring.logprobs_from_logits(data["ids"], sel, raw / T, scoring.restrictions_of(data))
    got = logp[0, 1:]  # [4]

    def by_hand(row: torch.Tensor, y: int, support: list[int]) -> torch.Tensor:
        z = row / T
        return z[y] - torch.logsumexp(z[support], dim=0)

    everything = list(range(V))
    support = {0: [1, 3, 4], 1: everything, 2: [t for t in everything if t not in (0, 5)], 3: everything}
    want = torch.stack([by_hand(raw[k], ids[k + 1], support[k]) for k in range(4)])
    assert torch.allclose(got, want, atol=1e-6)
    # the restricted tokens really differ from the unrestricted log π
    full = torch.log_softmax(raw.detach() / T, dim=-1)
    got_d = got.detach()
    assert abs(float(got_d[0] - full[0, 3])) > 1e-3 and abs(float(got_d[2] - full[2, 9])) > 1e-6
    # gradient of each restricted log q w.r.t. the raw logits
    for k, y in ((0, 3), (2, 9)):
        (g,) = torch.autograd.grad(got[k], raw, retain_graph=True)
        q = torch.zeros(V)
        q[support[k]] = torch.softmax(raw[k].detach()[support[k]] / T, dim=0)
        onehot = torch.zeros(V)
        onehot[y] = 1.0
        assert torch.allclose(g[k], (onehot - q) / T, atol=1e-6)
        assert torch.count_nonzero(g[[j for j in range(4) if j != k]]) == 0
        outside = [t for t in everything if t not in support[k]]
        # no push to move mass into the allowed set (the unrestricted log π would give −π(a)/T ≈ −0.1 here)
        assert float(g[k, outside].abs().max()) < 1e-6


@pytest.mark.parametrize("banned_logit", [0.0, 10.0, 15.0, 25.0])
def test_banned_tokens_holding_most_of_the_mass_score_exactly_in_the_sampler_and_the_trainer(banned_logit):
    """A ``Free`` segment's banned token (e.g. the end of the turn inside a reason) that the model all but insists on:
    log Z(A) = log(1 − π(banned)) lost digits as Z shrank (an error of 1e-5 at Z ≈ 0.01, 1e-2 at 1e-4, a positive
    log q at 4e-9) and its clamp cut the gradient.  The draw's log q, the trainer's, and its gradient match float64."""
    ids = [0, 3, 5, 9]
    banned = Restriction((0, 7), exclude=True)
    data = scoring.collate([_sample_with({1: banned, 2: banned}, ids)], pad_id=0)
    raw = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    raw[:, 0] = banned_logit  # position 0: the banned token's pull; position 1: a moderate one; position 2 unrestricted
    raw[1, 0] = 1.0
    raw.requires_grad_(True)
    logp, _ = scoring.logprobs_from_logits(data["ids"], data["mask"][:, 1:], raw, scoring.restrictions_of(data))
    exact = raw.detach().double().clone()
    exact[:2, [0, 7]] = float("-inf")
    want = torch.log_softmax(exact, dim=-1)[[0, 1, 2], [3, 5, 9]]  # [3]
    assert torch.allclose(logp[0, 1:].double(), want, atol=2e-6, rtol=0)
    (g,) = torch.autograd.grad(logp[0, 1], raw)
    assert float(g[0, [0, 7]].abs().max()) < 1e-6  # nothing pushes on a token that cannot be drawn
    # the sampler's log q of the same token: the draw with a generator forced onto token 3
    row = torch.log_softmax(raw.detach()[:1], dim=-1)  # [1, V]
    for seed in range(200):
        (tok, logq, _, _), = draw(row, [banned], generator=torch.Generator().manual_seed(seed))
        if tok == 3:
            break
    assert tok == 3 and abs(logq - float(want[0])) < 2e-6


def test_second_ppo_epoch_clips_on_the_restricted_ratio():
    """ppo_epochs=2: after one update the ratio the loss clips is q_θ/q_old (renormalised), not π_θ/π_old."""
    torch.manual_seed(1)
    T = 1.0
    ids = [0, 3, 4]
    data = scoring.collate([_sample_with({1: Restriction((3, 4)), 2: Restriction((1, 4))}, ids)], pad_id=0)
    sel = data["mask"][:, 1:]
    restrict = scoring.restrictions_of(data)
    old_logits = torch.randn(2, V)
    new_logits = old_logits.clone()
    # epoch 1 moved mass from the allowed set to token 7 (outside it): π of the sampled tokens fell a lot, but the
    # choice *within* the allowed set did not change
    new_logits[:, 7] += 4.0
    old, _ = scoring.logprobs_from_logits(data["ids"], sel, old_logits / T, restrict)
    new, _ = scoring.logprobs_from_logits(data["ids"], sel, new_logits / T, restrict)
    m = data["mask"]
    _, stats = grpo.grpo_loss(new, old, torch.ones(1), m, clip_low=0.2, clip_high=0.28)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)  # q unchanged: nothing to clip
    assert float(stats["clip_frac"]) == 0.0
    full_old = torch.log_softmax(old_logits, -1).gather(-1, torch.tensor([[3], [4]]))[:, 0]
    full_new = torch.log_softmax(new_logits, -1).gather(-1, torch.tensor([[3], [4]]))[:, 0]
    assert float((full_new - full_old).exp().max()) < 0.8  # the unrestricted ratio would have been clipped


def _module(action_decoding: str = "admissible", **over) -> SelfGuideModule:
    return tiny_module(
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_steps=2, temperature=0.9),
        guidance=GuidanceConfig(action_decoding=action_decoding, max_guidance_tokens=4, max_action_tokens=4),
        **over,
    )


def test_forced_choice_tokens_are_context_not_policy():
    """Admissible-action decoding: a token that is the only continuation in the trie was not chosen; it gets no loss,
    no log-prob and no place in the token-mean denominator, and is counted."""
    module = _module()
    module.configure_model()
    batch = rollout(module).run([1, 2], generator=torch.Generator().manual_seed(0))
    forced = sum(s.forced for s in batch.samples)
    assert forced > 0
    policy_action = sum(1 for s in batch.samples for p, k in zip(s.policy, s.kinds) if p and k == KIND_ACTION)
    chosen_actions = sum(1 for e in batch.episodes for st in e.steps)
    assert policy_action >= chosen_actions  # at least one real choice per action (the first token of the options)
    for s in batch.samples:
        for k, p in enumerate(s.policy):
            if p and s.kinds[k] == KIND_ACTION:
                assert s.restrictions[k] is not None and len(s.restrictions[k].ids) >= 2


def test_choice_with_a_single_option_has_no_policy_token(tiny_lm):
    model, tok = tiny_lm
    session = DecodeSession(model, tok.pad_token_id, temperature=1.0, generator=torch.Generator().manual_seed(0))
    session.feed([tok.encode("hello")])
    opts = [tok.encode(" go to desk 1") + [tok.eos_token_id]]
    (pieces,) = session.run([[Choice(opts, KIND_ACTION)]])
    (piece,) = pieces
    assert piece.choice_index == 0 and piece.ids == opts[0]
    assert not any(piece.policy) and piece.forced == len(opts[0])


@pytest.fixture(scope="module")
def tiny_lm():
    from sglightning.embedded import TinyModelConfig, build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return build_tiny_model(TinyModelConfig(), len(tok)).eval(), tok


def test_training_logs_the_unrestricted_logprob_and_the_restricted_mass(tmp_path):
    module = _module()
    tiny_trainer(tmp_path, steps=1).fit(module)
    (h,) = module.history
    assert h["policy/logprob_gap_sampler_trainer"] < 1e-4  # the trainer scored the restricted q the sampler drew from
    assert h["policy/restricted_log_mass"] < 0.0  # the allowed sets held less than all of the model's mass
    assert h["policy/logprob_unrestricted"] < 0.0
    assert h["tokens/forced_choice"] > 0


def test_the_whole_model_path_reads_the_lm_head_only_where_a_row_needs_it(tiny_lm, monkeypatch):
    """FSDP calls the whole model (its root gathers the weights): ``logits_to_keep`` gives the LM head only the
    positions some row reads, with the log-probs and entropies of the decoder-then-head path, row by row."""
    model, _ = tiny_lm
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 12), generator=g)  # [B, L]
    attn = torch.ones_like(ids)
    attn[2, 9:] = 0  # a padded row
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, [3, 4, 10]] = mask[1, [4, 7]] = mask[2, [8]] = True
    heads = []
    real = type(model).forward

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        heads.append(out.logits.shape[1])
        return out

    plain, plain_ent = scoring.token_logprobs(model, ids, attn, mask, 0.7, entropy=True)
    monkeypatch.setattr(type(model), "forward", spy)
    whole, whole_ent = scoring.token_logprobs(model, ids, attn, mask, 0.7, entropy=True, whole_model=True)
    assert heads == [5]  # positions 2, 3, 6, 7, 9 predict the six policy tokens; not all 12
    assert torch.allclose(whole, plain, atol=1e-6) and (whole[~mask] == 0).all()
    for k in plain_ent:
        assert torch.allclose(whole_ent[k], plain_ent[k], atol=1e-5), k


@pytest.mark.parametrize("boost", [5.0, 14.0, 18.0])
def test_the_entropy_over_a_set_that_bans_most_of_the_mass_is_exact(boost):
    """(H(π) + Σ_B π log π) / Z cancels where the banned ids hold most of π: at Z ≈ 4e-9 the logged entropy was
    −19.3 against an exact 4.3."""
    from sglightning.scoring import logprobs_from_logits

    torch.manual_seed(0)
    vocab, banned = 512, torch.arange(0, 400)
    logits = torch.randn(1, vocab)
    logits[0, banned] += boost
    restrict = {"index": torch.tensor([[-1, 0]]), "ids": banned[None], "valid": torch.ones(1, 400, dtype=torch.bool),
                "exclude": torch.tensor([True])}
    _, ent = logprobs_from_logits(torch.tensor([[0, 450]]), torch.tensor([[True]]), logits, restrict, entropy=True)
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[banned] = False
    logq = torch.log_softmax(logits[0].double()[allowed], -1)
    assert float(ent["sampled"][0, 1]) == pytest.approx(float(-(logq.exp() * logq).sum()), abs=1e-4)
