"""Generation and reference loss in the run's prompt format, the same for every system compared.

Both take ``fmt``, a :class:`lora_kit.prompting.PromptFormat` (None: the plain format), and prompts
as strings or example dicts (``{"prompt", "response"[, "context"]}``), so conversations are
rendered exactly as in training.

- :func:`generate`: left-padded batches (right padding ruins batched generation of decoder-only
  models), greedy unless ``do_sample``, stop at EOS (and the chat template's end-of-turn token) or,
  for the plain and template formats, at the first newline (checked on decoded text, so it works
  for any tokenizer, whatever token holds the newline), seed set first.
- :func:`reference_nll`: teacher-forced NLL of the reference (+ EOS) after the prompt, prompt
  masked -- the training loss, measured on examples the fine-tune did not see.
Trade-off: the newline stop decodes the new tokens of the batch at every step; that costs little
next to a forward pass for short answers, and is what makes the rule tokenizer-independent.
"""
from __future__ import annotations

from lora_kit.prompting import IGNORE_INDEX, PromptFormat


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
             fmt: PromptFormat | None = None) -> list[str]:
    """Answers in the prompt format ``fmt`` (default plain): left-padded batches, stop at EOS (or
    end of turn) or, plain/template, at a newline (text before it), stripped.
    ``torch.manual_seed(seed)`` is set first (matters when sampling)."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList
    fmt = fmt or PromptFormat(tokenizer)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample,
                               temperature=temperature if do_sample else None, top_p=None, top_k=None,
                               pad_token_id=pad, eos_token_id=fmt.stop_ids or None)
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = _left_pad([fmt.prompt_ids(p) for p in prompts[i:i + batch_size]], pad)
        dev = next(model.parameters()).device
        stop = StoppingCriteriaList([_stop_at_newline(tokenizer, ids.shape[1])] if fmt.stop_at_newline else [])
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen_cfg,
                                 stopping_criteria=stop)
        texts = tokenizer.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
        out += [(t.split("\n", 1)[0] if fmt.stop_at_newline else t).strip() for t in texts]
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
        enc = [fmt.encode(p, r) for p, r in zip(prompts[i:i + batch_size], references[i:i + batch_size])]
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
