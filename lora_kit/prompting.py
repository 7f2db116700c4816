"""The one prompt format the kit uses everywhere (training, smoke run, evaluation, generation).

A prompt is rendered as ``"{prompt}\\nAnswer: "`` and the response follows, ended by the
tokenizer's EOS token. Labels cover only the response (+ EOS): the prompt tokens are masked with
-100, so the loss measures the task, not the copying of the question. The same functions work
for real models: they use only the tokenizer's own BOS/EOS.
"""
from __future__ import annotations

PROMPT_TEMPLATE = "{prompt}\nAnswer: "
IGNORE_INDEX = -100


def render_prompt(prompt: str) -> str:
    return PROMPT_TEMPLATE.format(prompt=prompt)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of the rendered prompt, with BOS if the tokenizer adds one (never twice)."""
    return list(tokenizer(render_prompt(prompt), add_special_tokens=True)["input_ids"])


def encode_example(tokenizer, prompt: str, response: str, max_len: int | None = None,
                   truncate: bool = True) -> dict:
    """``input_ids`` and ``labels`` for one prompt/response pair (prompt masked in labels).

    If the example is longer than ``max_len`` it is truncated from the right when ``truncate``
    (``truncated=True`` is reported) or a ValueError says by how much it is too long.
    """
    p = encode_prompt(tokenizer, prompt)
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        r = r + [tokenizer.eos_token_id]
    ids = p + r
    labels = [IGNORE_INDEX] * len(p) + r
    truncated = False
    if max_len is not None and len(ids) > max_len:
        if not truncate:
            raise ValueError(f"example has {len(ids)} tokens, more than seq_len={max_len}; "
                             "raise seq_len or allow truncation.")
        ids, labels, truncated = ids[:max_len], labels[:max_len], True
    return {"input_ids": ids, "labels": labels, "length": len(ids), "truncated": truncated}
