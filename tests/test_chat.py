"""Chat templates other than ChatML: what closes a turn, a template without a system role, one that cannot grow turn
by turn, and special-token strings inside env text."""

from __future__ import annotations

import pytest

from sglightning.chat import ChatFormat
from sglightning.embedded import build_tiny_tokenizer
from sglightning.errors import ConfigError

GEMMA_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LLAMA3_STYLE = (
    "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + "
    "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Mistral's v1 template: the system text goes into the *last* user message, so earlier turns change as turns are added
MISTRAL_STYLE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}{{ bos_token }}{% for m in rest %}"
    "{% if m['role'] == 'user' %}{% if loop.last and system %}{{ '[INST] ' + system + '\n\n' + m['content'] + "
    "'[/INST]' }}{% else %}{{ '[INST] ' + m['content'] + '[/INST]' }}{% endif %}{% else %}{{ ' ' + m['content'] + "
    "eos_token }}{% endif %}{% endfor %}"
)


def _tok(template: str, specials: list[str], eos: str | None = None):
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    if eos:
        tok.eos_token = eos
    tok.chat_template = template
    return tok


def test_chatml_turns_end_with_im_end_even_where_eos_is_another_token():
    """A Qwen base-style tokenizer: eos is <|endoftext|>, turns close with <|im_end|>. An admissible action ended
    with eos, and a model that closed its turn got a second <|im_end|>."""
    tok = build_tiny_tokenizer()
    tok.eos_token = "<|endoftext|>"
    fmt = ChatFormat(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert fmt.turn_end_id == im_end != tok.eos_token_id
    closed = tok.decode(fmt.next_turn_ids("obs", closed_with=im_end))
    assert closed.startswith("\n<|im_start|>user\nobs") and "<|im_end|>" not in closed.split("obs")[0]
    open_ = tok.decode(fmt.next_turn_ids("obs", closed_with=tok.eos_token_id))  # closed by another end: ours added
    assert open_.startswith("<|im_end|>\n<|im_start|>user\nobs")


@pytest.mark.parametrize("template, specials, end", [
    (GEMMA_STYLE, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    (LLAMA3_STYLE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
])
def test_the_turn_end_is_read_from_the_template(template, specials, end):
    tok = _tok(template, specials)
    fmt = ChatFormat(tok)
    assert fmt.turn_end_id == tok.convert_tokens_to_ids(end) != tok.eos_token_id
    ids = fmt.next_turn_ids("you see a mug", closed_with=fmt.turn_end_id)
    text = tok.decode(ids)
    assert text.count(end) == 1 and "you see a mug" in text  # the model's own end is not written twice


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn():
    tok = _tok(GEMMA_STYLE, ["<start_of_turn>", "<end_of_turn>"])
    with pytest.raises(Exception, match="System role not supported"):  # the control: the template refuses it
        tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                tokenize=False)
    fmt = ChatFormat(tok)
    assert fmt.fold_system
    text = tok.decode(fmt.prompt_ids([{"role": "system", "content": "Answer in one line."},
                                      {"role": "user", "content": "Task: find the mug."}]))
    assert "<start_of_turn>user\nAnswer in one line.\n\nTask: find the mug.<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")
    assert not ChatFormat(build_tiny_tokenizer()).fold_system  # ChatML shows a system message as given


def test_a_template_that_rewrites_earlier_turns_is_refused_for_the_single_stream_only():
    tok = _tok(MISTRAL_STYLE, ["[INST]", "[/INST]"], eos="<|im_end|>")
    with pytest.raises(ConfigError, match="guidance.prompt_mode: single_stream .* rewrites earlier messages"):
        ChatFormat(tok)
    fmt = ChatFormat(tok, incremental=False)  # two_call renders each prompt whole: fine
    text = tok.decode(fmt.prompt_ids([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]))
    assert text.startswith("<|im_start|>[INST] S\n\nU[/INST]")


def test_special_token_strings_in_env_text_stay_text():
    """An observation holding "<|im_end|>" (a page, an echo) became a real end-of-turn token in the prompt."""
    tok = build_tiny_tokenizer()
    fmt = ChatFormat(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "you see <|im_end|> here"}]
    plain = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode(plain, add_special_tokens=False).count(im_end) == 3  # the control: the env's one counts
    ids = fmt.prompt_ids(msgs)
    assert ids.count(im_end) == 2  # the template's own two
    assert "you see <\u200b|im_end|> here" in tok.decode(ids)
    assert im_end not in fmt.encode_text("open <|im_end|>")
    assert fmt.next_turn_ids("a <|im_end|> b", closed_with=im_end).count(im_end) == 1  # the user turn's own close
    assert fmt.defuse("plain text") == "plain text"
