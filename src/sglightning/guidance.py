"""Self-guidance prompts, defensive parsers and the label -> reward map (self-guide.md §2-3).

Two prompt modes:

* ``two_call`` (paper-faithful): at every step the model is first called with the environment-independent *rate
  prompt* (task + trajectory so far, asking for ``Reason:``/``Label:``), then with the *actor prompt* (task, recent
  history, admissible actions or action grammar) plus a block showing that guidance.
* ``single_stream``: one growing conversation per episode; each assistant turn is
  ``Reason: …\\nLabel: …\\nAction: …``.  The guidance is written inline before the action in the same context, so
  the KV cache is reused across steps and the history is never re-read.  Cheaper; not the paper's exact prompting.

Parsers never raise.  They return ``None`` pieces for what they cannot find; the rollout counts them
(``guidance/label_unparsed``) and treats the label as neutral (reward 0).  Model output is only ever matched with
regular expressions: never evaluated, never handed to a shell.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

LABELS = ("positive", "neutral", "negative")

RATE_SYSTEM = (
    "You review the progress of an agent acting in a text environment. You see its task and the trajectory of "
    "actions and observations so far, and you judge the latest step."
)

LABEL_HELP = (
    "Labels:\n"
    "positive - clear progress toward the task, or information that will help later;\n"
    "neutral - neither clearly helpful nor harmful;\n"
    "negative - wasted or harmful: repeating itself, undoing progress, contradicting itself, stuck."
)

ACTOR_SYSTEM = (
    "You are an agent acting in a text environment. Each turn you get an observation and choose one action to "
    "make progress on your task."
)

STREAM_FORMAT = (
    "Before each action, judge how the previous step went. Answer every turn in exactly three lines:\n"
    "Reason: <one short sentence about your progress>\n"
    "Label: <positive|neutral|negative>\n"
    "Action: <one action>"
)
STREAM_FORMAT_NO_GUIDANCE = "Answer every turn with exactly one line:\nAction: <one action>"


@dataclass
class GuidanceConfig:
    """How the agent guides itself."""

    #: write self-guidance before each action (off = plain ReAct-style acting, for "w/o SG" baselines)
    enabled: bool = True
    #: ``single_stream`` (one context per episode, cheap) or ``two_call`` (paper: separate rate and act calls)
    prompt_mode: str = "single_stream"
    #: ``free``: the model writes ``Reason:``/``Label:`` freely and we parse;
    #: ``constrained``: ``Reason:``/``Label:`` are forced, the reason is capped, and the label is sampled from the
    #: model's own distribution restricted to the three label words (no parse failures; self-guide.md §10)
    decoding: str = "constrained"
    #: ``free``: the action is generated freely and parsed; ``admissible``: the action is sampled from the model's
    #: distribution restricted (token by token) to the admissible actions, when the env lists them
    action_decoding: str = "free"
    reward_positive: float = 0.1
    reward_neutral: float = 0.0
    reward_negative: float = -0.1
    #: max new tokens of the reason line (constrained) or of the whole guidance (free)
    max_guidance_tokens: int = 32
    #: max new tokens of the action (free) / of the whole actor answer in two_call mode
    max_action_tokens: int = 32
    #: steps of history shown in two_call prompts (the single stream keeps everything)
    history_length: int = 8

    def __post_init__(self) -> None:
        _check_choice("guidance.prompt_mode", self.prompt_mode, ("single_stream", "two_call"))
        _check_choice("guidance.decoding", self.decoding, ("free", "constrained"))
        _check_choice("guidance.action_decoding", self.action_decoding, ("free", "admissible"))
        for key in ("max_guidance_tokens", "max_action_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"guidance.{key}: must be >= 1, got {getattr(self, key)}")
        if self.history_length < 0:
            raise ValueError(f"guidance.history_length: must be >= 0, got {self.history_length}")

    def reward(self, label: str | None) -> float:
        """r_t = g(z_t) (paper eq. 5); an unparsed label counts as neutral."""
        return {"positive": self.reward_positive, "negative": self.reward_negative}.get(label or "", self.reward_neutral)


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


# ----------------------------------------------------------------------------------------------------------------------
# parsers

# written without adjacent overlapping repeats (e.g. ``\s*\**\s*``): those backtrack quadratically on long
# whitespace runs, and degenerate model output is full of them
_LABEL_LINE = re.compile(r"label\s*[:=\-][\s*]*(positive|neutral|negative)", re.IGNORECASE)
_REASON_LINE = re.compile(r"reason\s*[:=\-]\s*(.*)", re.IGNORECASE)
_ACTION_LINE = re.compile(r"^[^\S\n]*\**action\**\s*[:=]\s*(.+)", re.IGNORECASE | re.MULTILINE)
_ACTION_TAG = re.compile(r"<action>(.*?)(?:</action>|$)", re.IGNORECASE | re.DOTALL)
_JSON_OBJ = re.compile(r"\{.*\}", re.DOTALL)
_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass
class Guidance:
    label: str | None  # one of LABELS, or None when unparsed
    reason: str  # may be empty
    text: str = ""  # the raw text the model wrote

    @property
    def parsed(self) -> bool:
        return self.label is not None


def parse_guidance(text: object) -> Guidance:
    """Find ``Reason: …`` and ``Label: <word>``.  Several labels: the first ``Label:`` line wins.  Never raises."""
    if not isinstance(text, str):
        return Guidance(None, "", "")
    clean = _CTRL.sub(" ", text)[:20000]
    m = _LABEL_LINE.search(clean)
    label = m.group(1).lower() if m else None
    r = _REASON_LINE.search(clean)
    reason = r.group(1).strip()[:500] if r else ""
    return Guidance(label, reason, text)


@dataclass
class ParsedAction:
    action: str | None  # the action text, None when nothing usable was found
    source: str = ""  # how it was found: line | tag | json | raw
    notes: list[str] = field(default_factory=list)


def parse_action(text: object) -> ParsedAction:
    """Extract one action from model output.  Accepts ``Action: …`` lines, ``<action>…</action>`` tags,
    one-line JSON ``{"action": …}`` (parsed with ``json.loads`` only) or, as a last resort, the first non-empty line.
    Never raises."""
    if not isinstance(text, str):
        return ParsedAction(None, notes=["not text"])
    clean = _CTRL.sub(" ", text.replace("\r", ""))[:20000]
    found: str | None = None
    source = ""
    m = _ACTION_TAG.search(clean)
    if m and m.group(1).strip():
        found, source = m.group(1), "tag"
    if found is None:
        j = _JSON_OBJ.search(clean)
        if j:
            try:
                obj = json.loads(j.group(0))
            except (ValueError, RecursionError):
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("action"), str):
                found, source = obj["action"], "json"
    if found is None:
        m = _ACTION_LINE.search(clean)
        if m:
            found, source = m.group(1), "line"
    if found is None:
        for line in clean.split("\n"):
            line = line.strip()
            if line and not _LABEL_LINE.search(line) and not _REASON_LINE.match(line):
                found, source = line, "raw"
                break
    if found is None:
        return ParsedAction(None, notes=["empty"])
    action = " ".join(found.strip().split("\n")[0].split())
    action = action.lstrip("`*\"' ").rstrip("`*\"'. ")[:200].rstrip()
    return ParsedAction(action or None, source)


def match_admissible(action: str | None, admissible: list[str] | None) -> str | None:
    """Case/space-insensitive exact match of ``action`` against the admissible list (None if no match)."""
    if action is None or not admissible:
        return None
    key = " ".join(action.lower().split())
    for a in admissible:
        if " ".join(a.lower().split()) == key:
            return a
    return None


# ----------------------------------------------------------------------------------------------------------------------
# prompts


@dataclass
class StepView:
    """What the prompts show of one past step."""

    action: str
    observation: str
    label: str | None = None
    reason: str = ""


def _admissible_block(admissible: list[str] | None, action_help: str) -> str:
    if admissible:
        return "Admissible actions: " + "; ".join(admissible) + "\n" + action_help
    return action_help


def rate_messages(task: str, initial_observation: str, steps: list[StepView], history_length: int) -> list[dict]:
    """The environment-independent rate prompt (two_call mode)."""
    shown = steps[-history_length:] if history_length else []
    lines = [f"Task: {task}", "", f"Initial observation: {initial_observation}", "", "Trajectory so far:"]
    if not steps:
        lines.append("(no action yet: judge the starting situation)")
    offset = len(steps) - len(shown)
    for i, s in enumerate(shown, start=offset + 1):
        lines.append(f"Step {i} action: {s.action}")
        lines.append(f"Step {i} observation: {s.observation}")
    lines += [
        "",
        "Judge the latest step." if steps else "",
        LABEL_HELP,
        "Answer in exactly two lines:\nReason: <short explanation>\nLabel: <negative|neutral|positive>",
    ]
    return [{"role": "system", "content": RATE_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def actor_messages(
    task: str,
    observation: str,
    admissible: list[str] | None,
    action_help: str,
    steps: list[StepView],
    history_length: int,
    guidance: Guidance | None,
) -> list[dict]:
    """The actor prompt (two_call mode), with the self-guidance block when ``guidance`` is given."""
    shown = steps[-history_length:] if history_length else []
    lines = [f"Your task: {task}", ""]
    if shown:
        lines.append("Recent history:")
        for s in shown:
            lines.append(f"> {s.action}\n{s.observation}")
        lines.append("")
    lines.append(f"Current observation: {observation}")
    lines.append(_admissible_block(admissible, action_help))
    if guidance is not None:
        lines += [
            "",
            "Self-guidance on your progress so far:",
            f"Reason: {guidance.reason or '(none)'}",
            f"Label: {guidance.label or 'neutral'}",
            "Take it into account: keep doing what is labelled positive, change course when negative.",
        ]
    lines += ["", "Answer with one line:\nAction: <one action>"]
    return [{"role": "system", "content": ACTOR_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def stream_first_messages(
    task: str, observation: str, admissible: list[str] | None, action_help: str, guided: bool
) -> list[dict]:
    """Opening of the single-stream conversation."""
    system = ACTOR_SYSTEM + "\n" + (STREAM_FORMAT + "\n" + LABEL_HELP if guided else STREAM_FORMAT_NO_GUIDANCE)
    user = f"Your task: {task}\n\nObservation: {observation}\n{_admissible_block(admissible, action_help)}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def stream_next_user(observation: str, admissible: list[str] | None, action_help: str) -> str:
    return f"Observation: {observation}\n{_admissible_block(admissible, action_help)}"
