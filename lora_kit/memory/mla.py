"""Multi-head latent attention (DeepSeek-V2 / V3) in the memory model: what one attention block of transformers 5.24
keeps for backward, in words for a plan (:func:`mla_note`). The figures themselves are ``simulate``'s, fitted
(:mod:`lora_kit.memory.calibrate`); ``simulate`` is checked against real CPU steps (``tests/test_mla.py``).

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
not kept. That is what ``simulate`` counts for ``attn_implementation="sdpa"``. On CUDA, PyTorch's memory-efficient
kernel accepts ``dq != dv`` (its flash kernel does not), keeping the bf16 inputs, the output and a logsumexp instead
of ``B*H*S*S`` probabilities: a GPU step then needs less than this estimate (not measured here: no GPU).
Eager attention keeps q and k (``dq``), a contiguous copy of v, and the fp32 probabilities with their cast.
"""
from __future__ import annotations

from lora_kit.memory.device import alloc_bytes as _r



def is_mla(spec) -> bool:
    """Whether the attention is multi-head latent (the config has a latent K/V rank and separate head widths)."""
    return bool(spec.config.get("kv_lora_rank")) and "qk_rope_head_dim" in spec.config


def mla_dims(spec) -> dict:
    c = spec.config
    dn, dr, dv = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    return {"H": spec.num_heads, "c": int(c["kv_lora_rank"]), "qr": int(c.get("q_lora_rank") or 0), "dn": dn,
            "dr": dr, "dq": dn + dr, "dv": dv}


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
