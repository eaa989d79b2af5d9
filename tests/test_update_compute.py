"""Less compute, same update: context after a sample's last policy token is not fed to the update; (without a KL
term) samples whose advantages are all zero get no forward/backward; a prefix shared by samples of a micro-batch is
computed once.  Each is checked against the plain computation."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from tiny import tiny_module, tiny_trainer

from sglightning import grpo, scoring
from sglightning.data import RolloutConfig
from sglightning.embedded import TinyModelConfig, build_tiny_model
from sglightning.episodes import KIND_ACTION, Sample
from sglightning.guidance import GuidanceConfig
from sglightning.module import GRPOConfig, SelfGuideModule
from sglightning.rewards import RewardTerm
from sglightning.update import UpdateConfig


def _sample(context: list[int], policy: list[int], tail: list[int], episode: int = 0) -> Sample:
    s = Sample(episode)
    s.extend_context(context)
    for t in policy:
        s.ids.append(t)
        s.policy.append(True)
        s.logprobs.append(-1.0)
        s.full_logprobs.append(-1.5)
        s.kinds.append(KIND_ACTION)
        s.steps.append(0)
        s.restrictions.append(None)
    s.extend_context(tail)
    s.check()
    return s


def test_collate_cuts_each_sample_after_its_last_policy_token():
    a = _sample([1, 2, 3], [4, 5], [6, 7, 8, 9])
    b = _sample([1, 2], [4], [5, 6], episode=1)
    data = scoring.collate([a, b], pad_id=0)
    assert data["ids"].shape == (2, 5)
    assert data["ids"][0].tolist() == [1, 2, 3, 4, 5]
    assert data["attn"].sum(1).tolist() == [5, 3]
    assert data["mask"].sum(1).tolist() == [2, 1]
    assert data["old_logp"][0, 3:5].tolist() == [-1.0, -1.0]


def test_the_cut_context_changes_no_log_prob():
    """A causal LM's log-probs at the policy positions are the same with and without the trailing observation."""
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(num_layers=1), 64).eval()
    s = _sample([3, 9, 11, 5], [7, 21, 13], [30, 31, 32, 33, 34])
    full_ids = torch.tensor([s.ids])
    full_mask = torch.tensor([s.policy])
    cut = scoring.collate([s], pad_id=0)
    with torch.no_grad():
        lp_full, _ = scoring.token_logprobs(model, full_ids, torch.ones_like(full_ids), full_mask, 1.0)
        lp_cut, _ = scoring.token_logprobs(model, cut["ids"], cut["attn"], cut["mask"], 1.0)
    n = cut["ids"].shape[1]
    assert n < full_ids.shape[1]
    assert torch.allclose(lp_full[:, :n][cut["mask"]], lp_cut[cut["mask"]], atol=1e-6)


def test_zero_advantage_rows():
    adv = torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.3]])
    mask = torch.tensor([[False, True, True], [True, True, False], [True, True, False]])
    assert grpo.zero_advantage_rows(adv, mask).tolist() == [False, True, True]  # row 2's non-zero is not a policy token


class _HalfTheGroupsDegenerate(RewardTerm):
    """Even groups: minus the env return (every return of the group is 0: zero advantages); odd groups: a bonus for
    the group's first episode (non-zero advantages)."""

    name = "split"

    def value(self, episode) -> float:
        if episode.group % 2 == 0:
            return -episode.env_return
        return 0.37 if episode.index % 2 == 0 else 0.0


class _Grads(Callback):
    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                           if p.requires_grad and p.grad is not None})


class _EveryGroupDegenerate(RewardTerm):
    """Minus the env return: every return is 0, every advantage 0, nothing to learn from."""

    name = "flat"

    def value(self, episode) -> float:
        return -episode.env_return


def _fit(tmp_path, skip: bool, kl: float = 0.0, ppo_epochs: int = 1, term: RewardTerm | None = None,
         steps: int | None = None, share: bool | None = False, micro: int = 2, mode: str = "single_stream",
         budget: int | None = None, compiled: bool = False):
    seed_everything(0)
    module = tiny_module(
        rollout=RolloutConfig(groups_per_step=4, group_size=2, max_steps=2, temperature=1.0),
        guidance=GuidanceConfig(max_guidance_tokens=4, max_action_tokens=4, prompt_mode=mode),
        grpo=GRPOConfig(kl_coef=kl, trust_constant=0.0, ppo_epochs=ppo_epochs),
        update=UpdateConfig(micro_batch_size=micro, skip_zero_advantage=skip, share_prefix=share,
                            micro_batch_tokens=budget, compile=compiled),
        reward_terms=[term or _HalfTheGroupsDegenerate()],
    )
    calls = {"rows": 0}
    grads = _Grads()
    tiny_trainer(tmp_path, steps=steps or ppo_epochs, callbacks=[grads]).fit(_counting(module, calls))
    module.fed_positions, module.forwards = calls.get("positions", 0), calls.get("forwards", 0)
    return module, grads.grads, calls["rows"]


def _counting(module: SelfGuideModule, calls: dict) -> SelfGuideModule:
    inner = module.token_logprobs

    def counted(ids, *args, **kwargs):
        calls["rows"] += ids.shape[0]
        calls["positions"] = calls.get("positions", 0) + ids.numel()
        calls["forwards"] = calls.get("forwards", 0) + 1
        return inner(ids, *args, **kwargs)

    module.token_logprobs = counted
    return module


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_zero_advantage_samples_get_no_forward_and_the_update_is_the_same(tmp_path, ppo_epochs):
    skip_mod, skip_grads, skip_rows = _fit(tmp_path / "skip", skip=True, ppo_epochs=ppo_epochs)
    full_mod, full_grads, full_rows = _fit(tmp_path / "full", skip=False, ppo_epochs=ppo_epochs)
    h = skip_mod.history[0]
    assert h["tokens/skipped_zero_advantage_samples"] > 0
    assert h["tokens/zero_advantage_samples"] == h["tokens/skipped_zero_advantage_samples"]
    assert full_mod.history[0]["tokens/skipped_zero_advantage_samples"] == 0
    assert full_mod.history[0]["tokens/zero_advantage_samples"] == h["tokens/zero_advantage_samples"]
    assert skip_rows < full_rows  # fewer rows went through the model
    assert len(skip_grads) == len(full_grads) == ppo_epochs
    for gs, gf in zip(skip_grads, full_grads):
        assert gs.keys() == gf.keys() and gs
        assert max(float(g.abs().max()) for g in gf.values()) > 0  # the odd groups do move the adapters
        for name in gf:
            assert torch.allclose(gs[name], gf[name], atol=1e-6, rtol=1e-5), name


def test_with_a_kl_term_zero_advantage_samples_are_still_computed(tmp_path):
    module, _, _ = _fit(tmp_path, skip=True, kl=0.05)
    h = module.history[0]
    assert h["tokens/zero_advantage_samples"] > 0 and h["tokens/skipped_zero_advantage_samples"] == 0


def test_a_step_with_every_sample_skipped_moves_the_weights_as_the_computed_one(tmp_path):
    """Zero gradients still drive AdamW (weight decay, and momentum from earlier steps): skipping every sample of a
    step must leave the optimiser the same zero gradient, not none."""
    skip_mod, skip_grads, skip_rows = _fit(tmp_path / "skip", skip=True, term=_EveryGroupDegenerate(), steps=2)
    full_mod, _, full_rows = _fit(tmp_path / "full", skip=False, term=_EveryGroupDegenerate(), steps=2)
    assert skip_rows == 0 < full_rows
    trainable = sum(p.requires_grad for p in skip_mod.parameters())
    assert skip_grads and all(len(step) == trainable for step in skip_grads)  # a gradient each, none left None
    assert all(float(g.abs().max()) == 0 for step in skip_grads for g in step.values())
    trained = {n: p for n, p in full_mod.named_parameters() if p.requires_grad}
    moved = 0
    for name, p in skip_mod.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p, trained[name], atol=1e-7), name
            moved += 1
    assert moved


@pytest.mark.parametrize("mode,micro,kl", [("single_stream", 2, 0.0), ("single_stream", 8, 0.05), ("two_call", 4, 0.0)])
def test_shared_prefix_update_gives_the_same_loss_and_gradients(tmp_path, monkeypatch, mode, micro, kl):
    plans = []
    real = scoring.shared_prefixes

    def recording(rows, min_shared=8):
        plan = real(rows, min_shared)
        plans.append(plan)
        return plan

    monkeypatch.setattr(scoring, "shared_prefixes", recording)
    shared_mod, shared_grads, _ = _fit(tmp_path / "shared", skip=False, share=True, micro=micro, kl=kl, mode=mode)
    assert any(p is not None for p in plans)  # prefixes were shared
    n_shared_calls = len(plans)
    plain_mod, plain_grads, _ = _fit(tmp_path / "plain", skip=False, share=False, micro=micro, kl=kl, mode=mode)
    assert len(plans) == n_shared_calls  # the plain run never went through the shared path
    hs, hp = shared_mod.history[0], plain_mod.history[0]
    for key in ("loss/total", "loss/policy", "loss/kl", "policy/entropy", "policy/logprob_gap_sampler_trainer"):
        assert hs[key] == pytest.approx(hp[key], abs=1e-5, rel=1e-5), key
    (gs,), (gp,) = shared_grads, plain_grads
    assert gs.keys() == gp.keys() and gs
    scale = max(float(g.abs().max()) for g in gp.values())
    assert scale > 0
    for name in gp:
        assert float((gs[name] - gp[name]).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_a_token_budget_gives_the_same_loss_and_gradients(tmp_path, mode):
    """update.micro_batch_tokens: micro-batches cut by fed positions give the same loss and gradients as fixed row
    counts (a token sum over the step, one denominator).  Padding is what the rows' order (longest first, either
    way) removes; a budget bounds a micro-batch's size, for memory."""
    rows_mod, rows_grads, _ = _fit(tmp_path / "rows", skip=False, micro=4, mode=mode)
    budget_mod, budget_grads, _ = _fit(tmp_path / "budget", skip=False, micro=4, mode=mode, budget=160)
    hr, hb = rows_mod.history[0], budget_mod.history[0]
    for key in ("loss/total", "loss/policy", "policy/entropy", "policy/logprob_gap_sampler_trainer"):
        assert hb[key] == pytest.approx(hr[key], abs=1e-5, rel=1e-5), key
    (gr,), (gb,) = rows_grads, budget_grads
    scale = max(float(g.abs().max()) for g in gr.values())
    assert gr.keys() == gb.keys() and scale > 0
    for name in gr:
        assert float((gb[name] - gr[name]).abs().max()) <= 1e-5 * scale, name
    assert budget_mod.forwards > rows_mod.forwards  # the budget did cut the micro-batches


def test_shared_prefix_is_refused_where_it_cannot_hold():
    from lightning.pytorch.strategies import FSDPStrategy

    from sglightning.distributed import prefix_sharing
    from sglightning.errors import ConfigError
    from sglightning.strategies import sharding_of

    fsdp = sharding_of(FSDPStrategy())
    assert fsdp == "fsdp1"
    assert prefix_sharing(None, None, False) and not prefix_sharing(False, None, False)
    assert not prefix_sharing(None, fsdp, False)  # null: off where it cannot hold
    assert not prefix_sharing(None, None, True)
    with pytest.raises(ConfigError, match="update.share_prefix: true .*FSDP"):
        prefix_sharing(True, fsdp, False)
    with pytest.raises(ConfigError, match="update.share_prefix: true .*gradient checkpointing"):
        prefix_sharing(True, None, True)


def _compiled_against_eager(tmp_path, **kw):
    """Two 2-step fits (a KL term: the reference pass runs the layers with the adapter off), the layers eager and
    compiled: the losses and every gradient agree (fp32; inductor fuses, so sums may round differently)."""
    eager, eager_grads, _ = _fit(tmp_path / "eager", skip=False, kl=0.01, steps=2, micro=4, **kw)
    comp, comp_grads, _ = _fit(tmp_path / "compiled", skip=False, kl=0.01, steps=2, micro=4, compiled=True, **kw)
    assert len(eager.history) == len(comp.history) == 2
    for he, hc in zip(eager.history, comp.history):
        for key in ("loss/total", "loss/policy", "loss/kl", "policy/entropy", "policy/logprob_gap_sampler_trainer"):
            assert hc[key] == pytest.approx(he[key], abs=1e-5, rel=1e-5), key
    for ge, gc in zip(eager_grads, comp_grads):
        scale = max(float(g.abs().max()) for g in ge.values())
        assert ge.keys() == gc.keys() and scale > 0
        for name in ge:
            # 3e-5: step 2's gradients are taken at weights one AdamW step apart, which carries step 1's rounding
            # (AdamW divides by √v: tiny gradients' rounding becomes a relative change). Measured 2026-12-07 with
            # shared prefixes: step 1 3.9e-7 of the largest gradient, step 2 1.2e-5
            assert float((gc[name] - ge[name]).abs().max()) <= 3e-5 * scale, name
    return comp


def test_compiled_layers_give_the_same_update_and_the_rollout_runs_them_eager(tmp_path):
    """update.compile: the decoder layers compiled for the update only (the engine's rollout and the next step's run
    the eager forward: nothing is left swapped in)."""
    from sglightning.compiling import decoder_layers

    comp = _compiled_against_eager(tmp_path)
    layers = decoder_layers(comp.policy)
    assert layers and all("forward" not in layer.__dict__ for layer in layers)
    assert all(callable(layer.__dict__.get("_sglightning_compiled_forward")) for layer in layers)  # made, kept


@pytest.mark.slow
def test_compiled_layers_with_shared_prefixes_give_the_same_update(tmp_path, monkeypatch):
    """update.compile with update.share_prefix: the continuations attend to their prefix through the KV cache, which
    each compiled layer sees as its own layer's tensors; the same losses and gradients as the eager shared update."""
    import warnings

    from torch._dynamo.utils import counters

    real, plans = scoring.shared_prefixes, []
    monkeypatch.setattr(scoring, "shared_prefixes", lambda rows, min_shared=8: plans.append(real(rows, min_shared))
                        or plans[-1])
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        comp = _compiled_against_eager(tmp_path, share=True)
    assert any(p is not None for p in plans)  # prefixes were shared
    assert not [str(w.message) for w in seen if "model.update.compile" in str(w.message)]  # nothing fell back
    fallback = comp.policy._sglightning_compile_fallback
    assert not fallback.failed and not fallback.full
    assert counters["stats"]["unique_graphs"] >= 2  # a prefix's pass and its continuations' at least


def _six_layers_shared(compiled: bool):
    """A 6-layer tiny model's hidden states and gradients for 4 rows, 3 of which share a 10-token prefix."""
    from sglightning.compiling import compiled_layers

    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(num_layers=6), 64).train()
    rows = [[3, 9, 11, 5, 7, 21, 13, 30, 31, 32] + tail for tail in ([40], [41, 42, 43], [44, 45])]
    rows.append([8, 6, 4, 2, 1, 3, 5, 7, 9, 11, 12])
    ids = torch.zeros(len(rows), 13, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), 1
    with compiled_layers(model, compiled):
        h = scoring.shared_prefix_hidden(model.model, ids, attn) * attn[..., None]  # [B, L, H]
        h.pow(2).sum().backward()
    return h.detach(), [p.grad.clone() for p in model.parameters()], model


def _same_as_eager(comp, eager) -> None:
    (comp_h, comp_g, _), (eager_h, eager_g, _) = comp, eager
    assert torch.allclose(comp_h, eager_h, atol=1e-5)
    scale = max(float(g.abs().max()) for g in eager_g)
    for ge, gc in zip(eager_g, comp_g):
        assert torch.allclose(gc, ge, atol=1e-5 * scale)


def test_compiled_layers_take_a_kv_cache_in_one_graph_for_every_layer():
    """A KV cache indexes its layers by number; traced as it is, torch would compile one graph per layer.  Each
    compiled layer sees its own layer's keys and values instead: 6 layers, two passes, two graphs (one per layer would
    be 12; the continuations run eagerly: 1), and the hidden states and gradients of the eager run."""
    from torch._dynamo.utils import counters

    eager = _six_layers_shared(False)
    torch._dynamo.reset()
    counters.clear()
    comp = _six_layers_shared(True)
    assert counters["stats"]["unique_graphs"] == 2
    _same_as_eager(comp, eager)


def test_compiled_layers_past_the_graph_limit_run_new_inputs_eager_and_say_so_once(monkeypatch):
    """One graph allowed: the prefix pass compiles, the continuations run eagerly (the same result), one warning."""
    import warnings

    import sglightning.compiling

    monkeypatch.setattr(sglightning.compiling, "_RECOMPILE_LIMIT", 1)
    eager = _six_layers_shared(False)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        comp = _six_layers_shared(True)
    said = [str(w.message) for w in seen if "model.update.compile" in str(w.message)]
    assert len(said) == 1 and "more kinds of input than 1 compiled graphs" in said[0], said
    assert comp[2]._sglightning_compile_fallback.full and not comp[2]._sglightning_compile_fallback.failed
    _same_as_eager(comp, eager)


def test_a_layer_torch_cannot_compile_runs_eager_and_says_so_once(tmp_path, monkeypatch):
    import warnings

    import sglightning.compiling

    def broken(fn, **kw):
        def fails(*a, **k):
            raise torch._dynamo.exc.TorchDynamoException("inductor exploded")
        return fails

    monkeypatch.setattr(sglightning.compiling.torch, "compile", broken)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compiled_against_eager(tmp_path)
    said = [str(w.message) for w in seen if "model.update.compile" in str(w.message)]
    assert len(said) == 1 and "(TorchDynamoException: inductor exploded)" in said[0], said


def test_the_padding_benchmark_counts_what_the_update_feeds():
    """benchmarks/padding_share.py: rows longest first feed no more than in played order, each at least the rows' own
    positions; shared prefixes feed fewer than the rows hold (two_call shares each step's prompt)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import padding_share

    report = padding_share.main(["--tasks", "2", "--group", "2", "--steps", "2", "--micro", "2", "8"])
    own = report["positions"]
    assert report["rows"] == 2 * 2 * 2 * 2 and own > 0  # 4 episodes × 2 steps × 2 calls
    for micro in (2, 8):
        played, longest, by_ids, ordered = (a for a in report["arms"] if a["micro"] == micro)
        assert own <= longest["fed"] <= played["fed"]
        assert 0 <= longest["pad_share"] <= played["pad_share"] < 1
        assert 0 < ordered["fed"] <= by_ids["fed"] < own and ordered["pad_share"] is None


def test_the_positions_the_order_counts_are_those_the_shared_forward_feeds():
    """prefixes.fed_positions (what the update's row order minimises) against the decoder's inputs in
    scoring.shared_prefix_hidden: prefixes and rests, nothing shared (one whole pass), a row that is all prefix."""
    from sglightning.prefixes import fed_positions

    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(num_layers=1), 64).eval()
    fed = []
    model.model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    prompt = [3, 9, 11, 5, 7, 21, 13, 30, 31]
    cases = [[prompt + [40, 41], prompt + [42], prompt + [43, 44, 45, 46], [8, 6, 4, 2, 1, 3, 5, 7, 9]],
             [[1, 2, 3], [4, 5, 6, 7], [8, 9]],
             [prompt, prompt + [40, 41, 42], [2] + prompt]]
    for rows in cases:
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), 1
        fed.clear()
        with torch.no_grad():
            scoring.shared_prefix_hidden(model.model, ids, attn)
        assert sum(fed) == fed_positions(rows), rows


@pytest.mark.parametrize("share,kl,mode", [(True, 0.0, "two_call"), (True, 0.05, "single_stream"),
                                           (False, 0.0, "two_call")])
def test_the_logged_update_positions_are_those_the_model_is_fed(tmp_path, monkeypatch, share, kl, mode):
    """``tokens/update_positions`` (what gpu_check's MFU counts) against the positions the embedding layer sees in
    the update's forwards: pads included, a shared prefix once; the reference pass (KL on) feeds them again."""
    seen = {"on": False, "positions": 0}
    real = SelfGuideModule.token_logprobs

    def counted(self, ids, *args, **kwargs):
        if not seen.get("hooked"):
            self.policy.get_input_embeddings().register_forward_pre_hook(
                lambda m, a: seen.__setitem__("positions", seen["positions"] + (a[0].numel() if seen["on"] else 0)))
            seen["hooked"] = True
        seen["on"] = True
        try:
            return real(self, ids, *args, **kwargs)
        finally:
            seen["on"] = False

    monkeypatch.setattr(SelfGuideModule, "token_logprobs", counted)
    module, _, _ = _fit(tmp_path, skip=False, share=share, micro=4, kl=kl, mode=mode)
    h = module.history[0]
    passes = 2 if kl > 0 else 1
    assert h["tokens/update_positions"] > 0
    assert seen["positions"] == passes * h["tokens/update_positions"], (seen["positions"], h)
    if share:  # a shared prefix is fed once: fewer positions than the rows hold
        assert h["tokens/update_positions"] < h["tokens/total"]


def test_the_kl_term_is_against_the_base_model_in_a_fit(tmp_path):
    """The golden kl arm logs loss/kl 0 at every step (its adapters start at zero: policy = reference), so a reference
    pass that forgot to switch the adapters off passed every test. With adapters that move the logits, the logged KL
    is the mean k3 of the policy tokens against the base model, and it is 0 where the adapters change nothing."""
    from tiny import tiny_module, tiny_trainer

    def fit_with(scale: float) -> float:
        module = tiny_module()
        module.configure_model()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in module.policy.named_parameters():
                if "lora_B" in name:  # LoRA B starts at zero; drawn here, the adapters change the logits
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
        tiny_trainer(tmp_path, steps=1).fit(module)
        return module.history[0]["loss/kl"]

    assert fit_with(0.0) == 0.0  # the control: the adapted model is the base model
    assert fit_with(0.5) > 1e-3
