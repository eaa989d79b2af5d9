"""Update throughput: the GRPO update with a group's shared prompt computed once vs the plain update, same samples.

    python benchmarks/update_throughput.py                          # SmolLM2, the quickstart's shape, 3 rounds
    python benchmarks/update_throughput.py --model tiny --repeats 1 # seconds, a smoke run
    python benchmarks/update_throughput.py --micro 2 4 8 --json out.json

One rollout is played with the quickstart's settings (household env, single-stream self-guidance, constrained label,
admissible actions, LoRA r16 on every linear layer); its samples get fixed non-zero advantages, and one update
(forward + backward of every micro-batch, no optimiser step) is timed with ``share_prefix`` off and on, alternated
``--repeats`` times in one process.  Also measured in the same process: a fp32 matmul's GFLOP/s, which turns the
update's work into a floor:

    floor = 4 · N · T / matmul rate        (N: the non-embedding parameters; T: the tokens the plain update feeds;
                                            2·N·T for the forward, 2·N·T for the input gradients of the backward —
                                            the frozen weights get no weight gradient; LoRA's own work is < 1 %)

Prints seconds per update, tokens fed (positions, padding included), achieved GFLOP/s counted on the plain update's
work (so a faster arm shows a higher rate for the same result), the ratio to the floor, and shared / plain.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from sglightning import grpo, scoring
from sglightning.console import quiet
from sglightning.data import RolloutConfig
from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig
from sglightning.models import EMBEDDED_SMOLLM2, EMBEDDED_TINY, PolicyConfig, load_policy
from sglightning.rollout import Rollout
from sglightning.sampler import cluster_heads


def matmul_gflops(n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def one_update(model, samples, pad_id: int, micro: int, share: bool, temperature: float) -> tuple[float, int]:
    """Forward + backward of every micro-batch of ``samples`` (as the trainer orders them); returns (seconds, positions
    fed to the decoder)."""
    if share:
        samples = sorted(samples, key=lambda s: s.ids)
    data = scoring.collate(samples, pad_id)
    adv = torch.where(data["mask"], (data["episode"] % 3 - 1).float()[:, None] + 0.5, torch.zeros(()))  # [S, L]
    totals = grpo.policy_counts(data["mask"])
    fed = 0
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for start in range(0, adv.shape[0], micro):
        mb = scoring.microbatch(data, adv, slice(start, start + micro))
        if share:
            fed += _fed_positions(mb["ids"], mb["attn"])
        else:
            fed += mb["ids"].numel()
        logp, _ = scoring.token_logprobs(model, mb["ids"], mb["attn"], mb["mask"], temperature,
                                         restrict=mb["restrict"], share_prefix=share)
        loss, _ = grpo.grpo_loss(logp, mb["old_logp"], mb["adv"], mb["mask"], clip_low=0.2, clip_high=0.28)
        (loss * grpo.microbatch_weight(mb["mask"], totals)).backward()
    return time.perf_counter() - t0, fed


def _fed_positions(ids: torch.Tensor, attn: torch.Tensor) -> int:
    """Positions :func:`scoring.shared_prefix_hidden` feeds for these rows: the distinct prefixes, then the rests."""
    lengths = attn.sum(1).tolist()
    plan = scoring.shared_prefixes([ids[i, :n].tolist() for i, n in enumerate(lengths)])
    if plan is None:
        return ids.numel()
    cluster_of, cut = plan
    heads = cluster_heads(cluster_of)
    prefix = len(heads) * max(cut[i] for i in heads)
    return prefix + len(lengths) * max(n - k for n, k in zip(lengths, cut))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    ap.add_argument("--tasks", type=int, default=2, help="task groups")
    ap.add_argument("--group", type=int, default=4, help="episodes per task")
    ap.add_argument("--steps", type=int, default=5, help="env steps per episode")
    ap.add_argument("--micro", type=int, nargs="+", default=[4], help="micro-batch sizes to measure")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the two arms, alternated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--json", help="write every measurement and the ratios here")
    args = ap.parse_args()
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = EMBEDDED_TINY if args.model == "tiny" else EMBEDDED_SMOLLM2
    model, tok = load_policy(PolicyConfig(name_or_path=name, lora_r=16, lora_alpha=32,
                                          lora_target_modules="all-linear"))
    env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True,
                            task_types=["pick_up", "pick_and_place"])
    gc = GuidanceConfig(prompt_mode="single_stream", decoding="constrained", action_decoding="admissible",
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
    for micro in args.micro:
        secs: dict[str, list[float]] = {"plain": [], "shared": []}
        for rnd in range(args.repeats):
            for arm in (("plain", "shared") if rnd % 2 == 0 else ("shared", "plain")):
                sec, fed = one_update(model, samples, pad, micro, arm == "shared", 1.0)
                secs[arm].append(sec)
                report["runs"].append({"micro": micro, "arm": arm, "round": rnd, "seconds": sec, "fed": fed})
                print(f"{micro:5d} {arm:7} {rnd:5d} {sec:8.2f} {fed:7d} {work / sec:8.1f} {sec / floor:8.2f}",
                      flush=True)
        per_round = [p / s for p, s in zip(secs["plain"], secs["shared"])]
        ratio = statistics.median(per_round)
        report["ratios"][str(micro)] = {
            "shared_speedup": ratio, "range": [min(per_round), max(per_round)],
            "plain_x_floor": statistics.median(secs["plain"]) / floor,
            "shared_x_floor": statistics.median(secs["shared"]) / floor,
        }
        print(f"micro {micro}: shared prefix {ratio:.2f}x faster than plain (range {min(per_round):.2f}-"
              f"{max(per_round):.2f}); plain {report['ratios'][str(micro)]['plain_x_floor']:.2f}x the floor, shared "
              f"{report['ratios'][str(micro)]['shared_x_floor']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
