"""Out of memory: recognise it, record it, free memory, and say what change would fit.

``fit_suggestions`` is the planner's one ranked fix ladder (:func:`lora_kit.plan.planner.fixes`:
quality first -- a smaller micro-batch with more accumulation, gradient checkpointing, an 8-bit
optimizer, LoRA / QLoRA, then rank and seq_len, then a bigger GPU) on the device that ran out of
memory, with the planner's one fit rule (device total vs usable memory, ``fit_verdict``). On a
GPU the device is the CUDA device itself; on a CPU smoke run that emulates a smaller device
(``memory_limit_bytes``) it is that device, which has no CUDA context or caching allocator, so
its total is the estimated peak. The estimate is analytic, so the ladder is a plan to try, not a
promise: the smoke run then measures it.
"""
from __future__ import annotations

import gc

import torch

from lora_kit.plan.planner import device_of, fit_verdict, fixes
from lora_kit.settings import as_step


def is_oom(exc: BaseException) -> bool:
    """True for torch.OutOfMemoryError (CUDA or the tracker's CPU limit) and allocator OOM RuntimeErrors."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def memory_now(tracker=None) -> dict:
    """Bytes in use now: CUDA allocated/reserved on a GPU, the live-bytes tracker on CPU."""
    out = {}
    if torch.cuda.is_available():
        out.update(cuda_allocated_bytes=torch.cuda.memory_allocated(),
                   cuda_reserved_bytes=torch.cuda.memory_reserved(),
                   cuda_max_allocated_bytes=torch.cuda.max_memory_allocated())
    if tracker is not None:
        out.update(tracked_live_bytes=int(tracker.current_bytes), tracked_peak_bytes=int(tracker.peak_bytes))
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def oom_device(limit_bytes: int, cuda: bool, name: str | None = None) -> dict:
    """The device that ran out of memory, for :func:`lora_kit.plan.planner.fixes`; ``limit_bytes`` is its
    CUDA-visible capacity on a GPU (see :func:`fit_suggestions`)."""
    return {"name": name or (f"CUDA device ({limit_bytes / 2**30:.1f} GiB)" if cuda else
                             f"emulated device ({limit_bytes:,} bytes)"),
            "capacity_bytes": int(limit_bytes), "cuda": cuda}


def fit_suggestions(settings, limit_bytes: int | None, cuda: bool = False, name: str | None = None) -> dict:
    """The planner's fix ladder for ``settings`` (a Settings or a dict with ``model``, the step fields
    and optionally ``margin``) on a device of ``limit_bytes``: ``ranked`` is exactly
    ``planner.fixes(device, margin, model=..., step=...)``, cheapest in quality first. ``cuda``: the
    device is a CUDA GPU (its total includes the CUDA context, torch's reserved and the memory outside the
    allocator) rather than the device a CPU run emulates; then ``limit_bytes`` is CUDA's own total (``torch.cuda.mem_get_info()``'s,
    as the smoke run reads it, or a catalog GPU's ``cuda_capacity_bytes``), the capacity fits is judged on,
    never nvidia-smi's larger total. Without a known device size there is nothing to rank."""
    d = settings.to_dict() if hasattr(settings, "to_dict") else dict(settings)
    margin = d.get("margin", 0.10)
    step = as_step(d)
    if limit_bytes is None:
        return {"device": None, "limit_bytes": None, "margin": margin, "ranked": [],
                "note": "no device size known (CPU without memory_limit_bytes): nothing to rank against"}
    dev = oom_device(limit_bytes, cuda, name)
    from lora_kit.memory.estimate import estimate
    est = estimate(d["model"], step)
    total = getattr(est, device_of(dev)["total"])
    v = fit_verdict(total, dev, margin)
    return {"device": v["gpu"], "limit_bytes": int(limit_bytes), "margin": margin, "usable_bytes": v["usable_bytes"],
            "estimated_device_total_bytes": int(total), "estimate_fits": bool(v["fits"]),
            "ranked": fixes(dev, margin, model=d["model"], step=step)}
