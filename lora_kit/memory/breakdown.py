"""The one breakdown vocabulary: which part of a training step's memory a live tensor belongs to.

``BREAKDOWN_KEYS`` are the parts every figure of the kit uses -- ``estimate``, ``simulate``, the
measured step and the smoke run's ``smoke.json`` -- so measured and estimated parts line up part by
part: weights (base parameters and buffers), quant_constants (bitsandbytes absmax / code tables),
adapters (LoRA A/B), gradients, optimizer_states, activations (everything else: saved activations,
temporaries, logits and loss).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: ``estimate`` uses this vocabulary and stays torch-free
    from lora_kit.memory.tracker import LiveBytesTracker

def _is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


BREAKDOWN_KEYS = ("weights", "quant_constants", "adapters", "gradients", "optimizer_states", "activations")
PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages a state buffer only for params with >= 1e5 elements


def quant_state_tensors(model):
    """absmax / code / offset tensors of every bitsandbytes 4-bit weight (nested state included)."""
    seen = set()
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        while qs is not None and id(qs) not in seen:
            seen.add(id(qs))
            for name in ("absmax", "code", "offset"):
                t = getattr(qs, name, None)
                if _is_tensor(t):
                    yield t
            qs = getattr(qs, "state2", None)


def paged_state_tensors(optimizer):
    """State buffers a paged bitsandbytes optimizer keeps in CUDA managed memory (which
    ``max_memory_allocated`` does not count)."""
    for p, state in optimizer.state.items():
        if p.numel() >= PAGED_MIN_NUMEL:
            yield from (state[k] for k in ("state1", "state2") if _is_tensor(state.get(k)))


def label_training_state(tracker: LiveBytesTracker, model, optimizer=None, paged: bool = False) -> None:
    """Label live storages with the breakdown keys (call before the step and after backward).

    Order matters (a storage keeps its first label): paged states, quantization constants,
    adapters (``lora_`` parameters), weights (other parameters and buffers), gradients, optimizer
    states. Everything unlabelled is counted as activations.
    """
    if optimizer is not None and paged:
        tracker.label(paged_state_tensors(optimizer), "paged_optimizer_states")
    tracker.label(quant_state_tensors(model), "quant_constants")
    named = list(model.named_parameters(remove_duplicate=True))
    tracker.label((p for n, p in named if "lora_" in n), "adapters")
    tracker.label((p for n, p in named if "lora_" not in n), "weights")
    tracker.label(model.buffers(), "weights")
    tracker.label((p.grad for _, p in named if p.grad is not None), "gradients")
    if optimizer is not None:
        tracker.label((v for state in optimizer.state.values() for v in state.values() if _is_tensor(v)),
                      "optimizer_states")


def to_breakdown(raw: dict) -> dict:
    """Tracker categories -> the six estimate keys (unlabelled "other" = activations)."""
    out = {k: int(raw.get(k, 0)) for k in BREAKDOWN_KEYS}
    out["activations"] += int(raw.get("other", 0))
    return out


def tracked_peak(tracker: LiveBytesTracker) -> tuple[int, dict]:
    """The tracker's peak and its breakdown in :data:`BREAKDOWN_KEYS` (the breakdown sums to the peak).

    Paged optimizer states (labelled by ``label_training_state(..., paged=True)``) live in CUDA
    managed memory, which ``max_memory_allocated`` does not count: they are left out of both."""
    raw = tracker.peak_breakdown()
    paged_bytes = raw.pop("paged_optimizer_states", 0)
    return int(tracker.peak_bytes - paged_bytes), to_breakdown(raw)
