"""The one place an example becomes tokens: training, smoke run, evaluation and generation.

A :class:`PromptFormat` renders an example (``{"prompt", "response"[, "context"]}`` from
:mod:`lora_kit.data`, or a bare prompt string) in one of three ways (``prompt_format``):

- ``"plain"``: ``"{prompt}\\nAnswer: "`` then the response and the tokenizer's EOS -- the kit's own
  format, the one the embedded model was pretrained on;
- ``"chat"``: the tokenizer's chat template (``apply_chat_template``); the conversation is the
  row's context messages (``messages`` data) or one user message holding the prompt; the answer is
  what the template adds for the assistant's turn (its end-of-turn marker included, so the model
  learns to stop);
- a user template holding ``{prompt}``, e.g. ``"### Question: {prompt}\\n### Answer: "``, then the
  response and EOS.

``"auto"`` (:func:`resolve_prompt_format`) means "chat" when the tokenizer has a chat template and
the data is conversational, else "plain". Labels cover only the answer (+ EOS / end of turn):
everything before it is masked with -100, so the loss measures the task, not the copying of the
question or the template. BOS is added once: by the tokenizer for plain/template formats, by the
template text for "chat" (tokenized with ``add_special_tokens=False`` -- no double BOS).
Trade-off: prompt and answer are tokenized separately, so a token spanning their boundary is split;
the same split is used everywhere, so training and evaluation agree.
"""
from __future__ import annotations

PROMPT_TEMPLATE = "{prompt}\nAnswer: "
IGNORE_INDEX = -100


def render_prompt(prompt: str) -> str:
    return PROMPT_TEMPLATE.format(prompt=prompt)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(setting: str, tokenizer, conversational: bool) -> str:
    """``setting`` ("auto" | "plain" | "chat" | a template with ``{prompt}``) made concrete for this
    tokenizer and data; ValueError naming ``prompt_format`` when the tokenizer cannot do it."""
    if setting == "auto":
        return "chat" if conversational and has_chat_template(tokenizer) else "plain"
    if setting == "chat" and not has_chat_template(tokenizer):
        raise ValueError("prompt_format='chat' but the model's tokenizer has no chat template; set "
                         "prompt_format='plain' or a template holding {prompt}, e.g. '### Question: {prompt}\\n"
                         "### Answer: '.")
    if setting not in ("plain", "chat") and "{prompt}" not in str(setting):
        raise ValueError(f"prompt_format={setting!r} is not valid; choose 'auto', 'plain', 'chat' or a template "
                         "holding {prompt}.")
    return setting


class PromptFormat:
    """Encodes examples in one concrete format ("plain", "chat" or a template with ``{prompt}``)."""

    def __init__(self, tokenizer, kind: str = "plain"):
        self.tokenizer, self.kind = tokenizer, resolve_prompt_format(kind, tokenizer, False)  # "auto" -> "plain"
        self.template = PROMPT_TEMPLATE if self.kind in ("plain", "chat") else self.kind
        # plain/template answers end at the first newline; chat answers end at the end-of-turn marker
        self.stop_at_newline = self.kind != "chat"
        self.stop_ids = self._stop_ids()

    def __repr__(self) -> str:
        return f"PromptFormat({self.kind!r})"

    def _messages(self, ex) -> list[dict]:
        if isinstance(ex, str):
            return [{"role": "user", "content": ex}]
        return list(ex.get("context") or [{"role": "user", "content": ex["prompt"]}])

    def _chat(self, messages, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return text if isinstance(text, str) else text[0]

    def prompt_text(self, ex) -> str:
        if self.kind == "chat":
            return self._chat(self._messages(ex), True)
        return self.template.format(prompt=ex if isinstance(ex, str) else ex["prompt"])

    def prompt_ids(self, ex) -> list[int]:
        """Token ids of the rendered prompt (BOS once, if the tokenizer or the template adds one)."""
        return list(self.tokenizer(self.prompt_text(ex), add_special_tokens=self.kind != "chat")["input_ids"])

    def answer_ids(self, ex, response: str) -> list[int]:
        tok = self.tokenizer
        if self.kind == "chat":
            msgs = self._messages(ex)
            prompt = self._chat(msgs, True)
            full = self._chat(msgs + [{"role": "assistant", "content": response}], False)
            if not full.startswith(prompt) or response not in full[len(prompt):]:
                raise ValueError("the tokenizer's chat template does not render the assistant's answer after the "
                                 "generation prompt, so the answer cannot be told apart for the labels; set "
                                 "prompt_format='plain' or a template holding {prompt}.")
            return list(tok(full[len(prompt):], add_special_tokens=False)["input_ids"])
        ids = list(tok(response, add_special_tokens=False)["input_ids"])
        return ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])

    def _stop_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = [] if tok.eos_token_id is None else [tok.eos_token_id]
        if self.kind == "chat":  # the template's end-of-turn token, when it is one special token
            try:
                tail = self.answer_ids("x", "y")
            except Exception:  # noqa: BLE001 - a template that cannot render: encode() will say why
                tail = []
            special = set(getattr(tok, "all_special_ids", []) or [])
            ids += [t for t in tail if t in special and t not in ids][:1]
        return ids

    def encode(self, ex, response: str | None = None, max_len: int | None = None, truncate: bool = True) -> dict:
        """``input_ids`` and ``labels`` (everything but the answer masked) for one example.

        ``ex``: an example dict (its ``response`` is used unless ``response`` is given) or a prompt
        string with ``response``. Longer than ``max_len``: truncated from the right when
        ``truncate`` (``truncated=True``), else a ValueError saying by how much.
        """
        response = ex["response"] if response is None else response
        p, r = self.prompt_ids(ex), self.answer_ids(ex, response)
        ids, labels = p + r, [IGNORE_INDEX] * len(p) + r
        truncated = False
        if max_len is not None and len(ids) > max_len:
            if not truncate:
                raise ValueError(f"example has {len(ids)} tokens, more than seq_len={max_len}; "
                                 "raise seq_len or allow truncation.")
            ids, labels, truncated = ids[:max_len], labels[:max_len], True
        return {"input_ids": ids, "labels": labels, "length": len(ids), "truncated": truncated}


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of the rendered prompt in the plain format, with BOS if the tokenizer adds one."""
    return PromptFormat(tokenizer).prompt_ids(prompt)


def encode_example(tokenizer, prompt: str, response: str, max_len: int | None = None,
                   truncate: bool = True) -> dict:
    """``input_ids`` and ``labels`` for one prompt/response pair in the plain format (prompt masked)."""
    return PromptFormat(tokenizer).encode(prompt, response, max_len, truncate)
