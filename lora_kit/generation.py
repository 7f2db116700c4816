"""Generation and reference loss in the run's prompt format, the same for every system compared.

Both take ``fmt``, a :class:`lora_kit.prompting.PromptFormat` (None: the plain format), and prompts
as strings or example dicts (``{"prompt", "response"[, "context"]}``), so conversations are
rendered exactly as in training.

- :func:`generate`: left-padded batches (right padding ruins batched generation of decoder-only
  models), greedy unless ``do_sample``, seed set first. It stops where the model's turn ends
  (:func:`stop_ids`): the tokenizer's EOS, every id of the model's ``generation_config.eos_token_id``
  (Gemma-3's lists ``<end_of_turn>``, Llama-3's ``<|eot_id|>``) and the chat template's end-of-turn token;
  for the plain and template formats also at the first newline (checked on decoded text, so it works
  for any tokenizer, whatever token holds the newline). A reasoning template's think block
  (``<think>…</think>``, Qwen3) is handled by ``think``: "answer" (default) judges the text after the
  block, "whole" everything generated (:func:`answer_text`).
- :func:`reference_nll`: teacher-forced NLL of the reference (+ EOS / end of turn) after the prompt,
  everything before the final answer masked -- the training loss, measured on examples the fine-tune
  did not see.
Trade-off: the newline stop decodes the new tokens of the batch at every step; that costs little
next to a forward pass for short answers, and is what makes the rule tokenizer-independent.
"""
from __future__ import annotations

from lora_kit.prompting import IGNORE_INDEX, PromptFormat
from lora_kit.settings import THINK

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def check_think(think: str) -> str:
    if think not in THINK:
        raise ValueError(f"think={think!r} is not valid; choose 'answer' (judge the text after a <think>...</think> "
                         "block) or 'whole' (judge everything generated).")
    return think


def answer_text(text: str, think: str = "answer") -> str:
    """The answer judged in ``text``: with ``think="answer"`` the text after the last ``</think>`` (empty when a
    block was opened and never closed: the budget ran out while thinking); with "whole" the text itself."""
    check_think(think)
    if think == "answer":
        if THINK_CLOSE in text:
            text = text.rsplit(THINK_CLOSE, 1)[1]
        elif unfinished_think(text):
            text = ""
    return text.strip()


def unfinished_think(text: str) -> bool:
    """True when ``text`` opens a think block and never closes it (the budget ran out while thinking)."""
    return text.lstrip().startswith(THINK_OPEN) and THINK_CLOSE not in text


def stop_ids(model, fmt: PromptFormat) -> list[int]:
    """Token ids that end the model's turn: ``fmt.stop_ids`` (EOS, the template's end of turn) and every id of
    the model's ``generation_config.eos_token_id`` (an int or a list)."""
    ids = list(fmt.stop_ids)
    gc = getattr(model, "generation_config", None)
    extra = getattr(gc, "eos_token_id", None) if gc is not None else None
    for t in ([extra] if isinstance(extra, int) else list(extra or [])):
        if t is not None and int(t) not in ids:
            ids.append(int(t))
    return ids


def _stop_at_newline(tokenizer, start: int):
    import torch
    from transformers import StoppingCriteria

    class StopAtNewline(StoppingCriteria):
        """Per-sequence stop once the generated text holds a newline (works for any tokenizer)."""

        def __call__(self, input_ids, scores, **kwargs):
            texts = tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
            return torch.tensor(["\n" in t for t in texts], dtype=torch.bool, device=input_ids.device)

    return StopAtNewline()


def _left_pad(seqs: list[list[int]], pad: int):
    import torch
    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 16, batch_size: int = 32,
             do_sample: bool = False, temperature: float = 1.0, seed: int = 0, bar=None,
             fmt: PromptFormat | None = None, think: str = "answer", unfinished: list | None = None) -> list[str]:
    """Answers in the prompt format ``fmt`` (default plain): left-padded batches, stop at the end of the
    model's turn (:func:`stop_ids`) or, plain/template, at a newline (text before it), the think block
    handled by ``think`` (:func:`answer_text`), stripped. ``torch.manual_seed(seed)`` is set first
    (matters when sampling). ``unfinished``: a list that gets, per prompt, whether the output ended inside a
    think block (:func:`unfinished_think`)."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList
    fmt = fmt or PromptFormat(tokenizer)
    check_think(think)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    stops = stop_ids(model, fmt)
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample,
                               temperature=temperature if do_sample else None, top_p=None, top_k=None,
                               pad_token_id=pad, eos_token_id=stops or None)
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = _left_pad([fmt.prompt_ids(p) for p in prompts[i:i + batch_size]], pad)
        dev = next(model.parameters()).device
        stop = StoppingCriteriaList([_stop_at_newline(tokenizer, ids.shape[1])] if fmt.stop_at_newline else [])
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen_cfg,
                                 stopping_criteria=stop)
        new = [row.tolist() for row in gen[:, ids.shape[1]:]]
        new = [row[:next((j for j, t in enumerate(row) if t in stops), len(row))] for row in new]
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        texts = [t.split("\n", 1)[0] if fmt.stop_at_newline else t for t in texts]
        out += [answer_text(t, think) for t in texts]
        if unfinished is not None:
            unfinished += [unfinished_think(t) for t in texts]
        if bar is not None:
            bar.update(1)
    return out


def reference_nll(model, tokenizer, prompts: list, references: list[str], batch_size: int = 32,
                  bar=None, fmt: PromptFormat | None = None) -> tuple[list[float], list[int]]:
    """Teacher-forced negative log-likelihood of each reference (+ EOS / end of turn) after its prompt.

    Returns (summed NLL in nats, number of scored tokens) per example; the prompt is masked, so
    this is the loss the fine-tune optimises, measured on examples it did not train on.
    """
    import torch
    import torch.nn.functional as F
    fmt = fmt or PromptFormat(tokenizer)
    pad = tokenizer.pad_token_id
    nll, ntok = [], []
    dev = next(model.parameters()).device
    for i in range(0, len(prompts), batch_size):
        enc = [fmt.encode(p, r, train_on="last") for p, r in zip(prompts[i:i + batch_size], references[i:i + batch_size])]
        width = max(e["length"] for e in enc)
        ids = torch.tensor([e["input_ids"] + [pad] * (width - e["length"]) for e in enc], device=dev)
        labels = torch.tensor([e["labels"] + [IGNORE_INDEX] * (width - e["length"]) for e in enc], device=dev)
        mask = torch.tensor([[1] * e["length"] + [0] * (width - e["length"]) for e in enc], device=dev)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        tgt = labels[:, 1:]
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="none").view(tgt.shape)
        nll += tok.sum(1).tolist()
        ntok += (tgt != IGNORE_INDEX).sum(1).tolist()
        if bar is not None:
            bar.update(1)
    return nll, ntok
