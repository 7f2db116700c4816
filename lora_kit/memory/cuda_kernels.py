"""The SDPA kernel CUDA picks for a step, and what the math fallback costs: read from PyTorch's dispatch rules.

A CPU step cannot show which kernel CUDA runs: the kit's ``simulate`` takes the CPU flash path, which keeps
what CUDA's flash / memory-efficient / cuDNN kernels keep (the output and an fp32 logsumexp). This module
states CUDA's choice from PyTorch's public dispatch source and prices the one choice that changes memory
by a lot: the **math** kernel, which materialises ``B x heads x S x S`` fp32 scores.

**What SDPA receives** (:func:`sdpa_call`), from the kit's step and transformers' ``sdpa_attention_forward``:

- dtype: ``prepare_model_for_kbit_training`` (method ``qlora``) up-casts norms, embeddings and ``lm_head`` to
  fp32, so the residual stream is fp32; bitsandbytes' ``Linear4bit`` returns its input's dtype and peft adds
  the fp32 adapter output, so q/k/v are **fp32** (not with ``qlora_prepare="none"``, sharded QLoRA's recipe:
  q/k/v in ``dtype``). LoRA/full in bf16: peft casts its result back to the base
  layer's dtype, so q/k/v are in ``dtype``. ``autocast``: CUDA's autocast casts SDPA's inputs to the 16-bit
  compute dtype (``scaled_dot_product_attention`` is on its lower-precision list, ``autocast_mode.cpp``).
- ``enable_gqa=True`` when the model has fewer K/V heads than query heads and transformers'
  ``use_gqa_in_sdpa`` says yes: on CUDA it checks only that there is no attention mask and that K and V have
  the same head size <= 256 -- not the dtype. Otherwise transformers repeats K/V itself (``repeat_kv``).
- a mask: padded batches (``padding`` not ``"none"``) and sliding-window layers longer than their window
  (``masking_utils._ignore_causal_mask_sdpa``); without one, ``is_causal=True``.
- dropout: the config's ``attention_dropout`` (transformers passes it in training mode).

**Which backend** (:func:`sdpa_backend`): ``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` tries the backends in ``priority_order`` (flash,
memory-efficient, math, cuDNN; cuDNN first on sm90 / sm100 with a cuDNN newer than 9.15.0) and
takes the first whose ``can_use_*`` filters all pass. Each rule below names its filter; ``sdp_utils_cpp.h``
holds the shared ones. Version changes: ``enable_gqa`` exists from torch 2.5 (PR 132689); the memory-efficient
kernel instantiates ``check_batch_size_and_num_heads_dense<supports_gqa=false>`` until torch 2.13 and accepts
GQA (and implicit MQA) from 2.14 (PR 191085); ``_safe_softmax`` reuses its output's storage from torch 2.6
(PR 139613).

**What the math kernel costs** (:func:`math_fallback_bytes`): ``_scaled_dot_product_attention_math``
(``attention.cpp``) is composite -- the same ATen ops on every device -- so its tensors follow from the
source: ``q * sqrt(scale)``, a float causal mask, K/V repeated to every query head (``enable_gqa``),
``k^T * sqrt(scale)``, the fp32 scores, ``_safe_softmax`` (softmax output, a bool ``isneginf`` mask and its
row reduction), the output; autograd keeps the scaled q, the scaled K^T, the probabilities and the repeated V.
Backward holds the probabilities, their gradient and the softmax gradient at once (three S x S tensors).
Flash / memory-efficient keep q, k, v, the output and the logsumexp, and add the q/k/v gradients in backward,
as the kit counts them. Every storage is rounded to 512 bytes like the CUDA caching allocator. Checked on real
CPU steps (the math kernel runs the same composite there) with torch's profiler memory timeline:
``tests/test_cuda_kernels.py``.

**FlashAttention-2** (``attn_implementation="flash_attention_2"``, :func:`flash_attention_cast`): transformers calls
flash-attn directly, not SDPA, so there is no dispatch and never a math fallback. flash-attn takes fp16 / bf16 only:
fp32 q/k/v (QLoRA's recipe) are cast to the compute dtype first (``fa_peft_integration_check`` in
``modeling_flash_attention_utils.py``), three copies per layer that flash-attn keeps for backward (the fp32 ones die
unless something else holds them), and their gradients are cast back in backward. The kit's figures count them
(``lora_kit.memory.flash_attention`` emulates the path on a CPU).

fp16/bf16 inputs reach the math kernel only in corner cases (bf16 on pre-sm80 cards, odd head sizes), masked
fp32 attention never on sm50+ (the memory-efficient kernel takes it): neither is priced here
(:func:`math_fallback_bytes` raises; the note then names the kernel and what rules out the others).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lora_kit.memory.device import torch_version
from lora_kit.memory.specs import attention_dropout, model_spec
from lora_kit.settings import DTYPE_BYTES, as_step


def round_bytes(nbytes: int, block: int = 512) -> int:
    """``nbytes`` rounded up to ``block`` (the tracker's rule, here without importing torch: planning imports this
    module)."""
    return -(-int(nbytes) // block) * block


SDP_UTILS = "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
SDP_UTILS_CPP = "aten/src/ATen/native/transformers/sdp_utils_cpp.h"
ENABLE_GQA_FROM = (2, 5)  # scaled_dot_product_attention(enable_gqa=...) (PR 132689)
EFFICIENT_GQA_FROM = (2, 14)  # memory-efficient kernel: check_batch_size_and_num_heads_dense<true, ...> (PR 191085)
SAFE_SOFTMAX_REUSE_FROM = (2, 6)  # _safe_softmax writes its where() into the softmax output (PR 139613)
FIXED_TORCH = "2.14"
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class SdpaCall:
    """What one ``scaled_dot_product_attention`` call receives (the facts CUDA's dispatch reads)."""
    batch: int
    q_heads: int
    kv_heads: int  # heads of the K/V tensors passed (= q_heads when transformers repeated them)
    seq_q: int
    seq_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str  # of q, k and v
    enable_gqa: bool
    has_mask: bool
    is_causal: bool
    dropout: float = 0.0
    requires_grad: bool = True
    model_kv_heads: int = 0  # the model's K/V heads (0: same as kv_heads)
    layout: str = "bshd"  # "bshd": q/k/v are (B, S, H, D) tensors transposed to (B, H, S, D), as transformers'


def _cfg_value(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def sdpa_call(spec, step=None, **overrides) -> SdpaCall:
    """The SDPA call the kit's step makes (see the module docstring for each rule and its source)."""
    spec, st = model_spec(spec), as_step(step, **overrides)
    cfg = spec.config or {}
    # CUDA's autocast casts SDPA's inputs to 16-bit; else q/k/v as the projections make them (fp32 under
    # prepare_model_for_kbit_training: fp32 residual stream, Linear4bit returns fp32)
    dtype = st.half_dtype if st.autocast else st.activation_dtype
    window = _cfg_value(cfg, "sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    has_mask = st.padding != "none" or bool(window and st.seq_len > int(window))
    dqk = int(_cfg_value(cfg, "qk_head_dim", default=spec.head_dim))
    dv = int(_cfg_value(cfg, "v_head_dim", default=spec.head_dim))
    gqa_model = spec.num_kv_heads < spec.num_heads
    use_gqa = gqa_model and not has_mask and dqk == dv <= 256  # sdpa_attention.use_gqa_in_sdpa (CUDA branch)
    return SdpaCall(batch=int(st.batch_size), q_heads=spec.num_heads,
                    kv_heads=spec.num_kv_heads if use_gqa else spec.num_heads, seq_q=int(st.seq_len),
                    seq_kv=int(st.seq_len), head_dim_qk=dqk, head_dim_v=dv, dtype=dtype, enable_gqa=use_gqa,
                    has_mask=has_mask, is_causal=not has_mask and st.seq_len > 1,
                    dropout=(attention_dropout(cfg) or ("", 0.0))[1],
                    model_kv_heads=spec.num_kv_heads)


# -- the filters, one per rule: None when it passes, else why not (with the function it comes from) ----------------
def _sm(cc: float) -> tuple:
    major = int(cc)
    return major, int(round((cc - major) * 10))


def _in_range(cc, lo, hi) -> bool:
    return _sm(lo) <= _sm(cc) <= _sm(hi)


def _heads(c: SdpaCall, supports_gqa: bool, mqa_without_flag: bool = False):
    """check_batch_size_and_num_heads_dense<supports_gqa> (sdp_utils_cpp.h): with enable_gqa and a backend that
    supports it, K/V heads must divide the query heads; otherwise every head count must be equal."""
    if c.enable_gqa and supports_gqa:
        if c.q_heads % c.kv_heads:
            return f"{SDP_UTILS_CPP}:check_grouped_query_attention: K/V heads must divide query heads"
        return None
    if c.kv_heads != c.q_heads and not (mqa_without_flag and c.kv_heads == 1):
        why = " (enable_gqa is not supported by this backend)" if c.enable_gqa else ""
        return (f"{SDP_UTILS_CPP}:check_batch_size_and_num_heads_dense: query has {c.q_heads} heads, key/value "
                f"{c.kv_heads}{why}")
    return None


def _dtype(c: SdpaCall, allowed: tuple, fn: str):
    if c.dtype not in allowed:
        return f"{SDP_UTILS}:{fn}: {c.dtype} q/k/v; needs {' or '.join(allowed)}"
    return None


def _flash_reasons(c: SdpaCall, tv: tuple, cc: float) -> list:
    r = []
    if c.has_mask:
        r.append(f"{SDP_UTILS_CPP}:check_for_attn_mask: no attn_mask allowed")
    if not (c.head_dim_qk == c.head_dim_v and c.head_dim_qk <= 256):
        r.append(f"{SDP_UTILS}:check_head_dim_size_flash: q/k/v head dims must be equal and <= 256")
    if not _in_range(cc, 8.0, 12.1):
        r.append(f"{SDP_UTILS}:check_flash_attention_hardware_support: needs sm80-sm121, got sm{cc}")
    if (c.requires_grad and (_in_range(cc, 8.6, 8.9) or _in_range(cc, 12.0, 12.1))
            and not (c.head_dim_qk <= 192 or (c.dropout == 0 and c.head_dim_qk > 224))):
        r.append(f"{SDP_UTILS}:check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: "
                 f"no training with head dim {c.head_dim_qk} on sm{cc}")
    if c.is_causal and c.seq_q != c.seq_kv:
        r.append(f"{SDP_UTILS}:check_flash_causal_non_square_seqlens: causal needs seq_q == seq_kv")
    why = _dtype(c, ("float16", "bfloat16") if cc >= 8 else ("float16",), "check_dtypes_flash_attention")
    r += [why] if why else []
    why = _heads(c, supports_gqa=True)
    return r + ([why] if why else [])


def _efficient_reasons(c: SdpaCall, tv: tuple, cc: float) -> list:
    r = []
    if not _in_range(cc, 5.0, 12.1):
        r.append(f"{SDP_UTILS}:check_mem_efficient_hardware_support: needs sm50-sm121, got sm{cc}")
    half = c.dtype in ("float16", "bfloat16")
    align = (8 if half else 4) if cc >= 8 else (8 if half and cc >= 7 else 4 if cc >= 7 else 1)
    # minimum_gemm_alignment: 128 bits per tensor-core load on sm80+ (and for 16-bit on sm70+), else 1 (4 on sm80+)
    if c.head_dim_qk % align or c.head_dim_v % align:
        r.append(f"{SDP_UTILS}:check_head_dim_size_mem_efficient: head dims must be multiples of {align}")
    allowed = ("float16", "float32", "bfloat16") if cc >= 8 else ("float16", "float32")
    why = _dtype(c, allowed, "can_use_mem_efficient_attention")
    r += [why] if why else []
    gqa = tv >= EFFICIENT_GQA_FROM
    why = _heads(c, supports_gqa=gqa, mqa_without_flag=gqa)
    if why and not gqa and c.enable_gqa:
        why += f" (torch {tv[0]}.{tv[1]} < {FIXED_TORCH}, PR 191085)"
    return r + ([why] if why else [])


def _cudnn_reasons(c: SdpaCall, tv: tuple, cc: float) -> list:
    r = []
    why = _dtype(c, ("float16", "bfloat16") if cc >= 8 else ("float16",), "check_dtypes_low_precision")
    r += [why] if why else []
    if not _in_range(cc, 8.0, 12.1):
        r.append(f"{SDP_UTILS}:check_cudnn_hardware_support: needs sm80-sm121, got sm{cc}")
    if c.dropout * 16 != math.floor(c.dropout * 16):
        r.append(f"{SDP_UTILS}:check_cudnn_dropout: dropout must be a multiple of 1/16")
    limit = 256 if (int(cc) in (9, 10)) else 128  # check_cudnn_tensor_shapes (256 with cuDNN > 9.22 on sm90/sm10x)
    if c.head_dim_qk > limit or c.head_dim_v > limit or c.head_dim_qk % 8 or c.head_dim_v % 8:
        r.append(f"{SDP_UTILS}:check_cudnn_tensor_shapes: head dims must be multiples of 8 and <= {limit}")
    why = _heads(c, supports_gqa=True)
    return r + ([why] if why else [])


@dataclass
class BackendChoice:
    backend: str  # "flash" | "efficient" | "cudnn" | "math"
    torch: str  # the torch version the rules were read for
    compute_capability: float
    rejected: dict = field(default_factory=dict)  # backend tried before it -> the rules it failed (file:function)
    order: tuple = ()

    def why(self) -> str:
        """One line: the backend and, for each one passed over, its first failed rule."""
        parts = [f"{b}: {rs[0].split(': ', 1)[-1]}" for b, rs in self.rejected.items()]
        return f"{self.backend}" + (f" ({'; '.join(parts)})" if parts else "")


def sdpa_backend(call: SdpaCall, torch_version_: str | tuple | None = None, compute_capability: float = 9.0,
                 prefer_cudnn: bool = False) -> BackendChoice:
    """The backend CUDA's ``select_sdp_backend`` picks for ``call`` with torch ``torch_version_`` (default: the
    installed one) on a GPU of ``compute_capability``. ``prefer_cudnn=True`` puts cuDNN first, as
    ``check_prefer_cudnn_attention`` does on sm90 / sm100 when the wheel's cuDNN is newer than 9.15.0 (which
    depends on the wheel, not on torch's version: hence off by default). It never changes whether the math kernel
    runs (cuDNN, like flash, takes only fp16/bf16) nor what the kernel keeps (output and logsumexp)."""
    tv = torch_version(torch_version_)
    cc = float(compute_capability)
    if call.enable_gqa and tv < ENABLE_GQA_FROM:
        raise ValueError(f"enable_gqa needs torch >= 2.5 (got {tv[0]}.{tv[1]}); transformers repeats K/V there: "
                         "build the call with enable_gqa=False and kv_heads=q_heads.")
    order = ("cudnn", "flash", "efficient", "math") if prefer_cudnn else ("flash", "efficient", "math", "cudnn")
    rules = {"flash": _flash_reasons, "efficient": _efficient_reasons, "cudnn": _cudnn_reasons}
    rejected = {}
    for b in order:
        if b == "math":
            return BackendChoice("math", f"{tv[0]}.{tv[1]}", cc, rejected, order)
        why = rules[b](call, tv, cc)
        if not why:
            return BackendChoice(b, f"{tv[0]}.{tv[1]}", cc, rejected, order)
        rejected[b] = why
    raise AssertionError("math is always in the order")


def observed_backend(call: SdpaCall, device: str = "cuda") -> str:
    """The backend the installed torch picks for ``call`` on ``device`` (``torch._fused_sdp_choice`` on empty
    tensors of the call's shapes and layout): on a GPU, the check of :func:`sdpa_backend`'s prediction (on the
    CPU it answers with the CPU's own rules)."""
    import torch
    dt = getattr(torch, call.dtype)

    def t(heads, seq, dim):  # transformers' layout: (B, S, H, D) memory seen as (B, H, S, D)
        return torch.empty(call.batch, seq, heads, dim, dtype=dt, device=device).transpose(1, 2).requires_grad_(
            call.requires_grad)
    q, k, v = (t(call.q_heads, call.seq_q, call.head_dim_qk), t(call.kv_heads, call.seq_kv, call.head_dim_qk),
               t(call.kv_heads, call.seq_kv, call.head_dim_v))
    mask = (torch.zeros(call.batch, 1, call.seq_q, call.seq_kv, dtype=torch.bool, device=device)
            if call.has_mask else None)
    choice = torch._fused_sdp_choice(q, k, v, mask, call.dropout, call.is_causal, scale=None,
                                     enable_gqa=call.enable_gqa)
    return {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}.get(int(choice), f"backend {int(choice)}")


# -- the math kernel's tensors, allocation by allocation -------------------------------------------------------------
class _Live:
    """Live bytes of named storages (each rounded to ``block``) and the peak since :meth:`mark`."""

    def __init__(self, block: int):
        self.block, self.sizes, self.now, self.peak = block, {}, 0, 0

    def alloc(self, name: str, nbytes: int):
        assert name not in self.sizes, name
        self.sizes[name] = round_bytes(int(nbytes), self.block)
        self.now += self.sizes[name]
        self.peak = max(self.peak, self.now)

    def free(self, *names):
        for n in names:
            self.now -= self.sizes.pop(n)

    def mark(self):
        self.peak = self.now
        return self.now


def _shapes(c: SdpaCall) -> dict:
    e = DTYPE_BYTES[c.dtype]
    B, Hq, Hk, L, S = c.batch, c.q_heads, c.kv_heads, c.seq_q, c.seq_kv
    return dict(q=B * Hq * L * c.head_dim_qk * e, k=B * Hk * S * c.head_dim_qk * e, v=B * Hk * S * c.head_dim_v * e,
                krep=B * Hq * S * c.head_dim_qk * e, vrep=B * Hq * S * c.head_dim_v * e, out=B * Hq * L * c.head_dim_v * e,
                lse=B * Hq * L * 4, scores=B * Hq * L * S * 4, masked=B * Hq * L * S, rows=B * Hq * L,
                mask=L * S * 4, tril=L * S)


def _math_events(c: SdpaCall, tv: tuple, block: int, device: str = "cuda") -> dict:
    """Walk _scaled_dot_product_attention_math's forward and backward (attention.cpp) and the flash path the kit
    counts; return each phase's peak and what stays, relative to the same starting point. With dropout the math
    kernel calls ``at::dropout`` on the probabilities: on CUDA the fused ``native_dropout`` (an output and a bool
    mask), on a CPU ``_dropout_impl`` (an fp32 noise tensor, then probabilities x noise); ``device`` picks."""
    if c.dtype != "float32":
        raise ValueError(f"math_fallback_bytes prices fp32 q/k/v (QLoRA's recipe); got {c.dtype}, whose fp32 "
                         "up-casts inside the math kernel are not modelled.")
    if c.has_mask:  # transformers then repeats K/V and CUDA's memory-efficient kernel takes fp32 with a mask
        raise ValueError("math_fallback_bytes prices unmasked (causal) attention; with padding='none' and no "
                         "sliding window shorter than seq_len the step has no mask.")
    z = _shapes(c)
    repeat = c.enable_gqa and c.kv_heads != c.q_heads  # pre_process_group_query_attention_input
    # matmul reshapes (B, H, ...) to (B*H, ...): a view when B == 1 or the tensor is contiguous, else a copy.
    # transformers' q/k/v are transposed (B, S, H, D) tensors; repeat_interleave / repeat_kv outputs are contiguous.
    strided = c.layout == "bshd" and c.batch > 1 and c.q_heads > 1
    k_strided = strided and not repeat and c.model_kv_heads in (0, c.kv_heads)  # K/V as the model made them
    m = _Live(block)
    for n in ("q", "k", "v"):
        m.alloc(n, z[n])
    start = m.mark()
    m.alloc("qs", z["q"])  # q * sqrt(scale)
    if c.is_causal:  # ones(L, S, bool).tril() -> convert_boolean_attn_mask -> float mask
        m.alloc("ones", z["tril"]); m.alloc("tril", z["tril"]); m.free("ones")
        m.alloc("mask", z["mask"]); m.free("tril")
    if repeat:
        m.alloc("krep", z["krep"]); m.alloc("vrep", z["vrep"])
    m.alloc("ks", z["krep"] if repeat else z["k"])  # k^T * sqrt(scale)
    if strided:
        m.alloc("qc", z["q"])  # matmul's reshape copy of the scaled q (saved by bmm instead of qs)
    if k_strided:
        m.alloc("kc", z["k"])
    m.alloc("scores", z["scores"])  # q k^T (the mask is added in place)
    m.alloc("probs", z["scores"]); m.alloc("masked", z["masked"]); m.alloc("rows", z["rows"])  # _safe_softmax
    if tv < SAFE_SOFTMAX_REUSE_FROM:
        m.alloc("where", z["scores"]); m.free("probs"); m.sizes["probs"] = m.sizes.pop("where")
    m.free("rows", "masked", "scores")
    if c.dropout:  # kept for backward: the mask (or noise) by dropout, the dropped probabilities by the matmul
        m.alloc("dmask", z["masked"] if device == "cuda" else z["scores"]); m.alloc("dropped", z["scores"])
    v_saved = "vrep" if repeat else "v"
    if k_strided:
        m.alloc("vc", z["v"]); v_saved = "vc"
    m.alloc("o", z["out"])  # probs @ v
    fwd_peak = m.peak - start
    # on return: the locals die unless autograd saved them (bmm saved the copies qc / kc when it made them)
    m.free(*[n for n, gone in (("qs", strided), ("ks", k_strided), ("krep", repeat), ("mask", c.is_causal)) if gone])
    # transformers: o.transpose(1, 2).contiguous() copies (o is (B, H, S, D) here), o_proj saves the copy and o,
    # saved by nothing, dies; so do transformers' q/k/v locals on return
    m.alloc("o2", z["out"]); m.free("o")
    for n in ("q", "k", "v"):
        if n != v_saved:
            m.free(n)
    saved_math = m.now - start
    # backward: o_proj's backward has released o2 and hands back its gradient, (B, S, H, Dv) contiguous
    m.free("o2"); m.alloc("g_o2", z["out"])
    m.mark()
    if strided:  # reshape copy of the transposed gradient, its only use: the gradient dies with the copy made
        m.alloc("G", z["out"]); m.free("g_o2")
    # the matmul's gradient: of the probabilities, or with dropout of the dropped probabilities
    m.alloc("g_dropped" if c.dropout else "g_probs", z["scores"]); m.alloc("g_vrep", z["vrep"] if repeat else z["v"])
    m.free(v_saved, "G" if strided else "g_o2")
    if c.dropout:  # dropout's backward scales that gradient by the mask
        m.free("dropped")
        m.alloc("g_probs", z["scores"]); m.free("g_dropped", "dmask")
    m.alloc("g_scores", z["scores"])  # _softmax_backward_data
    m.free("g_probs", "probs")
    m.alloc("g_qs", z["q"]); m.alloc("g_ks", z["krep"] if repeat else z["k"])
    m.free("g_scores", "qc" if strided else "qs", "kc" if k_strided else "ks")
    bwd_peak = m.peak - start

    f = _Live(block)  # flash / efficient / cuDNN as the kit counts them
    for n in ("q", "k", "v"):
        f.alloc(n, z[n])
    fstart = f.mark()
    # the fused kernels write the output in (B, S, H, D) memory, so transformers' transpose(1, 2).contiguous() is
    # a view: the output is o_proj's saved input too
    f.alloc("o", z["out"]); f.alloc("lse", z["lse"])
    f_fwd_peak = f.peak - fstart
    saved_flash = f.now - fstart
    f.alloc("g_o2", z["out"])
    f.alloc("g_q", z["q"]); f.alloc("g_k", z["k"]); f.alloc("g_v", z["v"])
    f_bwd_peak = f.now - fstart  # just after the backward kernel, as a trace records it
    return dict(fwd_peak=fwd_peak, saved=saved_math, bwd_peak=bwd_peak, flash_fwd_peak=f_fwd_peak,
                flash_saved=saved_flash, flash_bwd_peak=f_bwd_peak)


@dataclass
class MathFallback:
    """Extra bytes of the math kernel over flash / memory-efficient, per attention call and for the step."""
    call: dict  # the SdpaCall
    saved_per_layer: int  # kept from a layer's forward to its backward
    forward_extra: int  # at the math forward's own peak, beyond what flash holds just after its kernel
    backward_extra: int  # at the math backward's peak (three S x S tensors), beyond flash's after its kernel
    layers: int
    checkpointing: bool
    peak_extra: int  # at the step's peak when the peak is in attention (an upper bound otherwise)
    scores_bytes: int  # one fp32 B x heads x S x S tensor

    def to_dict(self) -> dict:
        return asdict(self)


def math_fallback_bytes(spec, step=None, *, block: int = 512, torch_version_: str | tuple | None = None,
                        device: str = "cuda", **overrides) -> MathFallback:
    """What the math kernel adds, as exact arithmetic over the step's shapes (see the module docstring).

    ``peak_extra``: without checkpointing every layer keeps ``saved_per_layer`` until its backward, so the last
    layer's forward or backward adds ``(layers - 1) * saved_per_layer`` plus its own extra; with checkpointing
    only the recomputed layer keeps them. Where the step's peak lies elsewhere (the loss at a large vocabulary)
    the true increase is smaller: :func:`peak_with_math` places the per-call figures on a simulated step."""
    spec, st = model_spec(spec), as_step(step, **overrides)
    c = sdpa_call(spec, st)
    ev = _math_events(c, torch_version(torch_version_), block, device)
    saved = ev["saved"] - ev["flash_saved"]
    fwd = ev["fwd_peak"] - ev["flash_fwd_peak"]
    bwd = ev["bwd_peak"] - ev["flash_bwd_peak"]
    L = spec.num_layers
    own = max(fwd, bwd)
    peak = own if st.gradient_checkpointing else (L - 1) * saved + own
    return MathFallback(asdict(c), saved, fwd, bwd, L, bool(st.gradient_checkpointing), peak,
                        round_bytes(_shapes(c)["scores"], block))


SDPA_FORWARD_OPS = ("_scaled_dot_product_flash_attention_for_cpu.default",)
SDPA_BACKWARD_OPS = ("_scaled_dot_product_flash_attention_for_cpu_backward.default",)


def peak_with_math(trace, fb: MathFallback | None, attention_only: bool = False,
                   temporaries: dict | None = None) -> int:
    """The step's peak if every attention call ran the math kernel: ``simulate(..., trace=True)``'s trace (live
    bytes after each operator of the CPU step, whose SDPA is the flash path) with the math kernel's extra placed
    at each SDPA call -- its forward / backward peak at the kernel, its saved tensors from a kept forward (not the
    first pass of a checkpointed block) to its backward. ``attention_only``: the largest of those moments at the
    SDPA calls alone (where the math kernel peaks; below the step's peak when that lies elsewhere). ``fb`` None: no
    math kernel. ``temporaries`` (``SimResult.temporaries``): what opaque operators hold inside, placed at each."""
    extra = best = 0
    temps = temporaries or {}
    for j, (phase, op, live, *_) in enumerate(trace):
        here = live + extra + temps.get(j, 0)
        if fb is not None and op in SDPA_FORWARD_OPS:
            here += fb.forward_extra
            if not (fb.checkpointing and phase == "forward"):  # a checkpointed block's first pass keeps nothing
                extra += fb.saved_per_layer
        elif fb is not None and op in SDPA_BACKWARD_OPS:  # its forward was a kept one (the recompute, under ckpt)
            extra -= fb.saved_per_layer
            here = live + extra + fb.backward_extra
        elif attention_only:
            continue
        best = max(best, here)
    return int(best)


def flash_attention_dtype(step=None, **overrides) -> str:
    """The dtype flash-attn receives under ``attn_implementation="flash_attention_2"``: transformers'
    ``get_target_dtype`` casts fp32 q/k/v to the autocast dtype (``training.autocast_context``: bf16 for fp32
    weights) or, for a quantized model (QLoRA), to the config's ``dtype``; 16-bit q/k/v pass as they are."""
    st = as_step(step, **overrides)
    return st.half_dtype if st.autocast else st.dtype


@dataclass
class FlashCast:
    """What FlashAttention-2 costs instead of a math fallback: the casts of fp32 q/k/v to 16-bit (none when they are
    16-bit already)."""
    from_dtype: str  # of q/k/v as the projections make them (fp32 under QLoRA's recipe)
    to_dtype: str  # what flash-attn receives
    bytes_per_layer: int  # the three 16-bit copies (each rounded to 512 bytes), kept from forward to backward
    layers: int

    def to_dict(self) -> dict:
        return asdict(self)


def flash_attention_cast(spec, step=None, *, block: int = 512, **overrides) -> FlashCast:
    """The cast copies of :func:`flash_attention_dtype` for the step's shapes (see the module docstring)."""
    spec, st = model_spec(spec), as_step(step, **overrides)
    c = sdpa_call(spec, st)
    frm, to = st.activation_dtype, flash_attention_dtype(st)  # q/k/v as the projections make them (no autocast
    n = 0  # cast on the way into flash-attn, unlike SDPA's)
    if frm != to:
        per = c.batch * c.seq_q * DTYPE_BYTES[to]
        n = sum(round_bytes(per * h * d, block) for h, d in ((c.q_heads, c.head_dim_qk),
                                                            (c.model_kv_heads or c.kv_heads, c.head_dim_qk),
                                                            (c.model_kv_heads or c.kv_heads, c.head_dim_v)))
    return FlashCast(frm, to, n, spec.num_layers)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _math_fallback(spec, st, torch_version_, compute_capability):
    """(applies, fb): whether CUDA runs this step's SDPA in the math kernel, and its sizes (None where it runs on
    inputs this arithmetic does not cover: 16-bit q/k/v, a mask)."""
    if st.attn_implementation != "sdpa":
        return False, None
    c = sdpa_call(spec, st)
    if sdpa_backend(c, torch_version_, compute_capability).backend != "math":
        return False, None
    if c.dtype != "float32" or c.has_mask:
        return True, None
    return True, math_fallback_bytes(spec, st, torch_version_=torch_version_)


def math_kernel_extra(model, step=None, *, sim, torch_version_: str | tuple | None = None,
                      compute_capability: float = 9.0, **overrides) -> int | None:
    """What CUDA's math-kernel fallback adds to the step's peak, placed on ``sim`` (``simulate(..., trace=True)`` of
    the step, whose attention is a fused kernel): 0 where CUDA picks a fused kernel for this step's SDPA call (torch
    ``torch_version_``, a GPU of ``compute_capability``) or the peak lies elsewhere; None where the math kernel runs
    on inputs this arithmetic does not cover (16-bit q/k/v, a mask)."""
    spec, st = model_spec(model), as_step(step, **overrides)
    applies, fb = _math_fallback(spec, st, torch_version_, compute_capability)
    if not applies:
        return 0
    if fb is None:
        return None
    return max(0, peak_with_math(sim.trace, fb) - sim.peak_allocated_bytes)


def kernel_extra(model, step=None, *, sim, torch_version_: str | tuple | None = None,
                 compute_capability: float = 9.0, **overrides) -> int | None:
    """What CUDA's kernels add to the step's peak beyond the tensors ``sim`` (``simulate(..., trace=True)``) counts,
    placed together on its trace: the math-kernel fallback (:func:`math_kernel_extra`) and the tensors opaque
    operators hold inside beside their outputs (``SimResult.temporaries``: bitsandbytes' ``gemm_4bit`` dequantising
    its weight, which CUDA does for training-sized micro-batches). None where the math kernel runs on inputs this
    arithmetic does not cover. Not counted: CUDA's fused 4-bit kernel for micro-batches of a few hundred tokens or
    fewer allocates no dequantised weight (card-dependent: ``_gemm_4bit_use_custom_cuda``), so there this is an upper
    bound by the largest dequantised weight."""
    spec, st = model_spec(model), as_step(step, **overrides)
    applies, fb = _math_fallback(spec, st, torch_version_, compute_capability)
    if applies and fb is None:
        return None
    return max(0, peak_with_math(sim.trace, fb, temporaries=sim.temporaries) - sim.peak_allocated_bytes)


def math_kernel_bound(model, step=None, *, torch_version_: str | tuple | None = None, compute_capability: float = 9.0,
                      **overrides) -> int | None:
    """None where CUDA runs this step's attention in a fused kernel (or on inputs the arithmetic does not price);
    else the most its math kernel adds to the step's peak (:class:`MathFallback`'s ``peak_extra``: exact when the
    peak is in attention, an upper bound otherwise; :func:`math_kernel_extra` places it on a simulated step)."""
    spec, st = model_spec(model), as_step(step, **overrides)
    applies, fb = _math_fallback(spec, st, torch_version_, compute_capability)
    return fb.peak_extra if applies and fb is not None else None


def cuda_attention_note(model, step=None, *, torch_version_: str | tuple | None = None,
                        compute_capability: float = 9.0, peak_bytes: int | None = None, sim=None,
                        exact: bool = False, **overrides) -> str | None:
    """None, or one plain sentence for the plan / run card when CUDA would run this step's attention in the math
    kernel: what it adds per GPU and the fix (with ``flash_attention_2``, which never does: what its casts of fp32
    q/k/v keep, when there are any). With ``sim`` (``simulate(..., trace=True)`` of the step) the extra
    is placed on the step (exact; it can be nothing when the peak lies elsewhere, e.g. at the loss); without, it
    is the extra at attention ("up to"); ``exact=True`` runs that simulation here (seconds to a minute for a 7-8B
    model). ``peak_bytes`` (the kit's peak, which counts the fused kernel) or ``sim`` adds the peak both ways."""
    spec, st = model_spec(model), as_step(step, **overrides)
    if st.attn_implementation == "flash_attention_2":
        fc = flash_attention_cast(spec, st)
        if not fc.bytes_per_layer:
            return None
        return (f"With flash_attention_2 attention never falls back to the math kernel; instead the "
                f"{SHORT[fc.from_dtype]} q/k/v are cast to {SHORT[fc.to_dtype]} for it, {_gib(fc.bytes_per_layer)} per "
                "layer kept for backward (counted in the figures).")
    if st.attn_implementation != "sdpa":
        return None
    c = sdpa_call(spec, st)
    choice = sdpa_backend(c, torch_version_, compute_capability)
    if choice.backend != "math":
        return None
    head = (f"On CUDA with torch {choice.torch}, this step's attention runs in the math kernel "
            f"({SHORT[c.dtype]} q/k/v{' with grouped K/V' if c.enable_gqa else ''}{' and a mask' if c.has_mask else ''})")
    if c.dtype != "float32" or c.has_mask:
        return f"{head}, which keeps seq_len x seq_len scores per head. What rules out the others: {choice.why()}."
    fb = math_fallback_bytes(spec, st, torch_version_=torch_version_)
    if sim is None and exact:
        from lora_kit.memory.simulate import simulate
        sim = simulate(model, st, trace=True)
    if sim is not None and getattr(sim, "trace", None):
        extra = math_kernel_extra(model, st, sim=sim, torch_version_=torch_version_,
                                  compute_capability=compute_capability)
        base, bound = sim.peak_allocated_bytes, ""
    else:
        base, extra, bound = peak_bytes, fb.peak_extra, "up to "
    fixes = []
    if st.kbit_prepared:  # checked on a real CPU step: the embeddings too, or the residual stream stays fp32
        fixes.append("qlora_prepare='none' (embeddings, norms and LoRA layers in bf16: no "
                     "prepare_model_for_kbit_training up-cast)")
    fixes.append("autocast=True")
    if c.enable_gqa:
        fixes.append("repeat K/V to every query head before SDPA (the memory-efficient kernel then takes fp32)")
        fixes.append(f"torch >= {FIXED_TORCH}")
    if extra == 0:
        cost = f"its seq_len x seq_len scores stay below this step's peak ({_gib(base)}), but it runs slower"
    else:
        both = f" (peak {_gib(base + extra)} instead of {_gib(base)})" if base is not None else ""
        cost = f"{bound}+{_gib(extra)} per GPU{both}"
    return f"{head}: {cost}. Fix: {'; or '.join(fixes)}."
