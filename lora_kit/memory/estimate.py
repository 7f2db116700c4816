"""Memory estimate of one training step: ``simulate`` in closed form, microseconds, vectorizable.

Where a fit of ``simulate`` exists for the model and the step's categorical settings (shipped, cached, or made on
the spot: :mod:`lora_kit.memory.fits`), the figure is that fit evaluated (:mod:`lora_kit.memory.calibrate`: exact
integer polynomials in tokens, micro-batch and rank, blocks added per layer type), and ``memory_model`` says
"fitted". FSDP2's own step (``fsdp`` / ``zero3`` with LoRA or full fine-tuning, AdamW or SGD, no offload) is
fitted per GPU count from ``simulate``'s sharded runs. A step that differs from a fit only in its static parts --
another optimizer whose step composes, sharding (ZeRO-1/2, ZeRO-3 / FSDP with QLoRA, offload or other optimizers) --
is that fit composed with the exact static arithmetic (:mod:`lora_kit.memory.compose`; full fine-tuning only from a
fit that extrapolates each operator in depth), and ``memory_model`` says "composed (...)", naming what was
composed. Otherwise -- catalog settings no shipped fit covers -- the hand-written arithmetic below gives it, and
``memory_model`` says "arithmetic (not fitted)". What follows describes that arithmetic.

What is counted is defined in ``design.md`` ("one training step" = the second step of a loop:
forward with ``labels=input_ids``, ``loss.backward()``, ``optimizer.step()``,
``zero_grad(set_to_none=True)``; peak = max bytes of live tensors, each storage rounded up to
512 bytes, counting everything already live). The loop is the one the HF Trainer runs: the model
output (and with it the logits) is dropped once the loss is taken, so logits do not stay live
through backward.

How it is built (exact by construction where the arithmetic allows it):

- **Static parts** are counted per parameter tensor with 512-byte rounding: base weights in
  ``dtype`` (full fine-tuning with ``autocast=True`` keeps fp32 master weights), LoRA A/B in fp32
  (peft's default), QLoRA NF4 weights (two 4-bit values per byte) plus their constants (fp32 absmax
  per 64-block, or with double quant an 8-bit absmax per block plus an fp32 absmax per 256 blocks
  and the code tables). QLoRA follows ``prepare_model_for_kbit_training`` as users call it: the
  non-quantized tensors (embeddings, norms, lm_head, biases) are up-cast to fp32, so the residual
  stream and the logits are fp32 too.
- **Saved activations** are listed storage by storage for one decoder block of the actual
  architecture: the fp32 copies RMSNorm makes, the fp32 input copies peft casts for each LoRA
  layer (one per adapter, since each casts separately; shared when the stream is already fp32),
  LoRA A outputs, the attention inputs and outputs SDPA keeps (K/V not repeated: GQA stays
  grouped) or eager attention's ``B*H*S*S`` scores (fp32 softmax plus its cast) and repeated K/V,
  the MLP's gate/up/activation outputs (gated) or up/activation (plain). Gradient checkpointing
  keeps only each block's input plus one block's recomputation during backward.
- **Padding** (``padding``): a padded batch (``"max_length"``, or ``"longest"`` with more than one row)
  makes transformers build a ``(B, 1, S, S)`` bool mask; with SDPA each layer keeps its cast to the
  compute dtype and K/V repeated to all query heads (GQA is off with a mask); checkpointing keeps the
  bool mask as every block's input. The collator's attention_mask and labels are live all step.
  Block 0 reads the frozen embedding's output: a sub-block it enters without a LoRA layer on its
  inputs saves nothing (GPT-NeoX's MLP beside targeted attention). Partial rotary narrows cos/sin.
- **Logits and loss**: ``B*S*V`` logits in the compute dtype, transformers' fp32 up-cast for the
  loss, the saved log-softmax, and in backward the NLL and log-softmax gradients (3 fp32 copies).
- **Phases**: forward (saved activations + the loss' temporaries), backward (at its start: the
  loss gradients; at the last norm; inside a checkpointed block; at its end: all gradients) and
  the optimizer step (gradients + states + the step's temporaries, e.g. ``foreach`` AdamW's
  ``sqrt(v)`` copy). The peak is the largest; ``phase`` names it and ``breakdown`` is the
  composition at that moment (it sums to ``peak_allocated_bytes``).
- **Optimizer states**: AdamW 2 per trainable parameter in its dtype (fp32 for LoRA adapters);
  adamw_8bit 2 bytes + blockwise fp32 constants per 256 (tensors under 4096 elements stay 32-bit);
  paged optimizers keep states in CUDA unified memory, outside PyTorch's allocator, so they add 0
  to ``peak_allocated_bytes`` (they still need host RAM and page in when the GPU has room); sgd
  (no momentum) 0; adafactor factored row + column statistics for matrices, full for vectors.
- **Gradient accumulation** does not change the peak: the gradient buffers exist after the first
  micro-batch anyway and each micro-batch frees its activations. ``grad_accum`` is accepted for
  API symmetry and recorded in ``settings``.
- **Multi-GPU, per GPU**: ddp keeps everything plus DDP's gradient buckets (a second copy of the
  gradients, ``gradient_as_bucket_view=False``); zero1 shards optimizer states over ``num_gpus``;
  zero2 also gradients; zero3 / fsdp also parameters, plus the gathered working block (2 blocks:
  current + prefetch). ``cpu_offload`` moves the sharded optimizer states (zero3/fsdp: also the
  parameter shards) to host memory. For ``fsdp`` / ``zero3`` with LoRA or full
  fine-tuning (no offload, adamw or sgd) the figure is instead FSDP2's, group by group as
  ``simulate`` runs it (:mod:`lora_kit.memory.fsdp_math`: padded per-parameter shards, the groups
  gathered at each moment -- a tied embedding all step, the untied one again at the end of
  backward -- flat all-gather and reduce-scatter buffers, sharded optimizer states; within 1.6 % of
  ``simulate`` on ``benchmarks/memory_accuracy.py --sharded``); zero1, zero2, QLoRA, ``cpu_offload``
  and the 8-bit / paged / adafactor optimizers keep the arithmetic above. ``zero2`` / ``zero3`` launch
  DeepSpeed (the accelerate config lora_kit writes), so both add DeepSpeed's gradient bucket
  (``DEEPSPEED_REDUCE_BUCKET`` elements of the trained dtype: 1 GB in bf16, whatever the model's size); its
  other buffers are not modelled (``benchmarks/deepspeed_accuracy.py``: tiny fp32, 2 ranks, within 0.21 %
  of the measured rank-0 peak with DeepSpeed's default buckets). ``simulate``'s zero2 / zero3 are FSDP2's
  modes and have no such bucket.

``device_total_bytes`` is what the process adds to the card (:mod:`lora_kit.memory.device`): the CUDA context,
torch's reserved memory (the peak plus a closed form fitted on replays of PyTorch's caching allocator over
``simulate``'s steps), the memory outside the allocator, and NCCL's buffers per rank on several GPUs. Paged
optimizer states are shown apart ("resident when room"), never in a fit verdict.

Known limits: architectures outside llama / mistral / qwen2 / qwen3 / gemma / gemma2 / phi3 /
gpt_neox are read from a meta-device build and their activations modelled as a Llama-like block;
mixture-of-experts blocks (router, dispatch buffers, experts, LoRA on experts) by :mod:`lora_kit.memory.moe`;
DeepSeek's multi-head latent attention by :mod:`lora_kit.memory.mla` (the CPU kernel's math path: on CUDA less);
``autocast=True`` counts autocast's 16-bit weight copies, LoRA's 16-bit input copies, QLoRA's 16-bit
attention, the K/V cache's copies beside them and the forward's moments a block holds (SmolLM2-135M cut to 2
layers: within 0.003 % of ``simulate``, 8 settings; the embedded tiny model without checkpointing: within
0.21 % of real CPU steps, with checkpointing within 0.44 %: full fine-tuning's recomputed blocks at their MLP's
output-projection weight gradient and product backward, before the gate/up gradients exist, -0.18 %, was +3.77 %);
DeepSpeed / FSDP communication buffers are not counted; full fine-tuning's backward end counts
the fp32 ``V x h`` buffer the CPU embedding-backward kernel accumulates into (in fp32 it is the embedding's
gradient itself unless tied to lm_head, then it and its sum with lm_head's gradient) (what ``simulate`` sees:
the CUDA kernel accumulates per unique token instead, so on a GPU this term is smaller -- ``gpu_validate`` measures
it); SDPA saves what the CPU flash kernel saves (same as CUDA flash / memory-efficient: output and
fp32 logsumexp); AdamW's ``step`` scalars live on the host on CUDA and are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.calibrate import largest_phase
from lora_kit.memory.compose import (DEEPSPEED, GRADIENTS_SHARDED, STATES_SHARDED, SWAPPABLE, WEIGHTS_SHARDED, compose,
                                    deepspeed_bucket_bytes, label, static_terms)
from lora_kit.memory.device import device_kwargs, device_total
from lora_kit.memory.device import alloc_bytes as _r
from lora_kit.memory.fsdp_math import fsdp_totals
from lora_kit.memory.mla import is_mla, mla_attention, mla_rope_bytes
from lora_kit.memory.moe import expert_lora, expert_lora_tensors, moe_block
from lora_kit.memory.loops import loop_terms, sft_head
from lora_kit.memory.specs import ModelSpec, check_targets, model_spec
from lora_kit.memory.static import DTYPE_BYTES, tensor_bytes
from lora_kit.memory.static import block_weight_bytes as _block_weight_bytes
from lora_kit.memory.static import optimizer_state_bytes as _opt_state
from lora_kit.memory.static import optimizer_temp_bytes as _opt_temp
from lora_kit.memory.static import static_bytes as _static
from lora_kit.memory.static import trainable_shapes as _trainable
from lora_kit.memory.static import trainable_tensors as _trainable_tensors
from lora_kit.settings import Step, as_step, check_axes

PHASES = ("forward", "backward", "optimizer")
FP32_SCALED_NORMS = ("gemma", "gemma2", "gemma3_text")  # RMSNorm output = normalized * (1 + weight.float())
ROPE_BY_CAT = ("phi3", "gpt_neox")  # apply_rotary_pos_emb returns cat([rotated, pass-through], -1)


@dataclass
class Estimate:
    """Result of :func:`estimate` (the same shape as ``simulate``'s result)."""
    peak_allocated_bytes: int
    device_total_bytes: int
    breakdown: dict
    phase: str
    settings: dict = field(default_factory=dict)
    memory_model: str = ""  # "fitted" (the closed form of simulate; with the libraries it was fitted with when they
    # differ from the installed ones) or "arithmetic (not fitted)"

    def to_dict(self) -> dict:
        return {"peak_allocated_bytes": self.peak_allocated_bytes, "device_total_bytes": self.device_total_bytes,
                "breakdown": dict(self.breakdown), "phase": self.phase, "settings": dict(self.settings),
                "memory_model": self.memory_model}




def _rotary_dim(spec: ModelSpec) -> int:
    """Rotary embedding width: head_dim times the partial rotary factor, wherever the config keeps it."""
    c = spec.config
    f = ((c.get("rope_parameters") or {}).get("partial_rotary_factor") or c.get("partial_rotary_factor")
         or c.get("rotary_pct") or 1.0)
    return int(spec.head_dim * f)


def _layer_types(spec: ModelSpec) -> list:
    """Attention type of every block ("sliding_attention" | "full_attention"), from ``layer_types`` or Gemma-3's
    ``sliding_window_pattern`` (every pattern-th block global); all full when the config has no sliding window."""
    c, n = spec.config, spec.num_layers
    if c.get("layer_types"):
        return list(c["layer_types"])[:n]
    pattern = c.get("sliding_window_pattern")
    if c.get("sliding_window") and pattern:
        return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def _norms_per_layer(spec: ModelSpec) -> int:
    """Norms of one block: Gemma-3 has four (pre/post attention, pre/post MLP) like Gemma-2, read generically as two."""
    return 4 if spec.model_type == "gemma3_text" else spec.norms_per_layer


def _qk_norm(spec: ModelSpec, T, lora: bool, e: int):
    """What the q/k RMSNorms keep per block: their fp32 input copies and rsqrt (full fine-tuning: also the
    normalized output, for the weight's gradient). Qwen3 and Gemma-3 normalize per head (rsqrt per head),
    OLMo-2 over the full q / k width (rsqrt per token); other families have none."""
    return sum(_qk_norm_parts(spec, T, lora, e))


def _qk_norm_parts(spec: ModelSpec, T, lora: bool, e: int) -> tuple:
    """:func:`_qk_norm` as (the q norm's, the k norm's): block 0 keeps a norm's only if its projection is targeted."""
    H, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    per_head = spec.model_type in ("qwen3", "qwen3_moe", "gemma3_text")
    if not per_head and spec.model_type != "olmo2":
        return 0, 0
    rows_q, rows_k = (T * H, T * kv) if per_head else (T, T)
    q, k = _r(T * H * d * 4) + _r(rows_q * 4), _r(T * kv * d * 4) + _r(rows_k * 4)
    return (q, k) if lora else (q + _r(T * H * d * e), k + _r(T * kv * d * e))


def _rope_bytes(spec: ModelSpec, S, e: int):
    """cos/sin of the rotary embedding (+ inv_freq buffers): OLMo-2 keeps them in fp32, Gemma-3 has one pair per
    attention type (local and global rotary); partial rotary narrows them."""
    rd = _rotary_dim(spec)
    eb = 4 if spec.model_type == "olmo2" else e
    pairs = len(set(_layer_types(spec))) if spec.model_type == "gemma3_text" else 1
    return pairs * (2 * _r(S * rd * eb) + 2 * _r(rd // 2 * 4))


def _window_masks(spec: ModelSpec, S) -> int:
    """Blocks whose sliding window is shorter than the sequence (Gemma-3): transformers builds them a
    (B, 1, S, S) mask, and SDPA keeps its cast to the compute dtype in each such block."""
    if spec.model_type != "gemma3_text" or not spec.config.get("sliding_window"):
        return 0 * S
    n = sum(t == "sliding_attention" for t in _layer_types(spec))
    return np.where(S > int(spec.config["sliding_window"]), n, 0)


def _kv_cache(spec: ModelSpec, method: str, autocast: bool, gc: bool, attn: str, loop: str, T, masked,
              repeated: bool, e: int, ea: int, es: int):
    """What one block's K/V cache holds beyond what attention saves, live through the forward only.

    Without checkpointing transformers builds a ``DynamicCache`` in training too (config ``use_cache``, on by
    default; checkpointing and TRL's loss turn it off): each block's ``update`` keeps a concatenated copy of K
    (after the rotary embedding) and V, and attention reads those copies; the cache dies with the model's output,
    before backward. Where attention saves the very copies (same dtype, K/V not repeated) they are counted in its
    saved tensors already; otherwise -- autocast casting them for SDPA, ``repeat_kv`` copying them to every query
    head -- the cache's copies are extra. Under autocast the projections return bf16 (QLoRA: fp32, bitsandbytes
    casts its output back to the input's dtype) and K is promoted to fp32 by the rotary cos/sin, which are in the
    embedding output's dtype ``es`` (fp32 weights, QLoRA's up-cast embedding)."""
    if gc or loop == "sft" or not spec.config.get("use_cache", True):
        return 0
    kv, d = spec.num_kv_heads, spec.head_dim
    ev = (4 if method == "qlora" else 2) if autocast else e
    ek = max(ev, es)
    if attn == "sdpa":
        saved, copied = ea, masked & repeated
    else:  # eager: the matmuls save K/V repeated to every query head (GQA) in the stream dtype
        saved, copied = e, kv < spec.num_heads
    return np.where(copied | (ek != saved), _r(T * kv * d * ek), 0) + np.where(copied | (ev != saved),
                                                                             _r(T * kv * d * ev), 0)


def _autocast_casts(spec: ModelSpec, method: str, dtype: str, targets: tuple, r, first_free: bool):
    """16-bit weight copies autocast makes and the matmuls keep for backward: (one block's, lm_head's, what block 0
    keeps less, one block's that autocast's cache holds until the forward ends: copies of weights that need grad).
    Full fine-tuning: one cached copy of every linear and of lm_head (fp32 leaves that need grad).
    LoRA / QLoRA: one cached copy of every adapter A and B; a copy of an fp32 frozen lm_head (QLoRA's up-cast,
    LoRA on fp32 weights) and, on fp32 base weights, of every frozen linear per call, kept for the input's
    gradient. Block 0 keeps no copy of its attention-input A matrices (nor of their fp32 base weights) when its
    input needs no gradient (``first_free``); the A copies are cached all the same until the forward ends (the
    fifth value: autocast caches copies of leaves that need grad only)."""
    head = _r(spec.vocab_size * spec.hidden_size * 2)
    L = spec.num_layers
    share = [lin.layers or L for lin in spec.linears]  # DeepSeek: the dense MLP in block 0 only, the shared experts'
    # in the others: one block's copies are their average over the blocks (whole bytes: exact unless they differ)
    if method == "full":
        block = sum(_r(lin.out_features * lin.in_features * 2) * n for lin, n in zip(spec.linears, share)) // L
        return block, head, 0, block, 0
    base = method == "lora" and dtype == "float32"
    block, first, cached, first_cached = 0, 0, 0, 0
    for lin, n in zip(spec.linears, share):
        w = _r(lin.out_features * lin.in_features * 2) * n // L if base else 0
        ab = (_r(r * lin.in_features * 2) + _r(lin.out_features * r * 2)) * n // L if lin.name in targets else 0
        block, cached = block + w + ab, cached + ab
        spared = _r(r * lin.in_features * 2) * (lin.name in targets) if first_free and lin.kind == "attn_in" else 0
        first, first_cached = first + spared + (w if first_free and lin.kind == "attn_in" else 0), first_cached + spared
    return block, (head if base or method == "qlora" else 0), first, cached, first_cached


def _activations(spec: ModelSpec, method: str, dtype: str, autocast: bool, gc: bool, attn: str, targets: tuple,
                 T, B, S, r, padding: str, experts: dict | None, loop: str) -> dict:
    """Activation bytes (arrays over the broadcast shape) at the moments that can hold the peak."""
    h, i, H, kv, d, V, L = (spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads,
                            spec.head_dim, spec.vocab_size, spec.num_layers)
    e = 4 if method == "qlora" else (2 if autocast else DTYPE_BYTES[dtype])  # compute dtype of the stream
    lora = method != "full"
    cast = lora and e != 4  # peft casts each LoRA input to fp32 separately
    # under autocast (LoRA) that fp32 copy is cast to 16-bit again for the LoRA matmul: the 16-bit one is kept
    ce = 2 if (autocast and lora) else 4
    ea = 2 if autocast else e  # attention's tensors: autocast runs SDPA in 16-bit (QLoRA's fp32 stream too)
    # the embedding output's dtype, which the rotary cos/sin take: under autocast the weights' (fp32 for full
    # fine-tuning and for QLoRA's up-cast embedding)
    es = (4 if method in ("full", "qlora") else DTYPE_BYTES[dtype]) if autocast else e
    width = {"attn_in": h, "attn_out": H * d, "mlp_in": h, "mlp_out": i}
    n_t = {k: sum(1 for lin in spec.linears if lin.kind == k and lin.name in targets) for k in width}
    # -- one block's saved tensors --
    if spec.norm_bias:  # LayerNorm keeps its input (in the stream dtype) and mean / rstd
        norm = _r(T * h * e) + 2 * _r(T * e)
        norms = _r(T * h * e) + spec.norms_per_layer * 2 * _r(T * e) if spec.parallel_residual else \
            spec.norms_per_layer * norm  # parallel residual: both norms read (and keep) the same input
    else:  # RMSNorm: fp32 input copy + rsqrt; full fine-tuning also keeps the normalized input (weight grad)
        # full fine-tuning under autocast keeps the normalized input in fp32 (the stream stays fp32)
        # (Gemma's norms scale by ``1 + weight.float()``: in fp32 whatever the dtype)
        kept = 4 if autocast or spec.model_type in FP32_SCALED_NORMS else e
        norm = _r(T * h * 4) + _r(T * 4) + (0 if lora else _r(T * h * kept))
        norms = _norms_per_layer(spec) * norm
    # what block 0 saves less: its input needs no grad (OLMo-2 normalizes block outputs: no input norm to spare)
    first_free = norms if spec.parallel_residual else (0 if spec.model_type == "olmo2" else norm)
    block = norms
    group = {}
    for kind, w in width.items():
        # SDPA returns its output in the query's layout; transformers makes it (B, S, H, d)-contiguous for the output
        # projection: the same storage when the query is a transposed view, a copy when the rotary embedding
        # concatenated it into a (B, H, S, d)-contiguous tensor (Phi-3, GPT-NeoX: ``cat([rotated, passed])``)
        shared_with_attn = kind == "attn_out" and attn == "sdpa" and spec.model_type not in ROPE_BY_CAT
        if not lora:
            # under autocast each linear casts the fp32 stream to 16-bit on its own and keeps that copy
            each = sum(lin.kind == kind for lin in spec.linears) if autocast and kind in ("attn_in", "mlp_in") else 1
            group[kind] = 0 if shared_with_attn else each * _r(T * w * e)
        elif n_t[kind]:
            copies = n_t[kind] if cast or ce == 2 else (0 if shared_with_attn else 1)
            group[kind] = copies * _r(T * w * ce) + n_t[kind] * _r(T * r * ce)
        else:
            group[kind] = 0
        block = block + group[kind]
    # DeepSeek's multi-head latent attention: its own linears' widths, latent norms, cache and kernel (memory.mla)
    mla = mla_attention(spec, lora=lora, targets=targets, e=e, ce=ce, cast=cast, attn=attn, T=T, B=B, S=S, r=r,
                        cache=not gc and loop != "sft" and spec.config.get("use_cache", True)) if is_mla(spec) else None
    if mla is not None:
        block = block - group["attn_in"] - group["attn_out"] + mla["attn_in"] + mla["attn_out"]
        group["attn_in"], group["attn_out"] = mla["attn_in"], mla["attn_out"]
    v_bytes = _r(T * kv * d * ea)
    # a padded batch: transformers builds a (B, 1, S, S) bool mask; SDPA casts it to the compute dtype in every
    # layer and, with a mask, GQA is off: repeat_kv copies K and V out to all H heads (both kept for backward)
    masked = (padding == "max_length") | ((padding == "longest") & (B > 1))
    bool_mask = np.where(masked, _r(B * S * S), 0) if attn == "sdpa" else 0
    kv_repeat = 0 if kv == 1 else 2 * (_r(T * H * d * ea) - v_bytes)  # one K/V head: repeat_kv is a view
    # sliding-window blocks shorter than the sequence get a mask even unpadded: its cast, K/V repeated
    window = np.where(masked, 0, _window_masks(spec, S) * (_r(B * S * S * ea) + kv_repeat)) if attn == "sdpa" else 0
    if attn == "sdpa":
        attn_base = _r(T * H * d * ea) + _r(T * kv * d * ea) + v_bytes + _r(T * H * d * ea) + _r(B * H * S * 4)
        attn_base = attn_base + np.where(masked, _r(B * S * S * ea) + kv_repeat, 0)
    else:
        kv_rep = _r(T * H * d * e) if kv < H else None
        k_b = kv_rep if kv_rep is not None else _r(T * kv * d * e)
        v_b = kv_rep if kv_rep is not None else v_bytes
        scores = B * H * S * S
        attn_base = _r(T * H * d * e) + k_b + v_b + _r(scores * 4) + (_r(scores * e) if e != 4 else 0)
        if spec.attn_softcap:
            attn_base = attn_base + _r(scores * e)
    attn_base = attn_base + _qk_norm(spec, T, lora, e)
    kv_cache = _kv_cache(spec, method, autocast, gc, attn, loop, T, masked, kv_repeat != 0, e, ea, es)
    if mla is not None:  # the math path keeps no mask (it adds it), and K / V are per head already
        attn_base, kv_cache = mla["base"], mla["cache"]
    mlp_base = (3 if spec.gated_mlp else 1) * _r(T * i * e)
    moe = _moe_terms(spec, method, dtype, autocast, e, experts, group, T, r) if spec.moe else None
    if moe is not None:
        mlp_base = mlp_base if moe["dense_mlp"] else 0
        block = block + moe["saved"]
    block = block + attn_base + mlp_base
    # block 0 reads the frozen embedding's output (no grad): a sub-block it enters without a LoRA layer on
    # its inputs saves nothing (GPT-NeoX: the MLP beside targeted attention; any family: untargeted attention,
    # and then a sequential MLP too unless its inputs are targeted)
    if lora and spec.parallel_residual:
        first_free = first_free + (0 if n_t["attn_in"] else attn_base) + (0 if n_t["mlp_in"] else mlp_base)
    elif mla is not None and lora and n_t["attn_in"]:  # MLA: what its block 0 keeps less (memory.mla)
        first_free = first_free + mla["first_free"]
    elif lora and n_t["attn_in"]:  # q/k norms (Qwen3, Gemma-3, OLMo-2): block 0 keeps one only if its projection is
        # targeted
        qn, kn = _qk_norm_parts(spec, T, lora, e)
        first_free = first_free + (0 if "q_proj" in targets else qn) + (0 if "k_proj" in targets else kn)
    elif lora and not n_t["attn_in"]:
        first_free = first_free + attn_base
        if not n_t["attn_out"]:  # the MLP's input has no grad either: only what its targeted inputs need
            mlp_names = [lin.name for lin in spec.linears if lin.kind == "mlp_in"]
            kept = {0: 0, 1: (2 if mlp_names[0] in targets else 1), 2: 3}[n_t["mlp_in"]] if spec.gated_mlp and \
                len(mlp_names) == 2 else (3 if spec.gated_mlp else 1) * bool(n_t["mlp_in"])
            first_free = first_free + norm + mlp_base - kept * _r(T * i * e)
    # forward inside the last block, at its widest MLP projection: peft adds base output + B(A(x)) * scale
    mlp_in = [lin for lin in spec.linears if lin.kind == "mlp_in"]  # none: MoE experts held as fused tensors
    wi = mlp_in[-1].out_features if mlp_in else i
    up_lora = lora and bool(mlp_in) and mlp_in[-1].name in targets
    stream = 3 * _r(T * h * e)  # embedding output (held by the model's forward), residual, norm output
    not_yet = group["mlp_out"] + (3 if spec.gated_mlp and wi > i else 1) * _r(T * i * e)  # fused gate_up: all
    fwd_transient = stream + _r(T * wi * e) + (2 * _r(T * wi * 4) if up_lora else 0) - not_yet
    if autocast and lora and mlp_in and any(lin.name in targets for lin in spec.linears if lin.kind == "mlp_out"):
        # under autocast the MLP's output projection can hold the forward's peak instead: at its LoRA sum live
        # the embedding output and the MLP's input (stream dtype ``es``) -- with a 16-bit stream also the block's
        # input and its residual, which the norms do not keep (they keep fp32 copies) --, the MLP product it reads (the
        # projections' output dtype ``eo``: bf16, QLoRA fp32) and, if that is not fp32, peft's fp32 cast of it
        # for the fp32 A matrix, and three h-wide outputs: LoRA -- the base output, B's output and its scaled
        # copy; QLoRA -- peft's clone of the base output, the scaled LoRA output cast back to fp32 (peft casts
        # when ``torch.is_autocast_enabled()`` is false, as it is for CPU autocast) and their sum
        eo = 4 if method == "qlora" else 2
        stream_live = 2 if es == 4 else 3 + min(L - 1, 1)
        down = stream_live * _r(T * h * es) + _r(T * i * eo) + (_r(T * i * 4) if eo != 4 else 0) + 3 * _r(T * h * eo)
        fwd_transient = np.maximum(fwd_transient, down)
    if moe is not None:  # the routed experts' end (shared experts, if any, ran before them)
        fwd_transient = np.maximum(fwd_transient, 0) if moe["dense_mlp"] else 0 * T
        fwd_transient = np.maximum(fwd_transient, stream + moe["forward"])
    # backward inside a block, at the MLP input gradient (base + LoRA paths summed)
    if not lora:
        bwd_temps = 2 * _r(T * i * e)
    elif cast:
        bwd_temps = 2 * _r(T * i * e) + _r(T * i * 4)
    else:
        bwd_temps = 3 * _r(T * i * 4)
    bwd_temps = bwd_temps + (0 if gc and lora and not cast else 2 * _r(T * h * 4)) - group["mlp_out"]
    moe_temps = dense_temps = ds_shared = ds_dense = None
    # an fp32 stream's RMSNorm keeps its input itself, not a copy: with checkpointing the first norm's is the checkpoint's
    # input, counted with the block inputs (``block`` counts a copy)
    resid_saved = es == 4 and not spec.norm_bias
    own_input = _r(T * h * 4) if resid_saved else 0
    if moe is not None:  # routed experts' backward, or the end of a checkpoint's recomputed forward
        deepseek = spec.model_type.startswith("deepseek")  # DeepSeek: its MoE moments apart (moe.py's ``backward``)
        moe_bwd = moe["backward"] if deepseek else np.maximum(moe["backward_first"], moe["backward_late"])
        if gc and deepseek:  # DeepSeek's shared experts run after the routed ones, so
            # what they save (counted in the block) is not there at either moment: the routed experts' backward, with
            # the gradient at the block's output (the shared experts' backward has run and freed theirs), or the
            # recompute's end of the routed experts (the shared experts not run yet)
            i_s = spec.moe["shared_intermediate_size"]
            # (full fine-tuning: ``group["mlp_out"]`` is the product the down projection keeps, counted here at the
            # shared experts' width, not again)
            shared = (3 if spec.gated_mlp else 1) * _r(T * i_s * e) + (group["mlp_out"] if lora else _r(T * i_s * e)) \
                + group["mlp_in"]
            # (the routed backward: the gradient at the block's output and its sum with the shared experts' input
            # gradient, for the residual)
            moe_bwd = np.maximum(moe_bwd + 2 * _r(T * h * e), stream + moe["recompute"]) - shared - own_input
            if lora:  # peft never targets DeepSeek's MLP linears (their names mean the experts): a frozen gated MLP's
                # backward holds the gradient at the block's output, the down projection's input gradient and the
                # product's two; the shared experts' in the top block, the dense MLP's in the bottom one (block 0)
                ds_shared = _r(T * h * e) + 3 * _r(T * i_s * e) - own_input
                ds_dense = _r(T * h * e) + 3 * _r(T * i * e) - own_input
            else:  # full fine-tuning: block 0's MLP backward by the dense rule (estimate_arrays adds its gradients)
                ds_dense = bwd_temps
        elif gc:  # the gradient at the recomputed block's output waits through its experts' backward; or the
            # recompute's last moment (moe.py), less what the block saves after it: Qwen2-MoE's shared-expert gate's
            # LoRA input copy and A output
            gate = [lin for lin in spec.linears if lin.kind == "mlp_in" and lin.out_features == 1]
            post = sum(_r(T * h * ce) * (cast or ce == 2) + _r(T * r * ce) for lin in gate if lin.name in targets)
            # the recompute's stream (tensors of the stream's dtype ``es``) is the gradient at the block's output, the
            # residual and the norm output, each extra unless the block saved that very tensor: the residual when the
            # stream is fp32 (the RMSNorm's fp32 "copy" is the input itself), the norm output when a trained router
            # (full fine-tuning, LoRA on the router: its input) or peft's LoRA on an fp32 stream (no cast: the input
            # itself) keeps it (under autocast they keep 16-bit casts)
            gs = _r(T * h * es)
            norm_saved = not autocast and (method == "full" or bool((experts or {}).get("router")) or
                                           (lora and not cast and n_t["mlp_in"] > 0))
            rec_stream = gs + (0 if resid_saved else gs) + (0 if norm_saved else gs)
            # Qwen2-MoE: the gating multiply's and the gate's backward have made the shared expert output's gradient
            # and the gate's input gradient, which wait through the routed experts' backward, and freed the shared
            # expert output, the gate's LoRA input copy and A output; an fp32 stream's first norm keeps the
            # checkpoint's input itself (``block`` counts a copy)
            waiting = gs if moe["shared_first"] else 0
            moe_bwd = np.maximum(moe_bwd + gs + waiting, rec_stream + moe["recompute"] + moe["recompute_locals"]) - \
                post - own_input
        if moe["dense_mlp"] and moe["shared_first"]:  # the shared expert's backward, the routed experts' saved freed
            bwd_temps = bwd_temps - moe["saved"]
        if not deepseek:  # the recomputed bottom block holds different gradients at the two (estimate_arrays)
            moe_temps, dense_temps = moe_bwd, (bwd_temps if moe["dense_mlp"] else None)
        if ds_shared is not None:  # DeepSeek (LoRA, checkpointing): the top block's moments; the bottom's below
            bwd_temps = np.maximum(ds_shared, moe_bwd)
        else:
            bwd_temps = np.maximum(bwd_temps if moe["dense_mlp"] else 0, moe_bwd)
    attn_top = None  # the top block's softmax-backward moment (estimate_arrays adds the gradients made by then)
    if attn == "eager" or mla is not None:  # softmax backward: fp32 grad of the scores + its result, once the
        # MLP's saved are freed (MLA's SDPA takes the math path, which keeps fp32 probabilities like eager)
        scores = B * H * S * S
        mlp_saved = (3 if spec.gated_mlp else 1) * _r(T * i * e) + group["mlp_in"] + group["mlp_out"]
        attn_temps = (mla["softmax_bwd"] if mla is not None else 2 * _r(scores * 4) - (_r(scores * e) if e != 4 else 0)) \
            - mlp_saved - norm
        if mla is not None and gc:  # DeepSeek (checkpointing): the gradient at the attention's residual waits, the
            # output projection's backward has run, freeing what it kept, and an fp32 stream's first norm keeps the
            # checkpoint's input itself (``block`` counts a copy)
            attn_temps = attn_temps + _r(T * h * e) - group["attn_out"] - own_input
        # a MoE block's routed experts have freed their saved tensors too (DeepSeek's dense bottom block has none)
        attn_top = attn_temps - (moe["saved"] if moe is not None else 0)
        bwd_temps = np.maximum(bwd_temps, attn_top)
        if ds_dense is not None:
            ds_dense = np.maximum(ds_dense, attn_temps)
    first_norm_free = lora and not gc  # the frozen embedding's output needs no grad: block 0's norm saves nothing
    blk_casts, head_cast, first_casts, cached, first_cached = \
        _autocast_casts(spec, method, dtype, targets, r, first_norm_free) if autocast else (0, 0, 0, 0, 0)
    rope = _rope_bytes(spec, S, es) if mla is None else mla_rope_bytes(spec, S)  # cos/sin (in the embedding output's
    # dtype) + the inv_freq buffers
    final = norm + (_r(T * h * e) if not lora else 0)  # full fine-tuning: lm_head keeps its input
    # full fine-tuning under autocast: lm_head keeps its own 16-bit cast (in ``final``); the final norm's fp32
    # output, which the model holds until the loss is taken, is one more copy through the forward's end (QLoRA's fp32
    # stream too: its frozen lm_head keeps nothing, but the model holds that output all the same)
    head_in = _r(T * h * 4) if autocast and (not lora or method == "qlora") else 0
    el = 4 if method == "qlora" else e  # logits dtype (QLoRA: lm_head up-cast to fp32)
    # under autocast QLoRA's up-cast lm_head runs in 16-bit: its logits and their fp32 copy for the loss
    el_fwd = 2 if autocast and method == "qlora" else el
    loss_saved = _r(T * V * 4) + _r(T * 8) + 512
    if method == "full":
        loss_saved = loss_saved + _r(T * 8)  # embedding backward keeps the indices
    logits_fwd = _r(T * V * el_fwd) + (_r(T * V * 4) if el_fwd != 4 else 0)
    if spec.final_softcap:  # logits / cap, tanh, * cap: tanh's output is kept for backward, the division is freed
        loss_saved = loss_saved + _r(T * V * el)
    loss_bwd = 2 * _r(T * V * 4)  # backward start: the fp32 gradients of the loss and of the log-softmax
    if loop == "sft":  # TRL's fused LM head: no logits; the head's own saved tensors and tiles (memory.loops)
        head = sft_head(T, B, S, h, V, el, not lora)
        final, loss_saved, logits_fwd, loss_bwd = norm, head["saved"] + 512, head["forward"], head["backward"]
    # eager: a (B, 1, S, S) mask per attention type (Gemma-2: sliding and global); checkpointing keeps them as block
    # inputs through backward
    mask = len(set(_layer_types(spec))) * _r(B * S * S * e) if attn == "eager" else 0
    block_moments = moe_moments = None
    if gc:  # only block inputs stay; one block is recomputed during backward
        layers = L * _r(T * h * es) + rope + bool_mask  # block inputs (the stream dtype); the bool mask is one too
        layers = layers + np.where(window > 0, _r(B * S * S), 0)  # the sliding-window bool mask, an input too
        block = block + np.minimum(window, _r(B * S * S * e) + kv_repeat)  # the recomputed block's own mask
        layers, block = layers + head_cast, block + blk_casts  # autocast's copies: lm_head's, the recomputed block's
        fwd_block = layers + block + fwd_transient + (L - 1) * cached  # autocast's cache: earlier blocks' copies
        # the checkpoint keeps the eager mask as an input; lm_head's 16-bit copy is freed by its backward, before
        bwd_block = layers - head_cast + block + bwd_temps + mask
        # DeepSeek's bottom block is dense (``first_k_dense_replace``): no routed experts, its own MLP
        bwd_bottom = None if ds_dense is None else layers - head_cast + block - moe["saved"] + ds_dense + mask
        if moe_temps is not None:  # the routed experts' moments, and the shared expert's (Qwen2-MoE), apart
            moe_moments = (layers - head_cast + block + moe_temps + mask,
                           None if dense_temps is None else layers - head_cast + block + dense_temps + mask)
        if cast and not autocast and up_lora and moe is None:  # (MoE: the experts' end, above)
            # or while its forward is recomputed, at its widest MLP projection's LoRA sum (the forward's moment, the
            # embedding output being block 0's input here), with the gradients waiting at the block's output: two
            # in the 16-bit stream and the norm backward's fp32 one
            rec = fwd_transient + _r(T * h * e) + _r(T * h * 4)
            bwd_block = np.maximum(bwd_block, layers - head_cast + block + rec + mask)
        if autocast and lora and mlp_in and n_t["mlp_out"]:
            # or while its forward is recomputed under autocast, at the MLP output projection's LoRA A: the
            # gradients waiting at the block's output, the MLP's input, the residual (a 16-bit stream's: the norms
            # keep fp32 copies; an fp32 stream's is the norm's saved input), the base output, the MLP product and
            # peft's fp32 cast of it (stream dtype ``es``, projections' ``eo``); with an fp32 stream the first
            # norm keeps the checkpoint's saved input itself, not a copy
            eo = 4 if method == "qlora" else 2
            rec = (3 if es == 4 else 4) * _r(T * h * es) + _r(T * h * eo) + _r(T * i * eo) + \
                (_r(T * i * 4) if eo != 4 else 0) - (_r(T * h * 4) if es == 4 else 0)
            bwd_block = np.maximum(bwd_block, layers - head_cast + block + rec + mask)
        if method == "full" and autocast and spec.gated_mlp and mlp_in and moe is None and attn == "sdpa":
            # a recomputed block's backward -- the top block's, every block input kept, or the bottom block's, the
            # embedding output its only input left --, at two moments: (a) the MLP
            # output projection's weight gradient -- its 16-bit copy and the product still live, with the
            # gradient at the block's output (fp32), its 16-bit cast, the product's gradient and the 16-bit weight
            # gradient; (b) the product's backward (mul) -- the projection's fp32 gradient made and its 16-bit copy
            # freed, the product freed, its gradient and both of mul's outputs (the activation's and the up
            # projection's gradients) live with the gate/up outputs and the activation, before any gate/up weight
            # gradient exists. The first norm's fp32 input is the block input itself (fp32 stream), not a copy.
            # (activations only: estimate_arrays adds the gradients made by then)
            u, dn = _r(T * i * e), [lin for lin in spec.linears if lin.kind == "mlp_out"]
            dn_copy = sum(_r(lin.out_features * lin.in_features * 2) for lin in dn)
            top = layers - head_cast + block - _r(T * h * 4) + mask
            at_down = _r(T * h * 2) + u + _r(T * h * 4) + dn_copy  # the 16-bit weight gradient: the copy's size
            at_mul = 3 * u + _r(T * h * 4) - dn_copy - group["mlp_out"]
            bottom = top - (L - 1) * _r(T * h * es)
            block_moments = (top + at_down, top + at_mul, bottom + at_down, bottom + at_mul)
    else:
        layers = L * block - (first_free if first_norm_free else 0) + rope + window
        layers = layers + L * blk_casts + head_cast - first_casts  # autocast's 16-bit weight copies
        if moe is not None:  # dense blocks (DeepSeek's first) hold no routed experts
            layers = layers - (L - moe["blocks"]) * moe["saved"]
        fwd_block = layers + fwd_transient + first_cached  # autocast's cache keeps block 0's A copies till the end
        bwd_block = layers - head_cast + bwd_temps  # lm_head's backward has freed its 16-bit copy
        bwd_attn = None if attn_top is None else layers - head_cast + attn_top
    saved = layers + final + loss_saved
    fwd_block = fwd_block + L * kv_cache  # the cache holds every block's K/V through the forward
    # checkpointed (non-reentrant) blocks keep none of their saved tensors in the forward: the block inputs, the
    # stream and the running projection's outputs are live inside one
    in_fwd = fwd_block - block + not_yet if gc else fwd_block
    fwd = np.maximum(saved + logits_fwd + head_in + (L * cached if gc else 0) + L * kv_cache, in_fwd) + mask + \
        (0 if gc else bool_mask)
    bwd_start = saved + loss_bwd + (mask if gc else 0)
    bwd_norm = layers + norm + (4 if e == 4 else 5) * _r(T * h * 4) + _r(T * h * e)  # fp32: one cast is a no-op
    # full fine-tuning's embedding backward: the CPU kernel accumulates into one fp32 (V, h) buffer; in fp32 that
    # buffer becomes the embedding's gradient (counted with the gradients) unless the embedding is tied to lm_head,
    # whose gradient exists already: then the buffer and its out-of-place sum with that gradient; in 16 bits the
    # buffer is cast to the gradient's dtype
    emb_bwd = (2 * _r(V * h * 4) if spec.tied_embeddings else 0) if e == 4 else _r(V * h * 4)
    # the collator's attention_mask and labels (a tensor of their own when padded) are live all step
    inputs = 2 * _r(T * 8) if padding != "none" else (_r(T * 8) if loop == "sft" else 0 * T)  # SFT: an all-ones mask
    return {"inputs": inputs, "forward": fwd, "backward": np.maximum(bwd_start, bwd_norm), "backward_block": bwd_block,
            "backward_end": 2 * _r(V * h * 4) if method == "full" and autocast else  # fp32 grad of lm_head's copy
            _r(T * h * 4) + (_r(T * h * e) + emb_bwd if not lora else 0),
            # the two forward moments apart (sharded steps gather different groups at each)
            "forward_logits": saved + logits_fwd + head_in + (L * cached if gc else 0) + L * kv_cache + mask +
            (0 if gc else bool_mask),
            # checkpointed (non-reentrant) blocks keep none of their saved tensors in the forward: only the block
            # inputs, the stream and the running projection's outputs are live inside one (sharded steps only)
            "forward_block": (fwd_block - block + not_yet if gc else fwd_block) + mask + (0 if gc else bool_mask),
            "block_saved": _r(T * h * es) if gc else block,
            "backward_norm": bwd_norm, "backward_moments": block_moments, "moe_moments": moe_moments,
            "backward_bottom": bwd_bottom if gc else None, "backward_attn": None if gc else bwd_attn,
            # between blocks L - 2 and L - 1 (sharded: the last block's all-gather): what blocks 0 .. L - 2 saved, the
            # embedding output and the stream (checkpointing: every block's input)
            "forward_between": (layers - head_cast + (L - 1) * cached if gc else
                                layers - block - blk_casts - head_cast + 2 * _r(T * h * es))
            + (L - 1) * kv_cache + mask + (0 if gc else bool_mask)}


def _moe_terms(spec: ModelSpec, method: str, dtype: str, autocast: bool, e: int, experts, group: dict, T, r) -> dict:
    """A MoE block's routed part (:func:`lora_kit.memory.moe.moe_block`), with what the dense MLP terms must
    drop: a block without MLP linears (Mixtral, Qwen3-MoE) has no dense MLP, and its norm output is kept only
    as the router's input (full fine-tuning)."""
    w = 4 if method == "qlora" or (method == "full" and autocast) else DTYPE_BYTES[dtype]
    dense = any(lin.kind == "mlp_in" for lin in spec.linears)
    drop = 0 if dense else group["mlp_out"]
    if not dense:
        group["mlp_out"] = 0
    i, i_s = spec.intermediate_size, spec.moe["shared_intermediate_size"]
    if dense and i_s and i_s != i:  # DeepSeek: the dense terms are block 0's MLP; MoE blocks' shared experts are narrower
        drop = drop + (3 if spec.gated_mlp else 1) * (_r(T * i * e) - _r(T * i_s * e)) + \
            (_r(T * i * e) - _r(T * i_s * e) if method == "full" else 0)
    # the experts run in the residual stream's dtype: under autocast ``grouped_mm`` (and peft's W + B@A) are not cast,
    # so with fp32 weights the routed part stays fp32 while the attention's linears run in 16-bit
    ex = (4 if method in ("full", "qlora") else DTYPE_BYTES[dtype]) if autocast else e
    out = moe_block(spec, method, ex, w, experts or expert_lora(spec, ()), T, r, autocast)
    return {**out, "saved": out["saved"] - drop, "dense_mlp": dense, "blocks": len(spec.moe["moe_layers"])}


def estimate_arrays(spec, step: Step | None = None, **fields) -> dict:
    """Vectorized core of :func:`estimate` (the planner's engine).

    ``step``: the step (:data:`lora_kit.settings.PLANNING` when None); ``fields``: step fields changed from it,
    each a scalar, or for an integer field (``seq_len``, ``batch_size``, ``lora_rank``, ``num_gpus`` ...) an
    array: a sweep axis, numpy-broadcastable with the others and validated with the step
    (:func:`lora_kit.settings.check_axes`). Returns every ``breakdown`` key plus ``peak_allocated_bytes`` and
    ``device_total_bytes`` as int64 arrays, and ``phase`` as an array of phase names.

    The byte arithmetic is exact for every accepted setting: where a figure could pass int64's range (an eager
    ``B*H*S*S`` at millions of tokens) every array is an object array of Python ints instead. Memory grows with
    ``seq_len``, ``batch_size`` and ``lora_rank`` and shrinks with ``num_gpus``, so the corners of the sweep
    (computed in Python ints first) bound every row, and every term sums into a phase's total.
    """
    spec = model_spec(spec)
    axes = {k: v for k, v in fields.items() if np.ndim(v) > 0}
    s = as_step(step, **{k: v for k, v in fields.items() if k not in axes})
    ax = check_axes(s, **axes)
    seq_len, batch_size, lora_rank, num_gpus = (ax.get(k, getattr(s, k)) for k in ("seq_len", "batch_size", "lora_rank",
                                                                                    "num_gpus"))
    targets = check_targets(spec, s.method, lora_rank, s.lora_targets, s.attn_implementation)
    experts = expert_lora(spec, targets)  # MoE: what peft trains on the experts; linears it drops from targets
    targets = tuple(t for t in targets if t not in experts["dropped"])
    S, B, r, N = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (seq_len, batch_size, lora_rank,
                                                                               num_gpus)))
    if _fsdp_groups(spec, s):  # fitted per GPU count: one count per call here
        gpus = np.unique(N)
        fitted = _fit_for(spec, s.replace(num_gpus=int(gpus[0]))) if gpus.size == 1 else None
    else:
        fitted = _fit_for(spec, s)
    if fitted is not None and fitted[0].covers(S) and \
            fitted[0].weights(spec.num_layers, _filled_layer_types(spec)) is not None:
        # (else lengths of an unfitted regime, or a depth / layer pattern the fit does not describe: the arithmetic)
        return _fitted_arrays(spec, s, targets, experts, fitted, S, B, r, N)
    corners = [np.unique([a.min(), a.max()]).astype(object) for a in (S, B, r, N)]
    wide = _estimate_core(spec, s, targets, experts, *np.meshgrid(*corners, indexing="ij"))
    big = wide.pop("_bound") >= INT64_SAFE  # a figure beyond int64's range: every row in Python ints
    if S.size == 1:  # the one row is its own corner
        out = {k: v.reshape(S.shape) for k, v in wide.items()}
        if not big:
            out = {k: v if k == "phase" else v.astype(np.int64) for k, v in out.items()}
            out["device_total_bytes"] = device_total(out["peak_allocated_bytes"],  # int64's rounding, as in a sweep
                                                     **device_kwargs(spec, s.method, S * B, s.loop, N))
        out["memory_model"] = np.full(S.shape, ARITHMETIC, dtype=object)
        return out
    out = _estimate_core(spec, s, targets, experts, *(a.astype(object) if big else a for a in (S, B, r, N)))
    out.pop("_bound")
    out["memory_model"] = np.full(S.shape, ARITHMETIC, dtype=object)
    return out


@lru_cache(maxsize=1)
def _catalog_types() -> frozenset:
    from lora_kit.memory.specs import catalog, catalog_config
    return frozenset({catalog_config(n)["model_type"] for n in catalog()} | {"llama"})  # "tiny" is a Llama


def _fit_for(spec: ModelSpec, s: Step):
    """(fit, what it was fitted with, the optimizer it was fitted with) for this model and step: the step's own fit,
    else the same step's fit with AdamW (another optimizer is composed: :mod:`lora_kit.memory.compose`), else one
    fitted now when ``lora_kit.memory.fits.should_fit`` says so; None: the arithmetic below.

    Full fine-tuning is composed only from a fit whose operators are extrapolated one by one in depth
    (``Fit.aligned``): an older fit extrapolates each shallow stack's largest operator, and the end of backward
    (every gradient made) is outgrown at two or three blocks but can hold the peak at full depth once the states are
    small (Phi-4-mini, full, SGD, 2,048 tokens: the stacks' largest operators extrapolated were 26.7 % below
    ``simulate``)."""
    if not spec.config:
        return None
    from lora_kit.memory import fits
    if _fsdp_groups(spec, s):  # FSDP2's own step at this GPU count, fitted as simulate runs it
        found = fits.lookup(spec.config, s)
        return (*found, s.optimizer) if found else _fit_now(spec, s)
    one = s.replace(sharding="none", num_gpus=1, cpu_offload=False)  # one GPU's step: sharding is composed
    for opt in dict.fromkeys((s.optimizer, "adamw") if s.optimizer in SWAPPABLE else (s.optimizer,)):
        found = fits.lookup(spec.config, one.replace(optimizer=opt))
        composed = opt != s.optimizer or s.sharding not in ("none", "ddp")
        if found is not None and (s.method != "full" or not composed or found[0].aligned):
            return (*found, opt)
    return _fit_now(spec, one)


def _fit_now(spec: ModelSpec, s: Step):
    """A fit of ``s`` made now, when ``lora_kit.memory.fits.should_fit`` says so (None: the arithmetic)."""
    import sys

    from lora_kit.memory import fits
    if not fits.should_fit(spec.config, _catalog_types()):
        return None
    return (*fits.make(spec.config, s, show=f"fitting the memory model of {spec.name}" if sys.stderr.isatty()
                       else None), s.optimizer)


def _fsdp_groups(spec: ModelSpec, s: Step) -> bool:
    """Whether FSDP2's per-rank figure is FSDP2's own step (fitted per GPU count: ``simulate`` runs it, and a
    one-GPU fit composed with sharded gradients missed its validation rows by up to 1.9 %), not composed."""
    from lora_kit.memory.calibrate import fsdp_step
    return fsdp_step(s) and not spec.moe


def _filled_layer_types(spec: ModelSpec):
    """The layer types transformers fills in for the config (what a fit's depth composition reads)."""
    from lora_kit.memory import fits
    return fits.layer_types(spec.config)


@lru_cache(maxsize=256)
def _one_row_terms(spec: ModelSpec, s: Step, targets: tuple, experts: tuple, fitted_optimizer: str, r: int, N: int,
                   kind) -> dict:
    """:func:`lora_kit.memory.compose.static_terms` of one row (a single estimate), cached; ``experts``: the
    ``expert_lora`` flags as sorted items."""
    tensors, _ = _trainable_tensors(spec, s, targets, dict(experts), np.asarray([r], dtype=kind))
    return static_terms(spec, s, fitted_optimizer, tensors, np.asarray([N], dtype=kind))


def _fitted_arrays(spec: ModelSpec, s: Step, targets: tuple, experts: dict, fitted, S, B, r, N) -> dict:
    """:func:`estimate_arrays` from a fit, composed with the static arithmetic where the step differs from it
    (:mod:`lora_kit.memory.compose`): exact integers (int64 arrays, or Python ints where a figure passes int64's
    room); ``memory_model`` says which, and with which libraries when they differ from today's."""
    from lora_kit.memory import fits
    f, info, fitted_optimizer = fitted
    args = (spec.num_layers, B.ravel(), S.ravel(), r.ravel(), _filled_layer_types(spec))
    phases = f.phase_arrays(*args)
    kind = next(iter(phases.values()))[1].dtype
    sharded = _fsdp_groups(spec, s)  # FSDP2's own step: nothing to compose (zero3: DeepSpeed's bucket, below)
    if not sharded and (s.optimizer != fitted_optimizer or s.sharding != "none"):
        if r.size == 1:  # one figure: the static terms of this step, rank and GPU count, computed once
            terms = _one_row_terms(spec, s, targets, tuple(sorted(experts.items())), fitted_optimizer,
                                   int(r.ravel()[0]), int(N.ravel()[0]), kind)
        else:
            tensors, _ = _trainable_tensors(spec, s, targets, experts, r.ravel().astype(kind))
            terms = static_terms(spec, s, fitted_optimizer, tensors, N.ravel().astype(kind))
        phases = compose(s, phases, terms)
    if s.sharding in GRADIENTS_SHARDED and not sharded:  # the one-GPU peak's operator, or the one largest with 1/N
        other = compose(s, f.phase_arrays(*args, N.ravel()), terms)
        phases = {ph: (np.maximum(p, other[ph][0]), np.where((other[ph][0] > p)[:, None], other[ph][1], q))
                  for ph, (p, q) in phases.items()}
    peak, parts, phase = largest_phase({ph: phases[ph] for ph in PHASES if ph in phases})
    out = {k: parts[:, i] for i, k in enumerate(BREAKDOWN_KEYS[:5])}
    if sharded and s.sharding in DEEPSPEED:  # the engine ZeRO-3 launches: its reduce bucket, kept from backward on
        bucket = deepspeed_bucket_bytes(s.dtype)
        peak, out["gradients"] = peak + bucket, out["gradients"] + bucket
    out["activations"] = peak - sum(out[k] for k in BREAKDOWN_KEYS[:5])
    out = {k: np.asarray(v, dtype=kind).reshape(S.shape) for k, v in out.items()}
    out["peak_allocated_bytes"] = np.asarray(peak, dtype=kind).reshape(S.shape)
    out["device_total_bytes"] = np.asarray(device_total(out["peak_allocated_bytes"], **device_kwargs(
        spec, s.method, (S * B).astype(kind), s.loop, N.astype(kind))), dtype=kind)
    out["phase"] = phase.astype(str).reshape(S.shape)
    note = fits.version_note(info)
    how = label(s, fitted_optimizer) if not sharded else "fitted" if s.sharding == "fsdp" else \
        "composed (DeepSpeed's reduce bucket by arithmetic on FSDP2's fitted step)"
    out["memory_model"] = np.full(S.shape, how + (f" ({note})" if note else ""), dtype=object)
    return out


ARITHMETIC = "arithmetic (not fitted)"
INT64_SAFE = 1 << 56  # a phase total below this leaves every sum and product that builds it inside int64


def _estimate_core(spec: ModelSpec, s: Step, targets: tuple, experts: dict, S, B, r, N) -> dict:
    """:func:`estimate_arrays` on broadcast arrays ``S, B, r, N`` of one integer kind: int64, or object (Python
    ints, exact at any size); ``_bound`` is the largest phase total of any row."""
    method, dtype, autocast, double_quant = s.method, s.dtype, s.autocast, s.double_quant
    gradient_checkpointing, attn_implementation, optimizer = s.gradient_checkpointing, s.attn_implementation, s.optimizer
    sharding, cpu_offload = s.sharding, s.cpu_offload
    T = B * S
    zero = np.zeros(T.shape, dtype=T.dtype)
    weights, quant = _static(spec, method, dtype, autocast, double_quant)
    wb = 4 if (method == "full" and autocast) else DTYPE_BYTES[dtype]
    tensors, expert_tensors = _trainable_tensors(spec, s, targets, experts, r)
    trainable = zero + tensor_bytes(tensors)
    states = zero + sum(c * _opt_state(optimizer, rows, cols, eb) for rows, cols, c, eb in tensors)
    loop_t = loop_terms(s.loop, optimizer, sum(c for _, _, c, _ in tensors))  # the Trainer's optimizer phase
    opt_tmp = zero + loop_t["foreach_temp"] * _opt_temp(optimizer, tensors)
    adapters = zero if method == "full" else trainable
    grads = trainable

    # ---- per GPU under sharding -----------------------------------------------------------------
    w_gpu, q_gpu = zero + weights, zero + quant
    bucket = grads.copy() if sharding == "ddp" else zero  # DDP's gradient buckets

    def shard(x):  # rank 0's share: ceil(x / N)
        return -(-x // N)
    if sharding in STATES_SHARDED:
        states = zero if cpu_offload else shard(states)
        opt_tmp = zero if cpu_offload else shard(opt_tmp)
    if sharding in GRADIENTS_SHARDED:
        grads = shard(grads)
    if sharding in WEIGHTS_SHARDED:
        keep = 0 if cpu_offload else 1
        w_gpu = shard(zero + weights) * keep + 2 * _block_weight_bytes(spec, method, dtype, autocast)
        q_gpu = zero + quant  # QLoRA's quantisation constants are not parameters: whole on every GPU
        if method != "full":
            adapters = shard(adapters)
    static = w_gpu + q_gpu + adapters + states + bucket

    # ---- phases -----------------------------------------------------------------------------------
    act = _activations(spec, method, dtype, autocast, bool(gradient_checkpointing), attn_implementation, targets,
                       T, B, S, r, s.padding, experts, loop=s.loop)
    bwd_end = grads + act["backward_end"]
    in_block, block_grads = act["backward_block"], zero

    def lin_g(lins):  # the weight (and bias) gradients of some linears
        return sum(int(_r(lin.out_features * lin.in_features * wb)) + (int(_r(lin.out_features * wb)) if
                   lin.bias else 0) for lin in lins)

    def wgrads(kind):  # one block's gradients of one kind of linear
        return lin_g(lin for lin in spec.linears if lin.kind == kind)
    h = spec.hidden_size
    norm_g = int(_r(h * wb)) * (1 + spec.norm_bias)  # one norm's weight (and bias) gradient
    head_g = int(_r(spec.vocab_size * h * wb)) + norm_g  # lm_head's and the final norm's
    mlp = [lin for lin in spec.linears if lin.kind in ("mlp_in", "mlp_out")]
    # DeepSeek's first blocks are dense: its MLP linears are listed as block 0's, then the MoE blocks' shared experts'
    dense_first = bool(spec.moe) and len(spec.moe["moe_layers"]) < spec.num_layers
    top_mlp = mlp[len(mlp) // 2:] if dense_first else mlp  # the MLP linears of the top block
    experts_g = 0
    if spec.moe:  # one MoE block's experts' and router's weight gradients (full fine-tuning)
        E, i_e = spec.moe["experts"], spec.moe["expert_intermediate_size"]
        experts_g = int(_r(E * 2 * i_e * h * wb) + _r(E * h * i_e * wb) + _r(E * h * wb))
    if method == "full" and not gradient_checkpointing and act["backward_attn"] is not None:
        # eager / MLA attention: the top block's softmax backward runs once lm_head's, the final and second norms',
        # the block's MLP (experts, router, shared experts) and output projection's weight gradients exist
        made = head_g + norm_g + wgrads("attn_out") + experts_g + lin_g(top_mlp)
        attn_m = act["backward_attn"] + made
        block_grads = np.where(attn_m > in_block, made, block_grads)
        in_block = np.maximum(in_block, attn_m)
    if gradient_checkpointing:  # a recomputed block's backward: the top block's with every block input still kept,
        # or the bottom block's, with the inputs above it freed and the gradients of the blocks above it made
        if method == "full":  # all but the embedding's and, at its MLP input gradient, the bottom block's own
            embed = 0 if spec.tied_embeddings else int(_r(spec.vocab_size * spec.hidden_size * wb))
            own = wgrads("attn_in") + wgrads("attn_out") + \
                _norms_per_layer(spec) * int(_r(spec.hidden_size * wb)) * (1 + spec.norm_bias)  # attention's, norms'
            block_grads = np.maximum(grads - embed - own, 0)
        else:  # the adapters of the blocks above
            block_grads = grads * (spec.num_layers - 1) // spec.num_layers
        if act["backward_moments"] is not None:  # full fine-tuning under autocast: the moments apart
            wi, wo = wgrads("mlp_in"), wgrads("mlp_out")
            # the top block: lm_head's and the final norm's gradients made (its output projection's at (b)); the
            # bottom block: every gradient but the embedding's and its own (but its output projection's at (b))
            g_mul = np.maximum(block_grads - wi, 0)
            moments = [(m, g) for m, g in zip(act["backward_moments"], (zero + head_g, zero + head_g + wo,
                                                                        np.maximum(g_mul - wo, 0), g_mul))]
            in_block, block_grads = moments[0][0] + moments[0][1], moments[0][1]
            for m, g in moments[1:]:
                block_grads = np.where(m + g > in_block, g, block_grads)
                in_block = np.maximum(in_block, m + g)
        else:
            bottom = in_block - (spec.num_layers - 1) * act["block_saved"] + block_grads
            g_bottom = block_grads
            if act["backward_bottom"] is not None and method == "full":  # DeepSeek, full fine-tuning: the top
                # (MoE) block's routed backward with lm_head's, the final norm's and its shared experts' gradients made;
                # block 0 (dense) by the rule above; the lowest MoE block (K) with the gradients of the blocks above
                L, bs = spec.num_layers, act["block_saved"]
                K = L - len(spec.moe["moe_layers"])
                dense_blk = own + lin_g(mlp[:len(mlp) // 2])
                moe_blk = (grads - embed - head_g - K * dense_blk) // (L - K)  # one MoE block's gradients
                g_top = zero + head_g + lin_g(top_mlp)  # its shared experts' linears
                top = in_block + g_top
                bk = in_block - (L - 1 - K) * bs + g_top + (L - 1 - K) * moe_blk
                bottom = act["backward_bottom"] - (L - 1) * bs + block_grads
                g_bottom = np.where(bottom >= bk, block_grads, g_top + (L - 1 - K) * moe_blk)
                bottom = np.maximum(bottom, bk)
                in_block, block_grads = top, g_top
            elif act["backward_bottom"] is not None:  # DeepSeek (LoRA): block 0 is dense, with the adapters of every
                # block above it made; or the lowest MoE block (block K), with those of the K+1 .. L-1 blocks above
                L, bs = spec.num_layers, act["block_saved"]
                K = L - len(spec.moe["moe_layers"])
                exp_all = zero + tensor_bytes(expert_tensors)
                g_attn = (grads - exp_all) // L  # one block's attention adapters
                g0, gk = grads - g_attn, (L - 1 - K) * (g_attn + exp_all // (L - K))
                b0 = act["backward_bottom"] - (L - 1) * bs + g0
                bk = in_block - (L - 1 - K) * bs + gk
                bottom, g_bottom = np.maximum(b0, bk), np.where(b0 >= bk, g0, gk)
            if method == "full" and act["moe_moments"] is not None:
                # a MoE block (not DeepSeek's): at its routed experts' moments the bottom block has made none of its
                # own experts', router's and shared expert's gradients yet (moe.py counts the ones made by then;
                # Qwen2-MoE's 1-wide shared-expert gate runs last, its gradient is made); at the shared expert's
                # backward (Qwen2-MoE: after the routed experts') the dense rule above
                moe_own = experts_g + lin_g(lin for lin in mlp if lin.out_features > 1)
                moe_m, dense_m = act["moe_moments"]
                g_moe = np.maximum(block_grads - moe_own, 0)
                b_moe = moe_m - (spec.num_layers - 1) * act["block_saved"] + g_moe
                b_dense = b_moe if dense_m is None else dense_m - (spec.num_layers - 1) * act["block_saved"] + \
                    block_grads
                bottom = np.maximum(b_moe, b_dense)
                g_bottom = np.where(b_moe >= b_dense, g_moe, block_grads)
            block_grads = np.where(bottom >= in_block, g_bottom, block_grads if act["backward_bottom"] is not None and
                                   method == "full" else 0)
            in_block = np.maximum(in_block, bottom)
    bwd = np.maximum(np.maximum(act["backward"], in_block), bwd_end)
    totals = np.stack([static + act["forward"], static + bwd, static + grads + np.maximum(opt_tmp, loop_t["clip"])]) \
        + act["inputs"] + loop_t["scalars"]
    idx = np.argmax(totals, axis=0)
    peak = np.max(totals, axis=0)
    bound = np.max(peak)
    bwd_grads = np.where(bwd_end >= np.maximum(act["backward"], in_block), grads,
                         np.where(in_block >= act["backward"], block_grads, 0))
    grads_at = np.where(idx == 0, 0, np.where(idx == 2, grads, bwd_grads))
    out = {"weights": w_gpu, "quant_constants": q_gpu, "adapters": adapters, "gradients": grads_at + bucket,
           "optimizer_states": states}
    if _fsdp_groups(spec, s):  # per rank under FSDP2, group by group as simulate runs it (memory.fsdp_math; no experts)
        extra = totals[0] - (static + act["forward"])  # what every phase adds besides (the step's inputs)
        stream = 4 if method == "qlora" else (2 if autocast else DTYPE_BYTES[dtype])
        totals, parts = fsdp_totals(spec, method, wb, targets, N, r, optimizer, act, sharding,
                                    _r(T * spec.hidden_size * stream) if gradient_checkpointing else 0 * T,
                                    bool(gradient_checkpointing))
        totals = totals + extra
        idx, peak = np.argmax(totals, axis=0), np.max(totals, axis=0)
        bound = max(bound, np.max(peak))
        out = {k: np.choose(idx, [np.broadcast_to(x, peak.shape) for x in v]) for k, v in parts.items()}
    if sharding in DEEPSPEED:  # the engine the accelerate config launches: DeepSpeed's reduce bucket
        ds_bucket = zero + deepspeed_bucket_bytes(dtype)
        peak = peak + ds_bucket
        out["gradients"] = out["gradients"] + ds_bucket
    out["activations"] = peak - sum(out[k] for k in BREAKDOWN_KEYS[:5])
    kind = T.dtype  # int64, or object: Python ints
    out = {k: np.asarray(np.broadcast_to(v, T.shape), dtype=kind) for k, v in out.items()}
    out["peak_allocated_bytes"] = np.asarray(peak, dtype=kind)
    out["device_total_bytes"] = np.asarray(device_total(out["peak_allocated_bytes"], **device_kwargs(
        spec, s.method, np.broadcast_to(T, peak.shape), s.loop, np.broadcast_to(N, peak.shape))), dtype=kind)
    out["phase"] = np.asarray(PHASES)[np.asarray(idx, dtype=np.int64)]
    out["_bound"] = int(np.max(np.asarray(bound, dtype=object)))
    return out


def estimate(model="tiny", step: Step | None = None, **overrides) -> Estimate:
    """Peak GPU memory of one training step, per GPU, by arithmetic (see the module docstring).

    ``model``: catalog name, "tiny", local folder / config.json, hub id (online) or PretrainedConfig.
    ``step``: a :class:`lora_kit.settings.Step` (default: ``PLANNING``, a real model on a GPU: bf16, 2048
    tokens, micro-batch 1, gradient checkpointing on); ``overrides``: step fields changed from it, e.g.
    ``estimate("llama-3.1-8b", method="qlora", seq_len=4096)``. ``grad_accum`` and ``lora_alpha`` do not
    change the peak. Raises ValueError saying what to change for bad input.
    """
    s = as_step(step, **overrides)
    spec = model_spec(model)
    arrays = estimate_arrays(spec, s)
    return Estimate(peak_allocated_bytes=int(arrays["peak_allocated_bytes"]),
                    device_total_bytes=int(arrays["device_total_bytes"]),
                    breakdown={k: int(arrays[k]) for k in BREAKDOWN_KEYS}, phase=str(arrays["phase"]),
                    memory_model=str(arrays["memory_model"]),
                    settings={"model": model if isinstance(model, str) else getattr(model, "name_or_path", repr(model)),
                              **s.to_dict()})
