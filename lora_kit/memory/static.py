"""The exact static arithmetic of a step: bytes of weights, quantisation constants, trainable tensors and optimizer
states, per parameter tensor, each storage rounded to 512 bytes as the allocator hands it out.

No activation is counted here: those come from the fitted closed form of ``simulate``
(:mod:`lora_kit.memory.calibrate`). ``estimate`` composes the two where a setting changes only these static parts
(another optimizer, sharded states, gradients or weights, offloaded states).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from lora_kit.memory.breakdown import PAGED_MIN_NUMEL
from lora_kit.memory.device import alloc_bytes as _r
from lora_kit.memory.moe import expert_lora_tensors
from lora_kit.memory.specs import ModelSpec
from lora_kit.settings import DTYPE_BYTES, Step  # noqa: F401  (DTYPE_BYTES: compose and multi_gpu read it here)

NF4_BLOCK = 64  # bitsandbytes 4-bit blocksize
DQ_BLOCK = 256  # double-quant: absmax of the absmax, per 256 blocks
OPT8_BLOCK = 256  # bitsandbytes 8-bit optimizer blocksize
OPT8_MIN_SIZE = 4096
STEP_SCALAR = 512  # a 0-dim fp32 tensor (AdamW's step, Adafactor's RMS) as the allocator hands it out


@lru_cache(maxsize=1024)
def trainable_shapes(spec: ModelSpec, method: str, weight_bytes: int, targets: tuple) -> tuple:
    """(rows, cols, count, elem_bytes, per_rank) of every trainable tensor; numel = rows*cols (x rank if per_rank).

    LoRA: A is (rank, in), B is (out, rank), fp32; stored as (1, in) / (out, 1) with per_rank=True.
    """
    if method != "full":
        out = []
        for lin in spec.linears:
            if lin.name in targets:
                out += [(1, lin.in_features, spec.num_layers, 4, True), (lin.out_features, 1, spec.num_layers, 4, True)]
        return tuple(out)
    h, V, n = spec.hidden_size, spec.vocab_size, spec.num_layers
    out = [(V, h, 1 if spec.tied_embeddings else 2, weight_bytes, False)]
    for lin in spec.linears:
        out.append((lin.out_features, lin.in_features, lin.layers or n, weight_bytes, False))
        if lin.bias:
            out.append((1, lin.out_features, lin.layers or n, weight_bytes, False))
    out += [(1, numel, count, weight_bytes, False) for g, numel, count in spec.param_tensors() if g == "norm"]
    return tuple(out)


def optimizer_state_bytes(optimizer: str, rows, cols, eb):
    """Optimizer state bytes of one trainable tensor of shape (rows, cols) (rows == 1: a vector) with element bytes
    ``eb``, as the optimizer allocates them (read off the real optimizers; ``tests/test_compose.py`` checks them):

    - ``adamw``: ``exp_avg`` and ``exp_avg_sq`` in the tensor's dtype, and a 0-dim fp32 ``step``;
    - ``adafactor`` (transformers'): fp32 row and column second moments for a matrix, a full one for a vector, and a
      0-dim fp32 ``RMS``;
    - ``adamw_8bit``: 8-bit ``state1`` / ``state2`` with an fp32 absmax per 256 elements; tensors under 4,096
      elements keep 32-bit states (the shared quantisation maps: :func:`optimizer_shared_bytes`);
    - ``paged_*``: as their unpaged twins, except that for tensors of 100,000 elements or more ``state1`` /
      ``state2`` live in CUDA managed memory, outside the allocator's count;
    - ``sgd`` (no momentum): none."""
    numel = rows * cols
    if optimizer == "adamw":
        return 2 * _r(numel * eb) + STEP_SCALAR
    if optimizer == "adafactor":
        factored = (rows > 1) & (cols > 1)
        return np.where(factored, _r(rows * 4) + _r(cols * 4), _r(numel * 4)) + STEP_SCALAR
    paged = np.asarray(numel >= PAGED_MIN_NUMEL) if optimizer.startswith("paged_") else False
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        q8 = np.where(paged, 0, 2 * _r(numel)) + 2 * _r(4 * (-(-numel // OPT8_BLOCK)))
        return np.where(numel < OPT8_MIN_SIZE, 2 * _r(numel * 4), q8)
    if optimizer == "paged_adamw_32bit":
        return np.where(paged, 0, 2 * _r(numel * 4))
    return 0 * numel  # sgd


def optimizer_shared_bytes(optimizer: str, tensors) -> object:
    """State shared by all tensors: the 8-bit optimizers' two 256-entry fp32 quantisation maps, once some tensor
    has 8-bit states."""
    if optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        return 0
    big = sum(np.asarray(rows * cols >= OPT8_MIN_SIZE, dtype=np.int64) for rows, cols, _, _ in tensors)
    return np.where(big > 0, 2 * _r(256 * 4), 0)


def optimizer_states(optimizer: str, tensors) -> object:
    """All optimizer state bytes of the trainable ``tensors`` (rows, cols, count, element bytes)."""
    return sum(c * optimizer_state_bytes(optimizer, rows, cols, eb) for rows, cols, c, eb in tensors) + \
        optimizer_shared_bytes(optimizer, tensors)


def tensor_bytes(tensors) -> object:
    """Bytes of ``tensors`` (rows, cols, count, element bytes), each storage rounded as the allocator hands it out:
    the trainable tensors' own bytes, their gradients', DDP's buckets, foreach AdamW's ``sqrt(v)`` copies."""
    return sum(c * _r(rows * cols * eb) for rows, cols, c, eb in tensors)


def optimizer_temp_bytes(optimizer: str, tensors: list):
    """Temporaries of ``optimizer.step()`` at its largest moment: foreach AdamW's ``sqrt(v)`` copy of every state;
    Adafactor, one tensor at a time, the largest tensor's fp32 update and squared gradient (with a 16-bit tensor
    also its fp32 copies of the gradient and the weight) and, for a matrix, its row and column factors."""
    if optimizer == "adamw":
        return tensor_bytes(tensors)
    if optimizer == "adafactor":
        return np.max(np.stack([(2 if eb == 4 else 4) * _r(rows * cols * 4) +
                                np.where((rows > 1) & (cols > 1), _r(rows * 4) + _r(cols * 4), 0)
                                for rows, cols, c, eb in tensors]), axis=0)
    return 0


def block_weight_bytes(spec: ModelSpec, method: str, dtype: str, autocast: bool) -> int:
    """One decoder block's weights as gathered by zero3 / fsdp. QLoRA's 4-bit weights are sharded and gathered as
    stored (two values per byte, ``bnb_4bit_quant_storage`` a float type: what FSDP needs to shard them), biases in
    ``dtype``; their quantisation constants are not parameters and are not gathered."""
    e = 4 if (method == "full" and autocast) else DTYPE_BYTES[dtype]
    weights = sum(lin.in_features * lin.out_features for lin in spec.linears)
    biases = sum(lin.out_features * lin.bias for lin in spec.linears)
    if method == "qlora":
        return int(_r(-(-weights // 2)) + _r(biases * e))
    return int(_r((weights + biases) * e))


def trainable_tensors(spec: ModelSpec, s: Step, targets: tuple, experts: dict, r) -> tuple[list, list]:
    """(rows, cols, count, element bytes) of every trainable tensor at rank(s) ``r``, and of those the LoRA tensors
    on MoE experts and routers."""
    wb = 4 if (s.method == "full" and s.autocast) else DTYPE_BYTES[s.dtype]
    tensors = [((rows * r if rows == 1 else rows) if pr else rows, (cols * r if cols == 1 else cols) if pr else cols,
                c, eb) for rows, cols, c, eb, pr in trainable_shapes(spec, s.method, wb, targets)]
    expert_tensors = expert_lora_tensors(spec, experts, r)  # LoRA on MoE experts and routers (none elsewhere)
    return tensors + expert_tensors, expert_tensors
