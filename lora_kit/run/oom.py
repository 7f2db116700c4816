"""Out of memory: recognise it, record it, free memory, and say what change would fit.

``fit_suggestions`` asks ``lora_kit.memory.estimate`` for the peak of each single change a user can make
(gradient checkpointing, shorter seq_len, smaller micro-batch with more accumulation so the
effective batch stays, QLoRA, 8-bit / paged optimizer, fewer LoRA targets, lower rank) and ranks
them by estimated saving. If no single change fits, the changes are combined greedily, largest
saving first, until the estimate fits. The estimate is analytic, so the ranking is a plan to
try, not a promise: the smoke run then measures it.
"""
from __future__ import annotations

import gc

import torch


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


def candidate_changes(s: dict, target_names: list[str] | None = None) -> list[tuple[str, dict]]:
    """(description, settings changes) a user could make, each valid for the settings ``s``."""
    out = []
    if not s["gradient_checkpointing"]:
        out.append(("turn on gradient checkpointing", {"gradient_checkpointing": True}))
    if s["seq_len"] >= 16:
        out.append((f"halve seq_len to {s['seq_len'] // 2} (check your longest examples)", {"seq_len": s["seq_len"] // 2}))
    if s["batch_size"] > 1:
        b, a = max(1, s["batch_size"] // 2), s.get("grad_accum", 1) * 2
        out.append((f"batch_size {b} with grad_accum {a} (same effective batch)", {"batch_size": b, "grad_accum": a}))
        if b > 1:
            out.append((f"batch_size 1 with grad_accum {s['batch_size'] * s.get('grad_accum', 1)}",
                        {"batch_size": 1, "grad_accum": s["batch_size"] * s.get("grad_accum", 1)}))
    if s["method"] in ("full", "lora"):
        out.append(("QLoRA: 4-bit NF4 base", {"method": "qlora"}))
    if s["method"] == "full":
        out.append(("LoRA instead of full fine-tuning", {"method": "lora"}))
    if s["optimizer"] in ("adamw", "paged_adamw_32bit", "adafactor"):
        out.append(("8-bit paged optimizer (paged_adamw_8bit)", {"optimizer": "paged_adamw_8bit"}))
    if s["method"] != "full" and s["lora_targets"] == "all-linear" and target_names:
        fewer = [n for n in ("q_proj", "v_proj") if n in target_names] or target_names[:2]
        out.append((f"fewer LoRA targets {fewer}", {"lora_targets": fewer}))
    if s["method"] != "full" and s["lora_rank"] > 4:
        r = s["lora_rank"] // 2
        out.append((f"lower LoRA rank to {r}", {"lora_rank": r, "lora_alpha": max(1, s["lora_alpha"] // 2)}))
    return out


def fit_suggestions(settings: dict, limit_bytes: int | None, target_names: list[str] | None = None,
                    estimate_fn=None) -> dict:
    """Changes ranked by estimated saving, each with its estimated peak and whether it fits ``limit_bytes``."""
    if estimate_fn is None:
        from lora_kit.memory.estimate import estimate as estimate_fn
    keys = ("model", "method", "dtype", "autocast", "double_quant", "seq_len", "batch_size", "lora_rank",
            "lora_alpha", "lora_targets", "gradient_checkpointing", "attn_implementation", "optimizer",
            "num_gpus", "sharding", "cpu_offload", "grad_accum")

    def peak(s):
        return int(estimate_fn(**{k: s[k] for k in keys if k in s}).peak_allocated_bytes)

    current = peak(settings)
    rows = []
    for desc, change in candidate_changes(settings, target_names):
        p = peak({**settings, **change})
        rows.append({"change": desc, "settings": change, "estimated_peak_bytes": p,
                     "estimated_saving_bytes": current - p,
                     "fits": None if limit_bytes is None else p <= limit_bytes})
    rows.sort(key=lambda r: -r["estimated_saving_bytes"])
    combined = None
    if limit_bytes is not None and not any(r["fits"] for r in rows):
        s, applied = dict(settings), []
        for r in rows:
            if r["estimated_saving_bytes"] <= 0:
                continue
            s.update(r["settings"])
            applied.append(r["change"])
            p = peak(s)
            if p <= limit_bytes:
                break
        combined = {"changes": applied, "estimated_peak_bytes": peak(s), "fits": peak(s) <= limit_bytes}
    return {"limit_bytes": limit_bytes, "estimated_peak_bytes": current, "ranked": rows, "combined": combined}
