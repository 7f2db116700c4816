"""Settings composed from a fitted one-GPU step and the exact static arithmetic (:mod:`lora_kit.memory.static`).

A fit (:mod:`lora_kit.memory.calibrate`) gives, per phase of the step, the peak and what of it is weights,
quantisation constants, adapters, gradients and optimizer states; the rest is activations (everything else live at
that moment: saved tensors, temporaries, the batch). Some settings change only those static parts, so they are
composed instead of fitted again:

- **another optimizer** (fitted with AdamW, run with SGD, 8-bit or paged AdamW: :data:`SWAPPABLE`): the states are live the
  whole step, the same bytes at every operator of forward and backward, so swapping them leaves which operator holds
  a phase's peak unchanged; the optimizer phase also swaps the step's temporaries (foreach's ``sqrt(v)`` copies,
  the Trainer's clipping norms: :func:`lora_kit.memory.loops.loop_terms`). Checked against ``simulate`` in
  ``tests/test_compose.py``.
- **sharding** over ``N`` GPUs, per GPU (rank 0's share, ``ceil(x / N)``): ``zero1`` shards the optimizer states
  and the step's temporaries, ``zero2`` also the gradients, ``zero3`` / ``fsdp`` also the weights and adapters
  (not QLoRA's quantisation constants: not parameters), plus two gathered blocks (the working one and the
  prefetched one; QLoRA's as stored, 4-bit); ``cpu_offload`` moves the sharded states (and, with ``zero3`` /
  ``fsdp``, the parameter shards) to host memory; ``ddp`` adds its
  gradient buckets (a second copy of the gradients), ``zero2`` / ``zero3`` DeepSpeed's reduce bucket. With sharded
  gradients, each phase's operator is chosen again among the fitted ones by its value with ``1/N`` of its
  gradients (:meth:`lora_kit.memory.calibrate.Fit.phase_arrays`' ``grad_share``: late in backward the gradients
  dominate a one-GPU step, not a sharded one). The activations are the one-GPU step's; the collectives' buffers
  and the gathered blocks' exact lifetimes are not modelled, so these figures are labelled "composed".
"""
from __future__ import annotations

import numpy as np

from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.device import DEEPSPEED_REDUCE_BUCKET
from lora_kit.memory.loops import loop_terms
from lora_kit.memory.static import (DTYPE_BYTES, block_weight_bytes, optimizer_states, optimizer_temp_bytes,
                                   tensor_bytes)

STATES_SHARDED = ("zero1", "zero2", "zero3", "fsdp")
GRADIENTS_SHARDED = ("zero2", "zero3", "fsdp")
WEIGHTS_SHARDED = ("zero3", "fsdp")
DEEPSPEED = ("zero2", "zero3")  # the engine the accelerate config launches for these
# optimizers whose step composes exactly from a fit with another of them (their step's temporaries are
# ``optimizer_temp_bytes``'); Adafactor's step holds the previous tensor's fp32 copies beside the current one's: it is
# fitted itself
SWAPPABLE = ("adamw", "sgd", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


def deepspeed_bucket_bytes(dtype: str) -> int:
    """DeepSpeed's reduce bucket, allocated whole at the first backward and kept: ``zero2`` / ``zero3`` launch
    DeepSpeed (:data:`DEEPSPEED`)."""
    return DEEPSPEED_REDUCE_BUCKET * DTYPE_BYTES[dtype]


def label(step, fitted_optimizer: str) -> str:
    """How a figure was made: "fitted" (the fit itself; ``ddp`` adds only its buckets, as ``simulate`` does), or
    "composed (...)" naming what the arithmetic changed."""
    what = []
    if step.optimizer != fitted_optimizer:
        what.append(f"{step.optimizer} states from a fit with {fitted_optimizer}")
    if step.sharding not in ("none", "ddp"):
        what.append(f"{step.sharding}{' with CPU offload' if step.cpu_offload else ''} over {step.num_gpus} GPUs")
    return "fitted" if not what else "composed (" + "; ".join(what) + " by arithmetic)"


def _step_extra(loop: str, optimizer: str, tensors) -> object:
    """What the optimizer phase holds on top of weights, gradients and states: the larger of the optimizer's
    temporaries and the clipping norms (``loop_terms``)."""
    t = loop_terms(loop, optimizer, sum(c for _, _, c, _ in tensors))
    return t["foreach_temp"] * optimizer_temp_bytes(optimizer, tensors), t["clip"]


def static_terms(spec, step, fitted_optimizer: str, tensors: list, N) -> dict:
    """What :func:`compose` changes, computed once per step: ``tensors``: the trainable tensors (rows, cols, count,
    element bytes) at each row's rank (:func:`lora_kit.memory.static.trainable_tensors`); ``N``: GPUs per row."""
    sh, offload = step.sharding, step.cpu_offload
    out = {"N": N, "keep": 0 if offload else 1, "states": None, "extra": 0, "bucket": 0,
           "gathered": 2 * block_weight_bytes(spec, step.method, step.dtype, step.autocast)}
    if step.optimizer != fitted_optimizer or sh in STATES_SHARDED:
        tmp_f, clip_f = _step_extra(step.loop, fitted_optimizer, tensors)
        tmp, clip = _step_extra(step.loop, step.optimizer, tensors)
        if sh in STATES_SHARDED:
            tmp = 0 * tmp if offload else -(-tmp // N)
        out["extra"] = np.maximum(tmp, clip) - np.maximum(tmp_f, clip_f)  # the optimizer step's, new minus fitted
    if step.optimizer != fitted_optimizer:
        out["states"] = optimizer_states(step.optimizer, tensors)
    if sh == "ddp":  # DDP's gradient buckets: a second copy of the gradients
        out["bucket"] = tensor_bytes(tensors)
    elif sh == "none":  # on several GPUs the launcher runs "none" as DDP (lora_kit.run.distributed.engine)
        out["bucket"] = np.where(np.asarray(N) > 1, tensor_bytes(tensors), 0)
    if sh in DEEPSPEED:
        out["bucket"] = out["bucket"] + deepspeed_bucket_bytes(step.dtype)
    return out


def compose(step, phases: dict, terms: dict) -> dict:
    """Per-GPU figures of ``step`` from a fit of the same step with another optimizer or on one GPU.

    ``phases``: phase -> (peaks, parts (rows x 5)) of :meth:`lora_kit.memory.calibrate.Fit.phase_arrays`;
    ``terms``: :func:`static_terms`. Returns phase -> (peaks, parts) in the same form, exact integers of the same
    kind."""
    sh, N, keep = step.sharding, terms["N"], terms["keep"]

    def shard(x):  # rank 0's share
        return -(-x // N)
    out = {}
    for ph, (peak, parts) in phases.items():
        w, q, a, g, st = (parts[:, i] for i in range(len(BREAKDOWN_KEYS) - 1))  # the five static parts
        act = peak - parts.sum(axis=1)
        if ph == "optimizer":
            act = act + terms["extra"]
        if terms["states"] is not None:
            st = 0 * st + terms["states"]
        if sh in STATES_SHARDED:
            st = shard(st) * keep
        if sh in GRADIENTS_SHARDED:
            g = shard(g)
        if sh in WEIGHTS_SHARDED:  # QLoRA's quantisation constants are not parameters: whole on every GPU
            w = shard(w) * keep + terms["gathered"]
            if step.method != "full":
                a = shard(a)
        g = g + terms["bucket"]
        new = np.stack([w, q, a, g, st], axis=1).astype(parts.dtype)
        out[ph] = ((act + new.sum(axis=1)).astype(parts.dtype), new)
    return out
