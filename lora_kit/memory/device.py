"""What the training process adds to a CUDA card around torch's peak allocated bytes: the one basis of
``device_total_bytes`` and the one place for device constants.

``device_total`` = **context** + **reserved** + **outside** (+ **NCCL** per rank when ``num_gpus > 1``):

- *context*: the CUDA context the process creates (``mem_get_info`` total minus free after the first tensor): the
  catalog's ``cuda_context_bytes`` of the GPU when it is named and known (``lora_kit.plan.gpus``), else
  :data:`CUDA_CONTEXT_BYTES`, a stated default (the one measured context the catalog holds: H200, torch 2.11,
  CUDA 13.0, ``benchmarks/reference/cuda_h200.json``; public readings put other cards at 0.1-0.6 GiB).
- *reserved*: what torch's caching allocator holds at the peak (``max_memory_reserved``), in closed form
  (:func:`reserved_bytes`): the peak allocated bytes plus a fragmentation term fitted on replays of PyTorch's
  caching allocator (:mod:`lora_kit.memory.allocator`) over ``simulate``'s allocation sequences of 49 steps (ten
  models of six architectures, LoRA / QLoRA / full, 512-32,768 tokens, with and without checkpointing;
  ``benchmarks/cuda_reserved_fit.py``): a share of the largest single allocation of the step (in a causal LM, the
  fp32 logits), a share of the peak, and a multiple of one decoder layer's MLP activation (tokens x intermediate
  size, in the activations' dtype: on long rows a layer's blocks of hundreds of MiB stay cached while the loss and
  the backward ask for others), under PyTorch's default setting, which the device total counts (a user's own
  trainer may run it); ``expandable_segments:True`` (the kit's GPU path) has its own fitted constants, shown
  beside (:func:`reserved_bytes`). QLoRA adds the 16-bit embedding block that
  ``prepare_model_for_kbit_training`` frees into the cache when it up-casts it to fp32 (fitted on the shared H200
  QLoRA row).
- *outside*: memory outside torch's allocator once the first kernels ran (cuBLAS / cuDNN handles and workspaces,
  kernel images): :data:`OUTSIDE_BYTES`, fitted on (equal on) every shared H200 row of ``cuda_h200.json`` (6 rows).
- *NCCL*: a rank of a multi-GPU job holds NCCL's communicator buffers outside torch: :data:`NCCL_RANK_BYTES`.

Paged optimizer states (bitsandbytes ``paged_*``) are **not** in the device total: bitsandbytes keeps the states of
tensors of >= 100,000 elements in ``cudaMallocManaged`` memory, which the driver pages out to the host when the card
runs short, so a run fits without them; nvidia-smi shows them while there is room. :func:`paged_resident_bytes` is
that figure ("resident when room"), shown apart; it never enters *fits*.

What nvidia-smi prints adds the driver's share (nvidia-smi's total minus CUDA's, ``lora_kit.plan.gpus``), which is
"used" before any process starts: never part of the device total.

Every figure is exact integer arithmetic: an int for ints, int64 arrays for arrays, object arrays of Python ints for
object arrays (or figures past int64's room).
"""
from __future__ import annotations

import functools
import re
from importlib import metadata

import numpy as np

from lora_kit.settings import DTYPE_BYTES

ALLOC_ROUND = 512  # the CUDA caching allocator hands out storages in multiples of 512 bytes
MIB = 2 ** 20
# the CUDA context where the GPU's own reading is not in the catalog: the H200's, measured (mem_get_info total - free
# after torch.ones(1) on CUDA, benchmarks/reference/cuda_h200.json); public readings: 0.1-0.6 GiB by card
CUDA_CONTEXT_BYTES = 650_969_088
# memory outside torch's allocator after the first kernels (nvidia-smi's peak - used before the process - context -
# max_memory_reserved), the same on every shared H200 row of each kind: 142.75 MiB (LoRA, full), 126.75 MiB (QLoRA)
OUTSIDE_BYTES = {"lora": 149_684_224, "full": 149_684_224, "qlora": 132_907_008}
# NCCL's buffers per rank, outside torch (nvidia-smi): 544 MB for a 2-GPU group, 688 MB for more (4 x A100 with
# NVLink, PyTorch, one 4 MB all-reduce per group: NVIDIA/nccl issue 964); taken as MiB, the unit nvidia-smi prints
NCCL_RANK_BYTES = {2: 544 * MIB, 3: 688 * MIB}
# reserved = peak + ceil(LARGEST x the step's largest allocation + PEAK x peak + LAYER x one layer's MLP activation),
# rounded up to the 2 MiB of a large segment (+ QLoRA's cached 16-bit embedding block), per allocator setting; exact
# fractions chosen on the 49 replays of benchmarks/results/cuda_reserved_fit.json for the smallest spread with no
# replay more than 5 % above the closed form. PyTorch's default: 0.95-1.11 x the replays, median 1.00 (least squares
# without the bound: 0.49 x largest + 4.2 x layer; on the 51 replays now: 0.96-1.11 x, median 1.01).
# expandable_segments:True maps pages where a request needs them, so a layer's cached blocks cost nothing:
# 0.95-1.11 x, median 1.00 (least squares: 0.33 x largest + 0.011 x peak)
FRAGMENTATION = {"default": {"largest": (2, 5), "peak": (3, 100), "layer": (4, 1)},
                 "expandable": {"largest": (7, 20), "peak": (1, 40), "layer": (0, 1)}}
# LoRA, its own fractions: under PyTorch's default the shared ones sat at 0.953-1.020 x LoRA's 20 replays (median
# 0.974; Mistral-7B all-linear, 4,096 x 4 with checkpointing: 0.957), because an all-linear adapter's fp32 copy of
# the down projection's input (``layer`` for LoRA, :func:`device_kwargs`) is a layer's largest block. Least squares
# on those 20 replays, rounded: 0.960-1.022 x, median 1.00 (Mistral's row 0.997); with expandable segments
# 0.954-1.011 x (median 0.981) became 0.973-1.016 x (median 1.00). QLoRA and full keep the shared fractions
# (QLoRA's replays include the load; its closed form was checked on the measured H200 row).
FRAGMENTATION_LORA = {"default": {"largest": (3, 5), "peak": (1, 100), "layer": (17, 5)},
                      "expandable": {"largest": (9, 20), "peak": (3, 100), "layer": (0, 1)}}
# The QLoRA paper's step on LLaMA-65B / Llama-2-70B (512 tokens, 80 layers, paged 32-bit AdamW): the closed form is
# 1.03 / 1.04 x its replay. (Until 2026-12-07 the replay counted the paged states, which bitsandbytes keeps in CUDA
# managed memory outside torch's allocator, as reserved: 6.3 GiB more, 0.89 / 0.91 x, and out of memory at the
# L40S's capacity. Replayed at that capacity now: 40.3 / 42.2 GiB reserved of 43.8, no free-and-retry, as the paper
# trained 65B on one 48 GB card: ``python benchmarks/cuda_reserved_fit.py --at-capacity L40S``.)
ALLOCATORS = tuple(FRAGMENTATION)
SEGMENT = 2 * MIB  # kRoundLarge: a large segment is a multiple of 2 MiB
# DeepSpeed ZeRO-2 / ZeRO-3 allocate one gradient bucket of ``reduce_bucket_size`` elements (default 5e8, which the
# accelerate config lora_kit writes leaves as is), in the trained dtype, whatever the model's size
# (benchmarks/deepspeed_accuracy.py measures it on CPU ranks)
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# cuBLAS's workspace per (handle, stream), allocated through torch's caching allocator at a thread's first matmul and
# kept: PyTorch's parseChosenWorkspaceSize (aten/src/ATen/cuda/CublasHandlePool.cpp) gives 32 MiB on compute
# capability 9 (Hopper), and on 10 and 12 (Blackwell) from torch 2.11 (pytorch PR 175344, merged 2026-02), else
# ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB; CUBLAS_WORKSPACE_CONFIG overrides it. A training step runs matmuls on
# two threads -- the forward's and autograd's device thread -- so two workspaces: on the shared H200 rows of
# benchmarks/reference/cuda_h200.json, max_memory_allocated minus the step's tensors is 2 x 32 MiB (within 2 MB)
CUBLAS_WORKSPACE = {"hopper": 32 * MIB, "default": 2 * 4096 * 1024 + 8 * 16 * 1024}
CUBLAS_THREADS = 2
INT64_ROOM = 1 << 56  # below this every product and sum here stays inside int64


def alloc_bytes(nbytes):
    """Bytes of a storage as the CUDA caching allocator hands it out (rounded up to 512). Exact whatever the size:
    an integer gives a Python int, an object array (of Python ints) an object array, anything else int64."""
    if isinstance(nbytes, (int, np.integer)) and not isinstance(nbytes, bool):
        return (int(nbytes) + ALLOC_ROUND - 1) // ALLOC_ROUND * ALLOC_ROUND
    arr = np.asarray(nbytes)
    if arr.dtype != object:
        arr = arr.astype(np.int64)
    return (arr + ALLOC_ROUND - 1) // ALLOC_ROUND * ALLOC_ROUND


def _exact(*xs):
    """The arguments as arrays of one integer kind (int64, or object where any is object or too large) and whether
    the result is a scalar."""
    arrs = [np.asarray(x) for x in xs]
    scalar = all(a.ndim == 0 for a in arrs)
    big = any(a.dtype == object or (a.size and int(np.abs(a.astype(np.int64)).max()) >= INT64_ROOM) for a in arrs)
    return [a.astype(object if big else np.int64) for a in arrs], scalar


def _out(x, scalar: bool):
    return int(x) if scalar else x


def outside_bytes(method: str | None, num_gpus):
    """Memory outside torch's allocator: :data:`OUTSIDE_BYTES` of ``method`` (the largest when None), plus
    :data:`NCCL_RANK_BYTES` on each rank of a job of ``num_gpus`` > 1 (int or array)."""
    base = OUTSIDE_BYTES[method] if method in OUTSIDE_BYTES else max(OUTSIDE_BYTES.values())
    (n,), scalar = _exact(num_gpus)
    nccl = np.where(n > 2, NCCL_RANK_BYTES[3], np.where(n == 2, NCCL_RANK_BYTES[2], 0)).astype(n.dtype)
    return _out(base + nccl, scalar)


def reserved_bytes(peak, *, largest=0, layer=0, method: str | None = None, embedding_bytes=0,
                   allocator: str = "default"):
    """torch's ``max_memory_reserved`` for a step of ``peak`` allocated bytes, in closed form (module doc), under
    ``allocator``: "default" (PyTorch's default setting; what the verdict counts, as a user's own trainer may run
    it) or "expandable" (``expandable_segments:True``, what the kit's GPU path sets: on long rows several GiB less;
    the one measured pair, Llama-3.1-8B LoRA at 2,048 tokens on the H200, showed 0.2 % less).

    ``largest``: the step's largest single allocation; ``layer``: one decoder layer's MLP activation (both from
    :func:`device_kwargs`; default 0); ``embedding_bytes``: for
    QLoRA, the 16-bit embedding / ``lm_head`` block ``prepare_model_for_kbit_training`` leaves in the cache that
    the step does not take back (:func:`device_kwargs`; fitted on the shared H200 QLoRA row, where nvidia-smi
    showed both 16-bit blocks cached after load and the step reused one)."""
    if allocator not in FRAGMENTATION:
        raise ValueError(f"allocator={allocator!r}: give one of {', '.join(ALLOCATORS)}.")
    (p, big, lay, emb), scalar = _exact(peak, largest, layer, embedding_bytes)
    c = FRAGMENTATION[allocator]
    if method == "lora":
        c = FRAGMENTATION_LORA.get(allocator, c)
    frag = sum(-(-(n * x) // d) for x, (n, d) in ((big, c["largest"]), (p, c["peak"]), (lay, c["layer"])))
    if method == "qlora":
        frag = frag + emb
    frag = -(-frag // SEGMENT) * SEGMENT
    return _out(p + frag, scalar)


def device_kwargs(spec, step, tokens=None, num_gpus=None) -> dict:
    """The keywords of :func:`device_total` for ``step`` (a :class:`lora_kit.settings.Step`) on a model of ``spec``
    (``vocab_size``, ``hidden_size``, ``intermediate_size``, ``tied_embeddings``), ``tokens`` per micro-step (batch
    x sequence; int or array; default the step's) on ``num_gpus`` (default the step's): ``largest`` = the fp32
    logits (``tokens x vocab x 4``; TRL's SFT head, ``loop="sft"``, never builds them: its 4,096 x 32,768 fp32 tile
    instead); ``layer`` = one layer's MLP activation, ``tokens x intermediate_size`` in the step's
    ``activation_dtype``, or for LoRA without autocast whose targets hold the MLP's down projection, the fp32 copy
    of that projection's input peft makes for its fp32 adapter (``tokens x intermediate_size x 4``, saved for
    backward: the layer's largest block); ``embedding_bytes`` for QLoRA = one 16-bit ``vocab x hidden`` block when
    the embedding and ``lm_head`` are untied (two blocks cached after load, the step reuses one), else 0;
    ``method``; ``num_gpus``."""
    method = step.method
    (T,), _ = _exact(step.seq_len * step.batch_size if tokens is None else tokens)
    V, h, inter = int(spec.vocab_size), int(spec.hidden_size), int(spec.intermediate_size)
    largest = alloc_bytes(np.minimum(T, 4096) * 32768 * 4) if step.loop == "sft" else alloc_bytes(T * V * 4)
    width = DTYPE_BYTES[step.activation_dtype]
    if method == "lora" and not step.autocast and _adapts_down_projection(spec, step):
        width = 4
    layer = alloc_bytes(T * inter * width)
    emb = alloc_bytes(V * h * 2) if method == "qlora" and not spec.tied_embeddings else 0
    return {"largest": largest if np.ndim(largest) else int(largest), "layer": layer if np.ndim(layer) else int(layer),
            "method": method, "embedding_bytes": emb, "num_gpus": step.num_gpus if num_gpus is None else num_gpus}


def _adapts_down_projection(spec, step) -> bool:
    """Whether ``step``'s LoRA targets hold the MLP's down projection (a linear of kind "mlp_out")."""
    from lora_kit.memory.specs import check_targets  # lazy: specs reads the catalog
    targets = set(check_targets(spec, step.method, step.lora_rank, step.lora_targets, step.attn_implementation))
    return any(lin.kind == "mlp_out" and lin.name in targets for lin in spec.linears)


def device_parts(peak, *, num_gpus, largest=0, layer=0, method: str | None = None, embedding_bytes=0,
                 context: int | None = None, allocator: str = "default") -> dict:
    """The device total's parts, labelled: ``context``, ``reserved`` (torch's, ``peak`` allocated inside it),
    ``outside`` (kernel workspaces and, on a multi-GPU rank, NCCL) and ``total`` = context + reserved + outside.
    ``context``: the GPU's CUDA context (``lora_kit.plan.gpus``' ``context_bytes``), default
    :data:`CUDA_CONTEXT_BYTES`; the other keywords as :func:`reserved_bytes` and :func:`outside_bytes`."""
    reserved = reserved_bytes(peak, largest=largest, layer=layer, method=method, embedding_bytes=embedding_bytes,
                              allocator=allocator)
    outside = outside_bytes(method, num_gpus)
    ctx = CUDA_CONTEXT_BYTES if context is None else int(context)
    (r, o), scalar = _exact(reserved, outside)
    return {"context": ctx, "reserved": reserved, "outside": outside, "total": _out(ctx + r + o, scalar),
            "allocator": allocator}


@functools.cache
def _installed_torch() -> str:
    """The installed torch's version string, read once (planner sweeps ask per row)."""
    return metadata.version("torch")


def torch_version(version: str | tuple | None = None) -> tuple:
    """(major, minor) of ``version`` ("2.11.0+cu130", (2, 11)) or of the installed torch."""
    if isinstance(version, tuple):
        return tuple(int(x) for x in version[:2])
    text = version or _installed_torch()
    try:
        return tuple(int(x) for x in text.split("+")[0].split(".")[:2])
    except ValueError as e:
        raise ValueError(f"torch_version={version!r} is not a version; give e.g. '2.11' or (2, 11).") from e


def cublas_workspace_bytes(compute_capability=None, torch_version_: str | tuple | None = None,
                           config: str | None = None) -> int:
    """One cuBLAS workspace as torch allocates it on a GPU of ``compute_capability`` (e.g. 9.0; None: the larger,
    32 MiB) with torch ``torch_version_`` (default: the installed one): :data:`CUBLAS_WORKSPACE`; ``config``: the
    machine's ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs in KiB, e.g. ``:4096:8``), which replaces it."""
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if compute_capability is None or compute_capability != compute_capability:  # None or NaN: an unknown card
        return CUBLAS_WORKSPACE["hopper"]
    major = int(float(compute_capability))
    big = major == 9 or (major in (10, 12) and torch_version(torch_version_) >= (2, 11))
    return CUBLAS_WORKSPACE["hopper" if big else "default"]


def cuda_allocated_bytes(peak, compute_capability=None, torch_version_: str | tuple | None = None,
                         config: str | None = None):
    """What ``torch.cuda.max_memory_allocated()`` will read for a step whose tensors peak at ``peak`` bytes (the
    kit's ``peak_allocated_bytes``, the same on CPU and CUDA): plus :data:`CUBLAS_THREADS` cuBLAS workspaces
    (:func:`cublas_workspace_bytes`; ``config``: ``CUBLAS_WORKSPACE_CONFIG`` where the run sets it), which live in
    torch's allocator from the first matmul on. Not taken off: the 0-dim ``step`` tensors of a plain (not fused,
    not capturable) AdamW, which CUDA keeps on the host while the CPU step counts them (512 bytes each, a few
    hundred KB in all; a fused AdamW, the Trainer's default, keeps them on the card). Not added: the few buffers
    bitsandbytes keeps on the card after a 4-bit load (about 4.5 MiB on the shared QLoRA row)."""
    (p,), scalar = _exact(peak)
    return _out(p + CUBLAS_THREADS * cublas_workspace_bytes(compute_capability, torch_version_, config), scalar)


def device_total(peak, **kw):
    """What the process adds to the card for a peak of ``peak`` allocated bytes: CUDA context + torch's reserved
    + memory outside the allocator (:func:`device_parts`; keywords as there). An int for an int, an int64 array
    for an array, an object array of Python ints for an object array or figures past int64's room."""
    return device_parts(peak, **kw)["total"]


def paged_resident_bytes(optimizer: str, tensors) -> object:
    """The states a paged bitsandbytes optimizer keeps in CUDA managed memory (``state1`` / ``state2`` of
    trainable tensors of 100,000 elements or more; ``tensors``: (rows, cols, count, element bytes) as
    ``lora_kit.memory.static.trainable_tensors`` gives them): on the card while there is room (nvidia-smi shows
    them), paged to the host when there is not, so never part of the device total. 0 for other optimizers."""
    if not str(optimizer).startswith("paged_"):
        return 0
    from lora_kit.memory.breakdown import PAGED_MIN_NUMEL
    width = 1 if optimizer == "paged_adamw_8bit" else 4
    return sum(c * np.where(rows * cols >= PAGED_MIN_NUMEL, 2 * alloc_bytes(rows * cols * width), 0)
               for rows, cols, c, _ in tensors)
