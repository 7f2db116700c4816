"""The planning results the run card reads, built by the package (notebooks only save them).

``plan.json`` (notebook 01) and ``sweeps.json`` (notebook 02) have one schema each, defined here, so
the run card, the CLI and tests read the same keys whatever notebook or script produced them. Each
record states the assumptions behind its numbers: every step setting used (planning defaults
included), and for the plan what one epoch is in examples and tokens.
"""
from __future__ import annotations

import math

import pandas as pd

from lora_kit.settings import check_step

PLAN_BATCH = "largest micro-batch that fits (up to 64)"


def _clean(value):
    """JSON-friendly: NaN -> None, numpy scalars -> Python numbers."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value.item() if hasattr(value, "item") else value


def plan_record(table: pd.DataFrame, model: str, seq_len: int, num_examples: int = 10_000,
                margin: float | None = None, **step) -> dict:
    """plan.json: the method x GPU table of ``compare_methods`` with what it assumed.

    ``step`` are the step settings the table was computed with (as passed to ``compare_methods``);
    the record lists every step value, the planning defaults included, except ``method`` and
    ``batch_size`` which vary per row. What an epoch is comes from the table (``compare_methods``
    records it); ``num_examples`` only serves tables that do not say. ``margin``: the safety margin
    the table's "fits" used."""
    assumed = check_step({"seq_len": seq_len, **step})
    assumptions = {k: v for k, v in assumed.items() if k not in ("method", "batch_size", "lora_alpha", "grad_accum")}
    rows = [{k: _clean(v) for k, v in r.items()} for r in table.to_dict(orient="records")]
    epoch = table.attrs.get("epoch") or {"examples": int(num_examples), "tokens": int(num_examples) * int(seq_len),
                                         "note": "each example padded to seq_len"}
    return {"model": model, "seq_len": int(seq_len), "batch_size": PLAN_BATCH, "assumptions": assumptions,
            "margin": margin, "epoch": dict(epoch),
            "recommendation": table.attrs.get("recommendation", ""), "time_model": table.attrs.get("time_model", ""),
            "rows": rows}


def sweeps_record(plan_model: str, gpu: str, max_seq_len_batch1, dataset: dict, run_estimate) -> dict:
    """sweeps.json: the largest seq_len at batch 1 on ``gpu`` (one number, or one per setting such as
    ``{"lora, checkpointing on": 32768, ...}``), the dataset's lengths, and the estimate of the run's own
    settings (with the settings it assumed)."""
    longest = ({str(k): int(v) for k, v in max_seq_len_batch1.items()} if isinstance(max_seq_len_batch1, dict)
               else int(max_seq_len_batch1))
    return {"plan_model": plan_model, "gpu": gpu, "max_seq_len_batch1": longest, "dataset": dataset,
            "run_estimate": {"peak_allocated_bytes": run_estimate.peak_allocated_bytes,
                             "device_total_bytes": run_estimate.device_total_bytes,
                             "breakdown": dict(run_estimate.breakdown), "phase": run_estimate.phase,
                             "settings": dict(run_estimate.settings)}}
