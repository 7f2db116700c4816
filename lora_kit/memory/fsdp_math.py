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
    layer.add(h, 1, wb, full, False, optimizer, count=spec.norms_per_layer * (2 if spec.norm_bias else 1))
    for numel, count in spec.extra_params:  # e.g. qwen3's q/k norms, per layer
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


def fsdp_groups(spec, method: str, wb: int, targets: tuple, N, r, optimizer: str) -> dict:
    """Per-rank byte terms of the accelerate FSDP2 groups (arrays broadcast over ``N`` and ``r``)."""
    layer, embed, tail, root = _groups(spec, method, wb, targets, N, r, optimizer)
    L = spec.num_layers
    groups = [(layer, L), (embed, 1), (tail, 1), (root, 1)]
    out = {
        "weights": sum(g.shard * n for g, n in groups), "adapters": layer.adapters * L,
        "states": sum(g.states * n for g, n in groups), "opt_tmp": sum(g.opt_tmp * n for g, n in groups),
        "grads": sum(_r(g.grad_flat) * n for g, n in groups),
        "layer_gathered": layer.gathered, "layer_flat": _r(N * layer.flat),
        "layer_grads": layer.grad_unsharded, "layer_mlp_grads": layer.grad_mlp,
        "layer_rs_in": _r(N * layer.grad_flat), "layer_grads_s": _r(layer.grad_flat),
        "tail_grads": tail.grad_unsharded, "tail_rs_in": _r(N * tail.grad_flat), "tail_grads_s": _r(tail.grad_flat),
        "embed_gathered": embed.gathered, "embed_flat": _r(N * embed.flat),
        "embed_grads": embed.grad_unsharded, "tail_flat": _r(N * tail.flat),
        "kept": tail.gathered + root.gathered,  # gathered from their forward into backward
        "tail_tied": tail.gathered if spec.tied_embeddings else 0 * N,
        "root": root.gathered,
    }
    return out


def fsdp_totals(spec, method: str, wb: int, targets: tuple, N, r, optimizer: str, act: dict, sharding: str,
                layer_input, gc: bool = False):
    """(totals, parts): rank 0's bytes at the forward / backward / optimizer moments (``totals``, stacked like
    ``estimate``'s phases, without the step's inputs) and the breakdown parts at each (lists of 3 arrays).

    ``act``: the unsharded step's activation moments (``estimate._activations``); the gathered groups live at
    each moment are added to them. ``layer_input``: bytes of one decoder layer's input (what checkpointing
    keeps per layer). Backward moments: the loss gradients (tail and root still gathered); inside and at
    the end of the top layer, the one below it and the bottom one (``in_layer``: its gathered parameters and
    unsharded gradients, the next group's all-gather buffer, the last reduce-scatter's input, which FSDP2
    keeps until the next reduce-scatter, the shards of the layers done); the embedding at the end. Forward
    moments: the logits (an untied tail's all-gather buffer still held), inside the last layer, at the last
    layer's all-gather (the previous layer's buffer still held). ``sharding``: "fsdp" / "zero3" (the same
    FSDP2 figure). ``benchmarks/memory_accuracy.py --sharded`` is the check (vs ``simulate``; tiny, and
    SmolLM2-135M and Mistral-7B cut to 2 layers; LoRA / full, checkpointing on / off, N in {2, 4, 8, 64}:
    48 rows, median 0.05 %, p90 0.96 %, max 1.57 %). At full depth,
    Llama-3.1-8B on 8 GPUs (seq 2048, checkpointing): LoRA -0.23 %, full fine-tuning -0.00 % (the end-of-backward
    moment leaves out the embedding's unsharded gradient: with it, +8.2 % above ``simulate``, whose backward
    never reached that; only that one full-depth case pins this term)."""
    g = fsdp_groups(spec, method, wb, targets, N, r, optimizer)
    full, L, z = method == "full", spec.num_layers, 0 * N
    static = g["weights"] + g["adapters"] + g["states"]
    kept = g["kept"]
    tied_full = spec.tied_embeddings and full  # the shared embedding's gradient builds up over all of backward
    persist = g["root"] + g["tail_tied"]
    end_g = g["embed_gathered"] + persist  # its all-gather buffer is freed before the embedding's backward
    tail_unsh = g["tail_grads"] if tied_full else z
    freed = layer_input if gc else act["block_saved"]  # what one layer's backward frees of its saved activations

    def in_layer(k, end: bool):
        """(activations, gathered, gradients) inside layer k's backward (k = L - 1 first), or at its end.

        FSDP2: layer k is gathered and the next group in backward (layer k - 1, or the embedding) already
        prefetched into its all-gather buffer; the layers above have reduce-scattered their gradients into
        shards, and the input of the last reduce-scatter (the tail's, or layer k + 1's) is kept until the next
        one is issued, in layer k's post-backward hook. Autograd makes layer k's unsharded gradients as it
        goes: inside the block (at its MLP input gradient, estimate's ``backward_block``) only its MLP output
        linear's (autograd reaches it first; the input-side MLP weights' come after that moment's
        temporaries); at its end (its input norm's backward, estimate's ``backward_norm``) all of them, and
        its saved activations are freed but for the norm's. The layers above freed theirs (checkpointing:
        their inputs)."""
        above = L - 1 - k
        gathered = g["layer_gathered"] + (g["layer_flat"] if k > 0 else g["embed_flat"]) + persist
        a = (act["backward_norm"] - (0 if gc else act["block_saved"]) if end else act["backward_block"]) \
            - above * freed
        grads = ((g["layer_grads"] if end else g["layer_mlp_grads"]) + above * g["layer_grads_s"]
                 + (g["tail_rs_in"] if above == 0 else g["layer_rs_in"]) + g["tail_grads_s"] + tail_unsh)
        return a, gathered, grads if full else z
    # the step's extremes: each term is linear in k but the kept reduce-scatter input (the tail's above layer
    # L - 1, a layer's below): the top layer, the one below it and the bottom one
    layers = sorted({L - 1, max(L - 2, 0), 0})
    moments = [(act["backward"], kept, z)]  # the loss gradients: tail and root still gathered
    moments += [in_layer(k, end) for k in layers for end in (False, True)]
    moments += [(act["backward_end"], end_g, g["grads"] + (tail_unsh if full else 0))]
    tot = [static + a + gathered + grads for a, gathered, grads in moments]
    bwd_i = np.argmax(np.stack(tot), axis=0)
    pick = lambda xs: np.choose(bwd_i, [np.broadcast_to(x, np.shape(tot[0])) for x in xs])  # noqa: E731
    # forward (FSDP2 in program order): a block is all-gathered in its pre-forward, into a new buffer, while the
    # buffer of the previous all-gather is still held (freed once the new one is copied out); the block is
    # resharded after its forward. Moments: at the logits (tail and root gathered, the tail's buffer held until
    # the next all-gather, in backward); inside the last block (its parameters and its buffer); at the last
    # block's all-gather (its parameters, its buffer and the previous block's)
    tail_flat = 0 * N if spec.tied_embeddings else g["tail_flat"]  # a tied tail was gathered first, not last
    prev_flat = g["layer_flat"] if L > 1 else (g["tail_flat"] if spec.tied_embeddings else g["embed_flat"])
    f_moments = [  # (activations, gathered)
        (act["forward_logits"], kept + tail_flat),
        (act["forward_block"], g["layer_gathered"] + g["layer_flat"] + persist),
        (act["forward_between"], g["layer_gathered"] + g["layer_flat"] + prev_flat + persist),
    ]
    f_tot = np.stack([a + gathered for a, gathered in f_moments])
    f_i = np.argmax(f_tot, axis=0)
    fwd_gathered = np.choose(f_i, [np.broadcast_to(m[1], f_i.shape) for m in f_moments])
    totals = np.stack([static + np.max(f_tot, axis=0), np.max(np.stack(tot), axis=0),
                       static + g["grads"] + g["opt_tmp"]])
    parts = {
        "weights": [g["weights"] + fwd_gathered, g["weights"] + pick([m[1] for m in moments]), g["weights"]],
        "quant_constants": [z, z, z],
        "adapters": [g["adapters"]] * 3,
        "gradients": [z, pick([m[2] for m in moments]), g["grads"]],
        "optimizer_states": [g["states"]] * 3,
    }
    return totals, parts


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
