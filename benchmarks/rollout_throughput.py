"""Rollout throughput: sglightning's lock-step batched rollout vs a naive loop, same episodes, same run.

    python benchmarks/rollout_throughput.py                      # tiny model + SmolLM2 (short)
    python benchmarks/rollout_throughput.py --models smollm2 --group 8 --repeats 3 --json out.json

The arms (``--arms``; default shared, batched, naive), alternated ``--repeats`` times in one process (ratios are
taken within a repeat, then the median):

* ``shared``: sglightning's default — all live episodes advance in one batch, the single-stream context keeps its KV
  cache across turns, and a group's common prompt is computed once and its cache copied to the G rows;
* ``batched``: the same without prefix sharing (every row prefills its own prompt);
* ``naive``: one ``model.generate`` call per episode per step (no batching across episodes, the whole conversation
  re-encoded every turn, HF's own KV cache only inside a call);
* ``help_once``: ``shared`` with ``guidance.action_help_every_turn: false`` (the env's action help only in the first
  user turn).  Its prompts differ, so its episodes differ too: compare prefill positions per episode, and tokens/s;
* ``one_pass``: ``shared`` with every context block fed in one pass padded to the longest row's block, instead of in
  stages where the rows' lengths jump (``DecodeSession(staged_prefill=False)``) — the same tokens up to float rounding.

``--env twc`` plays TextWorldExpress twc (1 room, 1 object; needs ``pip install -e ".[twx]"`` and Java 17), whose
observations vary more in length than the household's.

All write guidance + action freely with the same token budget per turn, so they do comparable work
(``--decoding constrained``, without the naive arm: the trainer's default decoding, whose valid actions give
observations of more varied lengths).  Prints generated tokens/s, episodes/s, the prefill positions computed, and
the ratios of the pairs present (shared / naive, batched / naive, shared / batched, help_once / shared,
shared / one_pass).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from sglightning.chat import ChatFormat
from sglightning.console import quiet
from sglightning.data import RolloutConfig
from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig, parse_action, stream_first_messages, stream_next_user
from sglightning.models import EMBEDDED_SMOLLM2, EMBEDDED_TINY, PolicyConfig, load_policy
from sglightning.rollout import Rollout
from sglightning.sampler import DecodeSession


def naive(model, tok, env_factory, seeds, group, steps, max_new) -> tuple[int, int, float, int]:
    chat = ChatFormat(tok)
    tokens = episodes = prefill = 0
    t0 = time.perf_counter()
    for seed in seeds:
        for _ in range(group):
            env = env_factory()
            res = env.reset(seed)
            msgs = stream_first_messages(res.task, res.observation, res.admissible_actions, env.action_help, True)
            for _ in range(steps):
                ids = torch.tensor([chat.prompt_ids(msgs)])
                prefill += ids.shape[1]
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
    return tokens, episodes, time.perf_counter() - t0, prefill


def batched(model, tok, env_factory, seeds, group, steps, max_new, share=True,
            help_every_turn=True, staged=True, constrained=False) -> tuple[int, int, float, int]:
    decoding = "constrained" if constrained else "free"
    gc = GuidanceConfig(decoding=decoding, action_decoding="admissible" if constrained else "free",
                        max_guidance_tokens=max_new // 2, max_action_tokens=max_new - max_new // 2,
                        action_help_every_turn=help_every_turn)
    r = Rollout(model, tok, env_factory, gc, RolloutConfig(group_size=group, max_steps=steps),
                decoder=functools.partial(DecodeSession, share_prefix=share, staged_prefill=staged))
    t0 = time.perf_counter()
    b = r.run(seeds, generator=torch.Generator().manual_seed(0))
    return b.generated_tokens, len(b.episodes), time.perf_counter() - t0, b.prefill_positions


ARMS = {
    "shared": functools.partial(batched, share=True),
    "batched": functools.partial(batched, share=False),
    "naive": naive,
    "help_once": functools.partial(batched, share=True, help_every_turn=False),
    "one_pass": functools.partial(batched, share=True, staged=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--tasks", type=int, default=4, help="task groups")
    ap.add_argument("--group", type=int, default=4, help="episodes per task")
    ap.add_argument("--steps", type=int, default=3, help="env steps per episode")
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per turn")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the arms, alternated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--arms", nargs="+", default=["shared", "batched", "naive"], choices=list(ARMS),
                    help="arms to alternate (ratios are printed for the pairs present)")
    ap.add_argument("--env", default="household", choices=["household", "twc"])
    ap.add_argument("--decoding", default="free", choices=["free", "constrained"],
                    help="constrained: the trainer's default (forced Reason/Label lines, actions chosen among the "
                         "admissible ones); the naive arm only writes freely")
    ap.add_argument("--json", help="write every measurement and the ratios here")
    args = ap.parse_args()
    if args.decoding == "constrained" and "naive" in args.arms:
        ap.error("--decoding constrained: the naive arm writes freely; leave it out of --arms")
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.env == "twc":
        from sglightning.envs.textworld_express import TextWorldExpressEnv

        env = functools.partial(TextWorldExpressEnv, game="twc",
                                game_params="numLocations=1,numItemsToPutAway=1,includeDoors=0,limitInventorySize=0")
    else:
        env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True)
    seeds = list(range(args.tasks))
    kw = {"constrained": True} if args.decoding == "constrained" else {}  # naive is refused with constrained
    print(f"{args.env}: {args.tasks} tasks x {args.group} episodes x <= {args.steps} steps, "
          f"<= {args.max_new} new tokens/turn, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'model':8} {'arm':8} {'round':>5} {'tokens':>7} {'episodes':>8} {'prefill':>8} {'seconds':>8} "
          f"{'tok/s':>8} {'episodes/s':>10}")
    report: dict = {"args": vars(args), "torch": torch.__version__, "runs": [], "ratios": {}}
    for name in args.models:
        cfg = PolicyConfig(name_or_path=EMBEDDED_TINY if name == "tiny" else EMBEDDED_SMOLLM2)
        model, tok = load_policy(cfg)
        model.eval()
        speed: dict[str, list[float]] = {arm: [] for arm in args.arms}
        for rnd in range(args.repeats):
            order = list(args.arms) if rnd % 2 == 0 else list(reversed(args.arms))
            for arm in order:
                torch.manual_seed(0)
                with torch.no_grad():
                    n_tok, n_ep, sec, prefill = ARMS[arm](model, tok, env, seeds, args.group, args.steps,
                                                          args.max_new, **kw)
                speed[arm].append(n_tok / sec)
                report["runs"].append({"model": name, "arm": arm, "round": rnd, "tokens": n_tok, "episodes": n_ep,
                                       "prefill_positions": prefill, "seconds": sec})
                print(f"{name:8} {arm:8} {rnd:5d} {n_tok:7d} {n_ep:8d} {prefill:8d} {sec:8.1f} {n_tok / sec:8.1f} "
                      f"{n_ep / sec:10.3f}", flush=True)
        ratios = {}
        pairs = [("shared", "naive"), ("batched", "naive"), ("shared", "batched"), ("help_once", "shared"),
                 ("shared", "one_pass")]
        for a, b in pairs:
            if a in speed and b in speed:
                per_round = [x / y for x, y in zip(speed[a], speed[b])]
                ratios[f"{a}_vs_{b}"] = statistics.median(per_round)
                ratios[f"{a}_vs_{b}_range"] = [min(per_round), max(per_round)]
        report["ratios"][name] = ratios
        shown = ", ".join(f"{k.replace('_vs_', ' / ')} {v:.2f}x (range {ratios[k + '_range'][0]:.2f}-"
                          f"{ratios[k + '_range'][1]:.2f})" for k, v in ratios.items() if not k.endswith("_range"))
        print(f"{name}: generated tokens/s, median over rounds: {shown}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
