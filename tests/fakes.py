"""Test doubles: a scripted language model with the HF forward/cache interface, and faulty environments."""

from __future__ import annotations

import contextlib
import itertools
import re
from types import SimpleNamespace
from typing import Literal

import torch
from lightning.pytorch.loggers import Logger

from sglightning.engines.builtin import BuiltinEngine
from sglightning.envs.base import ResetResult, StepResult, TextEnv
from sglightning.envs.household import HouseholdEnv
from sglightning.rewards import RewardTerm

ASSISTANT_OPEN = "<|im_start|>assistant\n"


class FakeCache:
    """Keeps each row's real (unmasked) tokens; supports the one cache method the sampler uses."""

    def __init__(self, n: int):
        self.rows: list[list[int]] = [[] for _ in range(n)]

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        self.rows = [list(self.rows[int(i)]) for i in idx]  # copies, as a real cache (rows may repeat)


class ScriptedLM(torch.nn.Module):
    """A 'model' that decodes its own context and writes ``reply(context)`` as the current assistant turn, one token
    per forward call (all probability on the next token of the scripted reply, then end-of-turn)."""

    def __init__(self, tokenizer, reply):
        super().__init__()
        self.tok = tokenizer
        self.reply = reply
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.vocab = len(tokenizer)
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids=None, use_cache=True, logits_to_keep=1, cache=None, **kw):
        self.calls += 1
        n, w = input_ids.shape
        cache = cache or FakeCache(n)
        new_mask = attention_mask[:, -w:]
        logits = torch.full((n, 1, self.vocab), -30.0)
        for b in range(n):
            cache.rows[b] += [int(t) for t, m in zip(input_ids[b], new_mask[b]) if m]
            text = self.tok.decode(cache.rows[b])
            head, sep, written = text.rpartition(ASSISTANT_OPEN)
            target = self.reply(head + sep)
            remaining = target[len(written):] if target.startswith(written) else ""
            ids = self.tok.encode(remaining, add_special_tokens=False) if remaining else [self.tok.eos_token_id]
            logits[b, 0, ids[0]] = 0.0
        return SimpleNamespace(logits=logits, cache=cache)


_ADM = re.compile(r"Admissible actions: (.*)")


def first_admissible(context: str) -> str:
    found = _ADM.findall(context)
    return found[-1].split("; ")[0] if found else "look"


def scripted_reply(label: str = "positive", action=first_admissible):
    """Reply function: guidance + the first admissible action (single stream), or the part a two-call prompt asks."""

    def reply(context: str) -> str:
        last_user = context.rsplit("<|im_start|>user", 1)[-1]
        if "Answer in exactly two lines" in last_user:  # two_call rate prompt
            return f"Reason: scripted\nLabel: {label}"
        act = action(context)
        if "Answer with one line" in last_user or "Reason:" not in context.split("<|im_start|>user", 1)[0]:
            return f"Action: {act}"
        return f"Reason: scripted\nLabel: {label}\nAction: {act}"

    return reply


class RecordingEnv(HouseholdEnv):
    """Household env that records every reset seed (class-level log)."""

    log: list[int] = []

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        RecordingEnv.log.append(seed)
        return super().reset(seed, split)


class OwnTaskEnv(HouseholdEnv):
    """Household env that draws its own task in ``reset`` (the seed plus how many resets came before, class-wide):
    the mistake that makes a group's members play different tasks."""

    resets = itertools.count()

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        return super().reset(seed + next(OwnTaskEnv.resets), split)


class CrashingEnv(HouseholdEnv):
    """Raises in ``step`` (after ``crash_after`` steps) for seeds in ``bad_seeds``; counts instances."""

    instances = 0

    def __init__(self, bad_seeds=(1,), crash_after: int = 1, where: str = "step", **kw):
        super().__init__(**kw)
        CrashingEnv.instances += 1
        self.bad_seeds, self.crash_after, self.where = set(bad_seeds), crash_after, where
        self._seed = None
        self._n = 0

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        self._seed, self._n = seed, 0
        if self.where == "reset" and seed in self.bad_seeds:
            raise RuntimeError("simulated reset crash")
        if self.where == "garbage" and seed in self.bad_seeds:
            return "not a ResetResult"  # type: ignore[return-value]
        return super().reset(seed, split)

    def step(self, action: str) -> StepResult:
        self._n += 1
        if self.where == "step" and self._seed in self.bad_seeds and self._n > self.crash_after:
            raise RuntimeError("simulated step crash")
        return super().step(action)


class FreeFormEnv(TextEnv):
    """An env without an admissible list: echoes actions, succeeds on 'finish'."""

    name = "freeform"
    action_help = "Write one action, e.g. 'finish'."

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        return ResetResult("Nothing here.", "say finish", None, "echo")

    def step(self, action: str) -> StepResult:
        won = action.strip().lower() == "finish"
        return StepResult(f"You said {action!r}.", float(won), won, won)


#: A chat template written for the tests with the behaviour of Qwen3's that matters here (no download): with
#: ``enable_thinking=False`` the generation prompt holds an empty ``<think></think>`` block; an assistant turn after
#: the last user turn is rendered with that block, earlier ones without (so rendering is not incremental).
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


class EmptyDevSplitEnv(HouseholdEnv):
    """A household env whose ``dev`` split has no tasks (like ALFWorld with only the train games downloaded)."""

    def reset(self, seed: int, split: str = "train") -> ResetResult:
        if split == "dev":
            raise FileNotFoundError("no games found for split 'dev'")
        return super().reset(seed, split)


class NeedsAFileEnv(HouseholdEnv):
    """A household env whose constructor reads a file that is not there (an error neither TypeError nor ValueError)."""

    def __init__(self, layout: str = "/no/such/layout.json", **kw):
        with open(layout) as f:
            f.read()
        super().__init__(**kw)


def per_episode_advantages(x):
    """An advantage estimator with a mistake: one value per episode ([N]), not per token ([S, L])."""
    return x.returns - x.returns.mean()


class TextLengthBonus(RewardTerm):
    """A reward that differs between the episodes of a group whatever the policy does (the characters it wrote, /
    1000): a tiny random model's returns are otherwise often all equal, leaving nothing to train on."""

    name = "text_length"

    def value(self, episode) -> float:
        return sum(len(s.action_text) + len(s.reason) for s in episode.steps) / 1000.0


class LifecycleEngine(BuiltinEngine):
    """The in-process engine, recording its lifecycle hooks in order (class-level: ``check`` runs on an instance of
    its own, before the run's engine exists)."""

    events: list[str] = []

    def check(self, policy, rollout, grpo) -> None:
        LifecycleEngine.events.append("check")
        super().check(policy, rollout, grpo)

    def start(self, run) -> None:
        LifecycleEngine.events.append(f"start rank {run.rank} of {run.world_size}")
        super().start(run)

    @contextlib.contextmanager
    def sampling(self, weights):
        LifecycleEngine.events.append(f"sampling v{weights.version}")
        with super().sampling(weights) as stats:
            yield stats

    def close(self) -> None:
        LifecycleEngine.events.append("close")
        super().close()


class ModeEnv(HouseholdEnv):
    """The household env with an init argument that takes one of a few words (a config error's wording is tested
    with it)."""

    def __init__(self, mode: Literal["easy", "hard"] = "easy", **kw):
        super().__init__(difficulty=0 if mode == "easy" else 2, **kw)


class RunIdLogger(Logger):
    """A logger shaped like W&B's and MLflow's: a save_dir, a project name and a run id, no log_dir of its own."""

    def __init__(self, save_dir: str, run_id: str = "run1", project: str = "project"):
        super().__init__()
        self._save_dir, self.run_id, self.project = save_dir, run_id, project

    @property
    def name(self):
        return self.project

    @property
    def version(self):
        return self.run_id

    @property
    def save_dir(self):
        return self._save_dir

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass
