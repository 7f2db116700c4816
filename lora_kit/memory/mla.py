"""Multi-head latent attention (DeepSeek-V2 / V3) in the memory model: what one attention block of transformers 5.24
keeps for backward. Pure arithmetic (numpy), used by :mod:`lora_kit.memory.estimate`; checked against ``simulate``
and real CPU steps (``benchmarks/memory_accuracy.py --families``, ``--moe``, ``--moe --real``).

**The block.** Queries come from ``q_proj`` (``h -> H*dq``; with ``q_lora_rank``: ``q_a_proj``, an RMSNorm of width
``q_lora_rank``, ``q_b_proj``), ``dq = qk_nope_head_dim + qk_rope_head_dim``. Keys and values come from one latent:
``kv_a_proj_with_mqa`` (``h -> c + dr``, ``c = kv_lora_rank``), an RMSNorm over its first ``c`` columns, and
``kv_b_proj`` (``c -> H*(dn + dv)``). The rotary part (``dr`` wide, one head for K) is rotated as complex numbers
(``freqs_cis``, one complex64 table ``(S, dr/2)``, saved by the multiplications; no per-block copy). The query is
``cat(q_nope, q_pe)`` and the key a new ``(B, H, S, dq)`` tensor; the value is a strided view of ``kv_b_proj``'s
output. Without checkpointing the ``DynamicCache`` keeps concatenated copies of the normalized latent (``c``) and
the rotated key part (``dr``) through the forward.

**The attention kernel.** The query/key head width ``dq`` (DeepSeek-V2-Lite: 192) differs from the value's ``dv``
(128). PyTorch's CPU flash kernel needs equal widths, so on a CPU -- and therefore in ``simulate``, which runs on
fake CPU tensors -- SDPA takes the *math* path: it up-casts q, k and v to fp32 and keeps for backward the scaled
q and k (fp32, ``T*H*dq`` each), the fp32 probabilities ``B*H*S*S`` and a contiguous fp32 copy of v; its output is
not kept. That is what this module counts for ``attn_implementation="sdpa"``. On CUDA, PyTorch's memory-efficient
kernel accepts ``dq != dv`` (its flash kernel does not), keeping the bf16 inputs, the output and a logsumexp instead
of ``B*H*S*S`` probabilities: a GPU step then needs less than this estimate (not measured here: no GPU).
Eager attention keeps q and k (``dq``), a contiguous copy of v, and the fp32 probabilities with their cast.
"""
from __future__ import annotations

import numpy as np

from lora_kit.memory.device import alloc_bytes as _r

MLA_TYPES = ("deepseek_v2", "deepseek_v3")




def is_mla(spec) -> bool:
    return spec.model_type in MLA_TYPES and bool(spec.config.get("kv_lora_rank"))


def mla_dims(spec) -> dict:
    c = spec.config
    dn, dr, dv = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    return {"H": spec.num_heads, "c": int(c["kv_lora_rank"]), "qr": int(c.get("q_lora_rank") or 0), "dn": dn,
            "dr": dr, "dq": dn + dr, "dv": dv}


def mla_attention(spec, *, lora: bool, targets: tuple, e: int, ce: int, cast: bool, attn: str, T, B, S, r,
                  cache: bool) -> dict:
    """One MLA block's attention: ``{"attn_in", "attn_out"}`` (what LoRA on its linears keeps: the inputs'
    copies peft casts, or the shared input, and the A outputs; full fine-tuning: every linear's input, once),
    ``"base"`` (the latent norms' and the kernel's saved
    tensors), ``"cache"`` (the DynamicCache's copies not kept
    otherwise, live through the forward) and ``"softmax_bwd"`` (what the softmax backward adds: the fp32
    probability gradients; on the math path the product's backward freed the value copy and made v's fp32
    gradient in its place) and ``"first_free"`` (what block 0,
    reading the frozen embedding's output, keeps less with LoRA when only some attention linears are targeted).

    ``e``: the stream's dtype bytes, ``ce``: peft's cast of a LoRA input (fp32, or 16-bit under autocast),
    ``cast``: whether peft copies each LoRA input (the stream is not fp32; under autocast each LoRA matmul keeps
    its own 16-bit cast anyway); ``cache``: a forward without
    checkpointing builds the cache."""
    m = mla_dims(spec)
    H, c, qr, dr, dq, dv = m["H"], m["c"], m["qr"], m["dr"], m["dq"], m["dv"]
    h = spec.hidden_size
    widths = {lin.name: lin.in_features for lin in spec.linears if lin.kind in ("attn_in", "attn_out")}
    # LoRA inputs: each targeted linear casts its own copy (16-bit stream) or reads the shared input (fp32 stream)
    inputs = {"x": ("q_proj", "q_a_proj", "kv_a_proj_with_mqa"), "q_a": ("q_b_proj",), "kv": ("kv_b_proj",),
              "out": ("o_proj",)}
    width = {"x": h, "q_a": qr, "kv": c, "out": H * dv}
    attn_in, attn_out = 0 * T, 0 * T
    for src, names in inputs.items():
        hit = [n for n in names if n in widths and (n in targets or not lora)]
        if not hit:
            continue
        if not lora:  # full fine-tuning: each input once, in the stream dtype, for the weights' gradients
            kept = _r(T * width[src] * e)
        else:
            kept = len(hit) * _r(T * width[src] * ce) if cast or ce == 2 else _r(T * width[src] * e)
            kept = kept + len(hit) * _r(T * r * ce)
        if src == "out":
            attn_out = attn_out + kept
        else:
            attn_in = attn_in + kept
    # the latent RMSNorms: an fp32 copy of the input (fp32 stream: the input itself, a view of the projection's
    # whole output) and rsqrt; full fine-tuning also the normalized input for the weight's gradient
    def norm(width, whole):
        kept_in = _r(T * width * 4) if e != 4 else _r(T * whole * 4)
        return kept_in + _r(T * 4) + (0 if lora else _r(T * width * e))
    latent, q_latent = norm(c, c + dr), (norm(qr, qr) if qr else 0)
    scores = B * H * S * S
    if attn == "sdpa":  # the math path (dq != dv): scaled q and k, probabilities, v's contiguous copy, all fp32
        qk, probs, v = _r(T * H * dq * 4), _r(scores * 4), _r(T * H * dv * 4)
        softmax_bwd = 2 * _r(scores * 4)  # v's copy freed, its fp32 gradient (the product's backward) made
    else:  # eager: q, k, v's contiguous copy in the stream dtype, fp32 probabilities and their cast
        qk, probs, v = _r(T * H * dq * e), _r(scores * 4) + (_r(scores * e) if e != 4 else 0), _r(T * H * dv * e)
        softmax_bwd = 2 * _r(scores * 4) - (_r(scores * e) if e != 4 else 0)
    base = latent + q_latent + 2 * qk + probs + v
    # block 0 reads the frozen embedding's output: with LoRA only where targeted do tensors need a gradient. The
    # latent norms keep their input only when their projection is targeted; the product q.k keeps q only for k's
    # gradient and k only for q's; the probabilities and v's copy are kept when either side needs a gradient
    q_grad = any(n in targets for n in ("q_proj", "q_a_proj", "q_b_proj"))
    kv_grad = any(n in targets for n in ("kv_a_proj_with_mqa", "kv_b_proj"))
    first_free = (0 if "kv_a_proj_with_mqa" in targets else latent) + (0 if "q_a_proj" in targets else q_latent) + \
        (0 if kv_grad else qk) + (0 if q_grad else qk) + (0 if q_grad or kv_grad else probs + v)
    # the cache's copies: the latent's (unless kv_b_proj keeps that very copy: full fine-tuning, an uncast LoRA
    # input) and the rotated key part's
    latent_kept = not lora or ("kv_b_proj" in targets and not cast)
    kv_cache = (_r(T * dr * e) + (0 if latent_kept else _r(T * c * e))) if cache else 0 * T
    return {"attn_in": attn_in, "attn_out": attn_out, "base": base, "cache": kv_cache, "softmax_bwd": softmax_bwd,
            "first_free": first_free if lora else 0 * T}


def mla_rope_bytes(spec, S):
    """The rotary table: one complex64 ``(S, dr/2)`` tensor and the two fp32 inverse-frequency buffers."""
    dr = mla_dims(spec)["dr"]
    return _r(S * dr * 4) + 2 * _r(dr // 2 * 4)


def mla_note(spec, step) -> str:
    """One line for a plan (a ``lora_kit.settings.Step``) on an MLA model: which attention kernel the figure
    counts (empty for other models)."""
    if not is_mla(spec):
        return ""
    m = mla_dims(spec)
    blocks = 1 if step.gradient_checkpointing else spec.num_layers
    probs = blocks * int(_r(step.batch_size * m["H"] * step.seq_len * step.seq_len * 4))
    kernel = (f"SDPA's math path, which PyTorch takes on a CPU because the query/key heads ({m['dq']}) are wider than "
              "the value heads" if step.attn_implementation == "sdpa" else "eager attention, which keeps them too") + f" ({m['dv']})"
    return (f"{spec.name} uses multi-head latent attention: the figure counts {kernel}, keeping fp32 attention "
            f"probabilities ({probs / 2**30:.2f} GiB in {'the recomputed block' if blocks == 1 else 'all blocks'}); "
            "on a GPU, PyTorch's memory-efficient SDPA kernel accepts these widths and keeps no probabilities: up to "
            "that much less (arithmetic, not measured here).")
