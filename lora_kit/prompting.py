"""The one place an example becomes tokens: training, smoke run, evaluation and generation.

A :class:`PromptFormat` renders an example (``{"prompt", "response"[, "context"]}`` from
:mod:`lora_kit.data`, or a bare prompt string) in one of three ways (``prompt_format``):

- ``"plain"``: ``"{prompt}\\nAnswer: "`` then the response and the tokenizer's EOS -- the kit's own
  format, the one the embedded model was pretrained on;
- ``"chat"``: the tokenizer's chat template (``apply_chat_template``); the conversation is the
  row's context messages (``messages`` data) or one user message holding the prompt, then the
  assistant's answer;
- a user template holding ``{prompt}``, e.g. ``"### Question: {prompt}\\n### Answer: "``, then the
  response and EOS.

``"auto"`` (:func:`resolve_prompt_format`) means "chat" when the tokenizer has a chat template and
the data is conversational, else "plain".

Tokenised once. The whole text (the rendered conversation, or prompt + response + EOS) is tokenised
in one call, as TRL's ``SFTTrainer`` does (``apply_chat_template(tokenize=True)`` for conversations;
prompt + completion for the other formats), and labels come from character offsets into that one
tokenisation: a token is trained when it overlaps a trained character span (transformers'
``return_assistant_tokens_mask`` rule). Token ids are therefore the template's own -- no token split at
the prompt/answer boundary, no space token a SentencePiece tokenizer adds to a separately tokenised
answer. Which spans are trained is ``train_on``:

- ``"assistant"`` (default): every assistant turn -- TRL's ``assistant_only_loss=True``, LLaMA-Factory's
  default (``mask_history`` off);
- ``"last"``: the last assistant turn only;
- ``"all"``: every token -- TRL 1.16's default ``assistant_only_loss=False``.

An assistant turn's span runs from the end of the template's generation prompt (what
``add_generation_prompt=True`` renders before it) through its content and the template's end of turn
(what the template writes after a final assistant message, e.g. ``<end_of_turn>\\n``, ``<|im_end|>\\n``,
``<|end|>\\n`` + EOS, as far as the rendered text repeats it). A template with ``{% generation %}``
markers is taken at its word (its marked spans). For the plain and template formats the answer's span is
the response and EOS. A prompt's (or generation prompt's) trailing spaces belong to the answer's span when the tokenizer's
vocabulary joins a space to the next word (``Ġword`` / ``▁word``): BPE
and SentencePiece tokenizers merge a space with the word after it (``"Answer: "`` + ``"OK"`` -> ``" OK"``),
so the prompt the model generates after ends before them (:meth:`PromptFormat.prompt_ids`) and the
training context is the same. (A tokenizer whose vocabulary has no space-led word keeps the space in the
prompt, e.g. the embedded character-level one.)
BOS is added once: by the tokenizer for plain/template, by the template text for
chat (tokenised with ``add_special_tokens=False``).

A template that refuses or drops a system message (Mixtral's, Gemma-2's) gets the system text merged
into the first user turn, separated by a blank line; :attr:`PromptFormat.notes` says so for the run's
summary.
"""
from __future__ import annotations

import re

from lora_kit.settings import TRAIN_ON

PROMPT_TEMPLATE = "{prompt}\nAnswer: "
IGNORE_INDEX = -100
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = "x"  # stands for an answer's first character when the generation prompt's tokens are fixed


def cut_at_seq_len(encoded: dict, seq_len: int, long_examples: str) -> str:
    """How the smoke run takes one row (:meth:`PromptFormat.encode`'s ``length`` and ``labels``) at ``seq_len``:
    "dropped" (longer, under ``long_examples='drop'``), "cut_away" (no trained token left within ``seq_len``) or
    "kept" (cut to ``seq_len`` when longer). The one rule :func:`lora_kit.run.batches.verified_slice` trains by and
    :func:`lora_kit.data_check.check_data` checks before the run."""
    if encoded["length"] > seq_len and long_examples == "drop":
        return "dropped"
    return "kept" if any(t != IGNORE_INDEX for t in encoded["labels"][:seq_len]) else "cut_away"


def no_usable_example(dropped: int, cut_away: int, seq_len: int) -> str:
    """Why no row is left (:func:`cut_at_seq_len` dropped ``dropped`` and cut away ``cut_away`` of them)."""
    why = (f"all {dropped} are longer than seq_len={seq_len} and long_examples='drop'" if dropped and not cut_away
           else f"all {dropped + cut_away} lose their whole response at seq_len={seq_len}")
    return f"no usable example: {why}"


def render_prompt(prompt: str) -> str:
    return PROMPT_TEMPLATE.format(prompt=prompt)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_train_on(train_on: str) -> str:
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r} is not valid; choose 'assistant' (every assistant turn), 'last' "
                         "(the last assistant turn) or 'all' (the whole conversation).")
    return train_on


def choose_prompt_format(setting: str, tokenizer, conversational: bool) -> tuple[str, str]:
    """(``setting`` made concrete for this tokenizer and data, why, in words); ``setting`` is "auto" |
    "plain" | "chat" | a template with ``{prompt}``. ValueError naming ``prompt_format`` when the tokenizer
    cannot do it."""
    if setting == "auto":
        if not has_chat_template(tokenizer):
            return "plain", "prompt_format='auto' and the model has no chat template"
        if not conversational:
            return "plain", ("prompt_format='auto' and the data is prompt/response rows, not chat messages (the "
                             "model's chat template is used for messages data only)")
        return "chat", "prompt_format='auto', the data is chat messages and the model has a chat template"
    if setting == "chat" and not has_chat_template(tokenizer):
        raise ValueError("prompt_format='chat' but the model's tokenizer has no chat template; set "
                         "prompt_format='plain' or a template holding {prompt}, e.g. '### Question: {prompt}\\n"
                         "### Answer: '.")
    if setting not in ("plain", "chat") and "{prompt}" not in str(setting):
        raise ValueError(f"prompt_format={setting!r} is not valid; choose 'auto', 'plain', 'chat' or a template "
                         "holding {prompt}.")
    return setting, f"prompt_format={setting!r} is set"


def resolve_prompt_format(setting: str, tokenizer, conversational: bool) -> str:
    """``setting`` made concrete for this tokenizer and data (:func:`choose_prompt_format`)."""
    return choose_prompt_format(setting, tokenizer, conversational)[0]


def format_label(kind: str) -> str:
    """A concrete prompt format in words, e.g. "the model's chat template"."""
    if kind == "chat":
        return "the model's chat template"
    if kind == "plain":
        return f"plain ({PROMPT_TEMPLATE!r}, then the answer and EOS)"
    return f"your template ({kind!r}, then the answer and EOS)"


def labels_from_spans(ids: list[int], offsets, spans) -> list[int]:
    """``ids`` with every token that overlaps none of the character ``spans`` masked (-100); a token
    overlapping a span is trained (transformers' ``return_assistant_tokens_mask`` rule)."""
    labels, k = [IGNORE_INDEX] * len(ids), 0
    spans = sorted(s for s in spans if s[1] > s[0])
    for i, (a, b) in enumerate(offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if b > spans[k][0] and b > a:
            labels[i] = ids[i]
    return labels


def _runs(flags) -> list[list[int]]:
    """``[start, end)`` of each run of true flags."""
    runs, prev = [], False
    for i, on in enumerate(flags):
        if on and not prev:
            runs.append([i, i + 1])
        elif on:
            runs[-1][1] = i + 1
        prev = on
    return runs


class PromptFormat:
    """Encodes examples in one concrete format ("plain", "chat" or a template with ``{prompt}``),
    training the spans ``train_on`` names (see the module docstring)."""

    def __init__(self, tokenizer, kind: str = "plain", train_on: str = "assistant", conversational: bool = False):
        # kind "auto" resolves for ``conversational`` data (:func:`choose_prompt_format`); ``reason`` says why
        self.tokenizer = tokenizer
        self.kind, self.reason = choose_prompt_format(kind, tokenizer, conversational)
        self.train_on = check_train_on(train_on)
        self.template = PROMPT_TEMPLATE if self.kind in ("plain", "chat") else self.kind
        # plain/template answers end at the first newline; chat answers end at the end-of-turn marker
        self.stop_at_newline = self.kind != "chat"
        self.notes: list[str] = []
        self.merge_system = False
        self.end_of_turn = ""  # the text the chat template writes after a final assistant message
        self.marked = False
        self._space_joins = None
        if self.kind == "chat":
            self._probe_template()
        self.stop_ids = self._stop_ids()

    def __repr__(self) -> str:
        return f"PromptFormat({self.kind!r}, train_on={self.train_on!r})"

    # -- the chat template, probed once -----------------------------------------------------
    def _chat(self, messages, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return text if isinstance(text, str) else text[0]

    def _probe_template(self) -> None:
        tpl = self.tokenizer.chat_template
        self.marked = isinstance(tpl, str) and bool(_GENERATION_MARK.search(tpl))
        marker = "SYSTEMPROBE"
        try:
            ok = marker in self._chat([{"role": "system", "content": marker}, {"role": "user", "content": "u"}], True)
        except Exception:  # noqa: BLE001 - a template that raises on a system message (e.g. Mixtral's)
            ok = False
        if not ok:
            self.merge_system = True
            self.notes.append("the chat template has no system role: system messages are merged into the first "
                              "user turn (system text, a blank line, the user text)")
        try:
            head = self._chat([{"role": "user", "content": "u"}], True)
            full = self._chat([{"role": "user", "content": "u"}, {"role": "assistant", "content": "ANSWERPROBE"}],
                              False)
        except Exception:  # noqa: BLE001 - encode() will raise the template's own message on a real row
            return
        if full.startswith(head) and "ANSWERPROBE" in full[len(head):]:
            self.end_of_turn = full[full.rindex("ANSWERPROBE") + len("ANSWERPROBE"):]

    def _messages(self, ex) -> list[dict]:
        if isinstance(ex, str):
            msgs = [{"role": "user", "content": ex}]
        else:
            msgs = [dict(m) for m in (ex.get("context") or [{"role": "user", "content": ex["prompt"]}])]
        if self.merge_system and msgs and msgs[0]["role"] == "system":
            system, msgs = msgs[0]["content"], msgs[1:]
            for m in msgs:
                if m["role"] == "user":
                    m["content"] = f"{system}\n\n{m['content']}" if system.strip() else m["content"]
                    break
        return msgs

    def _render_conversation(self, messages) -> str:
        try:
            return self._chat(messages, False)
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError and friends: say what to change
            raise ValueError(f"the chat template refuses this conversation (roles {[m['role'] for m in messages]}): "
                             f"{e}; fix the row, or set prompt_format='plain' or a template holding {{prompt}}.") from None

    def _eot_length(self, text: str, at: int) -> int:
        """How much of the template's end of turn the text repeats at ``at``, in whole tokens of it."""
        eot = self.end_of_turn
        if not eot:
            return 0
        enc = self.tokenizer(eot, add_special_tokens=False, return_offsets_mapping=True)
        n = 0
        for a, b in enc["offset_mapping"]:
            piece = eot[n:b] if a <= n else eot[a:b]
            if not text.startswith(piece, at + n):
                break
            n = b
        return n

    def _assistant_spans(self, messages, text: str) -> list[tuple[int, int]]:
        spans, cursor = [], 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._chat(messages[:k], True)
            start = len(head) if text.startswith(head) else None
            content = str(m["content"])
            key = content.split("</think>")[-1].strip() if "</think>" in content else content.strip()
            pos = text.find(key, cursor if start is None else start) if key else (start or cursor)
            if pos < 0:
                raise ValueError(f"the chat template does not write assistant turn {k + 1}'s text as given "
                                 f"({key[:40]!r}), so its tokens cannot be told apart for the labels; set "
                                 "train_on='all', or prompt_format='plain' or a template holding {prompt}.")
            end = pos + len(key)
            end += self._eot_length(text, end)
            start = pos if start is None else self._answer_start(text, start)
            spans.append((start, end))
            cursor = end
        return spans

    # -- encoding ---------------------------------------------------------------------------
    def _answer_start(self, text: str, at: int) -> int:
        """Where the answer's span starts: ``at``, moved before the prompt's trailing spaces when this
        tokenizer joins a space to the word after it."""
        if self._space_joins is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._space_joins = any(len(t) > 1 and t[0] in "Ġ▁ " and t[1].isalnum() for t in vocab)
        return len(text[:at].rstrip(" ")) if self._space_joins else at

    def _tokenize(self, text: str, add_special_tokens: bool):
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def _text_and_spans(self, ex, response: str) -> tuple[str, list, list[tuple[int, int]]]:
        """(the whole text, its (ids, offsets) or None, the trained character spans -- all of them, in order)."""
        tok = self.tokenizer
        if isinstance(ex, dict) and ex.get("text") is not None:  # language-modelling rows (TRL's text + EOS)
            text = str(ex["text"]) + (tok.eos_token or "")
            return text, None, [(0, len(text))]
        if self.kind == "chat":
            msgs = self._messages(ex) + [{"role": "assistant", "content": response}]
            text = self._render_conversation(msgs)
            if self.marked:
                out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
                return text, (ids, mask), []
            return text, None, self._assistant_spans(msgs, text)
        prompt = self.template.format(prompt=ex if isinstance(ex, str) else ex["prompt"])
        text = prompt + response + (tok.eos_token or "")
        return text, None, [(self._answer_start(text, len(prompt)), len(text))]

    def encode(self, ex, response: str | None = None, max_len: int | None = None, truncate: bool = True,
               train_on: str | None = None) -> dict:
        """``input_ids`` and ``labels`` (the spans ``train_on`` names trained, the rest -100) for one example,
        from one tokenisation of the whole text.

        ``ex``: an example dict (its ``response`` is used unless ``response`` is given) or a prompt
        string with ``response``. Longer than ``max_len``: truncated from the right when
        ``truncate`` (``truncated=True``), else a ValueError saying by how much. ``train_on``: this
        format's unless given ("last" scores the final answer alone, as evaluation's reference loss does).
        """
        response = (ex.get("response", "") if isinstance(ex, dict) else "") if response is None else response
        ids, labels = self._ids_labels(ex, response, check_train_on(train_on) if train_on else None)
        truncated = False
        if max_len is not None and len(ids) > max_len:
            if not truncate:
                raise ValueError(f"example has {len(ids)} tokens, more than seq_len={max_len}; "
                                 "raise seq_len or allow truncation.")
            ids, labels, truncated = ids[:max_len], labels[:max_len], True
        return {"input_ids": ids, "labels": labels, "length": len(ids), "truncated": truncated}

    def _ids_labels(self, ex, response: str, train_on: str | None = None) -> tuple[list[int], list[int]]:
        train_on = train_on or self.train_on
        text, pre, spans = self._text_and_spans(ex, response)
        lm = isinstance(ex, dict) and ex.get("text") is not None
        if pre is not None:  # a template with generation markers: its mask
            ids, mask = pre
            if train_on == "all":
                return ids, list(ids)
            runs = _runs(mask)
            keep = runs[-1:] if train_on == "last" else runs
            labels = [IGNORE_INDEX] * len(ids)
            for a, b in keep:
                labels[a:b] = ids[a:b]
            return ids, labels
        plain = self.kind != "chat" or lm
        ids, offsets = self._tokenize(text, add_special_tokens=plain)
        eos = self.tokenizer.eos_token_id
        if plain and self.tokenizer.eos_token and eos is not None and (not ids or ids[-1] != eos):
            # an EOS the tokenizer does not parse from its text: tokenise without it and append its id
            ids, offsets = self._tokenize(text[:-len(self.tokenizer.eos_token)], add_special_tokens=True)
            ids, offsets = ids + [eos], offsets + [(len(text) - len(self.tokenizer.eos_token), len(text))]
        if train_on == "all" or lm:
            return ids, list(ids)
        return ids, labels_from_spans(ids, offsets, spans[-1:] if train_on == "last" else spans)

    def rendered(self, ex, response: str | None = None) -> str:
        """The whole text this format tokenises for ``ex`` (its ``response`` unless given): the rendered
        conversation, or prompt + response + EOS -- what the tokenizer receives. Plain and template formats
        tokenise it with the tokenizer's special tokens (its BOS, if it adds one)."""
        response = (ex.get("response", "") if isinstance(ex, dict) else "") if response is None else response
        return self._text_and_spans(ex, response)[0]

    def as_seen(self, ex, max_len: int | None = None) -> dict:
        """One example as training sees it: ``text`` (:meth:`rendered`), ``tokens`` (its length before any cut
        to ``max_len``), ``truncated_to`` (``max_len`` when cut, else None), ``trained`` (the trained tokens
        decoded, one string per run of them), ``trained_tokens``, and ``bos``: the BOS token the tokenizer
        adds in front of the text (None when the text holds it or none is added)."""
        ids, labels = self._ids_labels(ex, ex.get("response", "") if isinstance(ex, dict) else "")
        n = len(ids)
        if max_len is not None:
            ids, labels = ids[:max_len], labels[:max_len]
        runs = _runs([lab != IGNORE_INDEX for lab in labels])
        tok, text = self.tokenizer, self.rendered(ex)
        bos = tok.bos_token if (ids and tok.bos_token and ids[0] == tok.bos_token_id
                                and not text.startswith(tok.bos_token)) else None
        return {"text": text, "tokens": n, "truncated_to": max_len if max_len is not None and n > max_len else None,
                "trained": [tok.decode(ids[a:b]) for a, b in runs], "trained_tokens": sum(b - a for a, b in runs),
                "bos": bos}

    def prompt_text(self, ex) -> str:
        if self.kind == "chat":
            return self._chat(self._messages(ex), True)
        return self.template.format(prompt=ex if isinstance(ex, str) else ex["prompt"])

    def prompt_ids(self, ex) -> list[int]:
        """Token ids the model generates after: the tokens before the final answer's span in the one
        tokenisation of the whole text (with a one-letter stand-in answer), so generation sees the context
        training saw. BOS once, if the tokenizer or the template adds one."""
        ids, labels = self._ids_labels(ex, _PROBE, train_on="last")
        first = next((i for i, lab in enumerate(labels) if lab != IGNORE_INDEX), None)
        if first is None:
            return list(self.tokenizer(self.prompt_text(ex), add_special_tokens=self.kind != "chat")["input_ids"])
        return ids[:first]

    def answer_ids(self, ex, response: str) -> list[int]:
        """The trained tokens of the final answer (with its end of turn / EOS)."""
        ids, labels = self._ids_labels(ex, response, train_on="last")
        return [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]

    def end_of_turn_ids(self) -> list[int]:
        """The chat template's end-of-turn token: the first token of what it writes after a final assistant
        message, when that token is one added (special or control) token, e.g. ``<end_of_turn>``."""
        if not self.end_of_turn:
            return []
        tok = self.tokenizer
        first = tok(self.end_of_turn, add_special_tokens=False)["input_ids"][:1]
        added = set(getattr(tok, "all_special_ids", []) or [])
        added |= {i for i in (getattr(tok, "added_tokens_decoder", None) or {})}
        return [t for t in first if t in added]

    def _stop_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = [] if tok.eos_token_id is None else [tok.eos_token_id]
        if self.kind == "chat":
            ids += [t for t in self.end_of_turn_ids() if t not in ids]
        return ids


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of the rendered prompt in the plain format, with BOS if the tokenizer adds one."""
    return PromptFormat(tokenizer).prompt_ids(prompt)


def encode_example(tokenizer, prompt: str, response: str, max_len: int | None = None,
                   truncate: bool = True) -> dict:
    """``input_ids`` and ``labels`` for one prompt/response pair in the plain format (prompt masked)."""
    return PromptFormat(tokenizer).encode(prompt, response, max_len, truncate)
