"""Update throughput: the GRPO update with a group's shared prompt computed once vs the plain update, same samples.

    python benchmarks/update_throughput.py                          # SmolLM2, the quickstart's shape, 3 rounds
    python benchmarks/update_throughput.py --model tiny --repeats 1 # seconds, a smoke run
    python benchmarks/update_throughput.py --micro 2 4 8 --json out.json
    python benchmarks/update_throughput.py --compare calibration   # the hindsight label loss on vs off
    python benchmarks/update_throughput.py --compare token_budget --micro 8 --budget 4096  # micro-batches by tokens
    python benchmarks/update_throughput.py --compare lm_head       # FSDP's whole-model path: LM head where read
    python benchmarks/update_throughput.py --compare compile       # whole rows: eager vs compiled decoder layers
    python benchmarks/update_throughput.py --compare compile_shared  # shared prefixes: eager vs compiled layers
    python benchmarks/update_throughput.py --compare prefix_order --mode two_call  # rows by ids vs the trainer's order

One rollout is played with the quickstart's settings (household env, single-stream self-guidance, constrained label,
admissible actions, LoRA r16 on every linear layer); its samples get fixed non-zero advantages, and one update
(forward + backward of every micro-batch, no optimiser step) is timed with ``share_prefix`` off and on, alternated
``--repeats`` times in one process.  Also measured in the same process: a fp32 matmul's GFLOP/s, which turns the
update's work into a floor:

    floor = 4 · N · T / matmul rate        (N: the non-embedding parameters; T: the rows' own tokens, no padding;
                                            2·N·T for the forward, 2·N·T for the input gradients of the backward —
                                            the frozen weights get no weight gradient; LoRA's own work is < 1 %)

Prints seconds per update, tokens fed (positions, padding included), achieved GFLOP/s counted on the plain update's
work (so a faster arm shows a higher rate for the same result), the ratio to the floor, and shared / plain.

``--compare calibration`` times, the same way, the update as the trainer runs it (shared prefixes, entropies) without
and with the hindsight label loss (``grpo.calibration`` = 1: the label tokens' log q(y*) from the logits the policy
loss already computed, added to the objective): the cost of the extra term per scored row, on the same rows.  (In
training the option also keeps zero-advantage rows that hold a target, so a step may score more rows; that shows in
``time/update_s``, not here.)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from sglightning import grpo, prefixes, scoring
from sglightning.compiling import compiled_layers
from sglightning.console import quiet
from sglightning.data import RolloutConfig
from sglightning.embedded import EMBEDDED_SMOLLM2, EMBEDDED_TINY
from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig
from sglightning.models import PolicyConfig, load_policy
from sglightning.rollout import Rollout
from sglightning.update import UpdateConfig, prefix_order


def matmul_gflops(n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def one_update(model, samples, pad_id: int, micro: int, share: bool, temperature: float,
               calibration: float | None = None, budget: int | None = None, whole: str | None = None,
               compiled: bool = False, by_ids: bool = False, played: bool = False) -> tuple[float, int]:
    """Forward + backward of every micro-batch of ``samples`` (as the trainer orders them); returns (seconds, positions
    fed to the decoder).  ``calibration``: score as the trainer does (entropies too) and, when > 0, add the hindsight
    label loss α·Σ(−log q(y*)) / targets.  ``budget``: micro-batches of at most ``micro`` rows and ``budget`` fed
    positions (``update.micro_batch_tokens``).  Whole rows come longest first, as the trainer orders them;
    ``played``: in played order instead (the trainer before 2026-12-06 without a budget).  ``whole``: call the
    whole model, as FSDP does,
    with the LM head at the positions some row reads (``"read"``, the trainer) or at every position (``"all"``, the
    trainer before 2026-12-04).  ``compiled``: the decoder layers compiled (``update.compile``).  ``by_ids``: shared
    prefixes with the rows sorted by their ids (the trainer before 2026-12-06), not in the trainer's order."""
    if share:  # sorted by ids, as the trainer sorts them first; then the trainer's order (update.prefix_order)
        samples = sorted(samples, key=lambda s: s.ids)
    elif not played:
        samples = sorted(samples, key=lambda s: -scoring.scored_length(s))
    data = scoring.collate(samples, pad_id, targets=bool(calibration))
    if share and not by_ids:
        cfg = UpdateConfig(micro_batch_size=micro, micro_batch_tokens=budget)
        data = scoring.select_rows(data, torch.tensor(prefix_order(data, cfg), dtype=torch.long))
    adv = torch.where(data["mask"], (data["episode"] % 3 - 1).float()[:, None] + 0.5, torch.zeros(()))  # [S, L]
    # the trainer's denominators: every policy token and sequence, and every target at a policy token of the update
    n_targets = float(((data["target"] >= 0) & data["mask"]).sum()) if calibration else 0.0
    totals = grpo.StepCounts(*grpo.policy_counts(data["mask"]).tolist(), targets=n_targets)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with compiled_layers(model, compiled):
        fed = _microbatches(model, data, adv, totals, micro, budget, share, temperature, calibration, whole)
    return time.perf_counter() - t0, fed


def _microbatches(model, data, adv, totals, micro, budget, share, temperature, calibration, whole) -> int:
    """The forward and backward of each micro-batch of :func:`one_update`; returns the positions fed."""
    fed = 0
    for rows in scoring.microbatch_rows(data, micro, budget):
        mb = scoring.microbatch(data, adv, rows)
        if share:
            fed += _fed_positions(mb["ids"], mb["attn"])
        else:
            fed += mb["ids"].numel()
        if whole == "all":
            logp, ent = _every_position(model, mb, temperature), {}
        else:
            logp, ent = scoring.token_logprobs(model, mb["ids"], mb["attn"], mb["mask"], temperature,
                                               restrict=mb["restrict"], share_prefix=share,
                                               entropy=calibration is not None, whole_model=whole == "read")
        loss, _ = grpo.grpo_loss(logp, mb["old_logp"], mb["adv"], mb["mask"], clip_low=0.2, clip_high=0.28)
        objective = loss * grpo.microbatch_weight(mb["mask"], totals)
        if calibration:
            targets = (mb["restrict"]["target"] >= 0) & mb["mask"]  # [B, W]
            term, _ = grpo.calibration_term(ent["target_logq"], targets, mb["restrict"]["target_label"], totals)
            objective = objective + calibration * term
        objective.backward()
    return fed


def _every_position(model, mb: dict, temperature: float) -> torch.Tensor:
    """The whole-model scoring with full logits [B, L, V], selected afterwards (what FSDP's path computed before
    ``logits_to_keep``)."""
    sel = mb["mask"][:, 1:]  # [B, L-1]
    logits = model(input_ids=mb["ids"], attention_mask=mb["attn"], use_cache=False).logits  # [B, L, V]
    logp, _ = scoring.logprobs_from_logits(mb["ids"], sel, logits[:, :-1][sel].float() / temperature,
                                           mb["restrict"], False)
    return logp


def _fed_positions(ids: torch.Tensor, attn: torch.Tensor) -> int:
    """Positions :func:`scoring.shared_prefix_hidden` feeds for these rows: the distinct prefixes, then the rests."""
    return prefixes.fed_positions([row[:n] for row, n in zip(ids.tolist(), attn.sum(1).tolist())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    ap.add_argument("--tasks", type=int, default=2, help="task groups")
    ap.add_argument("--group", type=int, default=4, help="episodes per task")
    ap.add_argument("--steps", type=int, default=5, help="env steps per episode")
    ap.add_argument("--mode", default="single_stream", choices=["single_stream", "two_call"],
                    help="guidance.prompt_mode of the rollout (two_call: two rows per env step)")
    ap.add_argument("--decoding", default="constrained", choices=["constrained", "free"],
                    help="the rollout's decoding: the quickstart's (constrained label, admissible actions) or free")
    ap.add_argument("--micro", type=int, nargs="+", default=[4], help="micro-batch sizes to measure")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the two arms, alternated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--json", help="write every measurement and the ratios here")
    ap.add_argument("--compare", default="share_prefix",
                    choices=["share_prefix", "calibration", "token_budget", "lm_head", "compile", "compile_shared",
                             "prefix_order"],
                    help="share_prefix: plain vs shared prefixes; calibration: the trainer's update without vs with "
                         "the hindsight label loss (alpha 1); token_budget: plain micro-batches of --micro rows vs "
                         "longest-first micro-batches of at most --budget positions; lm_head: the whole model "
                         "called (as under FSDP) with the LM head at every position vs where a row reads it; "
                         "compile: the plain update with eager vs compiled decoder layers (update.compile)")
    ap.add_argument("--budget", type=int, default=4096, help="update.micro_batch_tokens for --compare token_budget")
    args = ap.parse_args()
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = EMBEDDED_TINY if args.model == "tiny" else EMBEDDED_SMOLLM2
    model, tok = load_policy(PolicyConfig(name_or_path=name, lora_r=16, lora_alpha=32,
                                          lora_target_modules="all-linear"))
    env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True,
                            task_types=["pick_up", "pick_and_place"])
    if args.decoding == "free":  # the paper configs' decoding: guidance and actions written freely
        gc = GuidanceConfig(prompt_mode=args.mode, decoding="free", action_decoding="free", max_guidance_tokens=32,
                            max_action_tokens=16)
    else:
        gc = GuidanceConfig(prompt_mode=args.mode, decoding="constrained", action_decoding="admissible",
                            max_guidance_tokens=12, max_action_tokens=16)
    rollout = Rollout(model, tok, env, gc, RolloutConfig(group_size=args.group, max_steps=args.steps))
    batch = rollout.run(list(range(args.tasks)), generator=torch.Generator().manual_seed(0))
    rollout.close()
    samples = [s for s in batch.samples if any(s.policy)]
    model.train()
    base = model.get_base_model()
    n_params = sum(p.numel() for n, p in base.named_parameters() if "embed" not in n and "lora_" not in n)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    plain_tokens = scoring.collate(samples, pad)["attn"].sum().item()
    rate = matmul_gflops()
    policy = sum(sum(s.policy) for s in samples)
    print(f"{args.model}: {len(samples)} samples, {plain_tokens} tokens ({policy} policy), "
          f"N = {n_params / 1e6:.1f} M non-embedding parameters, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}, matmul {rate:.1f} GFLOP/s")
    print(f"{'micro':>5} {'arm':7} {'round':>5} {'seconds':>8} {'fed':>7} {'GFLOP/s':>8} {'x floor':>8}")
    report: dict = {"args": vars(args), "torch": torch.__version__, "n_params": n_params, "tokens": plain_tokens,
                    "matmul_gflops": rate, "runs": [], "ratios": {}}
    work = 4 * n_params * plain_tokens / 1e9  # GFLOP of the plain update
    floor = work / rate
    if args.compare == "calibration":  # the trainer's update (shared prefixes, entropies), the label loss off / on
        arms = {"cal_off": dict(share=True, calibration=0.0), "cal_on": dict(share=True, calibration=1.0)}
        cal = scoring.collate(samples, pad, targets=True)
        n_targets = int(((cal["target"] >= 0) & cal["mask"]).sum())
        report["label_targets"] = n_targets
        print(f"{n_targets} hindsight label targets among the policy tokens")
    elif args.compare == "lm_head":  # the FSDP path: full logits vs logits_to_keep at the read positions
        arms = {"all": dict(share=False, whole="all"), "read": dict(share=False, whole="read")}
    elif args.compare == "token_budget":  # same rows, same loss: fixed row counts vs a budget of fed positions
        arms = {"rows": dict(share=False, played=True), "budget": dict(share=False, budget=args.budget)}
    elif args.compare in ("compile", "compile_shared"):  # eager vs compiled layers, rows whole or prefixes shared
        share = args.compare == "compile_shared"
        arms = {"eager": dict(share=share), "compiled": dict(share=share, compiled=True)}
        sec, _ = one_update(model, samples, pad, args.micro[0], share, 1.0, compiled=True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        report["compile_and_first_update_s"], report["graphs"] = sec, graphs
        print(f"compile and first compiled update: {sec:.1f} s, {graphs} graphs")
    elif args.compare == "prefix_order":  # shared prefixes, rows sorted by ids vs the trainer's order
        arms = {"by_ids": dict(share=True, by_ids=True), "ordered": dict(share=True)}
    else:
        arms = {"plain": dict(share=False), "shared": dict(share=True)}
    first, second = arms
    for micro in args.micro:
        secs: dict[str, list[float]] = {a: [] for a in arms}
        for rnd in range(args.repeats):
            for arm in ((first, second) if rnd % 2 == 0 else (second, first)):
                sec, fed = one_update(model, samples, pad, micro, temperature=1.0, **arms[arm])
                secs[arm].append(sec)
                report["runs"].append({"micro": micro, "arm": arm, "round": rnd, "seconds": sec, "fed": fed})
                print(f"{micro:5d} {arm:7} {rnd:5d} {sec:8.2f} {fed:7d} {work / sec:8.1f} {sec / floor:8.2f}",
                      flush=True)
        per_round = [a / b for a, b in zip(secs[first], secs[second])]
        ratio = statistics.median(per_round)
        name = {"share_prefix": "shared_speedup", "calibration": "off_over_on", "token_budget": "budget_speedup",
                "lm_head": "read_speedup", "compile": "compiled_speedup", "compile_shared": "compiled_speedup",
                "prefix_order": "ordered_speedup"}
        report["ratios"][str(micro)] = {
            name[args.compare]: ratio,
            "range": [min(per_round), max(per_round)],
            **{f"{a}_x_floor": statistics.median(secs[a]) / floor for a in arms},
        }
        what = {"share_prefix": "shared prefix {r:.2f}x faster than plain",
                "calibration": "the update with the label loss takes {inv:.3f}x the time without it",
                "token_budget": "the token budget {r:.2f}x faster than fixed rows",
                "lm_head": "the LM head at the read positions {r:.2f}x faster than at every position",
                "compile": "compiled layers {r:.2f}x faster than eager",
                "compile_shared": "compiled layers {r:.2f}x faster than eager, prefixes shared",
                "prefix_order": "the trainer's order {r:.2f}x faster than rows by ids"}[args.compare]
        print(f"micro {micro}: " + what.format(r=ratio, inv=1 / ratio) + f" (per-round range {min(per_round):.3f}-"
              f"{max(per_round):.3f} of {first}/{second}); "
              + ", ".join(f"{a} {report['ratios'][str(micro)][f'{a}_x_floor']:.2f}x the floor" for a in arms),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
