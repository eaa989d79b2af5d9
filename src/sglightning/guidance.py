"""Self-guidance prompts, actor answer formats, defensive parsers and the label -> reward map.

Two prompt modes:

* ``two_call`` (the paper): at every step the model is first called with the environment-independent *rate prompt*
  (task, initial observation and the trajectory so far, asking for ``Reason:``/``Label:`` on the latest step), then
  with the *actor prompt* (task, recent history, current observation, admissible actions or action grammar) plus an
  "intuition" block that shows that guidance.
* ``single_stream``: one growing conversation per episode; each assistant turn is ``Reason: …``, ``Label: …`` and then
  the action in the actor format.  The guidance is written inline before the action in the same context, so the KV
  cache is reused across steps and the history is never re-read.  Cheaper; not the paper's exact prompting.

Actor answer formats (``guidance.actor_format``):

* ``action_line``: ``Action: <one action>`` (one line; short, suits small models);
* ``json``: ``{"think": "<reasoning>", "action": "<one action>"}`` — the paper's ALFWorld / ScienceWorld format;
* ``think_tags``: ``<think>…</think><action>…</action>`` — the paper's WebShop format.

The two thinking formats let the actor reason before it acts.  With ``action_decoding: admissible`` the thought is
written freely (up to ``max_think_tokens``, closed where the model closes it) and the action is then chosen among the
admissible ones.

Parsers never raise.  They return ``None`` pieces for what they cannot find; the rollout counts them
(``guidance/label_unparsed``, ``rollout/format_error_rate``) and treats an unparsed label as neutral (reward 0).  Model
output is only ever matched with regular expressions and ``json`` decoding: never evaluated, never handed to a shell.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from sglightning.errors import ConfigError, check_number

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


@dataclass(frozen=True)
class ActorFormat:
    """How the actor writes its answer."""

    name: str
    instruction: str  # the actor prompt's request (two_call)
    stream_line: str  # the answer's shape inside a single-stream turn
    opener: str  # the text that starts an answer
    closer: str  # between the thought and the action ("" = no thought)
    end: str  # after the action
    source: str  # the ``parse_action`` source of a well-formed answer


ACTOR_FORMATS = {
    "action_line": ActorFormat(
        "action_line", "Answer with one line:\nAction: <one action>", "Action: <one action>", "Action:", "", "", "line",
    ),
    "json": ActorFormat(
        "json",
        'Answer with one line of JSON and nothing else:\n{"think": "<your brief reasoning>", "action": "<one action>"}',
        '{"think": "<brief reasoning>", "action": "<one action>"}',
        '{"think": "', '", "action": "', '"}', "json",
    ),
    "think_tags": ActorFormat(
        "think_tags",
        "Think briefly, then act. Answer as:\n<think>your brief reasoning</think><action>one action</action>",
        "<think>brief reasoning</think><action>one action</action>",
        "<think>", "</think><action>", "</action>", "tag",
    ),
}


def stream_format(actor_format: str = "action_line", guided: bool = True) -> str:
    """The single-stream system instruction for one turn."""
    line = ACTOR_FORMATS[actor_format].stream_line
    if not guided:
        return f"Answer every turn with exactly one line:\n{line}"
    return (
        "Before each action, judge how the previous step went. Answer every turn in exactly three lines:\n"
        "Reason: <one short sentence about your progress>\n"
        "Label: <positive|neutral|negative>\n"
        f"{line}"
    )


STREAM_FORMAT = stream_format()
STREAM_FORMAT_NO_GUIDANCE = stream_format(guided=False)


@dataclass
class GuidanceConfig:
    """How the agent guides itself, and how it writes its actions."""

    enabled: bool = True
    """write self-guidance before each action (off = plain ReAct-style acting, for "w/o SG" baselines)"""
    prompt_mode: Literal["single_stream", "two_call"] = "single_stream"
    """``single_stream`` (one context per episode, cheap) or ``two_call`` (paper: separate rate and act calls)"""
    decoding: Literal["free", "constrained"] = "constrained"
    """free: the model writes the Reason and Label lines, then they are parsed (the paper); constrained: the label is
    sampled among three words, never unparsed"""
    action_decoding: Literal["free", "admissible"] = "free"
    """free: the action is written freely and parsed (the paper); admissible: it is sampled token by token among the
    actions the env lists"""
    actor_format: Literal["action_line", "json", "think_tags"] = "action_line"
    """the actor's answer: ``action_line`` (``Action: …``), ``json`` (``{"think": …, "action": …}``, the paper's
    ALFWorld/ScienceWorld format) or ``think_tags`` (``<think>…</think><action>…</action>``, the paper's WebShop)"""
    source: Literal["model", "oracle"] = "model"
    """who writes the label: model (self-guidance, the paper) or oracle (a control: the sign of the env's measured
    progress, nothing sampled; docs/method.md §4b)"""
    reward_positive: float = 0.1
    """r_t for a positive label (the paper: +0.1)"""
    reward_neutral: float = 0.0
    """r_t for a neutral or unparsed label"""
    reward_negative: float = -0.1
    """r_t for a negative label (the paper: −0.1)"""
    max_guidance_tokens: int = 32
    """max new tokens of the reason line (constrained) or of the whole guidance (free)"""
    max_action_tokens: int = 32
    """max new tokens of the actor's answer when written freely (thought included)"""
    max_think_tokens: int = 64
    """max new tokens of the thought before an action chosen among the admissible ones (thinking formats)"""
    history_length: int = 8
    """steps of history shown in the two_call actor prompt (the single stream keeps everything)"""
    rate_history_length: int | None = None
    """steps the two_call rate prompt shows; null = the whole trajectory so far (the paper). Oldest steps are cut past
    rollout.max_context_tokens (counted)"""
    action_help_every_turn: bool = True
    """single_stream: repeat the env's action help in every user turn (true) or only the first (false: fewer positions
    to prefill). two_call always shows it"""

    def __post_init__(self) -> None:
        _check_choice("guidance.prompt_mode", self.prompt_mode, ("single_stream", "two_call"))
        _check_choice("guidance.decoding", self.decoding, ("free", "constrained"))
        _check_choice("guidance.action_decoding", self.action_decoding, ("free", "admissible"))
        _check_choice("guidance.actor_format", self.actor_format, tuple(ACTOR_FORMATS))
        _check_choice("guidance.source", self.source, ("model", "oracle"))
        for key in ("reward_positive", "reward_neutral", "reward_negative"):  # a NaN reward: NaN returns at step 1
            check_number(f"guidance.{key}", getattr(self, key), -math.inf)
        for key in ("max_guidance_tokens", "max_action_tokens", "max_think_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"guidance.{key}: must be >= 1, got {getattr(self, key)}")
        if self.history_length < 0:
            raise ValueError(f"guidance.history_length: must be >= 0, got {self.history_length}")
        if not self.action_help_every_turn and self.prompt_mode == "two_call":
            raise ValueError("guidance.action_help_every_turn: false needs guidance.prompt_mode single_stream "
                             "(two_call builds each actor prompt afresh, so the help is always shown)")
        if (self.enabled and self.source == "model" and self.prompt_mode == "single_stream"
                and self.decoding == "free" and self.action_decoding == "admissible"):
            raise ValueError("guidance.action_decoding: admissible needs guidance.decoding constrained in "
                             "single_stream (free guidance writes the action in its free turn) or prompt_mode two_call")
        if self.rate_history_length is not None and self.rate_history_length < 0:
            raise ValueError(f"guidance.rate_history_length: must be >= 0 or null (whole trajectory), got "
                             f"{self.rate_history_length}")

    @property
    def format(self) -> ActorFormat:
        return ACTOR_FORMATS[self.actor_format]

    def reward(self, label: str | None) -> float:
        """r_t = g(z_t) (paper eq. 5); an unparsed label counts as neutral."""
        rewards = {"positive": self.reward_positive, "negative": self.reward_negative}
        return rewards.get(label or "", self.reward_neutral)


#: the oracle's reason line for each label (and for the first step, before any action)
ORACLE_REASONS = {"positive": "the last action brought the goal closer.",
                  "neutral": "the last action did not change the distance to the goal.",
                  "negative": "the last action moved away from the goal.",
                  None: "no action has been taken yet."}


def progress_label(progress: float | None) -> str:
    """The label that describes an action's measured ``progress``: its sign (neutral for 0 or unknown)."""
    return "neutral" if progress is None or progress == 0 else "positive" if progress > 0 else "negative"


def oracle_guidance(progress: float | None, first: bool) -> Guidance:
    """The oracle's guidance shown before a step: the label of the previous action's measured ``progress``
    (:func:`progress_label`; at the ``first`` step there is no action yet).  What the oracle *pays* is the credit of
    each action itself (:func:`progress_label` of its own progress, every action the env measured, the last one
    included: ``Rollout``), not this shown label."""
    if first:
        label, reason = "neutral", ORACLE_REASONS[None]
    else:
        label = progress_label(progress)
        reason = ORACLE_REASONS[label]
    return Guidance(label, reason, f"Reason: {reason}\nLabel: {label}")


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


# ----------------------------------------------------------------------------------------------------------------------
# parsers

# written without adjacent overlapping repeats (e.g. ``\s*\**\s*``): those backtrack quadratically on long
# whitespace runs, and degenerate model output is full of them.
# A *label line*: a line that starts (after optional markdown: ``**``, ``#``, ``>``, ``-``) with ``Label`` and a
# separator, followed (after spaces, a line break, quotes or markdown) by one of the three label words.
_LABEL_LINE = re.compile(
    r"^[^\S\n]*(?:[*_#>\-][^\S\n]*)*label[*_]*[^\S\n]*[:=\-][\s*_\"'`\[(]*(positive|neutral|negative)\b"
    r"(?![^\S\n]*[|/])",  # not the echoed template's "positive|neutral|negative"
    re.IGNORECASE | re.MULTILINE,
)
# A *reason line*: a line that starts (the same markdown allowed) with ``Reason`` and a separator; the reason is the
# rest of it.  "for one reason: …" inside a sentence is not one (it would void the label lines written before it).
_REASON_LINE = re.compile(
    r"^[^\S\n]*(?:[*_#>\-][^\S\n]*)*reason[*_]*[^\S\n]*[:=\-][*_]*[^\S\n]*(.*)", re.IGNORECASE | re.MULTILINE
)
# where the actor's part of a free single-stream turn starts: the same line rule, and for the think_tags format a line
# that opens the thought (the thought belongs to the actor's answer)
_ACTION_PART = re.compile(r"^[^\S\n]*(?:\**action\**[^\S\n]*[:=]|\{|<action>|<think>)", re.IGNORECASE | re.MULTILINE)
_ACTION_LINE = re.compile(r"^[^\S\n]*\**action\**\s*[:=]\s*(.+)", re.IGNORECASE | re.MULTILINE)
_BARE_ACTION = re.compile(r"\**action\**[^\S\n]*[:=][^\S\n]*\**", re.IGNORECASE)  # "Action:" with nothing after
_THINK_OPEN, _THINK_CLOSE = re.compile("<think>", re.IGNORECASE), re.compile("</think>", re.IGNORECASE)
_LEADING_THINK = re.compile(r"\s*<think>", re.IGNORECASE)
_ACTION_TAG = re.compile(r"<action>(.*?)(?:</action>|$)", re.IGNORECASE | re.DOTALL)
# the "action" member of a JSON object that did not parse (cut by the token cap, a missing brace): its string value
_JSON_ACTION = re.compile(r'"action"[^\S\n]*:[^\S\n]*"((?:[^"\\\n]|\\.){1,400})"')
_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MAX_JSON_TRIES = 20


def strip_think(text: str) -> str:
    """Remove ``<think>…</think>`` blocks (reasoning models such as Qwen3 open one unless told not to).  An unclosed
    block is removed to the end only when the text opens with it (the model was cut while thinking); elsewhere an
    unclosed ``<think>`` is plain text.  Linear time (``str.find``, no backtracking regex)."""
    if _THINK_OPEN.search(text) is None:  # found in the text itself: a lowered copy can be longer ("İ")
        return text
    out, pos = [], 0
    while True:
        start = _THINK_OPEN.search(text, pos)
        if start is None:
            out.append(text[pos:])
            break
        end = _THINK_CLOSE.search(text, start.end())
        if end is None:
            if pos == 0 and not text[: start.start()].strip():
                break  # opened with an unclosed block: all of it is thinking
            out.append(text[pos:])
            break
        out.append(text[pos : start.start()])
        pos = end.end()
    return "".join(out)


@dataclass
class Guidance:
    label: str | None  # one of LABELS, or None when unparsed
    reason: str  # may be empty
    text: str = ""  # the raw text the model wrote

    @property
    def parsed(self) -> bool:
        return self.label is not None


def action_part_start(text: str) -> int | None:
    """Where the actor's answer starts in a freely written ``Reason/Label/Action`` turn: the character offset of the
    first line that starts it (``Action:``, ``{``, ``<action>`` or ``<think>``), or None.  A ``<think>`` block that
    opens the turn is the guide's own thinking, skipped (unclosed: the whole turn is thinking, None).  An "action:"
    inside a reason line is not a line start and does not count.  :func:`parse_guidance` ends the guidance here."""
    if not isinstance(text, str):
        return None
    pos = 0
    lead = _LEADING_THINK.match(text)
    if lead:
        close = _THINK_CLOSE.search(text, lead.end())
        if close is None:
            return None
        pos = close.end()
    m = _ACTION_PART.search(text, pos)
    return m.start() if m else None


def parse_guidance(text: object) -> Guidance:
    """Find the reason and the label in freely written guidance.  Never raises.

    The rule (free decoding; constrained decoding takes the label the sampler chose, not a parse):

    1. ``<think>…</think>`` blocks are removed, and the guidance ends where the action part starts (a line starting
       ``Action:``, ``{`` or ``<action>``, or ``<think>`` after some text: the actor's thought): nothing the model
       writes after it counts as guidance.
    2. The reason is the rest of the first *reason line*: a line that starts with ``Reason:`` (markdown allowed).
    3. The label is the **last** *label line* — a line that starts with ``Label:`` (markdown allowed) followed by
       ``positive``, ``neutral`` or ``negative`` — that starts after the ``Reason:``.  A label mentioned inside the
       reason line ("Reason: … Label: positive") is not a label line and never counts; with several label lines the
       model's last word wins.  No reason line: the last label line anywhere.
    """
    if not isinstance(text, str):
        return Guidance(None, "", "")
    clean = _CTRL.sub(" ", text)[:20000]
    end = action_part_start(clean)
    clean = strip_think(clean if end is None else clean[:end])
    r = _REASON_LINE.search(clean)
    reason = r.group(1).strip()[:500] if r else ""
    after = r.start() if r else 0
    label = None
    for m in _LABEL_LINE.finditer(clean):
        if m.start() >= after and not (r and m.start() == r.start()):
            label = m.group(1).lower()
    return Guidance(label, reason, text)


@dataclass
class ParsedAction:
    action: str | None  # the action text, None when nothing usable was found
    source: str = ""
    """how it was found: ``tag`` (<action>…</action>), ``json`` (an object with a string "action"), ``json_partial``
    (the "action" member of JSON that did not parse), ``line`` (Action: …), ``raw`` (the first other line)"""
    notes: list[str] = field(default_factory=list)


def _json_action(text: str) -> str | None:
    """The string ``action`` of the first JSON object in ``text`` that has one (``json`` only, never ``eval``)."""
    decoder = json.JSONDecoder()
    pos = 0
    for _ in range(_MAX_JSON_TRIES):
        start = text.find("{", pos)
        if start < 0:
            return None
        try:
            obj, _end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("action"), str):
            return obj["action"]
        pos = start + 1
    return None


def parse_action(text: object, prefer: str | None = None) -> ParsedAction:
    """Extract one action from model output.  Never raises.

    Accepts, in this order: an ``<action>…</action>`` tag (unterminated: to the end), a JSON object with a string
    ``"action"`` (decoded with ``json`` only), the ``"action": "…"`` member of JSON that does not parse (cut short),
    an ``Action: …`` line, and as a last resort the first non-empty line that is not guidance.  ``prefer`` (``tag``,
    ``json`` or ``line``: the configured answer format's source) is tried first, so that e.g. a JSON thought that
    mentions ``<action>`` is still read as JSON.  ``<think>`` blocks are removed first.  The action is one line, at most
    200 characters, without surrounding quotes or backticks."""
    if not isinstance(text, str):
        return ParsedAction(None, notes=["not text"])
    raw = _CTRL.sub(" ", text.replace("\r", ""))[:20000]
    clean = strip_think(raw)

    def tag() -> tuple[str | None, str]:
        # also before stripping: an unclosed <think> may swallow a tag written inside it
        m = _ACTION_TAG.search(clean) or _ACTION_TAG.search(raw)
        return (m.group(1), "tag") if m and m.group(1).strip() else (None, "")

    def json_object() -> tuple[str | None, str]:
        if "{" not in clean:
            return None, ""
        found = _json_action(clean)
        if found is not None:
            return found, "json"
        j = _JSON_ACTION.search(clean)
        if not j:
            return None, ""
        try:
            return json.loads(f'"{j.group(1)}"'), "json_partial"
        except ValueError:
            return j.group(1), "json_partial"

    def line() -> tuple[str | None, str]:
        m = _ACTION_LINE.search(clean)  # the action may sit on the next line, but not a label or reason line
        if m is None or _LABEL_LINE.match(m.group(1)) or _REASON_LINE.match(m.group(1)):
            return None, ""
        return m.group(1), "line"

    order = {"tag": tag, "json": json_object, "line": line}
    first = order.pop(prefer, None) if prefer else None
    found, source = None, ""
    for extract in ([first] if first else []) + list(order.values()):
        found, source = extract()
        if found is not None:
            break
    if found is None:
        for row in clean.split("\n"):
            row = row.strip()
            if row and not _LABEL_LINE.search(row) and not _REASON_LINE.match(row) and not _BARE_ACTION.fullmatch(row):
                found, source = row, "raw"
                break
    if found is None:
        return ParsedAction(None, notes=["empty"])
    action = " ".join(valid_text(found).strip().split("\n")[0].split())
    action = action.lstrip("`*\"' ").rstrip("`*\"'. ")[:200].rstrip()
    return ParsedAction(action or None, source)


def valid_text(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (a JSON escape of half a pair decodes to one) becomes ``?``.
    Tokenizers and TensorBoard raise on one, which would end the step, not the episode."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


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
    lines = ["Admissible actions: " + "; ".join(admissible)] if admissible else []
    return "\n".join(lines + ([action_help] if action_help else []))


def _window(steps: list[StepView], history_length: int | None) -> list[StepView]:
    if history_length is None:
        return list(steps)
    return steps[-history_length:] if history_length else []


def rate_messages(
    task: str, initial_observation: str, steps: list[StepView], history_length: int | None = None
) -> list[dict]:
    """The environment-independent rate prompt (two_call mode): the last ``history_length`` steps (None = all)."""
    shown = _window(steps, history_length)
    lines = [f"Task: {task}", "", f"Initial observation: {initial_observation}", "", "Trajectory so far:"]
    if not steps:
        lines.append("(no action yet: judge the starting situation)")
    elif len(shown) < len(steps):
        lines.append(f"({len(steps) - len(shown)} earlier steps not shown)")
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


def intuition_block(guidance: Guidance) -> list[str]:
    """How the actor is shown the self-guidance of the current trajectory prefix."""
    return [
        "Your intuition about your progress so far (your own self-assessment):",
        f"Reason: {guidance.reason or '(none)'}",
        f"Label: {guidance.label or 'neutral'}",
        "Use it: keep doing what is labelled positive; change course when it is negative.",
    ]


def actor_messages(
    task: str,
    observation: str,
    admissible: list[str] | None,
    action_help: str,
    steps: list[StepView],
    history_length: int,
    guidance: Guidance | None,
    actor_format: Literal["action_line", "json", "think_tags"] = "action_line",
) -> list[dict]:
    """The actor prompt (two_call mode), with the intuition block when ``guidance`` is given."""
    shown = _window(steps, history_length)
    lines = [f"Your task: {task}", ""]
    if shown:
        lines.append("Recent history:")
        for s in shown:
            lines.append(f"> {s.action}\n{s.observation}")
        lines.append("")
    lines.append(f"Current observation: {observation}")
    lines.append(_admissible_block(admissible, action_help))
    if guidance is not None:
        lines += ["", *intuition_block(guidance)]
    lines += ["", ACTOR_FORMATS[actor_format].instruction]
    return [{"role": "system", "content": ACTOR_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def stream_first_messages(
    task: str, observation: str, admissible: list[str] | None, action_help: str, guided: bool,
    actor_format: Literal["action_line", "json", "think_tags"] = "action_line",
) -> list[dict]:
    """Opening of the single-stream conversation."""
    fmt = stream_format(actor_format, guided)
    system = ACTOR_SYSTEM + "\n" + (fmt + "\n" + LABEL_HELP if guided else fmt)
    user = f"Your task: {task}\n\nObservation: {observation}\n{_admissible_block(admissible, action_help)}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def stream_next_user(observation: str, admissible: list[str] | None, action_help: str) -> str:
    """A later user turn of the single stream (``action_help`` "" = not repeated)."""
    block = _admissible_block(admissible, action_help)
    return f"Observation: {observation}\n{block}" if block else f"Observation: {observation}"


def check_calibration(calibration: float, g: GuidanceConfig) -> None:
    """``grpo.calibration`` > 0 trains the model's own sampled labels: it needs guidance on, from the model, with
    constrained decoding (else :class:`~sglightning.errors.ConfigError` naming the key)."""
    if calibration > 0 and (not g.enabled or g.source == "oracle" or g.decoding != "constrained"):
        raise ConfigError("grpo.calibration: trains the model's own sampled labels: it needs guidance.enabled, "
                          "guidance.source model and guidance.decoding constrained")
