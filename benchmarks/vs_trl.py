r"""sglightning vs TRL's GRPOTrainer: the same GRPO steps through both trainers, alternated in one sitting.

    pip install -e ".[vs-trl]"                  # trl==1.16.0 + datasets (torch, transformers, peft untouched)
    python benchmarks/vs_trl.py                 # SmolLM2-135M, household, 2 tasks x G 4 x <= 3 turns, 2 rounds
    python benchmarks/vs_trl.py --group 8 --rounds 1 --json benchmarks/results/vs_trl_g8.json
    python benchmarks/vs_trl.py --env twc       # TextWorldExpress twc (needs the [twx] extra and Java 17)

Held equal on both sides: the model (fp32) with LoRA r 16 / alpha 32 on every linear layer; AdamW at the same
learning rate; the env, its task seeds step by step (sglightning's own seed schedule, fed to TRL as its dataset in
order, unshuffled), N tasks x G episodes x <= T turns; <= ``--max-new`` tokens per turn written freely (self-guidance
then the action, temperature 1, no top-k / top-p); the same first prompt and per-turn messages; one optimiser step
per rollout; token-mean loss (TRL ``loss_type="dapo"``) with clip (0.2, 0.28); no KL term (beta 0: neither side runs
a reference pass); micro-batches of ``--micro`` samples; no gradient checkpointing; the same torch thread count.

* sglightning: ``sglightning fit`` in-process on a generated config (single-stream prompts, free decoding).
* TRL: ``GRPOTrainer`` with a ``rollout_func`` written the way a TRL user writes a multi-turn rollout: every turn
  one batched ``generate`` over the live episodes on the whole conversation so far (left-padded), the env's reply
  appended to the completion and masked out of the loss with ``env_mask``, the sampled tokens' log-probs taken from
  ``generate``'s scores.  (TRL's ``environment_factory`` drives tool calls through the chat template's tool schema,
  which SmolLM2's template does not have.)

Each arm runs in a process of its own (``--worker``) for ``--steps`` GRPO steps; the first step of every process is
warm-up and left out; the arms alternate ``--rounds`` times.  A step's time is the wall time between consecutive
step ends (everything the trainer does); its update time is the step minus its rollout.  Printed per arm: s/step,
rollout s and generated tokens/s, update s and update tokens/s (the step's samples' tokens, prompt + completion, per
second of update), peak RSS, and how many samples sglightning skipped because their group's returns were all equal
(no gradient: TRL computes them); then the ratios per round and their median.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------------- shared setup


def env_factory(name: str):
    if name == "household":
        from sglightning.envs.household import HouseholdEnv

        return functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True,
                                 task_types=["pick_up", "pick_and_place"])
    from sglightning.envs.textworld_express import TextWorldExpressEnv

    return functools.partial(TextWorldExpressEnv, game="twc",
                             game_params="numLocations=1,numItemsToPutAway=2,includeDoors=0,limitInventorySize=0")


def env_init(name: str) -> dict:
    """The env as a config block (the same object :func:`env_factory` builds)."""
    fac = env_factory(name)
    return {"class_path": f"{fac.func.__module__}.{fac.func.__name__}", "init_args": dict(fac.keywords)}


def step_seeds(args, step: int) -> list[int]:
    """The task seeds sglightning plays at ``step`` (one process, default rollout seed) — TRL gets the same."""
    from sglightning.data import EvalConfig, RolloutConfig, task_seeds

    return task_seeds(RolloutConfig().seed, step, args.tasks, 0, 1, EvalConfig().seed_offset)


def model_name(args) -> str:
    from sglightning.embedded import EMBEDDED_SMOLLM2, EMBEDDED_TINY

    return {"smollm2": EMBEDDED_SMOLLM2, "tiny": EMBEDDED_TINY}.get(args.model, args.model)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def per_step(ends: list[float], start: float) -> list[float]:
    """Seconds of each step from the wall-clock times at which steps ended."""
    return [b - a for a, b in zip([start, *ends[:-1]], ends)]


# ------------------------------------------------------------------------------------------------------- sglightning


def sgl_config(args, out: Path) -> dict:
    half = args.max_new // 2
    return {
        "seed_everything": 0,
        "trainer": {"max_steps": args.steps, "accelerator": "cpu", "devices": 1, "precision": "32-true",
                    "limit_val_batches": 0, "enable_progress_bar": False,
                    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(out), "name": "sgl"}}},
        "model": {
            "policy": {"name_or_path": model_name(args), "lora_r": 16, "lora_alpha": 32,
                       "lora_target_modules": "all-linear"},
            "env": env_init(args.env),
            "rollout": {"groups_per_step": args.tasks, "group_size": args.group, "max_steps": args.turns,
                        "temperature": 1.0},
            "guidance": {"enabled": True, "prompt_mode": "single_stream", "decoding": "free",
                         "action_decoding": "free", "max_guidance_tokens": half,
                         "max_action_tokens": args.max_new - half},
            # the score gained (0-100 -> 0-1) on top of the sparse success reward, as on the TRL side: a 135M model
            # rarely wins within a few turns, and with every return equal there would be no update to compare
            "reward_terms": [{"class_path": "sglightning.rewards.ScoreGain"}],
            "grpo": {"kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.28},
            "update": {"micro_batch_size": args.micro, "skip_zero_advantage": not args.no_skip},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": args.lr, "weight_decay": 0.0}},
        },
    }


def sgl_worker(args, out: Path) -> dict:
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sglightning.cli import cli_main

    cfg_path = out / "sgl.yaml"
    cfg_path.write_text(yaml.safe_dump(sgl_config(args, out), sort_keys=False))
    sys.argv = sys.argv[:1]  # the CLI gets its arguments below, not this worker's
    start = time.time()  # the default last.ckpt after every step stays on: it is part of a step as users run it
    cli_main(["fit", "--config", str(cfg_path), "--threads", str(args.threads)])
    acc = EventAccumulator(str(next((out / "sgl").glob("version_*"))), size_guidance={"scalars": 0})
    acc.Reload()
    series = {tag: acc.Scalars(tag) for tag in ("time/rollout_s", "time/update_s", "tokens/generated", "tokens/total",
                                                "tokens/skipped_zero_advantage_samples")}
    steps = per_step([ev.wall_time for ev in series["time/update_s"]], start)
    rollout = [ev.value for ev in series["time/rollout_s"]]
    return {
        "step_s": steps,
        "rollout_s": rollout,
        "generated": [ev.value for ev in series["tokens/generated"]],
        "update_s": [s - r for s, r in zip(steps, rollout)],  # as on the TRL side: the step minus its rollout
        "update_tokens": [ev.value for ev in series["tokens/total"]],
        # samples of groups whose returns were all equal: no gradient, so sglightning skips them (TRL computes them)
        "skipped_samples": [ev.value for ev in series["tokens/skipped_zero_advantage_samples"]],
    }


# --------------------------------------------------------------------------------------------------------------- TRL


class EpisodeRollout:
    """The TRL side's ``rollout_func(prompts, trainer)``: plays one episode per prompt (prompts are ``"task <seed>"``,
    each repeated G times by TRL's sampler) in lock step, one batched ``generate`` per turn over the live episodes
    on their whole conversation so far.  Returns per episode the first prompt's ids, the completion (sampled tokens
    and the env's replies in between, in order), its ``env_mask`` (1 = sampled), the sampled tokens' log-probs (0 on
    env tokens) and ``env_reward`` (the episode's summed env reward, for the reward function)."""

    def __init__(self, tokenizer, make_env, turns: int, max_new: int):
        from sglightning.chat import ChatFormat

        self.tok, self.make_env, self.turns, self.max_new = tokenizer, make_env, turns, max_new
        self.chat = ChatFormat(tokenizer)
        self.records: list[dict] = []

    def __call__(self, prompts: list, trainer) -> dict:
        t0 = time.perf_counter()
        model = trainer.model
        was_training = model.training
        model.eval()
        try:
            out = self.play(model, [int(str(p).split()[-1]) for p in prompts])
        finally:
            model.train(was_training)
        self.records.append({
            "rollout_s": time.perf_counter() - t0,
            "generated": sum(map(sum, out["env_mask"])),
            "update_tokens": sum(len(p) + len(c) for p, c in zip(out["prompt_ids"], out["completion_ids"])),
        })
        return out

    def play(self, model, seeds: list[int]) -> dict:
        from sglightning.guidance import parse_action, stream_first_messages, stream_next_user

        tok, n = self.tok, len(seeds)
        envs = [self.make_env() for _ in seeds]
        msgs, prompt_ids, first_score = [], [], []
        for env, seed in zip(envs, seeds):
            res = env.reset(seed)
            first_score.append(res.score)
            msgs.append(stream_first_messages(res.task, res.observation, res.admissible_actions, env.action_help,
                                              True))
            prompt_ids.append(self.chat.prompt_ids(msgs[-1]))
        completion: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reward, done, score = [0.0] * n, [False] * n, list(first_score)
        eos = tok.eos_token_id
        for turn in range(self.turns):
            live = [i for i in range(n) if not done[i]]
            if not live:
                break
            rows = [torch.tensor(prompt_ids[i] + completion[i]) for i in live]  # the whole conversation, re-encoded
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), tok.pad_token_id)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for j, r in enumerate(rows):  # left padding
                ids[j, width - len(r):], attn[j, width - len(r):] = r, 1
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=self.max_new, do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id,
                                     eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
            new = gen.sequences[:, width:]  # [B, T_new]
            lp = torch.stack(gen.scores, 1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]  # [B, T_new]
            for j, i in enumerate(live):
                toks = new[j].tolist()
                closed = eos in toks
                keep = toks.index(eos) + 1 if closed else len(toks)
                toks = toks[:keep]
                completion[i] += toks
                mask[i] += [1] * keep
                logps[i] += lp[j, :keep].tolist()
                step = envs[i].step(parse_action(tok.decode(toks, skip_special_tokens=True)).action or "")
                reward[i] += float(step.reward)
                score[i] = step.score if step.score is not None else score[i]
                if step.done or turn == self.turns - 1:
                    done[i] = True
                    continue
                reply = self.chat.next_turn_ids(
                    stream_next_user(step.observation, step.admissible_actions, envs[i].action_help), closed)
                completion[i] += reply
                mask[i] += [0] * len(reply)
                logps[i] += [0.0] * len(reply)
        gained = [0.0 if b is None else (b - (a or 0.0)) / 100.0 for a, b in zip(first_score, score)]
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": logps, "env_mask": mask,
                "env_reward": [r + g for r, g in zip(reward, gained)]}


def env_reward(prompts, completions, env_reward, **kwargs) -> list[float]:
    """TRL reward function: the episode's env reward, passed through from the rollout."""
    return [float(r) for r in env_reward]


def trl_worker(args, out: Path) -> dict:
    import datasets
    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback

    from sglightning.models import PolicyConfig, load_base_model, load_tokenizer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pc = PolicyConfig(name_or_path=model_name(args))
    tok = load_tokenizer(pc)
    tok.padding_side = "left"
    base = load_base_model(pc, len(tok))
    rows = [{"prompt": f"task {s}"} for step in range(args.steps) for s in step_seeds(args, step)]
    rollout = EpisodeRollout(tok, env_factory(args.env), args.turns, args.max_new)
    n = args.tasks * args.group
    if n % args.micro:
        raise SystemExit(f"vs_trl: --micro {args.micro} must divide tasks x group = {n} (TRL accumulates whole "
                         "micro-batches)")
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.time())

    config = trl.GRPOConfig(
        output_dir=str(out / "trl"), max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=n // args.micro,
        num_generations=args.group, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        temperature=1.0, max_completion_length=args.turns * (args.max_new + 512), shuffle_dataset=False,
        gradient_checkpointing=False, use_cpu=True, bf16=False, fp16=False, seed=0, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=base, reward_funcs=env_reward, args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok, rollout_func=rollout,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                               task_type="CAUSAL_LM"),
    )
    trainer.add_callback(StepEnds())
    start = time.time()
    trainer.train()
    steps = per_step(ends, start)
    rec = rollout.records
    return {
        "step_s": steps,
        "rollout_s": [r["rollout_s"] for r in rec],
        "generated": [r["generated"] for r in rec],
        "update_s": [s - r["rollout_s"] for s, r in zip(steps, rec)],
        "update_tokens": [r["update_tokens"] for r in rec],
    }


# ------------------------------------------------------------------------------------------------------------ driver


def summary(res: dict) -> dict:
    """Medians over the measured steps (warm-up step 0 left out, unless it is the only one)."""
    keep = slice(1, None) if len(res["step_s"]) > 1 else slice(None)
    m = {k: statistics.median(v[keep]) for k, v in res.items() if isinstance(v, list) and v}
    rollout_tps = statistics.median(g / s for g, s in zip(res["generated"][keep], res["rollout_s"][keep]))
    update_tps = statistics.median(t / s for t, s in zip(res["update_tokens"][keep], res["update_s"][keep]))
    return {"step_s": m["step_s"], "rollout_s": m["rollout_s"], "update_s": m["update_s"],
            "rollout_tok_s": rollout_tps, "update_tok_s": update_tps, "peak_rss_mb": res["peak_rss_mb"],
            "skipped_samples": sum(res.get("skipped_samples", [])[keep])}


def run_worker(arm: str, args, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE), "--worker", arm, "--out", str(folder),
           *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in PASSED],
           *(["--no-skip"] if args.no_skip else [])]
    with open(folder / "worker.log", "w") as log:
        res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        tail = (folder / "worker.log").read_text()[-3000:]
        raise SystemExit(f"vs_trl: the {arm} worker failed (exit {res.returncode}); log {folder / 'worker.log'}:"
                         f"\n{tail}")
    return json.loads((folder / "result.json").read_text())


# options a worker gets as --key=value (--no-skip is a flag: passed on its own)
PASSED = ("model", "env", "tasks", "group", "turns", "max_new", "micro", "steps", "lr", "threads")
ARMS = ("sglightning", "trl")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (embedded), tiny, or a HF id / local folder")
    ap.add_argument("--env", default="household", choices=["household", "twc"])
    ap.add_argument("--tasks", type=int, default=2, help="task groups per step (N)")
    ap.add_argument("--group", type=int, default=4, help="episodes per task (G)")
    ap.add_argument("--turns", type=int, default=3, help="env steps per episode at most (T)")
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per turn at most")
    ap.add_argument("--micro", type=int, default=4, help="samples per forward/backward")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per worker process (the first is warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two arms")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both arms")
    ap.add_argument("--no-skip", action="store_true",
                    help="sglightning computes zero-advantage samples too, as TRL does (engine against engine; by "
                         "default it skips them, as it does in training)")
    ap.add_argument("--json", help="write every measurement and the ratios here")
    ap.add_argument("--work", help="folder for the workers' runs (default: a temporary one)")
    ap.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = Path(args.out)
        res = (sgl_worker if args.worker == "sglightning" else trl_worker)(args, out)
        res["peak_rss_mb"] = peak_rss_mb()
        (out / "result.json").write_text(json.dumps(res))
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="vs_trl-"))
    print(f"{args.model} on {args.env}: {args.tasks} tasks x G {args.group} x <= {args.turns} turns, <= {args.max_new} "
          f"new tokens/turn, micro {args.micro}, {args.steps} steps/process (first = warm-up), torch "
          f"{torch.__version__}, {args.threads} threads; runs in {work}", flush=True)
    print(f"{'arm':12} {'round':>5} {'s/step':>7} {'rollout s':>9} {'gen tok/s':>9} {'update s':>8} "
          f"{'upd tok/s':>9} {'peak RSS MB':>11} {'0-adv skipped':>13}", flush=True)
    report: dict = {"args": vars(args), "torch": torch.__version__, "runs": [], "ratios": {}}
    per_round: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for rnd in range(args.rounds):
        for arm in (ARMS if rnd % 2 == 0 else ARMS[::-1]):
            res = run_worker(arm, args, work / f"{arm}-{rnd}")
            s = summary(res)
            per_round[arm].append(s)
            report["runs"].append({"arm": arm, "round": rnd, "raw": res, "summary": s})
            print(f"{arm:12} {rnd:5d} {s['step_s']:7.1f} {s['rollout_s']:9.1f} {s['rollout_tok_s']:9.1f} "
                  f"{s['update_s']:8.1f} {s['update_tok_s']:9.0f} {s['peak_rss_mb']:11.0f} "
                  f"{s['skipped_samples']:13.0f}", flush=True)
    # sglightning's update tokens count every sample, the skipped zero-advantage ones too: no update rate to compare
    skipped = sum(g["skipped_samples"] for g in per_round["sglightning"])
    for key, better in (("step_s", "lower"), ("rollout_tok_s", "higher"), ("update_tok_s", "higher")):
        if key == "update_tok_s" and skipped:
            report["ratios"][key] = {"median": None, "why": f"sglightning skipped {skipped:.0f} zero-advantage samples"}
            continue
        ratios = [(t[key] / g[key]) if better == "lower" else (g[key] / t[key])
                  for g, t in zip(per_round["sglightning"], per_round["trl"])]
        report["ratios"][key] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    r = report["ratios"]
    update = (f"{r['update_tok_s']['median']:.2f}x" if r["update_tok_s"]["median"] is not None else
              f"not compared ({r['update_tok_s']['why']} that TRL computes)")
    print(f"sglightning vs TRL (median over rounds, >1 = sglightning faster): per step "
          f"{r['step_s']['median']:.2f}x (range {r['step_s']['range'][0]:.2f}-{r['step_s']['range'][1]:.2f}), "
          f"rollout tokens/s {r['rollout_tok_s']['median']:.2f}x, update tokens/s {update}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
