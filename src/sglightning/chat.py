"""The tokenizer's side of a conversation: chat turns rendered to token ids with the tokenizer's own template
(incrementally, for the single-stream prompt mode), and the pad id every padded tensor uses (no Lightning import)."""

from __future__ import annotations


def pad_token_id(tokenizer) -> int:
    """The id used to pad rows, in the decoder's cache and in the update's batches: the tokenizer's pad token, else its
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

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, True))

    def next_turn_ids(self, user_text: str, turn_closed: bool) -> list[int]:
        """Ids that close the assistant turn (unless the model already did), add a user turn, open the next answer."""
        prefix = self.turn_prefix
        if turn_closed and self.eos_text and prefix.startswith(self.eos_text):
            prefix = prefix[len(self.eos_text) :]
        return self.encode(prefix + user_text + self.turn_suffix)
