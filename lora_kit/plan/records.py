"""The planning results the run card reads, built by the package (notebooks only save them).

``plan.json`` (notebook 01) and ``sweeps.json`` (notebook 02) have one schema each, defined here, so
the run card, the CLI and tests read the same keys whatever notebook or script produced them. Each
record states the assumptions behind its numbers: every step setting used (planning defaults
included), and for the plan what one epoch is in examples and tokens.
"""
from __future__ import annotations

import math

import pandas as pd

from lora_kit.plan.gpus import compute_capability, get_gpu
from lora_kit.plan.multi_gpu import OUTPUT_DIR, multi_gpu_plan
from lora_kit.plan.planner import placeholder_epoch
from lora_kit.settings import Step, as_step

PLAN_BATCH = "largest micro-batch that fits (up to 64)"


def _clean(value):
    """JSON-friendly: NaN -> None, numpy scalars -> Python numbers."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value.item() if hasattr(value, "item") else value


def plan_record(table: pd.DataFrame, model: str, step: Step | None = None, num_examples: int = 10_000,
                margin: float | None = None, gpu: str | None = None, method: str | None = None,
                output_dir: str = OUTPUT_DIR, time_model=None, **overrides) -> dict:
    """plan.json: the method x GPU table of ``compare_methods`` with what it assumed.

    ``step`` (default ``PLANNING``) with ``overrides`` is the step the table was computed with (as passed to
    ``compare_methods``); the record lists every step value, the planning defaults included, except ``method`` and
    ``batch_size`` which vary per row. What an epoch is comes from the table (``compare_methods``
    records it); ``num_examples`` only serves tables that do not say. ``margin``: the safety margin
    the table's "fits" used. ``time_error_factor``: the time model's measured error the table's ``*_low`` /
    ``*_high`` intervals used (``[t / f, t * f]``; smaller after a smoke run calibrated the model).

    With ``num_gpus > 1`` the record also holds ``multi_gpu`` (:func:`lora_kit.plan.multi_gpu.multi_gpu_plan`)
    for one row of the table: ``method`` on ``gpu`` when given (the run's settings) and in the table, else
    the recommended row (cheapest fitting, else fastest fitting), at that row's micro-batch; a plan that
    cannot be made holds ``{"error": ...}``. With ``gpu`` and ``method`` (the run's) it holds ``attention_note``:
    what the math kernel adds when CUDA would run that row's attention in it, else None."""
    assumed = as_step(step, **overrides)
    seq_len = assumed.seq_len
    assumptions = {k: v for k, v in assumed.to_dict().items()
                   if k not in ("method", "batch_size", "lora_alpha", "grad_accum")}
    rows = [{k: _clean(v) for k, v in r.items()} for r in table.to_dict(orient="records")]
    epoch = table.attrs.get("epoch") or placeholder_epoch(num_examples, seq_len)
    out = {"model": model, "seq_len": int(seq_len), "batch_size": PLAN_BATCH, "assumptions": assumptions,
           "margin": margin, "epoch": dict(epoch),
           "recommendation": table.attrs.get("recommendation", ""), "time_model": table.attrs.get("time_model", ""),
           "time_error_factor": _clean(table.attrs.get("time_error_factor")), "rows": rows}
    if gpu is not None and method is not None:
        out["attention_note"] = _attention_note(rows, model, gpu, method, assumed)
    if assumed.num_gpus > 1:
        out["multi_gpu"] = _multi_gpu(rows, model, margin, gpu, method, output_dir, time_model, assumed)
    return out


def plan_row(rows: list[dict], gpu: str | None, method: str | None) -> dict | None:
    """The table row a plan's one-row sections describe (the multi-GPU section, the run card's loop): ``method``
    on ``gpu``; where the table has no such row, the recommended row of ``method`` (cheapest fitting, else fastest
    fitting, else the first), else of the whole table."""
    name = get_gpu(gpu)["name"] if gpu is not None else None
    for g, m in ((name, method), (None, method), (None, None)):
        want = [r for r in rows if (g is None or r["gpu"] == g) and (m is None or r["method"] == m)]
        fits = [r for r in want if r.get("fits")]
        for key in ("epoch_cost", "epoch_hours"):
            priced = [r for r in fits if r.get(key) is not None]
            if priced:
                return min(priced, key=lambda r: r[key])
        if want:
            return want[0]
    return None


def _attention_note(rows, model, gpu, method, step: Step) -> str | None:
    """:func:`lora_kit.memory.cuda_kernels.cuda_attention_note` for ``method`` on ``gpu`` at the plan row's
    micro-batch (and the row's peak): None unless CUDA would run the step's attention in the math kernel. Not
    ``exact``: that simulates the step (about 23 s for an 8B model on 2 CPU cores), so the figure is the extra at
    attention ("up to")."""
    from lora_kit.memory.cuda_kernels import cuda_attention_note
    st, peak = step.for_method(method), None
    row = plan_row(rows, gpu, method)
    b = row.get("batch_size") if row and row["method"] == method else None
    if isinstance(b, (int, float)) and b >= 1:
        st = st.replace(batch_size=int(b))
        peak = int(row["peak_gib"] * 2**30) if isinstance(row.get("peak_gib"), (int, float)) else None
    return cuda_attention_note(model, st, compute_capability=compute_capability(gpu, unknown=8.0), peak_bytes=peak)


def _multi_gpu(rows, model, margin, gpu, method, output_dir, time_model, step: Step) -> dict:
    try:
        row = plan_row(rows, gpu, method)
        if row is None:
            return {"error": "the plan has no rows"}
        return multi_gpu_plan(model, row["gpu"], step.for_method(row["method"]).replace(
                                  batch_size=int(row["batch_size"])),
                              margin=0.10 if margin is None else margin, output_dir=output_dir,
                              steps_per_epoch=row.get("steps_per_epoch"), time_model=time_model)
    except ValueError as e:
        return {"error": str(e)}


def sweeps_record(plan_model: str, gpu: str, max_seq_len_batch1, dataset: dict, run_estimate) -> dict:
    """sweeps.json: the largest seq_len at batch 1 on ``gpu`` (one number, or one per setting such as
    ``{"lora, checkpointing on": 32768, ...}``), the dataset's lengths, and the estimate of the run's own
    settings (with the settings it assumed); ``context``: the model's context length, where the search for the
    longest seq_len stops (a value equal to it is the model's limit, not the card's)."""
    from lora_kit.memory.specs import model_spec
    longest = ({str(k): int(v) for k, v in max_seq_len_batch1.items()} if isinstance(max_seq_len_batch1, dict)
               else int(max_seq_len_batch1))
    context = (model_spec(plan_model).config or {}).get("max_position_embeddings")  # max_fit's cap for seq_len
    return {"plan_model": plan_model, "gpu": gpu, "max_seq_len_batch1": longest,
            "context": context if isinstance(context, int) else None, "dataset": dataset,
            "run_estimate": {"peak_allocated_bytes": run_estimate.peak_allocated_bytes,
                             "device_total_bytes": run_estimate.device_total_bytes,
                             "breakdown": dict(run_estimate.breakdown), "phase": run_estimate.phase,
                             "settings": dict(run_estimate.settings)}}
