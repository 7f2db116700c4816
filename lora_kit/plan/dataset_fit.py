"""Dataset-aware planning: how long are the examples in tokens, and does the longest one fit?

Out-of-memory errors in fine-tuning often come from a few very long examples, not from the mean:
memory is set by the longest sequence in a micro-batch. Gradient accumulation cannot help there --
it splits a batch into more micro-batches but never splits one example. So this module measures the
token length of every example in the run's prompt format (:class:`lora_kit.prompting.PromptFormat`,
prompt + response + EOS) and, given a model and a GPU, checks the longest example at micro-batch 1 and
prices the three ways out with the memory estimator:

- truncation to the longest length that fits (loses the tail of the longest examples; says how many);
- gradient checkpointing (recomputes activations: ~30 % more compute for much less activation memory);
- packing / chunking into rows of the fitting length (no padding waste; a long example split across
  rows loses attention across the split).

Trade-off: tokenizing the whole dataset costs time (about a second per 10-50k short examples with a
fast tokenizer); pass ``limit`` to look at the first examples only (then the maximum may be missed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lora_kit.memory.estimate import estimate
from lora_kit.plan.planner import fit_verdict, fixes
from lora_kit.data import is_conversational, load_examples, to_examples
from lora_kit.prompting import PromptFormat, resolve_prompt_format
from lora_kit.settings import Step, as_step


@dataclass
class DatasetLengths:
    """Token-length statistics of a dataset and the planning verdict for its longest example."""
    n_examples: int
    lengths: np.ndarray  # tokens per example (prompt + response + EOS, BOS if the tokenizer adds one)
    p50: float
    p95: float
    p99: float
    max: int
    mean: float
    longest: list  # [{"index", "length", "prompt", "response"}], longest first
    seq_len: int | None = None
    n_over_seq_len: int = 0  # examples that would be truncated at seq_len
    padding_fraction: float | None = None  # share of a padded seq_len batch that is padding
    longest_fits: bool | None = None  # longest example at micro-batch 1 on the GPU (None: not checked)
    warnings: list = field(default_factory=list)
    suggestions: list = field(default_factory=list)  # [{"change", "effect", "fits", "settings", "device_total_bytes"}]

    def summary(self) -> str:
        lines = [f"{self.n_examples} examples; tokens p50 {self.p50:.0f}, p95 {self.p95:.0f}, "
                 f"p99 {self.p99:.0f}, max {self.max}"]
        if self.seq_len:
            lines.append(f"seq_len {self.seq_len}: {self.n_over_seq_len} example(s) longer (truncated); "
                         f"{self.padding_fraction:.0%} of a padded batch is padding")
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines += [f"  - {s['change']}: {s['effect']}" for s in self.suggestions]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "lengths"}
        d["lengths"] = self.lengths.tolist()
        return d


def load_rows(source, split=None, prompt_field: str = "prompt", response_field: str = "response",
              data_format: str = "auto", messages_field: str = "messages") -> list[dict]:
    """Examples (``prompt``, ``response``[, ``context``]) from a list of rows or any source of
    :func:`lora_kit.data.load_examples` ("tiny:dates", JSONL, CSV, a datasets folder), in any of its
    formats (prompt/response with any field names, Alpaca, ``messages``)."""
    fields = dict(prompt_field=prompt_field, response_field=response_field, data_format=data_format,
                  messages_field=messages_field)
    if not isinstance(source, (list, tuple)):
        return load_examples(source, split=split, **fields)
    rows = list(source)
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError("every example must be a mapping of field -> text, e.g. {'prompt': ..., 'response': ...}.")
    return to_examples(rows, "the dataset (a list)", **fields)


def token_lengths(rows: list[dict], tokenizer, fmt: PromptFormat | None = None) -> np.ndarray:
    """Tokens per example in the run's prompt format (the one training uses)."""
    fmt = fmt or PromptFormat(tokenizer)
    return np.array([fmt.encode(r)["length"] for r in rows], dtype=np.int64)


def dataset_lengths(examples_or_source, tokenizer, seq_len: int | None = None, *, prompt_field: str = "prompt",
                    response_field: str = "response", split=None, limit: int | None = None, top_k: int = 5,
                    data_format: str = "auto", messages_field: str = "messages", prompt_format: str = "auto",
                    model=None, gpu: str | None = None, margin: float = 0.10, step=None,
                    **step_overrides) -> DatasetLengths:
    """Token-length statistics, the ``top_k`` longest examples, and (with ``model`` and ``gpu``) whether
    the longest example fits at micro-batch 1, with the estimated effect of truncation, checkpointing
    and packing. ``step`` (a ``lora_kit.settings.Step``, default ``PLANNING``) with ``step_overrides`` (method,
    dtype ...) is the step planned; its seq_len and micro-batch are the longest example's and 1.
    ``tokenizer`` is a tokenizer object or anything :func:`lora_kit.loading.load_tokenizer` accepts.
    """
    if isinstance(tokenizer, str):
        from lora_kit.loading import load_tokenizer
        tokenizer = load_tokenizer(tokenizer)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0):
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}.")
    rows = load_rows(examples_or_source, split, prompt_field, response_field, data_format, messages_field)
    if limit is not None:
        rows = rows[:limit]
    fmt = PromptFormat(tokenizer, resolve_prompt_format(prompt_format, tokenizer, is_conversational(rows)))
    lengths = token_lengths(rows, tokenizer, fmt)
    order = np.argsort(-lengths, kind="stable")[:top_k]
    p50, p95, p99 = np.percentile(lengths, [50, 95, 99])
    out = DatasetLengths(
        n_examples=len(rows), lengths=lengths, p50=float(p50), p95=float(p95), p99=float(p99),
        max=int(lengths.max()), mean=float(lengths.mean()),
        longest=[{"index": int(i), "length": int(lengths[i]), "prompt": rows[i]["prompt"],
                  "response": rows[i]["response"]} for i in order], seq_len=seq_len)
    if seq_len is not None:
        out.n_over_seq_len = int((lengths > seq_len).sum())
        out.padding_fraction = float(1 - np.minimum(lengths, seq_len).mean() / seq_len)
        if out.n_over_seq_len:
            out.warnings.append(f"{out.n_over_seq_len} example(s) ({out.n_over_seq_len / len(rows):.1%}) are longer "
                                f"than seq_len={seq_len} and will be truncated (longest: {out.max} tokens).")
    if model is not None and gpu is not None:
        _check_longest(out, model, gpu, margin, as_step(step, **step_overrides))
    return out


def _check_longest(out: DatasetLengths, model, gpu: str, margin: float, step: Step) -> None:
    """Does the longest example fit at micro-batch 1 (the planner's one fit rule)? If not, the
    planner's one fix ladder (:func:`lora_kit.plan.planner.fixes`) in this dataset's terms: a shorter
    ``seq_len`` becomes truncation (how many examples lose their tail) and, beside it, packing."""
    need = out.max if out.seq_len is None else min(out.max, out.seq_len)
    step = step.replace(seq_len=need, batch_size=1)
    est = estimate(model, step)
    v = fit_verdict(est.device_total_bytes, gpu, margin)
    out.longest_fits = v["fits"]
    if v["fits"]:
        return
    gib = 2 ** 30
    out.warnings.append(
        f"the longest example ({need} tokens) does not fit on {v['gpu']} even at micro-batch 1: it needs "
        f"{est.device_total_bytes / gib:.1f} GiB of {v['usable_bytes'] / gib:.1f} GiB usable ({margin:.0%} margin). "
        "Gradient accumulation cannot help: it splits a batch into micro-batches but never splits an example.")
    ladder = fixes(gpu, margin, model=model, step=step)
    for f in ladder:
        out.suggestions += _in_dataset_terms(f, out)
    if not ladder:
        out.suggestions.append({"change": "no change in the fix ladder", "fits": False, "settings": {},
                                "device_total_bytes": None, "effect": (
                                    "not even 1 token fits with any single change or bigger catalog GPU: shard "
                                    "across GPUs (sharding, num_gpus) or offload to CPU")})


def _in_dataset_terms(fix: dict, out: DatasetLengths) -> list[dict]:
    """One rung of the planner's ladder as dataset suggestions (a seq_len cut: truncation, then packing)."""
    gib = 2 ** 30
    row = {"settings": fix["settings"], "device_total_bytes": fix["device_total_bytes"], "fits": True,
           "change": fix["change"], "effect": f"{fix['device_total_bytes'] / gib:.1f} GiB at micro-batch 1; {fix['why']}"}
    if "seq_len" not in fix["settings"]:
        return [row]
    n = fix["settings"]["seq_len"]
    cut = int((out.lengths > n).sum())
    parts = fix["change"].split(" + ")  # one part per changed setting, in the order of fix["settings"]
    at = list(fix["settings"]).index("seq_len")
    truncate = {**row, "change": " + ".join(parts[:at] + [f"truncate to seq_len={n}"] + parts[at + 1:]),
                "effect": f"{row['effect']}; {cut} example(s) ({cut / out.n_examples:.1%}) lose their tail"}
    pack = {**row, "change": " + ".join(parts[:at] + [f"pack/chunk into rows of {n} tokens"] + parts[at + 1:]),
            "effect": (f"same memory as truncation ({fix['device_total_bytes'] / gib:.1f} GiB) with no padding and "
                       f"no token dropped; the {cut} longer example(s) are split and lose attention across the split")}
    return [truncate, pack]
