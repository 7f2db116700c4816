"""FSDP2 per-rank arithmetic for ``estimate`` (torch-free): what each sharded group holds and gathers.

The groups are accelerate's FSDP2 wrapping, as :mod:`lora_kit.memory.sharded` runs it: one per
decoder layer, the input embedding (untied models), the tail (``lm_head``, plus the final norm when
the model is not a PeftModel; tied models: the shared embedding) and the root (what is left: a
LoRA model's final norm). Per parameter, FSDP2 pads dim 0 to a multiple of N; rank 0 holds
``ceil(dim0 / N)`` rows (one storage per parameter), gathers into one storage per parameter of
``N * ceil(dim0 / N)`` rows, through one flat all-gather buffer per group of the same total, and
reduce-scatters a group's gradients into one flat shard per group. Optimizer states are made from
the local shard (``zeros_like``), one storage each. Every storage is rounded to 512 bytes.

Which gathered groups are live at each moment of the step (the moments ``estimate`` compares) is
read from the engine: the tail and root stay gathered from their forward to their backward
(``reshard_after_forward=False``; a tied embedding therefore stays gathered all step); a decoder
layer is gathered during its forward and again during its backward, beside the prefetched next
layer's all-gather buffer; the untied embedding is gathered again at the end of backward whenever
its output needs a gradient (always here: full fine-tuning, or LoRA with input gradients enabled).
"""
from __future__ import annotations

import numpy as np

from lora_kit.memory.device import alloc_bytes as _r



def _rows(dim0, N):
    return -(-dim0 // N)  # ceil: rank 0's rows (padded shard)


class _Group:
    """Sums over a group's parameters (arrays over N and rank r)."""

    def __init__(self, N):
        self.N = N
        self.shard = 0  # rank 0's parameter shards (weights, adapters separately below)
        self.adapters = 0
        self.gathered = 0  # per-parameter unsharded storages
        self.flat = 0  # padded bytes of the group (all-gather buffer before rounding)
        self.grad_flat = 0  # padded bytes of the trainable parameters (reduce-scatter buffers)
        self.grad_unsharded = 0  # autograd's unsharded gradients of the trainable parameters
        self.grad_mlp = 0  # of them, the MLP output linear's (the first autograd makes in a layer's backward)
        self.states = 0
        self.opt_tmp = 0

    def add(self, dim0, rest, e, trainable: bool, adapter: bool, optimizer: str, count=1, mlp: bool = False):
        rows = _rows(dim0, self.N)
        part = rows * rest * e
        shard = count * _r(part)
        if adapter:
            self.adapters = self.adapters + shard
        else:
            self.shard = self.shard + shard
        self.gathered = self.gathered + count * _r(self.N * part)
        self.flat = self.flat + count * part
        if trainable:
            self.grad_flat = self.grad_flat + count * part
            self.grad_unsharded = self.grad_unsharded + count * _r(dim0 * rest * e)
            if mlp:
                self.grad_mlp = self.grad_mlp + count * _r(dim0 * rest * e)
            if optimizer == "adamw":
                self.states = self.states + 2 * shard
                self.opt_tmp = self.opt_tmp + shard


def _groups(spec, method: str, wb: int, targets: tuple, N, r, optimizer: str) -> tuple:
    """(layer, embedding, tail, root) groups of accelerate's FSDP2 wrapping (one decoder layer stands for all)."""
    h, V, L = spec.hidden_size, spec.vocab_size, spec.num_layers
    full = method == "full"
    layer = _Group(N)
    for lin in spec.linears:
        mlp = lin.kind == "mlp_out"
        layer.add(lin.out_features, lin.in_features, wb, full, False, optimizer, mlp=mlp)
        if lin.bias:
            layer.add(lin.out_features, 1, wb, full, False, optimizer, mlp=mlp)
        if not full and lin.name in targets:
            layer.add(r, lin.in_features, 4, True, True, optimizer)  # lora_A: (r, in), fp32
            layer.add(lin.out_features, r, 4, True, True, optimizer)  # lora_B: (out, r), fp32
    if spec.exact:  # a generic spec carries its norms in extra_params (below), as ModelSpec.param_tensors does
        layer.add(h, 1, wb, full, False, optimizer, count=spec.norms_per_layer * (2 if spec.norm_bias else 1))
    for numel, count in spec.extra_params:  # e.g. per-head q/k norms, per layer
        layer.add(numel, 1, wb, full, False, optimizer, count=max(1, count // L))
    embed, tail, root = _Group(N), _Group(N), _Group(N)
    final_norm = 2 if spec.norm_bias else 1
    if spec.tied_embeddings:
        tail.add(V, h, wb, full, False, optimizer)
    else:
        embed.add(V, h, wb, full, False, optimizer)
        tail.add(V, h, wb, full, False, optimizer)
    (tail if full else root).add(h, 1, wb, full, False, optimizer, count=final_norm)
    return layer, embed, tail, root


def fsdp_communication(spec, step) -> dict:
    """Buffer bytes FSDP2 all-gathers and reduce-scatters per step (rank 0; accelerate's wrapping), by arithmetic.

    Decoder layers and an untied embedding are gathered twice (forward, and again in backward: resharded
    after forward; the embedding's output needs a gradient), the tail and root once (kept from forward to
    backward); every group with trainable parameters reduce-scatters their padded gradients once. A ring
    moves (N - 1) / N of each buffer per rank; divide by the interconnect's bandwidth for a lower bound on
    the time. ``simulate`` counts the same buffers from FSDP2's own calls (``SimResult.collectives``).
    ``step``: a ``lora_kit.settings.Step`` (its method, dtype, autocast, num_gpus and LoRA fields)."""
    from lora_kit.memory.specs import check_targets, model_spec
    spec = model_spec(spec)
    method, dtype, autocast, num_gpus, lora_rank = step.method, step.dtype, step.autocast, step.num_gpus, step.lora_rank
    lora_targets = step.lora_targets
    targets = check_targets(spec, method, lora_rank, lora_targets, "sdpa")
    wb = 4 if (method == "full" and autocast) else {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    N = np.int64(num_gpus)
    layer, embed, tail, root = _groups(spec, method, wb, targets, N, np.int64(lora_rank), "sgd")
    L = spec.num_layers
    gathered = N * (2 * L * layer.flat + 2 * embed.flat + tail.flat + root.flat)
    scattered = N * (L * layer.grad_flat + embed.grad_flat + tail.grad_flat + root.grad_flat)
    return {"all_gather_bytes": int(gathered), "reduce_scatter_bytes": int(scattered),
            "per_rank_traffic_bytes": int((gathered + scattered) * (num_gpus - 1) // num_gpus)}
