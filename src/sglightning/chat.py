"""The tokenizer's side of a conversation: chat turns rendered to token ids with the tokenizer's own template
(incrementally, for the single-stream prompt mode), the pad id every padded tensor uses, and the token sets the
programs need (end of turn, newlines, how a thought can close) (no Lightning import)."""

from __future__ import annotations

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
    a few dozen tokens (any think block a model writes anyway is removed before parsing)."""

    _A, _U = "@@SGL_A@@", "@@SGL_U@@"

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if "enable_thinking" in template and "enable_thinking" not in self.kwargs:
            self.kwargs["enable_thinking"] = False
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        turn = [{"role": "assistant", "content": self._A}, {"role": "user", "content": self._U}]
        t2 = self._render(base + turn, True)
        a = t2.find(self._A)
        u = t2.find(self._U, a + len(self._A)) if a >= 0 else -1
        if u < 0:
            raise ValueError("the tokenizer's chat template cannot be rendered incrementally (single_stream mode)")
        # what closes an assistant turn and opens a user turn / what closes it and opens the next answer
        self.turn_prefix, self.turn_suffix = t2[a + len(self._A) : u], t2[u + len(self._U) :]
        self.eos_text = tokenizer.eos_token or ""
        # text -> ids: the forced words, label options and admissible actions recur in every turn of every episode,
        # and a tokenizer call costs ~80 µs of Python (more than a GPU's decode step per hundred calls)
        self._ids: dict[str, tuple[int, ...]] = {}
        self._cached = 0  # tokens held by _ids: whole two_call prompts (thousands of tokens, ~100 KB each) add up

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            ids = tuple(self.tok.encode(valid_text(text), add_special_tokens=False))
            if len(self._ids) >= 65_536 or self._cached + len(ids) > CACHE_TOKENS:
                self._ids.clear()
                self._cached = 0
            self._ids[text] = ids
            self._cached += len(ids)
        return list(ids)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, True))

    def next_turn_ids(self, user_text: str, turn_closed: bool) -> list[int]:
        """Ids that close the assistant turn (unless the model already did), add a user turn, open the next answer."""
        prefix = self.turn_prefix
        if turn_closed and self.eos_text and prefix.startswith(self.eos_text):
            prefix = prefix[len(self.eos_text) :]
        return self.encode(prefix + user_text + self.turn_suffix)


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


def closing_tokens(tokenizer, closer: str, forbid_newline: bool = False) -> tuple[dict[int, str], frozenset[int]]:
    r"""How a free segment (a thought) can end with ``closer`` (e.g. ``", "action": "`` or ``</think><action>``).

    Returns ``(stops, banned)``: ``stops`` maps each token whose text, from its first ``closer[0]`` on, is a prefix
    of ``closer`` to the rest of ``closer`` still to be written (a token ``",`` leaves `` "action": "``); ``banned``
    holds every other token containing ``closer[0]`` (or an escaped one: ``\"``), so that the thought can only end
    by starting ``closer``, and, with ``forbid_newline``, the tokens containing a newline (JSON strings hold none).
    Cached on the tokenizer per (closer, forbid_newline)."""

    def build():
        first = closer[0]
        stops: dict[int, str] = {}
        banned: set[int] = set()
        for i, text in enumerate(token_texts(tokenizer)):
            if forbid_newline and "\n" in text.split(first, 1)[0]:
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
    key = (closer, forbid_newline)
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
