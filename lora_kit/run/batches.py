"""The verified slice of a dataset that a smoke run trains on.

Out-of-memory errors come from the longest examples, not the mean, so the slice is built from the
whole dataset sorted by token length: the longest examples go first (they are in the first,
measured steps), the rest follow shuffled with the seed. Every example is encoded in the run's
prompt format (:class:`lora_kit.prompting.PromptFormat`, the one evaluation and generation use) and
checked:

- rows with an empty prompt or response (or an empty ``text``, for language-modelling rows) are a ValueError naming them
  (:func:`lora_kit.data.row_refs`: their lines in the user's file, as ``load_examples`` does): rows are never silently
  dropped;
- examples longer than ``seq_len`` follow ``long_examples``: "truncate" (from the right; an example
  whose whole answer is cut away is skipped, it would train on nothing), "drop" (left out) or
  "error" (:func:`lora_kit.data.refuse_long_examples`: a ValueError saying how many, how long and where). Either
  way they are counted: the report's ``long_examples`` says how many, what share, the longest (and where:
  ``longest_at``), and what was done;
- ``seq_len`` beyond the model's context (``max_position_embeddings``) is a ValueError.

Batches are built as the step's ``padding`` says (:func:`collate`): ``"max_length"`` pads every row to
``seq_len`` with an attention mask, so every step has the shape the plan names; ``"longest"`` pads to each
batch's longest row (the step's width is recorded, and the figures beside it describe that width);
``"none"`` gives rows of ``seq_len`` tokens without an attention mask, as the plan's unpadded rows.
"""
from __future__ import annotations

import random

import torch

from lora_kit.data import refuse_long_examples, row_refs
from lora_kit.prompting import IGNORE_INDEX, PromptFormat, cut_at_seq_len, no_usable_example


def _empty(v) -> bool:
    return v is None or (isinstance(v, float) and v != v) or not str(v).strip()


def check_context(seq_len: int, config) -> None:
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx is not None and seq_len > ctx:
        raise ValueError(f"seq_len={seq_len} is longer than the model's context "
                         f"(max_position_embeddings={ctx}); lower seq_len to at most {ctx}.")


def _checked(examples, prompt_field: str, response_field: str) -> list[dict]:
    if not examples:
        raise ValueError("the dataset is empty; pass a dataset with prompt/response rows.")
    first = examples[0]
    for f in (prompt_field, response_field):
        if f not in first:
            raise ValueError(f"dataset rows have no {f!r} column (columns: {sorted(first)}); "
                             f"set prompt_field / response_field.")
    empty_rows = [i for i, row in enumerate(examples, 1) if (_empty(row.get("text")) if "text" in row else
                  _empty(row.get(prompt_field)) or _empty(row.get(response_field)))]
    if empty_rows:
        raise ValueError(f"{len(empty_rows)} row(s) have an empty {prompt_field!r} or {response_field!r} "
                         f"({row_refs(examples, empty_rows)}); fill or remove them.")
    return [{"prompt": str(r[prompt_field]), "response": str(r[response_field]),
             **({"context": r["context"]} if isinstance(r.get("context"), list) else {}),
             **({"text": str(r["text"])} if "text" in r else {})} for r in examples]


def verified_slice(tokenizer, examples, seq_len: int, n_examples: int, seed: int = 0,
                   prompt_field: str = "prompt", response_field: str = "response", n_first: int = 1,
                   fmt: PromptFormat | None = None, long_examples: str = "truncate"):
    """(encoded examples in training order, report). ``n_first`` longest examples lead the order.

    The list has exactly ``n_examples`` items (the dataset is repeated, reshuffled, if it is
    smaller). The report holds counts, the longest lengths, the prompt format and why it was chosen, the first
    trained row as the tokenizer receives it (``rendered_example``, :meth:`PromptFormat.as_seen`), and ``long_examples``
    (how many are longer than ``seq_len``, their share, the longest, how many were truncated,
    dropped or lost their whole answer).
    """
    if long_examples not in ("truncate", "drop", "error"):
        raise ValueError(f"long_examples={long_examples!r} is not valid; choose 'truncate', 'drop' or 'error'.")
    fmt = fmt or PromptFormat(tokenizer)
    rows = _checked(examples, prompt_field, response_field)
    encoded, cut_away, dropped, long_rows, all_lengths = [], [], [], [], []
    for i, row in enumerate(rows):
        e = fmt.encode(row)
        e["row"] = i
        e["full_length"] = e["length"]
        all_lengths.append(e["length"])
        how = cut_at_seq_len(e, seq_len, long_examples)
        if e["length"] > seq_len:
            long_rows.append(i)
            if how == "dropped":
                dropped.append(i)
                continue
            e["input_ids"], e["labels"] = e["input_ids"][:seq_len], e["labels"][:seq_len]
            e["length"], e["truncated"] = seq_len, True
        if how == "cut_away":
            cut_away.append(i)
            continue
        encoded.append(e)
    longest = max(range(len(rows)), key=lambda i: all_lengths[i])
    long_report = {"policy": long_examples, "seq_len": seq_len, "count": len(long_rows),
                   "share": len(long_rows) / len(rows), "longest_tokens": all_lengths[longest],
                   "longest_row": longest, "longest_at": row_refs(examples, [longest + 1]), "rows": long_rows[:20],
                   "truncated": sum(e["truncated"] for e in encoded), "dropped": len(dropped),
                   "answer_cut_away": len(cut_away)}
    if long_examples == "error":
        refuse_long_examples(examples, all_lengths, seq_len)
    if not encoded:
        raise ValueError(f"{no_usable_example(len(dropped), len(cut_away), seq_len)}; raise seq_len.")
    by_len = sorted(encoded, key=lambda e: -e["full_length"])
    n_first = min(n_first, len(by_len), n_examples)
    lead, rest = by_len[:n_first], by_len[n_first:]
    rng = random.Random(seed)
    rng.shuffle(rest)
    order = list(lead) + rest
    while len(order) < n_examples:  # small dataset: repeat it, reshuffled
        more = list(encoded)
        rng.shuffle(more)
        order += more
    order = order[:n_examples]
    lengths = [e["full_length"] for e in by_len]
    report = {
        "rows": len(rows), "usable": len(encoded), "used": len(order), "prompt_format": fmt.kind,
        "prompt_format_reason": fmt.reason, "train_on": fmt.train_on, "format_notes": list(fmt.notes),
        # the first row trained (the first of data/trained.jsonl) as the tokenizer receives it
        "rendered_example": fmt.as_seen(rows[min(e["row"] for e in order)], seq_len),
        "trained_tokens": sum(sum(t != IGNORE_INDEX for t in e["labels"]) for e in encoded),
        "skipped_response_cut_away": len(cut_away), "skipped_response_cut_away_rows": cut_away[:20],
        "truncated": long_report["truncated"], "dropped_long": len(dropped), "seq_len": seq_len,
        "longest_lengths": lengths[:5], "longest_rows": [e["row"] for e in by_len[:5]],
        "mean_length": sum(lengths) / len(lengths), "lead_examples_are_longest": n_first,
        "long_examples": long_report,
    }
    return order, report


def collate(batch, seq_len: int, pad_id: int, padding: str = "max_length") -> dict:
    """The batch as the step field ``padding`` says (right padding; pads are -100 in labels):

    - ``"max_length"``: every row padded to ``seq_len``, with an attention mask (0 on pads);
    - ``"longest"``: padded to the batch's longest row, with an attention mask (all ones when nothing is padded);
    - ``"none"``: every row ``seq_len`` tokens and no attention mask. Pads follow the real tokens of their row, so
      under causal attention no real token sees them and their labels are masked: the loss and gradients are those
      of the masked batch, while the model runs the unmasked attention path the plan describes;
    - ``"packed"``: the rows concatenated into one, no padding and no mask, position_ids restarting at 0 for each
      row and -100 as each row's first label (transformers' ``DataCollatorWithFlattening``, TRL's padding_free).
    """
    if padding not in ("none", "longest", "max_length", "packed"):
        raise ValueError(f"padding={padding!r} is not valid; choose 'none', 'longest', 'max_length' or 'packed'.")
    if padding == "packed":
        ids = [t for e in batch for t in e["input_ids"]]
        labels = [t for e in batch for t in [IGNORE_INDEX, *e["labels"][1:]]]
        positions = [p for e in batch for p in range(len(e["input_ids"]))]
        return {k: torch.tensor([v], dtype=torch.long) for k, v in
                (("input_ids", ids), ("labels", labels), ("position_ids", positions))}
    width = max(len(e["input_ids"]) for e in batch) if padding == "longest" else seq_len
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    if padding == "none":
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def ran_seq_len(padding: str, seq_len: int, batch_size: int, width: int | None) -> int:
    """The ``seq_len`` that describes, as ``batch_size`` rows, a step whose widest micro-batch :func:`collate` made
    ``width`` tokens wide (what a smoke run records per step): that width with ``"longest"``; with ``"packed"`` the
    one row of ``width`` tokens, as ``ceil(width / batch_size)`` tokens per row (the same tokens, fewer than
    ``batch_size`` over); else ``seq_len`` (every row padded or cut to it)."""
    if not width:
        return seq_len
    if padding == "longest":
        return width
    if padding == "packed":
        return -(-width // batch_size)
    return seq_len


def real_tokens(batch: list) -> int:
    """Tokens of the rows in ``batch`` (encoded examples), padding left out."""
    return sum(len(e["input_ids"]) for e in batch)
