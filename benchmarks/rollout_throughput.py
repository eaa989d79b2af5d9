"""Rollout throughput: sglightning's lock-step batched rollout vs a naive loop, same episodes, same run.

    python benchmarks/rollout_throughput.py                      # tiny model + SmolLM2 (short)
    python benchmarks/rollout_throughput.py --models tiny --episodes 16 --steps 4

Naive baseline: one ``model.generate`` call per episode per step (no batching across episodes, the whole
conversation re-encoded every turn, HF's own KV cache only inside a call).  sglightning: all live episodes advance in
one batch; the single-stream context keeps its KV cache across turns.  Both write guidance + action freely with the
same token budget per turn, so they do comparable work.  Prints generated tokens/s and episodes/s.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig, parse_action, stream_first_messages, stream_next_user
from sglightning.models import EMBEDDED_SMOLLM2, EMBEDDED_TINY, PolicyConfig, load_policy
from sglightning.rollout import ChatFormat, Rollout, RolloutConfig


def naive(model, tok, env_factory, seeds, group, steps, max_new) -> tuple[int, int, float]:
    chat = ChatFormat(tok)
    tokens = episodes = 0
    t0 = time.perf_counter()
    for seed in seeds:
        for _ in range(group):
            env = env_factory()
            res = env.reset(seed)
            msgs = stream_first_messages(res.task, res.observation, res.admissible_actions, env.action_help, True)
            for _ in range(steps):
                ids = torch.tensor([chat.prompt_ids(msgs)])
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=True,
                    temperature=1.0, top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                )
                new = out[0, ids.shape[1]:]
                tokens += int(new.numel())
                text = tok.decode(new, skip_special_tokens=True)
                step = env.step(parse_action(text).action or "")
                msgs = msgs + [
                    {"role": "assistant", "content": text},
                    {"role": "user",
                     "content": stream_next_user(step.observation, step.admissible_actions, env.action_help)},
                ]
                if step.done:
                    break
            episodes += 1
    return tokens, episodes, time.perf_counter() - t0


def batched(model, tok, env_factory, seeds, group, steps, max_new) -> tuple[int, int, float]:
    gc = GuidanceConfig(decoding="free", action_decoding="free", max_guidance_tokens=max_new // 2,
                        max_action_tokens=max_new - max_new // 2)
    r = Rollout(model, tok, env_factory, gc, RolloutConfig(group_size=group, max_steps=steps))
    t0 = time.perf_counter()
    b = r.run(seeds, generator=torch.Generator().manual_seed(0))
    return b.generated_tokens, len(b.episodes), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--tasks", type=int, default=4, help="task groups")
    ap.add_argument("--group", type=int, default=4, help="episodes per task")
    ap.add_argument("--steps", type=int, default=3, help="env steps per episode")
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per turn")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True)
    seeds = list(range(args.tasks))
    print(f"{args.tasks} tasks x {args.group} episodes x <= {args.steps} steps, <= {args.max_new} new tokens/turn, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'model':10} {'mode':28} {'tokens':>7} {'episodes':>8} {'seconds':>8} {'tok/s':>8} {'episodes/s':>10}")
    for name in args.models:
        cfg = PolicyConfig(name_or_path=EMBEDDED_TINY if name == "tiny" else EMBEDDED_SMOLLM2)
        model, tok = load_policy(cfg)
        model.eval()
        for label, fn in (("sglightning batched+KV", batched), ("naive generate/episode", naive)):
            torch.manual_seed(0)
            with torch.no_grad():
                n_tok, n_ep, sec = fn(model, tok, env, seeds, args.group, args.steps, args.max_new)
            print(f"{name:10} {label:28} {n_tok:7d} {n_ep:8d} {sec:8.1f} {n_tok / sec:8.1f} {n_ep / sec:10.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
