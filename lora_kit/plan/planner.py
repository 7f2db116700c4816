"""Planning over GPUs and settings: sweeps, the fit finder, fixes, and method x GPU comparison.

The guide this follows: first ask whether the model fits at all (in 4-bit if need be), then spend
the remaining memory on sequence length and batch; compare LoRA on a bigger, pricier card with QLoRA
on a smaller, cheaper one by *total cost*, since QLoRA is slower per step; several GPUs do not pool
their memory unless the states are sharded (``sharding``), so every number here is per GPU.

- :func:`sweep` evaluates any grid of ``lora_kit.memory.estimate`` arguments (plus ``gpu``) with one
  vectorized ``estimate_arrays`` call per combination of categorical settings: 10,000 rows take
  milliseconds (``benchmarks/planner_speed.py``), and every row equals ``estimate(...)`` exactly.
- :func:`max_fit` finds the exact largest ``seq_len`` / ``batch_size`` / ``lora_rank`` that fits
  (memory grows monotonically in each), by vectorized bisection, and checks the boundary with
  ``estimate``.
- :func:`fixes` lists single changes that make a plan fit, cheapest first (see its docstring for the
  order and why); the widget's verdict shows the first one.
- :func:`compare_methods` builds the full / LoRA / QLoRA x GPU table with memory, step time,
  tokens/s, time and cost per epoch and a plain-language recommendation.

"Fits" means ``device_total_bytes <= (1 - margin) * cuda_capacity_bytes`` of the GPU: the CUDA-visible total
(what ``torch.cuda.mem_get_info()`` reports and a process can fill, its context included; the vendor figure as a
labelled fallback, see :mod:`lora_kit.plan.gpus`), never nvidia-smi's total, part of which the driver keeps.
``capacity_bytes`` (the catalog's, nvidia-smi's total where a reading is named) is shown, not judged on.
Headroom is ``usable - device_total`` (negative: short by).
That is the kit's one fit rule (:func:`fit_verdict`), and :func:`fixes` its one ranked fix ladder:
the OOM advice after a failed smoke run (``lora_kit.run.oom.fit_suggestions``) and the dataset
check (``lora_kit.plan.dataset_fit``) call them. A "GPU" is a catalog name or any device described
by its capacity (:func:`device_of`), e.g. the CUDA device a smoke run ran on, or the smaller device
a CPU smoke run emulates. Every function takes a ``lora_kit.settings.Step`` (``step=``, default ``PLANNING``)
and step fields overriding it, validated by making the Step.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from lora_kit.memory.estimate import estimate, estimate_arrays
from lora_kit.memory.mla import mla_note
from lora_kit.memory.moe import moe_note
from lora_kit.memory.specs import model_spec
from lora_kit.plan.gpus import compute_capability, get_gpu, gpu_problems, gpu_table, resolve_prices
from lora_kit.plan.timing import TimeModel, step_time
from lora_kit.settings import (AXIS_FIELDS, LORA_FIELDS, METHODS, STEP_FIELDS, Settings, Step, as_step, check_names,
                               default_of, method_label)

GIB = 2 ** 30
ARRAY_ARGS = ("seq_len", "batch_size", "lora_rank", "num_gpus")  # vectorised axes of a sweep
PASSTHROUGH_ARGS = tuple(f for f in AXIS_FIELDS if f not in ARRAY_ARGS)  # integer fields with no effect on memory
# every other step field of the one schema is a categorical sweep axis (derived, so a new field is never refused)
CATEGORICAL_ARGS = tuple(f for f in STEP_FIELDS if f not in ARRAY_ARGS + PASSTHROUGH_ARGS)
FIT_PARAMS = {"seq_len": 1 << 20, "batch_size": 1 << 14, "lora_rank": 1 << 14}  # searchable -> default upper bound


def check_margin(margin) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1), e.g. 0.10 for a 10 % safety margin; got {margin!r}.")
    return float(margin)


GIVEN_CAPACITY = "the capacity given for this device (on a GPU: mem_get_info's total)"


def device_of(gpu) -> dict:
    """The device a plan must fit: a catalog GPU name (:func:`lora_kit.plan.gpus.get_gpu`), or a dict
    ``{"name", "capacity_bytes"}`` for any other device (on CUDA, ``torch.cuda.mem_get_info()``'s total: CUDA's
    own capacity). ``"cuda": False`` in the dict marks a device with no CUDA context and no caching allocator
    (the CPU device a smoke run emulates with ``memory_limit_bytes``): its "device total" is the peak allocated
    bytes. Returns ``name``, ``cuda_capacity_bytes`` (what fits is judged on) with ``capacity_basis``,
    ``capacity_bytes`` (for display: the catalog's, nvidia-smi's total where a reading is named) and ``total``
    (the estimate field that is this device's total)."""
    if isinstance(gpu, dict):
        cap = gpu.get("capacity_bytes")
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap <= 0:
            raise ValueError(f"a device needs capacity_bytes, a positive number of bytes; got {cap!r}.")
        return {"name": str(gpu.get("name", "device")), "capacity_bytes": int(cap), "cuda_capacity_bytes": int(cap),
                "capacity_basis": GIVEN_CAPACITY,
                "total": "device_total_bytes" if gpu.get("cuda", True) else "peak_allocated_bytes"}
    g = get_gpu(gpu)
    return {"name": g["name"], "capacity_bytes": int(g["capacity_bytes"]),
            "cuda_capacity_bytes": int(g["cuda_capacity_bytes"]), "capacity_basis": g["cuda_capacity_basis"],
            "total": "device_total_bytes"}


def fit_verdict(device_total_bytes, gpu, margin: float = 0.10) -> dict:
    """Does ``device_total_bytes`` (int or array) fit ``gpu`` (see :func:`device_of`) with ``margin``?
    Judged on the CUDA-visible capacity (``cuda_capacity_bytes``, with ``capacity_basis``); headroom in bytes
    and % of it; ``capacity_bytes`` is the catalog's, for display. The kit's one fit rule."""
    g = device_of(gpu)
    cap = g["cuda_capacity_bytes"]
    usable = cap * (1 - check_margin(margin))
    head = usable - np.asarray(device_total_bytes)
    fits = head >= 0
    if head.ndim == 0:  # a scalar in, plain Python numbers out
        head, fits = float(head), bool(fits)
    return {"gpu": g["name"], "capacity_bytes": g["capacity_bytes"], "cuda_capacity_bytes": cap,
            "capacity_basis": g["capacity_basis"], "usable_bytes": usable, "fits": fits,
            "headroom_bytes": head, "headroom_pct": 100 * head / cap}


def _values(name: str, v) -> list:
    """A grid axis: scalars become one value; lists are axes (for lora_targets a list of names is ONE value)."""
    if name == "lora_targets":
        if isinstance(v, (list, tuple)) and v and all(isinstance(t, str) for t in v) and "all-linear" not in v:
            return [tuple(v)]
        return [tuple(t) if isinstance(t, list) else t for t in v] if isinstance(v, (list, tuple)) else [v]
    if isinstance(v, (list, tuple, np.ndarray, pd.Series, range)):
        vals = list(v)
        if not vals:
            raise ValueError(f"sweep: {name} is an empty list; give at least one value.")
        return vals
    return [v]


def sweep(model, gpu=None, margin: float = 0.10, step: Step | None = None, **grid) -> pd.DataFrame:
    """DataFrame over the cartesian grid of step fields (each a value or a list) and ``gpu``, on ``step``
    (default ``PLANNING``) for the fields not given.

    Per row: the settings, the breakdown (bytes), ``peak_allocated_bytes``, ``device_total_bytes``
    (per GPU), ``peak_gib`` / ``device_total_gib`` and, when ``gpu`` is given (a name or a list),
    ``capacity_gib`` (the catalog's, shown), ``cuda_capacity_gib`` (judged on), ``usable_gib``, ``fits``,
    ``headroom_gib``, ``headroom_pct`` (of the CUDA capacity). ``model`` may
    be a list too. Example: ``sweep("llama-3.1-8b", method=["lora", "qlora"], seq_len=[512, 1024,
    2048], batch_size=[1, 2, 4, 8], gpu=["L4", "A100-80GB"])``. Rows with ``method="full"`` ignore the
    LoRA fields of a grid that also has LoRA rows.
    """
    base = as_step(step)
    check_names(grid, STEP_FIELDS, "sweep argument")
    check_margin(margin)
    axes = {k: _values(k, grid.get(k, getattr(base, k))) for k in (*CATEGORICAL_ARGS, *PASSTHROUGH_ARGS)}
    if set(axes["method"]) == {"full"}:  # LoRA settings with full fine-tuning only: refused as everywhere
        base.replace(method="full", **{k: (list(v[0]) if isinstance(v[0], tuple) else v[0])
                                       for k, v in ((k, _values(k, grid[k])) for k in LORA_FIELDS if k in grid)
                                       if len(v) == 1})
    num_axes = {k: _values(k, grid.get(k, getattr(base, k))) for k in ARRAY_ARGS}
    mesh = [m.ravel() for m in np.meshgrid(*(np.asarray(v) for v in num_axes.values()), indexing="ij")]
    n = mesh[0].size
    groups, results = [], []  # one estimate_arrays call per (model, categorical combination)
    for mdl in _values("model", model):
        spec = model_spec(mdl)
        for combo in itertools.product(*axes.values()):
            cats = dict(zip(axes, combo))
            full = cats["method"] == "full"
            fixed = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cats.items()
                     if not (full and k in LORA_FIELDS)}
            arrays = {k: m for k, m in zip(ARRAY_ARGS, mesh) if not (full and k in LORA_FIELDS)}
            st = base.for_method(cats["method"]).replace(**{k: v for k, v in fixed.items() if k != "method"},
                                                         **{k: int(a[0]) for k, a in arrays.items()})
            results.append(estimate_arrays(spec, st, **arrays))
            groups.append({"model": mdl if isinstance(mdl, str) else spec.name, **cats})
    gpus = [fit_verdict(0, g, margin) for g in _values("gpu", gpu)] if gpu is not None else [None]
    reps = len(gpus)  # rows: gpu-major, then group, then the numeric mesh
    group_idx = np.tile(np.repeat(np.arange(len(groups), dtype=np.int32), n), reps)
    cols: dict = {"model": _codes_column([g["model"] for g in groups], group_idx)}
    if gpu is not None:
        cols["gpu"] = _codes_column([v["gpu"] for v in gpus], np.repeat(np.arange(reps, dtype=np.int32), n * len(groups)))
    for k in axes:
        cols[k] = _codes_column([g[k] for g in groups], group_idx)
    for k, arr in zip(ARRAY_ARGS, mesh):
        cols[k] = np.tile(arr, len(groups) * reps)
    for k in results[0]:
        block = np.concatenate([np.broadcast_to(np.asarray(r[k]), (n,)) for r in results])
        cols[k] = pd.Categorical(np.tile(block, reps)) if k == "phase" else np.tile(block, reps)
    total = np.asarray(cols["device_total_bytes"], dtype=np.float64)  # byte columns: int64, or Python ints (exact)
    cols["peak_gib"] = np.asarray(cols["peak_allocated_bytes"], dtype=np.float64) / GIB
    cols["device_total_gib"] = total / GIB
    if gpu is not None:
        per = len(groups) * n
        shown = np.repeat([v["capacity_bytes"] for v in gpus], per).astype(np.float64)
        cap = np.repeat([v["cuda_capacity_bytes"] for v in gpus], per).astype(np.float64)
        usable = np.repeat([v["usable_bytes"] for v in gpus], per)
        head = usable - total
        cols.update(capacity_gib=shown / GIB, cuda_capacity_gib=cap / GIB, usable_gib=usable / GIB, fits=head >= 0,
                    headroom_gib=head / GIB, headroom_pct=100 * head / cap)
    return pd.DataFrame(cols, copy=False)


def _codes_column(values: list, idx: np.ndarray):
    """Column whose row i holds ``values[idx[i]]``: categorical for text / target lists, numpy otherwise."""
    if all(isinstance(v, (bool, np.bool_)) for v in values) or all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return np.asarray(values)[idx]
    cats = list(dict.fromkeys(values))
    codes = np.asarray([cats.index(v) for v in values], dtype=np.int32)[idx]
    return pd.Categorical.from_codes(codes, categories=pd.Index(cats, dtype=object, tupleize_cols=False))


def _device_totals(model, param: str, values: np.ndarray, step: Step,
                   total: str = "device_total_bytes") -> np.ndarray:
    return np.asarray(estimate_arrays(model_spec(model), step, **{param: values.astype(np.int64)})[total])


def _device_total(model, step: Step, total: str = "device_total_bytes") -> int:
    """``estimate(model, step).<total>`` through the vectorized core (same number, less overhead)."""
    return int(_device_totals(model, "seq_len", np.asarray([step.seq_len]), step, total)[0])


def max_fit(param: str, model, gpu, margin: float = 0.10, low: int = 1, high: int | None = None,
            multiple_of: int = 1, verify: bool = True, step: Step | None = None, **overrides) -> int:
    """The largest ``param`` ("seq_len", "batch_size" or "lora_rank") that fits ``gpu``; 0 if ``low`` does not.

    The other settings are ``step`` (default ``PLANNING``) with ``overrides``. Memory grows monotonically with
    each searchable parameter, so the answer is exact: ``value`` fits and ``value + multiple_of`` does not
    (checked with ``estimate`` when ``verify``), unless ``high`` itself fits (default: a generous cap; for
    ``seq_len``, the model's context length when its config states one).
    """
    if param not in FIT_PARAMS:
        raise ValueError(f"max_fit: param must be one of {list(FIT_PARAMS)}, got {param!r}.")
    st = as_step(step, **overrides)
    if param == "lora_rank" and st.method == "full":
        raise ValueError("max_fit('lora_rank') needs method='lora' or 'qlora'.")
    if multiple_of < 1 or low < 1:
        raise ValueError("max_fit: low and multiple_of must be >= 1.")
    usable, total = fit_verdict(0, gpu, margin)["usable_bytes"], device_of(gpu)["total"]
    if high is None:
        high = FIT_PARAMS[param]
        if param == "lora_rank":  # estimate refuses a rank above the smallest adapted layer width
            high = min(min(lin.in_features, lin.out_features) for lin in model_spec(model).linears)
        context = model_spec(model).config.get("max_position_embeddings") if param == "seq_len" else None
        if isinstance(context, int) and context > 0:  # the model reads no longer rows
            high = min(high, context)
    lo_k, hi_k = -(-low // multiple_of), high // multiple_of

    def fits(ks: np.ndarray) -> np.ndarray:
        return _device_totals(model, param, ks * multiple_of, st, total) <= usable

    if lo_k > hi_k or not fits(np.array([lo_k]))[0]:
        return 0
    powers = lo_k * 2 ** np.arange(0, int(math.log2(max(hi_k / lo_k, 1))) + 2)
    cand = np.unique(np.minimum(powers, hi_k))
    ok = fits(cand)
    if ok.all():
        return int(cand[-1] * multiple_of)
    first_bad = int(np.argmax(~ok))
    lo, hi = int(cand[first_bad - 1]), int(cand[first_bad])  # lo fits, hi does not (monotone memory)
    while hi - lo > 1:
        pts = np.unique(np.linspace(lo, hi, num=min(hi - lo + 1, 1025)).astype(np.int64))
        ok = fits(pts)
        bad = pts[~ok]
        hi = int(bad.min())
        lo = int(pts[ok & (pts < hi)].max())
    value = lo * multiple_of
    if not verify:
        return int(value)
    # the boundary, checked with the scalar estimator (the one users call)
    while value > 0 and getattr(estimate(model, st, **{param: value}), total) > usable:
        value -= multiple_of
    while value + multiple_of <= high and \
            getattr(estimate(model, st, **{param: value + multiple_of}), total) <= usable:
        value += multiple_of
    return int(value)


WHY = {
    "batch_size": "same effective batch through grad_accum: no quality change, a little slower",
    "gradient_checkpointing": "no quality change, ~30 % more compute",
    "optimizer": "8-bit optimizer states: results usually unchanged",
    "method": "LoRA instead of full fine-tuning / QLoRA (4-bit base) instead of LoRA: QLoRA is slower per step",
    "lora_rank": "less adapter capacity",
    "seq_len": "longer examples are truncated",
    "gpu": "costs more per hour",
}


def fixes(gpu, margin: float = 0.10, model=None, first_only: bool = False, step: Step | None = None,
          **overrides) -> list[dict]:
    """Changes that make a plan fit ``gpu`` (a catalog name or a device, see :func:`device_of`),
    cheapest first; [] when it already fits. The kit's one ranked fix ladder.

    Cheapest means the least loss of result quality, then of speed, then of money:

    1. one change that costs no quality: a smaller micro-batch (same effective batch through
       ``grad_accum``), gradient checkpointing, an 8-bit optimizer, LoRA instead of full / QLoRA
       instead of LoRA -- in that order;
    2. the same changes combined, in that order (the "out of memory? try this" ladder), each step
       with the largest micro-batch that then fits;
    3. changes that cost quality: a lower LoRA rank, a shorter ``seq_len`` (alone, then on top of
       the whole ladder);
    4. the smallest bigger GPU in the catalog that fits the plan unchanged (CUDA devices only).

    The plan is ``step`` (default ``PLANNING``) with ``overrides``. Each dict: ``change`` (text), ``settings`` (the changed
    arguments), ``device_total_bytes`` (the device's total: the peak on a non-CUDA device), ``why``.
    """
    kw = as_step(step, **overrides)
    dev = device_of(gpu)
    usable, key = fit_verdict(0, gpu, margin)["usable_bytes"], dev["total"]
    total = _device_total(model, kw, key)
    if total <= usable:
        return []
    out: list[dict] = []

    def done() -> bool:
        return first_only and bool(out)

    def describe(ch: dict) -> str:
        parts = []
        for k, v in ch.items():
            if k == "batch_size":
                parts.append(f"micro-batch {kw.batch_size} -> {v} (x grad_accum {math.ceil(kw.batch_size / v)})")
            elif k == "gradient_checkpointing":
                parts.append("gradient checkpointing on")
            else:
                parts.append(f"{k} {getattr(kw, k)} -> {v}")
        return " + ".join(parts)

    def fits(ch: dict) -> bool:
        return _device_total(model, kw.replace(**ch), key) <= usable

    def attempt(ch: dict, shrink: str | None = None) -> None:
        """Add ``ch`` if it fits; else, with ``shrink``, the largest smaller value of that setting that fits.
        A combination is pruned: a step that is not needed for the fit is dropped."""
        if done():
            return
        trial = kw.replace(**ch)
        if not fits(ch):
            if not shrink or getattr(trial, shrink) <= 1:
                return
            v = max_fit(shrink, model=model, gpu=gpu, margin=margin, high=int(getattr(trial, shrink)) - 1,
                        verify=False, step=trial)
            if not v:
                return
            ch = {**ch, shrink: v}
        for k in [k for k in ch if k != shrink and len(ch) > 1]:
            rest = {j: x for j, x in ch.items() if j != k}
            if fits(rest):
                ch = rest
        out.append({"change": describe(ch), "settings": ch, "device_total_bytes": _device_total(model, kw.replace(**ch), key),
                    "why": "; ".join(WHY[k] for k in ch)})

    free = []  # quality-free steps in ladder order
    if not kw.gradient_checkpointing:
        free.append({"gradient_checkpointing": True})
    if kw.optimizer in ("adamw", "paged_adamw_32bit", "adafactor"):
        free.append({"optimizer": "paged_adamw_8bit"})
    free += [{"method": m} for m in {"full": ("lora", "qlora"), "lora": ("qlora",)}.get(kw.method, ())]
    attempt({}, shrink="batch_size")
    for step in free:
        attempt(step)
    ladder: dict = {}
    for step in free:
        ladder = {**ladder, **step}
        if len(ladder) > 1:
            attempt(dict(ladder), shrink="batch_size")
    if kw.method != "full":
        attempt({}, shrink="lora_rank")
    attempt({}, shrink="seq_len")
    if ladder:
        attempt(dict(ladder), shrink="seq_len")
    if not done() and key == "device_total_bytes":
        table = gpu_table().sort_values("cuda_capacity_bytes")
        ok = table[table["cuda_capacity_bytes"] * (1 - margin) >= total]
        if len(ok):
            g = ok.iloc[0]
            out.append({"change": f"GPU {dev['name']} -> {g['name']} ({g['cuda_capacity_bytes'] / GIB:.0f} GiB "
                                  "CUDA-visible)",
                        "settings": {"gpu": g["name"]}, "device_total_bytes": int(total), "why": WHY["gpu"]})
    return out[:1] if first_only else out


def model_note(model, step=None) -> str:
    """What an estimate on ``model`` assumes beyond its step (a Step, or ``estimate``'s ``settings``): every
    expert resident and what LoRA reaches on a mixture-of-experts, the attention kernel counted for multi-head
    latent attention; a ``seq_len`` beyond the model's context; empty for other models and steps."""
    spec, st = model_spec(model), as_step(step)
    return " ".join(n for n in (moe_note(spec, st.method, st.lora_targets), mla_note(spec, st),
                                context_note(spec, st.seq_len)) if n)


def context_note(spec, seq_len: int) -> str:
    """One sentence, or "": ``seq_len`` is longer than the model's context (its config's
    ``max_position_embeddings``)."""
    ctx = spec.config.get("max_position_embeddings") if isinstance(spec.config, dict) else None
    if not isinstance(ctx, int) or seq_len <= ctx:
        return ""
    return (f"seq_len {seq_len:,} is longer than this model's context ({ctx:,} positions, max_position_embeddings): "
            "the memory is planned as asked, but the model never saw positions that far, and a tokenizer whose "
            "model_max_length is the context cuts rows there; plan at most its context unless you extend it.")


def plan_note(model, step, gpu=None, peak_bytes: int | None = None) -> str:
    """:func:`model_note`, and on a catalog ``gpu`` (a name) when CUDA would run this step's attention in the math
    kernel, what that adds to ``peak_bytes`` and the fix (``lora_kit.memory.cuda_kernels.cuda_attention_note``)."""
    note = model_note(model, step)
    if isinstance(gpu, str):
        from lora_kit.memory.cuda_kernels import cuda_attention_note
        attn = cuda_attention_note(model, step, compute_capability=compute_capability(gpu, unknown=8.0),
                                   peak_bytes=peak_bytes)
        note = " ".join(n for n in (note, attn) if n)
    return note


def expandable_fit(model, step: Step, est, gpu: str, margin: float) -> dict:
    """The device total of ``est`` (``estimate(model, step)``) with ``expandable_segments:True``, the setting the
    kit's own GPU path runs with, and its fit verdict on ``gpu``: ``{"device_total_bytes", "fits",
    "headroom_bytes"}`` ({} for a device without CUDA). *Fits* counts PyTorch's default setting (a user's own
    trainer may run it); this says when the plan fits only with expandable segments."""
    from lora_kit.memory.device import device_kwargs, device_total
    if device_of(gpu)["total"] != "device_total_bytes":  # a device without CUDA's caching allocator
        return {}
    total = int(device_total(est.peak_allocated_bytes, allocator="expandable",
                             **device_kwargs(model_spec(model), step)))
    return _total_fit(total, gpu, margin)


def _total_fit(total: int, gpu: str, margin: float) -> dict:
    """``{"device_total_bytes", "fits", "headroom_bytes"}`` of a device total on ``gpu`` (:func:`fit_verdict`)."""
    v = fit_verdict(total, gpu, margin)
    return {"device_total_bytes": total, "fits": bool(v["fits"]), "headroom_bytes": float(v["headroom_bytes"])}


def math_kernel_fit(model, step: Step, est, gpu: str, margin: float) -> dict:
    """When CUDA would run this step's attention in the math kernel on ``gpu``
    (:func:`lora_kit.memory.cuda_kernels.math_kernel_bound`, the installed torch's dispatch rules): the device total
    with at most what it adds, and that total's fit verdict: ``{"extra_bytes", "device_total_bytes", "fits",
    "headroom_bytes"}`` ({} otherwise). *Fits* counts the fused kernel, which the note's fix gives; this says
    whether the step as configured fits too."""
    from lora_kit.memory.cuda_kernels import math_kernel_bound
    from lora_kit.memory.device import device_kwargs, device_total
    if not isinstance(gpu, str) or device_of(gpu)["total"] != "device_total_bytes":
        return {}
    extra = math_kernel_bound(model, step, compute_capability=compute_capability(gpu, unknown=8.0))
    if not extra:
        return {}
    total = int(device_total(est.peak_allocated_bytes + extra, **device_kwargs(model_spec(model), step)))
    return {"extra_bytes": int(extra), **_total_fit(total, gpu, margin)}


def math_kernel_sentence(fit: dict, math: dict) -> str:
    """One sentence, or "": what the verdict becomes with the math kernel CUDA would run (:func:`math_kernel_fit`)."""
    if not math:
        return ""
    head = (f"As configured, CUDA runs this attention in the math kernel (see the note): up to "
            f"{math['device_total_bytes'] / GIB:.2f} GiB, which ")
    room = f"(headroom {math['headroom_bytes'] / GIB:+.2f} GiB)"
    if not math["fits"]:
        return head + f"does NOT fit {room}" + ("; the verdict above holds with the note's fix." if fit["fits"]
                                                else ".")
    return head + f"still fits {room}, slower."


def expandable_sentence(plan: dict) -> str:
    """One sentence, or "": a plan that does not fit under the default allocator setting but fits with expandable
    segments (``plan["expandable"]`` of :func:`check_plan`)."""
    ex = plan.get("expandable") or {}
    if plan["fits"] or not ex.get("fits"):
        return ""
    return (f"With expandable_segments:True, which lora-kit's GPU path sets, it needs "
            f"{ex['device_total_bytes'] / GIB:.2f} GiB and fits (headroom {ex['headroom_bytes'] / GIB:.2f} GiB): "
            "set it in your own trainer too (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).")


def check_plan(model, gpu: str, margin: float = 0.10, step: Step | None = None, **overrides) -> dict:
    """One plan: its estimate, the fit verdict on ``gpu`` (PyTorch's default allocator setting; ``expandable``:
    the same with expandable segments) and, when it does not fit, the cheapest fix. ``gpu_problems``: what the card
    cannot run of this step, each with its fix (:func:`lora_kit.plan.gpus.gpu_problems`; ``runs_on_gpu`` when there
    is none): "fits" is memory only."""
    st = as_step(step, **overrides)
    est = estimate(model, st)
    v = fit_verdict(est.device_total_bytes, gpu, margin)
    fits = bool(v["fits"])
    fix = None if fits else next(iter(fixes(gpu, margin, model=model, first_only=True, step=st)), None)
    note = plan_note(model, st, gpu, est.peak_allocated_bytes)
    problems = gpu_problems(gpu, st) if isinstance(gpu, str) else []
    return {**v, "fits": fits, "headroom_bytes": float(v["headroom_bytes"]),
            "headroom_pct": float(v["headroom_pct"]), "margin": margin, "estimate": est, "fix": fix, "note": note,
            "expandable": expandable_fit(model, st, est, gpu, margin), "gpu_problems": problems,
            "runs_on_gpu": not problems}


def _capacity_label(v: dict) -> str:
    """How a verdict's capacity was read, in a few words."""
    basis = v.get("capacity_basis", "")
    if basis.startswith("fallback"):
        return "from the vendor's GB (no CUDA reading in the catalog)"
    return "CUDA-visible" if basis != GIVEN_CAPACITY else "of the device"


def cannot_run_sentence(gpu: str, problems: list[str]) -> str:
    """One sentence, or "": the card cannot run the step as planned (:func:`lora_kit.plan.gpus.gpu_problems`)."""
    return f"{gpu} cannot run this step as planned: {'; '.join(problems)}." if problems else ""


def verdict_text(plan: dict) -> str:
    """Plain-language verdict of :func:`check_plan`: fits or not, headroom in GiB and %, the fix; what the card cannot
    run of the step."""
    est = plan["estimate"]
    head = f"{abs(plan['headroom_bytes']) / GIB:.2f} GiB ({abs(plan['headroom_pct']):.1f} % of the GPU)"
    need = (f"needs {est.device_total_bytes / GIB:.2f} GiB per GPU of {plan['usable_bytes'] / GIB:.2f} GiB "
            f"usable ({plan['cuda_capacity_bytes'] / GIB:.1f} GiB {_capacity_label(plan)} minus the "
            f"{plan['margin']:.0%} margin)")
    note = f" {plan['note']}" if plan.get("note") else ""
    runs = cannot_run_sentence(plan["gpu"], plan.get("gpu_problems") or [])
    note = f" {runs}{note}" if runs else note
    if plan["fits"]:
        return f"Fits on {plan['gpu']}: {need}; headroom {head}.{note}"
    fix = plan["fix"]
    tail = (f" Cheapest change that fits: {fix['change']} ({fix['device_total_bytes'] / GIB:.2f} GiB) - {fix['why']}."
            if fix else " No single change fits: combine changes, shard across GPUs, or pick a bigger GPU.")
    ex = expandable_sentence(plan)
    return f"Does NOT fit on {plan['gpu']}: {need}; short by {head}.{' ' + ex if ex else ''}{tail}{note}"


def epoch_from_data(data: dict, packed: bool = False) -> dict:
    """One epoch of the user's dataset from the smoke run's data statistics (``smoke.json``'s ``data``: the rows
    that train after the long-example policy, their mean length): ``{"examples", "tokens", "packed", "note"}``
    for :func:`compare_methods`' ``epoch``. ``packed``: rows packed into ``seq_len`` (steps follow tokens), else
    each row padded (steps follow rows)."""
    if not isinstance(data, dict) or not data.get("usable") or not data.get("mean_length"):
        raise ValueError("epoch_from_data needs the smoke run's data statistics (smoke.json 'data' with 'usable' and "
                         f"'mean_length'); got {data!r:.120}. Run the smoke run on your dataset, or pass "
                         "epoch={'examples': N} (or {'tokens': N, 'packed': True}) yourself.")
    seq_len = int(data.get("seq_len") or 0)
    mean = min(float(data["mean_length"]), seq_len) if seq_len else float(data["mean_length"])
    n = int(data["usable"])
    return {"examples": n, "tokens": int(round(n * mean)), "packed": bool(packed),
            "note": f"your dataset: {n:,} rows of {mean:,.0f} tokens on average (the smoke run's data statistics), "
                    + ("packed into rows of seq_len" if packed else "each padded to seq_len")}


def _epoch(epoch, num_examples, dataset_tokens, seq_len) -> dict:
    """What one epoch is: the user's ``epoch`` (see :func:`epoch_from_data`; ``source`` "yours"), else
    ``dataset_tokens`` packed, else ``num_examples`` padded (a placeholder until the dataset is known: no
    ``source``)."""
    if epoch is not None:
        if not isinstance(epoch, dict) or not (epoch.get("examples") or epoch.get("tokens")):
            raise ValueError(f"epoch must be a dict with 'examples' (padded rows) or 'tokens' (with 'packed': True), "
                             f"e.g. epoch_from_data(smoke['data']); got {epoch!r:.120}.")
        for k in ("examples", "tokens"):
            v = epoch.get(k)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"epoch[{k!r}] must be a positive number, got {v!r}.")
        packed = bool(epoch.get("packed")) or not epoch.get("examples")
        if packed and not epoch.get("tokens"):
            raise ValueError("a packed epoch needs epoch['tokens'] (the dataset's tokens).")
        ex = int(epoch["examples"]) if epoch.get("examples") else None
        return {"examples": ex, "tokens": int(epoch.get("tokens") or ex * int(seq_len)), "packed": packed,
                "source": "yours", "note": epoch.get("note") or ("your tokens packed into rows of seq_len" if packed
                                                                 else "your rows, each padded to seq_len")}
    if num_examples is None or num_examples <= 0:
        raise ValueError(f"num_examples must be a positive integer, got {num_examples!r}.")
    if dataset_tokens is not None:
        if dataset_tokens <= 0:
            raise ValueError(f"dataset_tokens must be positive, got {dataset_tokens!r}.")
        return {"examples": None, "tokens": int(dataset_tokens), "note": "dataset_tokens packed into rows of seq_len"}
    return placeholder_epoch(num_examples, seq_len)


def placeholder_epoch(num_examples: int, seq_len: int) -> dict:
    """The epoch a plan assumes before the smoke run has read the user's data: ``num_examples`` padded to
    ``seq_len``, labelled as such (no ``source``: the run card recomputes it from the data)."""
    return {"examples": int(num_examples), "tokens": int(num_examples) * int(seq_len),
            "note": f"a placeholder, not your data: {int(num_examples):,} examples (num_examples) of seq_len tokens "
                    "each; the run card recomputes the epoch from your dataset once the smoke run has read it"}


def steps_per_epoch(epoch: dict, batch_size: int, seq_len: int, num_gpus: int, grad_accum: int) -> int:
    """Optimizer steps in one epoch (:func:`_epoch`'s dict): packed tokens fill rows of ``seq_len``; padded
    examples are one row each; a step takes ``batch_size * num_gpus * grad_accum`` rows."""
    rows_step = int(batch_size) * int(num_gpus) * int(grad_accum)
    if epoch.get("packed", not epoch.get("examples")):
        return math.ceil(int(epoch["tokens"]) / (rows_step * int(seq_len)))
    return math.ceil(int(epoch["examples"]) / rows_step)


def compare_methods(model, gpus=None, batch_size="max", num_examples: int = 10_000, epochs: float = 1.0,
                    dataset_tokens: int | None = None, prices: dict | None = None, margin: float = 0.10,
                    methods=METHODS, time_model=None, max_batch: int = 64, step: Step | None = None,
                    epoch: dict | None = None, **overrides) -> pd.DataFrame:
    """Method x GPU table: fits, memory, step time, tokens/s, time and cost per epoch with their interval;
    recommendation.

    The plan is ``step`` (default ``PLANNING``) with ``overrides``, for each of ``methods`` (LoRA fields back
    to their defaults for "full"). ``batch_size="max"`` uses, per row, the largest micro-batch that fits (up
    to ``max_batch``): the guide's "spend the remaining memory on batch"; an int uses that micro-batch
    everywhere. An epoch is the user's dataset: ``epoch`` (:func:`epoch_from_data` of the smoke run's data
    statistics, or ``{"examples": N}`` / ``{"tokens": N, "packed": True}``), else ``dataset_tokens`` packed into
    rows of ``seq_len``, else ``num_examples`` padded to ``seq_len`` (a placeholder; ``df.attrs["epoch"]`` says
    which). A step is ``grad_accum`` micro-steps of ``batch_size`` rows on each of ``num_gpus`` GPUs.
    Where CUDA would run a row's attention in the math kernel (the installed torch's dispatch rules:
    :func:`math_kernel_fit`), ``fits`` and the micro-batch count the fused kernel the plan's note offers as the
    fix, as ``estimate``'s verdict does; ``math_kernel_gib`` is what the math kernel adds at most, and
    ``fits_as_configured`` whether the row fits without the fix (its step time is the math kernel's, as
    ``attention_kernel`` names it). The recommendation says so for the rows it names.
    ``fits`` is memory only; ``runs_on_gpu`` says whether the card can run the step at all and ``gpu_problem`` why
    not, with the fix (:func:`lora_kit.plan.gpus.gpu_problems`: bf16 or FlashAttention-2 on a pre-Ampere card such as
    the T4): such a row keeps its memory but has no time or cost, and is never recommended.
    ``prices`` maps GPU -> your price per GPU-hour; missing GPUs use the catalog's *example* price and
    ``price_source`` says so. Time uses :mod:`lora_kit.plan.timing` (``time_model``: a calibrated one from a
    smoke run, else the fitted model); ``*_low`` / ``*_high`` columns are the interval from the model's measured
    error (``df.attrs["time_error_factor"]``). The plain-language recommendation is in ``df.attrs["recommendation"]``
    (and :func:`recommend`); it says when the cheapest options' costs are within that error.
    """
    check_margin(margin)
    gpus = list(gpus or default_of("gpus"))
    base = as_step(step, **overrides)
    ep = _epoch(epoch, num_examples, dataset_tokens, base.seq_len)
    if batch_size != "max":
        base = base.replace(batch_size=batch_size)
    steps_by_method = {m: base.for_method(m) for m in methods}  # each method's step, validated
    price = resolve_prices(gpus, prices)
    user_priced = {get_gpu(k)["name"] for k in (prices or {})}
    num_gpus = base.num_gpus
    tm = time_model or TimeModel()
    rows = []
    for method in methods:
        for g in gpus:
            gname = get_gpu(g)["name"]
            st = steps_by_method[method]
            b = max_fit("batch_size", model=model, gpu=gname, margin=margin, high=max_batch, step=st) \
                if batch_size == "max" else st.batch_size
            st = st.replace(batch_size=max(b, 1))
            e = estimate(model, st)
            v = fit_verdict(e.device_total_bytes, gname, margin)
            row = {"method": method, "gpu": gname, "fits": bool(v["fits"]) and b > 0, "batch_size": st.batch_size,
                   "peak_gib": e.peak_allocated_bytes / GIB, "device_total_gib": e.device_total_bytes / GIB,
                   "capacity_gib": v["capacity_bytes"] / GIB, "cuda_capacity_gib": v["cuda_capacity_bytes"] / GIB,
                   "headroom_gib": float(v["headroom_bytes"]) / GIB}
            t = step_time(model, get_gpu(gname), st, time_model=tm)
            math_fit = math_kernel_fit(model, st, e, gname, margin)  # {} unless CUDA runs the math kernel
            row.update(attention_kernel=t["attention_kernel"], math_kernel_gib=math_fit.get("extra_bytes", 0) / GIB,
                       fits_as_configured=row["fits"] and math_fit.get("fits", True))
            problems = gpu_problems(gname, st)  # what this card cannot run of the step (bf16, flash-attn 2)
            row.update(runs_on_gpu=not problems, gpu_problem="; ".join(problems))
            row.update(step_seconds=t["step_seconds"], tokens_per_second=t["tokens_per_second"],
                       price_per_hour=price[gname], price_source="yours" if gname in user_priced else "example")
            row.update(epoch_columns(row, ep, epochs, st.seq_len, num_gpus, st.grad_accum, tm.error_factor))
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs["time_error_factor"] = tm.error_factor
    df.attrs["recommendation"] = recommend(df)
    df.attrs["time_model"] = tm.describe()
    df.attrs["epoch"] = ep
    df.attrs["epochs"] = epochs
    return df


def epoch_columns(row: dict, ep: dict, epochs: float, seq_len: int, num_gpus: int, grad_accum: int,
                   factor: float) -> dict:
    """A row's steps, time and cost per epoch (and for ``epochs``) from its step time and price, with the interval
    from the time model's measured error ``factor``; NaN where the row does not fit or its GPU cannot run the step."""
    steps = steps_per_epoch(ep, row["batch_size"], seq_len, num_gpus, grad_accum)
    if not row["fits"] or not runs_on_gpu(row):
        return {"steps_per_epoch": steps, **{k: float("nan") for k in TIME_COLUMNS}}
    hours = steps * epochs * row["step_seconds"] / 3600
    p = row["price_per_hour"] if row.get("price_per_hour") is not None else float("nan")  # plan.json: null
    cost = (hours / epochs) * p * num_gpus if p == p else float("nan")
    return dict(steps_per_epoch=steps, epoch_hours=hours / epochs, total_hours=hours,
                epoch_hours_low=hours / epochs / factor, epoch_hours_high=hours / epochs * factor,
                epoch_cost=cost, epoch_cost_low=cost / factor, epoch_cost_high=cost * factor,
                total_cost=hours * p * num_gpus if p == p else float("nan"))


def reprice(rows, epoch: dict, step: Step, epochs: float = 1.0, error_factor: float | None = None) -> pd.DataFrame:
    """A :func:`compare_methods` table (or plan.json's ``rows``) of ``step`` (its ``seq_len``, ``num_gpus`` and
    ``grad_accum``) with its time and cost per epoch recomputed for another ``epoch`` (the user's dataset once the
    smoke run has read it: :func:`epoch_from_data`), and its recommendation made again from them. Step times,
    prices, micro-batches and fits are the table's."""
    st = as_step(step)
    attrs = dict(getattr(rows, "attrs", {}))
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else [dict(r) for r in rows]
    ep = _epoch(epoch, None, None, st.seq_len)
    factor = float(error_factor or attrs.get("time_error_factor") or 1.0)
    df = pd.DataFrame([{**r, **epoch_columns(r, ep, epochs, st.seq_len, st.num_gpus, st.grad_accum, factor)}
                       for r in records])
    df.attrs.update(attrs, time_error_factor=factor, epoch=ep, epochs=epochs)
    df.attrs["recommendation"] = recommend(df)
    return df


TIME_COLUMNS = ("step_seconds", "tokens_per_second", "epoch_hours", "total_hours", "epoch_cost", "total_cost",
                "epoch_hours_low", "epoch_hours_high", "epoch_cost_low", "epoch_cost_high")


QLORA_VS_LORA = ("weights QLoRA saves (MiB)", "extra activations of QLoRA (MiB)", "QLoRA / LoRA peak")


def qlora_vs_lora(df: pd.DataFrame) -> pd.DataFrame:
    """Where QLoRA's 4-bit weights stop paying for its fp32 up-casts, from a :func:`sweep` over
    ``method=["lora", "qlora"]``: per (model, gradient_checkpointing, seq_len), the weight bytes QLoRA saves
    (constants included), the activation bytes it adds, and the ratio of the peaks (above 1: QLoRA needs more)."""
    keys = ["model", "gradient_checkpointing", "seq_len"]
    both = df[df["method"].isin(["lora", "qlora"])]
    if set(both["method"]) != {"lora", "qlora"}:
        raise ValueError("qlora_vs_lora needs a sweep with method=['lora', 'qlora'].")
    if both.duplicated(keys + ["method"]).any():
        raise ValueError("qlora_vs_lora: one row per model, gradient_checkpointing, seq_len and method; fix the "
                         "other settings (batch_size, lora_rank, ...) to one value in the sweep.")
    w = both.pivot_table(index=keys, columns="method",
                         values=["weights", "quant_constants", "activations", "peak_allocated_bytes"])
    return pd.DataFrame({
        QLORA_VS_LORA[0]: (w.weights.lora - w.weights.qlora - w.quant_constants.qlora) / 2 ** 20,
        QLORA_VS_LORA[1]: (w.activations.qlora - w.activations.lora) / 2 ** 20,
        QLORA_VS_LORA[2]: w.peak_allocated_bytes.qlora / w.peak_allocated_bytes.lora})


def _method_words(method) -> str:
    return "full fine-tuning" if method == "full" else method_label(method)


def money_text(x: float) -> str:
    """An amount of money readable at any size: "$1,234", "$12.34", "$0.034" (two significant digits below $1)."""
    return f"${x:,.0f}" if x >= 1000 else f"${x:,.2f}" if x >= 0.995 else f"${x:#.2g}"


def hours_text(h: float) -> str:
    """A duration given in hours, in the unit that keeps it readable: "3.25 h", "14 min", "40 s"."""
    return f"{h:,.2f} h" if h >= 0.995 else f"{h * 60:.0f} min" if h * 60 >= 0.995 else f"{h * 3600:.2g} s"


def _within_error(priced: pd.DataFrame, cheapest, factor) -> list[str]:
    """The options whose cost per epoch is within the time model's measured error of the cheapest one (a ranking
    the model cannot make: each prediction may be off by that factor)."""
    if not factor or factor <= 1:
        return []
    near = priced[(priced.index != cheapest.name) & (priced["epoch_cost"] <= cheapest["epoch_cost"] * factor)]
    if near.empty:
        return []
    names = ", ".join(f"{_method_words(r['method'])} on {r['gpu']} ({money_text(r['epoch_cost'])})"
                      for _, r in near.sort_values("epoch_cost").head(3).iterrows())
    return [f"Within the time model's accuracy (x{factor:.2f}, its measured error; a smoke run on the rented GPU "
            f"narrows it) {names} cost{'s' if len(near) == 1 else ''} the same as {_method_words(cheapest['method'])} "
            f"on {cheapest['gpu']}."]


def runs_on_gpu(row) -> bool:
    """A :func:`compare_methods` row (dict or Series) whose GPU can run its step; a table from before the column
    (an older plan.json) runs."""
    v = row.get("runs_on_gpu", True)
    return True if v is None or v != v else bool(v)


def needs_attention_fix(row) -> bool:
    """A :func:`compare_methods` row (dict or Series) that fits only with the attention fix: CUDA runs its attention
    in the math kernel as configured (``fits_as_configured``); a table from before the column (an older plan.json)
    does not say so."""
    v = row.get("fits_as_configured", True)
    return bool(row["fits"]) and not (True if v is None or v != v else bool(v))


def usable(df: pd.DataFrame) -> pd.Series:
    """The rows of a :func:`compare_methods` table that may be recommended: they fit, and their GPU runs the step."""
    runs = df["runs_on_gpu"].fillna(True).astype(bool) if "runs_on_gpu" in df else True
    return df["fits"].fillna(False).astype(bool) & runs


def cannot_run_rows(df: pd.DataFrame) -> list[str]:
    """A sentence per GPU of a :func:`compare_methods` table that fits a row but cannot run its step: left out."""
    if "runs_on_gpu" not in df:
        return []
    out: dict = {}
    for _, r in df[df["fits"].fillna(False).astype(bool) & ~usable(df)].iterrows():
        out.setdefault((r["gpu"], r["gpu_problem"]), []).append(_method_words(r["method"]))
    return [f"Not recommended (memory shown, no time or cost): {', '.join(ms)} on {g}, which cannot run this step "
            f"as planned: {p}." for (g, p), ms in out.items()]


def fastest_index(df: pd.DataFrame):
    """Row label of the fastest fitting row per epoch whose GPU runs its step; among rows the time model times the
    same (a host-bound step runs as fast on every GPU), the cheapest, then the first. None when no such row has a
    time."""
    ok = df[usable(df)]
    hours = pd.to_numeric(ok["epoch_hours"], errors="coerce")
    if not hours.notna().any():
        return None
    tied = ok[hours <= hours.min() * (1 + 1e-9)]
    cost = pd.to_numeric(tied["epoch_cost"], errors="coerce")
    return cost.idxmin() if cost.notna().any() else tied.index[0]


def recommend(df: pd.DataFrame) -> str:
    """Plain-language recommendation from a :func:`compare_methods` table: among the rows that fit and whose GPU
    runs the step (:func:`usable`); each GPU that cannot run it is named with the fix."""
    ok, blocked = df[usable(df)], cannot_run_rows(df)
    if ok.empty and blocked:
        return "Nothing that fits can run on its GPU as planned. " + " ".join(blocked)
    if ok.empty:
        worst = df.loc[df["headroom_gib"].idxmax()]
        return (f"Nothing fits: the closest is {_method_words(worst['method'])} on {worst['gpu']}, short by "
                f"{-worst['headroom_gib']:.1f} GiB. Shorten seq_len, enable checkpointing, or use sharding "
                "across GPUs (memory is per GPU; it pools only when states are sharded).")
    parts = []
    priced = ok[ok["epoch_cost"].notna()]
    example = (priced["price_source"] == "example").any() if len(priced) else False
    if len(priced):
        c = priced.loc[priced["epoch_cost"].idxmin()]
        parts.append(f"Cheapest per epoch: {_method_words(c['method'])} on {c['gpu']} ({money_text(c['epoch_cost'])}, "
                     f"{hours_text(c['epoch_hours'])}, micro-batch {c['batch_size']}).")
        parts += _within_error(priced, c, df.attrs.get("time_error_factor"))
    f = ok.loc[fastest_index(ok)]
    parts.append(f"Fastest: {_method_words(f['method'])} on {f['gpu']} ({hours_text(f['epoch_hours'])} per epoch"
                 + (f", {money_text(f['epoch_cost'])}" if f["epoch_cost"] == f["epoch_cost"] else "") + ").")
    for m in ("lora", "qlora"):
        if m in set(ok["method"]):
            rows = ok[ok["method"] == m]
            fixed = [r["gpu"] for _, r in rows.iterrows() if needs_attention_fix(r)]
            parts.append(f"{method_label(m)} fits on {', '.join(rows['gpu'])}"
                         + (f" (on {', '.join(fixed)} only with the attention fix in the plan's note)." if fixed
                            else "."))
    named = [c] if len(priced) else []
    parts += _math_kernel_warning(named + [f])
    parts += blocked
    if example:
        parts.append("Costs use the catalog's EXAMPLE prices: pass prices={gpu: your price per hour}.")
    return " ".join(parts)


def _math_kernel_warning(rows) -> list[str]:
    """A sentence per named row (cheapest, fastest) that fits only with the attention fix: CUDA runs its attention
    in the math kernel (``compare_methods``' ``fits_as_configured``)."""
    out, seen = [], set()
    for r in rows:
        key = (r["method"], r["gpu"])
        if key in seen or not needs_attention_fix(r):
            continue
        seen.add(key)
        out.append(f"{_method_words(r['method'])} on {r['gpu']} fits only with the attention fix in the plan's note: "
                   f"as configured, CUDA runs its attention in the math kernel (up to +{r['math_kernel_gib']:.1f} GiB "
                   f"at micro-batch {r['batch_size']}), which does not fit; its time counts the math kernel.")
    return out
