"""The tokenizer's side of a conversation: chat turns rendered to token ids with the tokenizer's own template
(incrementally, for the single-stream prompt mode), the pad id every padded tensor uses, and the token sets the
programs need (end of turn, newlines, how a thought can close) (no Lightning import)."""

from __future__ import annotations

import re

from sglightning.errors import ConfigError
from sglightning.guidance import valid_text

#: the most tokens the text -> ids cache holds (~40 MB of Python ints and their texts); past it, it starts anew
CACHE_TOKENS = 1_000_000


def pad_token_id(tokenizer) -> int:
    """The id used to pad rows, in the engine's cache and in the update's batches: the tokenizer's pad token, else its
    end-of-sequence token.  (``models.load_tokenizer`` gives every tokenizer it loads a pad token by the same rule;
    padded positions are always masked, so the value never changes a result.)"""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


class ChatFormat:
    """Renders chat turns to token ids with the tokenizer's own template, incrementally for the single stream.

    ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``enable_thinking``).  A template that knows
    ``enable_thinking`` (Qwen3) gets ``enable_thinking=False`` unless told otherwise: its thinking mode would open a
    ``<think>`` block in every answer, where the actor's first line must be an action and the rate call's budget is
    a few dozen tokens (any think block a model writes anyway is removed before parsing).

    Templates differ in ways the programs depend on, so they are read here, not assumed:

    * ``turn_end_id``: the token that closes an assistant turn (ChatML ``<|im_end|>``, Llama 3 ``<|eot_id|>``, Gemma
      ``<end_of_turn>``), read from a rendered turn; the tokenizer's end-of-sequence token where none is special.
    * A template without a system role (Gemma) gets the system text at the head of the first user message.
    * Special-token strings inside message text (an env's page holding ``<s>``, a model echoing ``<|im_end|>``) are
      defused with a zero-width space, so they reach the model as text, never as control tokens."""

    _A, _U, _S, _U0 = "@@SGL_A@@", "@@SGL_U@@", "@@SGL_S@@", "@@SGL_U0@@"  # the probes' texts

    def __init__(self, tokenizer, template_kwargs: dict | None = None, incremental: bool = True):
        """Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        template_kwargs: extra arguments of ``apply_chat_template``.
        incremental: read what closes a turn and opens the next (single_stream needs it; two_call does not).
        """
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if "enable_thinking" in template and "enable_thinking" not in self.kwargs:
            self.kwargs["enable_thinking"] = False
        special_ids = _special_ids(tokenizer)
        specials = sorted({t for t in tokenizer.all_special_tokens if t}
                          | {t for t, i in tokenizer.get_added_vocab().items() if i in special_ids},
                          key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._firsts = frozenset(t[0] for t in specials)  # most texts hold none of these: no regex run
        self.fold_system = not self._renders_system()
        # the token that closes an assistant turn: the first of what the template writes after its content
        after = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": self._A}], False)
        tail = self.tok.encode(after[after.find(self._A) + len(self._A):], add_special_tokens=False)
        eos = tokenizer.eos_token_id
        self.turn_end_id = tail[0] if tail and tail[0] in special_ids else eos
        self.turn_end_text = tokenizer.decode([self.turn_end_id]) if self.turn_end_id is not None else ""
        self.turn_prefix = self.turn_suffix = ""
        if incremental:
            self._read_turns()
        # text -> ids: the forced words, label options and admissible actions recur in every turn of every episode,
        # and a tokenizer call costs ~80 µs of Python (more than a GPU's decode step per hundred calls)
        self._ids: dict[str, tuple[int, ...]] = {}
        self._cached = 0  # tokens held by _ids: whole two_call prompts (thousands of tokens, ~100 KB each) add up

    def _renders_system(self) -> bool:
        """Whether the template shows a system message as given (Gemma's raises; some drop it)."""
        try:
            text = self.tok.apply_chat_template([{"role": "system", "content": self._S},
                                                 {"role": "user", "content": self._U0}],
                                                tokenize=False, add_generation_prompt=True, **self.kwargs)
        except Exception:  # noqa: BLE001 - jinja's TemplateError ("System role not supported") and kin
            return False
        return self._S in text

    def _read_turns(self) -> None:
        """What closes an assistant turn and opens a user turn, and what closes that and opens the next answer."""
        base = [{"role": "system", "content": self._S}, {"role": "user", "content": self._U0}]
        turn = [{"role": "assistant", "content": self._A}, {"role": "user", "content": self._U}]
        t2 = self._render(base + turn, True)
        a = t2.find(self._A)
        u = t2.find(self._U, a + len(self._A)) if a >= 0 else -1
        if u < 0:
            raise ConfigError("guidance.prompt_mode: single_stream needs a chat template that can be rendered turn "
                              "by turn, and this tokenizer's cannot: use two_call")
        self.turn_prefix, self.turn_suffix = t2[a + len(self._A) : u], t2[u + len(self._U) :]
        if any(p in self.turn_prefix + self.turn_suffix for p in (self._S, self._U0)):  # Mistral's v1: the system
            raise ConfigError("guidance.prompt_mode: single_stream grows one conversation turn by turn, and this "
                              "tokenizer's chat template rewrites earlier messages into later turns: use two_call")

    def defuse(self, text: str) -> str:
        """``text`` with every special-token string broken by a zero-width space after its first character."""
        text = valid_text(text)
        if self._special is None or not any(c in text for c in self._firsts):
            return text
        return self._special.sub(lambda m: m.group(0)[0] + "\u200b" + m.group(0)[1:], text)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        messages = [{**m, "content": self.defuse(m["content"])} for m in messages]
        if self.fold_system and messages and messages[0]["role"] == "system":
            system, rest = messages[0]["content"], messages[1:]
            if rest and rest[0]["role"] == "user":
                rest = [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}] + rest[1:]
            else:
                rest = [{"role": "user", "content": system}] + rest
            messages = rest
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as written (special-token strings in it count: for the template's own text)."""
        ids = self._ids.get(text)
        if ids is None:
            ids = tuple(self.tok.encode(valid_text(text), add_special_tokens=False))
            if len(self._ids) >= 65_536 or self._cached + len(ids) > CACHE_TOKENS:
                self._ids.clear()
                self._cached = 0
            self._ids[text] = ids
            self._cached += len(ids)
        return list(ids)

    def encode_text(self, text: str) -> list[int]:
        """Ids of text from an env or a model (an admissible action): :meth:`defuse` d, then :meth:`encode` d."""
        return self.encode(self.defuse(text))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, True))

    def next_turn_ids(self, user_text: str, closed_with: int | None) -> list[int]:
        """Ids that close the assistant turn (unless the model closed it with ``closed_with``, its last token), add a
        user turn, open the next answer."""
        prefix = self.turn_prefix
        if closed_with == self.turn_end_id and self.turn_end_text and prefix.startswith(self.turn_end_text):
            prefix = prefix[len(self.turn_end_text) :]
        return self.encode(prefix + self.defuse(user_text) + self.turn_suffix)


def _special_ids(tokenizer) -> frozenset[int]:
    """The ids of ``tokenizer``'s special (control) tokens: its named ones and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _cached(tokenizer, key: str, build):
    cached = getattr(tokenizer, key, None)
    if cached is not None:
        return cached
    value = build()
    try:
        setattr(tokenizer, key, value)
    except AttributeError:
        pass
    return value


def token_texts(tokenizer) -> list[str]:
    """The text of every vocabulary token, decoded alone (cached on the tokenizer object)."""
    return _cached(tokenizer, "_sglightning_token_texts",
                   lambda: [tokenizer.decode([i]) for i in range(len(tokenizer))])


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Ids of all vocabulary tokens whose text contains a newline (cached on the tokenizer object)."""
    return _cached(tokenizer, "_sglightning_newline_ids",
                   lambda: frozenset(i for i, t in enumerate(token_texts(tokenizer)) if "\n" in t))


def closing_tokens(tokenizer, closer: str, json_string: bool = False) -> tuple[dict[int, str], frozenset[int]]:
    r"""How a free segment (a thought) can end with ``closer`` (e.g. ``", "action": "`` or ``</think><action>``).

    Returns ``(stops, banned)``: ``stops`` maps each token whose text, from its first ``closer[0]`` on, is a prefix
    of ``closer`` to the rest of ``closer`` still to be written (a token ``",`` leaves `` "action": "``); ``banned``
    holds every other token containing ``closer[0]`` (or an escaped one: ``\"``), so that the thought can only end
    by starting ``closer``.  With ``json_string`` (the thought is a JSON string) also the tokens holding a newline
    and those ending in an odd run of backslashes (``abc\`` then ``",`` would escape the closing quote).  Cached on
    the tokenizer per (closer, json_string)."""

    def build():
        first = closer[0]
        stops: dict[int, str] = {}
        banned: set[int] = set()
        for i, text in enumerate(token_texts(tokenizer)):
            if json_string and ("\n" in text.split(first, 1)[0]
                                or (first not in text and (len(text) - len(text.rstrip("\\"))) % 2)):
                banned.add(i)
                continue
            k = text.find(first)
            if k < 0:
                continue
            suffix = text[k:]
            if closer.startswith(suffix) and not (k > 0 and text[k - 1] == "\\"):
                stops[i] = closer[len(suffix):]
            else:
                banned.add(i)
        return stops, frozenset(banned)

    cache = _cached(tokenizer, "_sglightning_closers", dict)
    key = (closer, json_string)
    if key not in cache:
        cache[key] = build()
    return cache[key]


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return frozenset(i for i in ids if i is not None)
