"""Self-guidance parsers, the label -> reward map, config validation and prompt text."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglightning.guidance import (
    LABEL_HELP,
    LABELS,
    STREAM_FORMAT,
    STREAM_FORMAT_NO_GUIDANCE,
    Guidance,
    GuidanceConfig,
    StepView,
    actor_messages,
    match_admissible,
    parse_action,
    parse_guidance,
    rate_messages,
    stream_first_messages,
    stream_next_user,
)

# =============================================================================================== parse_guidance


def test_parse_guidance_well_formed_two_lines():
    g = parse_guidance("Reason: I opened the fridge and found the apple.\nLabel: positive")
    assert g.label == "positive"
    assert g.reason == "I opened the fridge and found the apple."
    assert g.parsed
    assert g.text == "Reason: I opened the fridge and found the apple.\nLabel: positive"


@pytest.mark.parametrize(
    "text, label",
    [
        ("label - Positive", "positive"),
        ("**Label:** negative", "negative"),
        ("LABEL:NEUTRAL", "neutral"),
        ("Label = negative", "negative"),
        ("  label :   positive  ", "positive"),
        ("Label:\n  negative", "negative"),  # the label word on the next line still counts
        ("Label: **Positive**", "positive"),
        ("Reason: went in circles.\nlabel: NEGATIVE.", "negative"),
    ],
)
def test_parse_guidance_case_and_spacing_variants(text, label):
    g = parse_guidance(text)
    assert g.label == label and g.parsed


def test_parse_guidance_last_label_line_wins():
    g = parse_guidance("Reason: hm\nLabel: negative\nLabel: positive\nLabel: neutral")
    assert g.label == "neutral"
    # a label word in the reason's free text is not a label line
    g = parse_guidance("Reason: this was positive overall\nLabel: neutral")
    assert g.label == "neutral"
    assert g.reason == "this was positive overall"


@pytest.mark.parametrize(
    "text, label",
    [
        # "Label: positive" written inside the reason line is not a label line: it never earns the reward
        ("Reason: great move. Label: positive\nLabel: negative", "negative"),
        ("Reason: great move. Label: positive", None),
        ("Reason: I would say Label: positive, Label: positive", None),
        # a label line written before the reason does not count once a reason follows
        ("Label: positive\nReason: looped again\nLabel: negative", "negative"),
        ("Label: positive\nReason: looped again", None),
        # no reason line at all: the last label line anywhere
        ("Label: negative\nLabel: positive", "positive"),
        # what comes after the action part is not guidance
        ("Reason: ok\nLabel: neutral\nAction: go to desk 1\nLabel: positive", "neutral"),
        ('Reason: ok\nLabel: negative\n{"think": "Label: positive", "action": "look"}', "negative"),
        ("Reason: ok\nLabel: negative\n<action>look</action>\nLabel: positive", "negative"),
        # the actor's thought (think_tags) opens the action part: a label after it is not guidance (it bought reward)
        ("Reason: ok\nLabel: negative\n<think>x</think>\nLabel: positive", "negative"),
        ("Reason: ok\nLabel: negative\n<think>cut short\nLabel: positive", "negative"),
        # reasoning models: a think block is not guidance
        ("<think>\nLabel: positive\n</think>\nReason: stuck\nLabel: negative", "negative"),
        ("<think>Label: positive", None),
        ("Reason: I wrote <think> here\nLabel: negative", "negative"),  # an unclosed tag inside text is text
        ("- Label: neutral", "neutral"),
        ("> **Label**: negative", "negative"),
        # "reason:" inside a sentence is not a reason line: the label line before it still counts
        ("Label: positive\nI chose it for one reason: it worked", "positive"),
        ("Label: negative\nThe reason - it looped", "negative"),
        ("Label: positive\n**Reason:** looped\nLabel: negative", "negative"),
    ],
)
def test_parse_guidance_label_rule(text, label):
    assert parse_guidance(text).label == label


@settings(max_examples=300, deadline=None)
@given(
    reason=st.text(alphabet=st.characters(blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
                   max_size=60),
    inline=st.sampled_from(LABELS),
    final=st.sampled_from(LABELS),
)
def test_fuzz_inline_label_in_reason_never_overrides_the_label_line(reason, inline, final):
    """Whatever the reason line says (including 'Label: <word>'), the label line after it decides."""
    g = parse_guidance(f"Reason: {reason} Label: {inline}\nLabel: {final}")
    assert g.label == final


@pytest.mark.parametrize(
    "text",
    [
        "Reason: the agent looked around.",
        "The final step was to take a step which was positively marked but",  # SmolLM2-135M rambling, seen zero-shot
        "Label: great",
        "positive",  # a bare word without "Label:" is not a label line
        "",
    ],
)
def test_parse_guidance_missing_label(text):
    g = parse_guidance(text)
    assert g.label is None
    assert not g.parsed


@pytest.mark.parametrize(
    "text, reason",
    [
        ("**Reason:** it looped\nLabel: negative", "it looped"),
        ("> Reason = stuck\nLabel: negative", "stuck"),
        ("Overall, for one reason: luck\nReason: found the key\nLabel: positive", "found the key"),
        ("My reason: luck\nLabel: positive", ""),
    ],
)
def test_parse_guidance_reason_is_a_line_of_its_own(text, reason):
    assert parse_guidance(text).reason == reason


def test_parse_guidance_reason_without_label_is_kept():
    g = parse_guidance("Reason: nothing happened\nthe end")
    assert g.label is None and g.reason == "nothing happened"


@pytest.mark.parametrize("value", [None, 3, b"Label: positive", 1.5, ["Label: positive"], {"label": "positive"}])
def test_parse_guidance_non_str_is_unparsed(value):
    g = parse_guidance(value)
    assert isinstance(g, Guidance)
    assert g.label is None and not g.parsed and g.reason == "" and g.text == ""


def test_parse_guidance_control_characters():
    g = parse_guidance("Reason:\x00 ok\x07 fine\x1b[31m\nLabel:\x0b positive\x7f")
    assert g.label == "positive"
    assert "\x00" not in g.reason and "\x07" not in g.reason and "\x1b" not in g.reason
    # the raw text is kept verbatim
    assert g.text.startswith("Reason:\x00")


def test_parse_guidance_reason_is_capped():
    g = parse_guidance("Reason: " + "x" * 5000 + "\nLabel: neutral")
    assert g.label == "neutral"
    assert len(g.reason) <= 500


@pytest.mark.parametrize(
    "text",
    [
        "Reason: fine\nLabel: positive\n" * 40000,  # ~1.2 MB
        "label:" + " " * 1_000_000,  # long whitespace run after "label:" (no label word)
        "\n" * 1_000_000,
        "{" * 1_000_000,
        "Reason: " + "Label: " * 150_000,
    ],
    ids=["repeated", "label-spaces", "newlines", "braces", "label-run"],
)
def test_parsers_on_megabyte_input_are_fast(text):
    t = time.perf_counter()
    g = parse_guidance(text)
    a = parse_action(text)
    assert time.perf_counter() - t < 2.0
    assert g.label in (*LABELS, None)
    assert a.action is None or len(a.action) <= 200


def test_parse_guidance_one_megabyte_label_found():
    g = parse_guidance("Reason: fine\nLabel: positive\n" + "z" * 1_000_000)
    assert g.label == "positive"


# ================================================================================================= parse_action


@pytest.mark.parametrize(
    "text, action, source",
    [
        ("Action: go to fridge 1", "go to fridge 1", "line"),
        ("Reason: closer\nLabel: positive\nAction: go to fridge 1", "go to fridge 1", "line"),
        ("**Action:** open drawer 2", "open drawer 2", "line"),
        ("  action = look", "look", "line"),
        ("Action:\n\nexamine mug 1", "examine mug 1", "line"),
        ("I think.\nAction: look", "look", "line"),
        ("<action>take apple 1 from countertop 1</action>", "take apple 1 from countertop 1", "tag"),
        ("<think>need apple</think><action>take apple 1 from countertop 1</action>", "take apple 1 from countertop 1",
         "tag"),
        ("<ACTION>\n  put mug 1 in/on shelf 2\n</ACTION>", "put mug 1 in/on shelf 2", "tag"),
        ("<action>go to sinkbasin 1", "go to sinkbasin 1", "tag"),  # unterminated tag: up to the end
        ('{"think": "...", "action": "open fridge 1"}', "open fridge 1", "json"),
        ('{"think": {"plan": [1, 2]}, "action": "open fridge 1"}', "open fridge 1", "json"),
        ('Sure! {"action": "cool apple 1 with fridge 1"} done', "cool apple 1 with fridge 1", "json"),
    ],
)
def test_parse_action_formats(text, action, source):
    p = parse_action(text)
    assert p.action == action
    assert p.source == source


def test_parse_action_prefers_the_configured_format():
    text = '{"think": "write <action>x</action>? no", "action": "open fridge 1"}'
    assert parse_action(text).action == "x"  # the default order reads the tag first
    assert (parse_action(text, prefer="json").action, parse_action(text, prefer="json").source) == (
        "open fridge 1", "json")
    assert parse_action('Action: a\n{"action": "b"}', prefer="line").action == "a"
    assert parse_action("nothing structured", prefer="json").source == "raw"


def test_parse_action_tag_beats_json_beats_line():
    assert parse_action('Action: a\n{"action": "b"}\n<action>c</action>').action == "c"
    p = parse_action('Action: a\n{"action": "b"}')
    assert (p.action, p.source) == ("b", "json")


@pytest.mark.parametrize(
    "text",
    [
        '{"think": "x", "action": ["go", "to"]}',  # action not a string
        "{" + "[" * 50_000 + "}",  # json.loads recursion
        '{"action": 1}',
        "{'action': 'open fridge 1'}",  # python dict, not JSON
        '{"think": "x", "action": "open fri',  # the action string itself was cut
    ],
)
def test_parse_action_broken_json_falls_back(text):
    p = parse_action(text)  # must not raise
    assert p.source in ("raw", "line", "")
    assert p.action is None or (len(p.action) <= 200 and "\n" not in p.action)


@pytest.mark.parametrize(
    "text",
    [
        '{"think": {"nested": {"deep": [1, 2}, "action": "open fridge 1"',  # broken nesting
        '{"action": "open fridge 1"',  # unterminated (token cap, or the model stopped)
        '{"think": "I need the fridge", "action": "open fridge 1"',
        '{"think": "I need the fridge",\n "action":  "open fridge 1"',
    ],
)
def test_parse_action_recovers_the_action_of_json_that_does_not_parse(text):
    """A cut or malformed JSON answer whose "action" string is complete still acts; the source says it was not
    well-formed (counted as a format error by the rollout)."""
    p = parse_action(text)
    assert (p.action, p.source) == ("open fridge 1", "json_partial")


def test_parse_action_json_with_braces_and_escapes_in_the_thought():
    p = parse_action('{"think": "the {box} is \\"closed\\"", "action": "open box 1"} trailing {junk}')
    assert (p.action, p.source) == ("open box 1", "json")


@pytest.mark.parametrize(
    "text, action, source",
    [
        ("<think>go to desk 1? no</think>\nAction: open drawer 2", "open drawer 2", "line"),
        ("<think>\n\n</think>\n\nAction: look", "look", "line"),
        ('<think>{"action": "bad"}</think>{"think": "ok", "action": "good"}', "good", "json"),
        ("<think>I will go <action>go to desk 1</action>", "go to desk 1", "tag"),  # unclosed think, tag inside
    ],
)
def test_parse_action_ignores_think_blocks(text, action, source):
    p = parse_action(text)
    assert (p.action, p.source) == (action, source)


def test_parse_action_broken_json_then_action_line():
    p = parse_action('{"think": "oops", "action": \nAction: go to cabinet 3')
    assert (p.action, p.source) == ("go to cabinet 3", "line")


@pytest.mark.parametrize(
    "text, action",
    [
        ("Action: go to fridge 1.", "go to fridge 1"),
        ("Action: `open drawer 2`.", "open drawer 2"),
        ("Action: `open drawer 2`", "open drawer 2"),
        ("Action: ```look```", "look"),
        ('Action: "take mug 1 from shelf 1"', "take mug 1 from shelf 1"),
        ("Action: **inventory**...", "inventory"),
        ("Action:   go    to   desk   1   ", "go to desk 1"),
        ("Action: go to fridge 1\nObservation: you arrive", "go to fridge 1"),
    ],
)
def test_parse_action_trailing_punctuation_stripped(text, action):
    assert parse_action(text).action == action


@pytest.mark.parametrize(
    "text, action, source",
    [
        ("!!!@@@ garbage", "!!!@@@ garbage", "raw"),
        ("\n\n   go to desk 1  \nmore", "go to desk 1", "raw"),
        ("Reason: I am lost\nLabel: negative\nlook around", "look around", "raw"),  # guidance lines are skipped
        ("", None, ""),
        ("   \n \t \n", None, ""),
        ("Reason: x\nLabel: positive", None, ""),  # nothing but guidance
        ("...", None, "raw"),  # a raw line that strips to nothing
    ],
)
def test_parse_action_garbage(text, action, source):
    p = parse_action(text)
    assert p.action == action
    assert p.source == source


def test_parse_action_is_capped_and_single_line():
    p = parse_action("Action: " + "a" * 500)
    assert p.action == "a" * 200
    p = parse_action("<action>go to\nfridge 1</action>")
    assert p.action == "go to"


@pytest.mark.parametrize("value", [None, 3, b"Action: look", 2.0, ["Action: look"]])
def test_parse_action_non_str(value):
    p = parse_action(value)
    assert p.action is None
    assert p.notes == ["not text"]


def test_parse_action_control_characters():
    p = parse_action("Action: go\x00 to\x1b fridge\x07 1\r\n")
    assert p.action == "go to fridge 1"


# ============================================================================================== match_admissible

ADMISSIBLE = ["go to fridge 1", "go to fridge 10", "open fridge 1", "take apple 1 from countertop 1"]


@pytest.mark.parametrize(
    "action, expected",
    [
        ("go to fridge 1", "go to fridge 1"),
        ("Go To Fridge 1", "go to fridge 1"),
        ("  go   to\tfridge 1 ", "go to fridge 1"),
        ("GO TO FRIDGE 10", "go to fridge 10"),
        ("TAKE apple 1 FROM countertop 1", "take apple 1 from countertop 1"),
    ],
)
def test_match_admissible_exact_modulo_case_and_space(action, expected):
    assert match_admissible(action, ADMISSIBLE) == expected


@pytest.mark.parametrize(
    "action",
    ["go to fridge", "fridge 1", "go to fridge 1 now", "go to fridge 100", "gotofridge1", "open fridge", "", None],
)
def test_match_admissible_no_partial_matches(action):
    assert match_admissible(action, ADMISSIBLE) is None


def test_match_admissible_returns_the_listed_spelling():
    assert match_admissible("open fridge 1", ["Open  Fridge 1"]) == "Open  Fridge 1"


@pytest.mark.parametrize("admissible", [None, []])
def test_match_admissible_without_list(admissible):
    assert match_admissible("look", admissible) is None


# ======================================================================================================= fuzzing

_PIECES = st.sampled_from(
    [
        "Reason:", "reason -", "Label:", "label=", "LABEL :", "**Label:**", "Action:", "action =", "**Action:**",
        "<action>", "</action>", "<ACTION>", "<think>", "{", "}", "[", "]", '"action": ', '"think": ', '"', ":",
        ",", "\n", "\r\n", "\t", " ", "*", "`", ".", "positive", "neutral", "negative", "Positive", "NEGATIVE",
        "go to fridge 1", "take apple 1 from countertop 1", "é", "日本語", "🙂", "\u2028", "\u0085", "\ufeff",
        "\x00", "\x07", "\x0b", "\x1b[31m", "\x7f", "\ud800",
    ]
)
_RUNS = st.builds(
    lambda piece, n: piece * n,
    st.sampled_from([" ", "\n", "{", "*", "label:", "Action: ", "<action>", "x", "\t", "reason:"]),
    st.integers(min_value=100, max_value=30_000),
)
_STRUCTURED = st.lists(st.one_of(_PIECES, st.text(max_size=20), _RUNS), max_size=40).map("".join)
_FROM_BYTES = st.binary(max_size=500).map(lambda b: b.decode("utf-8", errors="replace"))
_FROM_BYTES_LATIN = st.binary(max_size=500).map(lambda b: b.decode("latin-1"))
_ANY_TEXT = st.one_of(st.text(), _FROM_BYTES, _FROM_BYTES_LATIN, _STRUCTURED)


def _check_invariants(text: str) -> None:
    g = parse_guidance(text)
    assert g.label in ("positive", "neutral", "negative", None)
    assert g.parsed == (g.label is not None)
    assert isinstance(g.reason, str) and len(g.reason) <= 500
    p = parse_action(text)
    assert p.action is None or (
        isinstance(p.action, str)
        and p.action
        and len(p.action) <= 200
        and p.action == p.action.strip()
        and len(p.action.splitlines()) == 1
        and "\n" not in p.action
    )
    # matching the parsed action never raises either
    match_admissible(p.action, ["go to fridge 1", p.action or "x"])


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_ANY_TEXT)
def test_fuzz_parsers_never_raise(text):
    t = time.perf_counter()
    _check_invariants(text)
    # generous bound: the parsers are linear; quadratic regex backtracking on long runs took seconds here
    assert time.perf_counter() - t < 1.5


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.floats(), st.binary(), st.lists(st.text(max_size=5))))
def test_fuzz_parsers_non_str(value):
    assert parse_guidance(value).label is None
    assert parse_action(value).action is None


# ================================================================================================ GuidanceConfig


def test_reward_defaults():
    cfg = GuidanceConfig()
    assert cfg.reward("positive") == pytest.approx(0.1)
    assert cfg.reward("neutral") == 0.0
    assert cfg.reward("negative") == pytest.approx(-0.1)
    assert cfg.reward(None) == 0.0  # unparsed -> neutral


def test_reward_custom_values():
    cfg = GuidanceConfig(reward_positive=1.0, reward_neutral=0.25, reward_negative=-2.0)
    assert cfg.reward("positive") == 1.0
    assert cfg.reward("neutral") == 0.25
    assert cfg.reward("negative") == -2.0
    assert cfg.reward(None) == 0.25  # unparsed gets the *neutral* reward, whatever it is
    assert cfg.reward("") == 0.25


def test_reward_matches_parsed_guidance():
    cfg = GuidanceConfig()
    assert cfg.reward(parse_guidance("Reason: x\nLabel: Negative").label) == pytest.approx(-0.1)
    assert cfg.reward(parse_guidance("rambling").label) == 0.0


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"prompt_mode": "three_call"}, "guidance.prompt_mode"),
        ({"prompt_mode": "Single_Stream"}, "guidance.prompt_mode"),
        ({"decoding": "greedy"}, "guidance.decoding"),
        ({"action_decoding": "constrained"}, "guidance.action_decoding"),
        ({"max_guidance_tokens": 0}, "guidance.max_guidance_tokens"),
        ({"max_guidance_tokens": -5}, "guidance.max_guidance_tokens"),
        ({"max_action_tokens": 0}, "guidance.max_action_tokens"),
        ({"history_length": -1}, "guidance.history_length"),
    ],
)
def test_guidance_config_invalid(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        GuidanceConfig(**kwargs)


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
@pytest.mark.parametrize("decoding", ["free", "constrained"])
@pytest.mark.parametrize("action_decoding", ["free", "admissible"])
def test_guidance_config_valid_choices(mode, decoding, action_decoding):
    kw = dict(prompt_mode=mode, decoding=decoding, action_decoding=action_decoding, history_length=0)
    if (mode, decoding, action_decoding) == ("single_stream", "free", "admissible"):
        # free guidance writes the whole turn, action included, in one free segment: the admissible set was ignored
        with pytest.raises(ValueError, match=r"guidance\.action_decoding: admissible needs guidance\.decoding"):
            GuidanceConfig(**kw)
        for fine in (dict(source="oracle"), dict(enabled=False)):  # the action is a segment of its own there
            assert GuidanceConfig(**kw, **fine).action_decoding == "admissible"
        return
    assert GuidanceConfig(**kw).prompt_mode == mode


# ======================================================================================================= prompts

TASK = "put a clean apple in fridge"
INIT = "You are in the middle of a room. You see a countertop 1, a fridge 1 and a sinkbasin 1."


def _steps(n: int) -> list[StepView]:
    return [StepView(action=f"action-{i}", observation=f"observation-{i}", label="neutral") for i in range(1, n + 1)]


def _user(messages: list[dict]) -> str:
    assert [m["role"] for m in messages] == ["system", "user"]
    assert all(isinstance(m["content"], str) and m["content"] for m in messages)
    return messages[1]["content"]


def test_rate_messages_content():
    steps = _steps(3)
    msgs = rate_messages(TASK, INIT, steps, history_length=8)
    user = _user(msgs)
    assert TASK in user and INIT in user
    for i in (1, 2, 3):
        assert f"Step {i} action: action-{i}" in user
        assert f"Step {i} observation: observation-{i}" in user
    assert user.index("action-1") < user.index("action-2") < user.index("action-3")
    # the three label definitions
    assert LABEL_HELP in user
    for label in LABELS:
        assert f"{label} - " in user
    assert "Answer in exactly two lines:\nReason: <short explanation>\nLabel: <negative|neutral|positive>" in user
    assert user.rstrip().endswith("Label: <negative|neutral|positive>")
    assert "no action yet" not in user
    assert "Judge the latest step." in user
    # the rate prompt is environment-independent: nothing about admissible actions or how to act
    assert "Admissible" not in user and "Action:" not in user


def test_rate_messages_respects_history_length():
    user = _user(rate_messages(TASK, INIT, _steps(10), history_length=3))
    for i in (8, 9, 10):  # the last three, numbered by their true position in the episode
        assert f"Step {i} action: action-{i}" in user
    for i in range(1, 8):
        assert f"action-{i}\n" not in user and f"observation-{i}\n" not in user
        assert f"Step {i} action:" not in user


def test_rate_messages_history_length_zero_shows_no_steps():
    user = _user(rate_messages(TASK, INIT, _steps(4), history_length=0))
    assert "Step " not in user
    assert TASK in user and LABEL_HELP in user


def test_rate_messages_first_step_wording():
    user = _user(rate_messages(TASK, INIT, [], history_length=8))
    assert "(no action yet: judge the starting situation)" in user
    assert "Step 1" not in user
    assert "Judge the latest step." not in user
    assert "Reason: <short explanation>\nLabel: <negative|neutral|positive>" in user


def test_actor_messages_with_guidance():
    g = parse_guidance("Reason: I keep opening the same drawer.\nLabel: negative")
    msgs = actor_messages(TASK, "You see nothing.", ["look", "go to fridge 1"], "unused help", _steps(2), 8, g)
    user = _user(msgs)
    assert TASK in user and "Current observation: You see nothing." in user
    assert "Your intuition about your progress so far" in user
    assert "Label: negative" in user
    assert "Reason: I keep opening the same drawer." in user
    assert "> action-1\nobservation-1" in user and "> action-2\nobservation-2" in user
    assert "Admissible actions: look; go to fridge 1" in user
    assert user.rstrip().endswith("Action: <one action>")
    # guidance sits after the observation and before the answer format
    assert user.index("Current observation") < user.index("Your intuition") < user.index("Action: <one action>")


def test_actor_messages_unparsed_guidance_shows_neutral():
    user = _user(actor_messages(TASK, "obs", None, "help", [], 8, Guidance(None, "", "garbage")))
    assert "Label: neutral" in user
    assert "Reason: (none)" in user


def test_actor_messages_without_guidance():
    user = _user(actor_messages(TASK, "obs", ["look"], "help", _steps(2), 8, None))
    assert "intuition" not in user
    assert "Label:" not in user and "Reason:" not in user


def test_actor_messages_history_length():
    user = _user(actor_messages(TASK, "obs", None, "help", _steps(5), 2, None))
    assert "> action-4" in user and "> action-5" in user
    assert "> action-3" not in user and "> action-1" not in user
    user = _user(actor_messages(TASK, "obs", None, "help", _steps(5), 0, None))
    assert "Recent history" not in user and "> action-" not in user


def test_actor_messages_action_help_when_no_admissible():
    help_text = "Actions look like: go to <receptacle>, take <object> from <receptacle>."
    user = _user(actor_messages(TASK, "obs", None, help_text, [], 8, None))
    assert help_text in user
    assert "Admissible actions" not in user
    user = _user(actor_messages(TASK, "obs", ["look", "inventory"], help_text, [], 8, None))
    assert "Admissible actions: look; inventory" in user


def test_stream_first_messages_guided_vs_unguided():
    guided = stream_first_messages(TASK, INIT, ["look", "go to fridge 1"], "help", guided=True)
    plain = stream_first_messages(TASK, INIT, ["look", "go to fridge 1"], "help", guided=False)
    assert guided != plain
    assert STREAM_FORMAT in guided[0]["content"] and LABEL_HELP in guided[0]["content"]
    assert STREAM_FORMAT_NO_GUIDANCE in plain[0]["content"]
    assert "Label:" not in plain[0]["content"] and "Reason:" not in plain[0]["content"]
    assert "Reason: <" in guided[0]["content"] and "Label: <positive|neutral|negative>" in guided[0]["content"]
    # same user turn either way: only the format text differs
    assert guided[1] == plain[1]
    user = _user(guided)
    assert TASK in user and INIT in user and "Admissible actions: look; go to fridge 1" in user


def test_stream_next_user():
    assert stream_next_user("You arrive.", ["look"], "help") == (
        "Observation: You arrive.\nAdmissible actions: look\nhelp")
    assert stream_next_user("You arrive.", None, "help") == "Observation: You arrive.\nhelp"


def test_stream_format_round_trips_through_parsers():
    """What the stream format asks for is exactly what the parsers read."""
    reply = "Reason: found the apple.\nLabel: positive\nAction: take apple 1 from countertop 1"
    assert parse_guidance(reply).label == "positive"
    assert parse_guidance(reply).reason == "found the apple."
    p = parse_action(reply)
    assert (p.action, p.source) == ("take apple 1 from countertop 1", "line")


def test_rate_prompt_shows_the_whole_trajectory_by_default():
    user = _user(rate_messages(TASK, INIT, _steps(40)))
    for i in range(1, 41):
        assert f"Step {i} action: action-{i}" in user
    assert "not shown" not in user
    cut = _user(rate_messages(TASK, INIT, _steps(40), history_length=5))
    assert "(35 earlier steps not shown)" in cut and "Step 36 action" in cut and "Step 35 action" not in cut


@pytest.mark.parametrize(
    "fmt, answer, source",
    [
        ("action_line", "Action: open fridge 1", "line"),
        ("json", '{"think": "the apple is cold inside", "action": "open fridge 1"}', "json"),
        ("think_tags", "<think>the apple may be inside</think><action>open fridge 1</action>", "tag"),
    ],
)
def test_actor_formats_round_trip_through_the_prompt_and_the_parser(fmt, answer, source):
    """The actor prompt asks for the format's shape, and an answer in that shape parses with the format's source."""
    from sglightning.guidance import ACTOR_FORMATS

    f = ACTOR_FORMATS[fmt]
    g = Guidance("positive", "found the fridge", "")
    user = _user(actor_messages(TASK, "obs", ["open fridge 1"], "help", [], 8, g, actor_format=fmt))
    assert user.rstrip().endswith(f.instruction)
    assert f.opener in f.instruction and (not f.closer or f.closer in f.instruction.replace("your brief reasoning", ""))
    p = parse_action(answer)
    assert (p.action, p.source) == ("open fridge 1", source) and source == f.source
    stream = stream_first_messages(TASK, INIT, None, "help", guided=True, actor_format=fmt)[0]["content"]
    assert f.stream_line in stream and "Label: <positive|neutral|negative>" in stream
    # a whole single-stream turn in this format: guidance and action both found
    turn = f"Reason: found the fridge\nLabel: positive\n{answer}"
    assert parse_guidance(turn).label == "positive" and parse_action(turn).action == "open fridge 1"


def test_guidance_config_rejects_an_unknown_actor_format_naming_the_key():
    with pytest.raises(ValueError, match="guidance.actor_format"):
        GuidanceConfig(actor_format="xml")
    with pytest.raises(ValueError, match="guidance.rate_history_length"):
        GuidanceConfig(rate_history_length=-1)


_ACTION_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"),
                                              blacklist_characters='"`*\'.'),
                       min_size=1, max_size=40).filter(lambda a: a.strip())


def _normalised(action: str) -> str:
    return " ".join(action.split())


@settings(max_examples=400, deadline=None)
@given(think=st.text(max_size=200), action=_ACTION_TEXT)
def test_fuzz_json_answers_give_their_action(think, action):
    """Any thought (quotes, braces, newlines, 'Label:' — JSON-escaped as a model must write it) and any one-line action:
    the parsed action is the action, from well-formed JSON."""
    p = parse_action(json.dumps({"think": think, "action": action}), prefer="json")
    assert p.source == "json" and p.action == _normalised(action)[:200].rstrip()


@settings(max_examples=400, deadline=None)
@given(think=st.text(max_size=200).filter(lambda t: "</think>" not in t.lower() and "<action>" not in t.lower()),
       action=_ACTION_TEXT.filter(lambda a: "</action>" not in a.lower() and "<think>" not in a.lower()))
def test_fuzz_think_tag_answers_give_their_action(think, action):
    p = parse_action(f"<think>{think}</think><action>{action}</action>", prefer="tag")
    assert p.source == "tag" and p.action == _normalised(action)[:200].rstrip()


def test_think_blocks_are_found_in_the_text_itself_not_a_lowered_copy():
    """"İ".lower() is two characters: offsets found in text.lower() cut the text in the wrong places."""
    from sglightning.guidance import strip_think

    assert "İ".lower() != "İ" and len("İ".lower()) == 2  # the control: lowering can lengthen a text
    assert strip_think("ßİİİİ<think>x</think>Label: negative") == "ßİİİİLabel: negative"
    assert parse_guidance("İİİ<think>hidden</think>\nReason: ok\nLabel: positive").reason == "ok"
    assert parse_guidance("İİİİ<ThInK>x</THINK>\nLabel: negative").label == "negative"


def test_a_leading_think_block_is_guidance_for_the_parser_and_the_token_split_alike():
    """The split of a free turn took a leading <think> for the start of the action part (every guidance token an
    action token) while the parser read the label after it: the label was paid, its tokens were not guidance."""
    from sglightning.guidance import action_part_start

    turn = "<think>x</think>\nReason: a\nLabel: positive\nAction: go"
    assert parse_guidance(turn).label == "positive"
    assert action_part_start(turn) == turn.index("Action: go")
    assert action_part_start("<think>still thinking, cut by the cap") is None
    later = "Reason: a\nLabel: neutral\n<think>the actor's thought</think>\nAction: go"
    assert action_part_start(later) == later.index("<think>") and parse_guidance(later).label == "neutral"


def test_a_separator_does_not_reach_into_the_next_line():
    assert parse_guidance("Reason:\nLabel: positive") == Guidance("positive", "", "Reason:\nLabel: positive")
    got = parse_action("Action:\n\nLabel: positive")
    assert got.action != "Label: positive" and got.source != "line"
    assert parse_action("Action:\nexamine mug 1").action == "examine mug 1"  # an action on the next line still is
    assert parse_action("Reason: stuck\nAction:").action is None  # a bare "Action:" is no action


def test_an_echoed_label_template_is_not_a_label():
    assert parse_guidance("Reason: fine\nLabel: positive|neutral|negative").label is None
    assert parse_guidance("Reason: fine\nLabel: positive / negative").label is None
    assert parse_guidance("Reason: fine\nLabel: positive. It moved me on").label == "positive"
