"""FlashAttention-2 on a CPU: the tensors transformers' ``flash_attention_2`` path and flash-attn 2 allocate and keep.

flash-attn runs on CUDA only, so ``simulate`` (fake tensors) and a CPU ``measure`` run the step with this emulation,
registered with transformers' ``AttentionInterface`` under :data:`KIT_NAME` (the name holds no "flash": transformers
imports flash_attn for any such name). Its values are right (CPU SDPA computes them, unseen by the live-bytes
trackers: :func:`lora_kit.memory.tracker.untracked`); its allocations are FlashAttention-2's. On CUDA,
:func:`model_attn_implementation` gives the real ``"flash_attention_2"`` (transformers loads flash_attn).

What is emulated, and where it comes from:

- transformers 5.24 ``integrations/flash_attention.py: flash_attention_forward``: q/k/v transposed back to
  (B, S, H, D), views of the projections; V padded to Q's head size when they differ (MLA); ``get_target_dtype``:
  fp32 q (QLoRA: ``prepare_model_for_kbit_training``'s fp32 residual stream) is cast to the autocast dtype, the
  quantized config's ``dtype``, or the first Linear's weight dtype.
- ``modeling_flash_attention_utils.py: _flash_attention_forward``: ``fa_peft_integration_check`` makes those three
  casts (copies: flash-attn keeps them, the fp32 q/k/v can die); with no attention mask (``padding="none"``) and no
  varlen kwargs, ``_is_packed_sequence`` on position_ids at batch 1 (small int64 temporaries), then
  ``flash_attn_func``: no mask and no ``repeat_kv`` (flash-attn takes grouped K/V as they are). Packed rows
  (``padding="packed"``: position_ids restarting within the one row): ``_prepare_from_posids`` flattens q/k/v (views)
  and ``prepare_fa_kwargs_from_position_ids`` builds int32 ``cu_seqlens`` (its ``nonzero`` allocated at the size the
  real values give), then ``flash_attn_varlen_func``.
- flash-attn 2 ``flash_attn/flash_attn_interface.py: FlashAttnFunc.forward`` saves ``(q, k, v, out_padded,
  softmax_lse, rng_state)``; ``FlashAttnFunc.backward`` allocates ``dq, dk, dv = empty_like(q / k / v)``;
  ``_flash_attn_backward`` makes dout contiguous when its last stride is not 1 (``maybe_contiguous``).
- ``csrc/flash_attn/flash_api.cpp: mha_fwd``: ``out`` (B, S, H, Dv) in q's dtype, ``softmax_lse`` fp32 (B, H, S),
  ``rng_state`` int64[2].
- ``mha_bwd``: ``softmax_d`` fp32 (B, H, S rounded to 128), ``dq_accum`` fp32 (B, S rounded to 128, H, D rounded to
  32; ``loop = true``, non-deterministic), and for GQA / MQA ``dk_expanded`` / ``dv_expanded`` (B, S, H, D) in q's
  dtype, summed into dk / dv (``at::sum_out``) after the kernel.
- ``mha_varlen_fwd`` / ``mha_varlen_bwd`` (packed rows, T tokens of n examples): the same buffers over T tokens
  (softmax_lse fp32 (H, T)), ``FlashAttnVarlenFunc`` keeping cu_seqlens for backward, and backward's 128 spare rows
  per example: ``softmax_d`` fp32 (H, T + 128 n), ``dq_accum`` fp32 (T + 128 n, H, D rounded to 32).

Not emulated (refused by :func:`lora_kit.memory.specs.check_attention`): padded training batches (transformers' unpad
path, ``_upad_input``'s ``index_first_axis`` gathers; without gradients, as in adapter checks and generation, padded
batches get the attention values and no memory claim), fp32 q/k/v with nothing to cast them to (flash-attn
takes fp16 / bf16 only), head sizes that are not a multiple of 8 or above 256. Left out: ``mha_fwd``'s split-KV
accumulators (``set_params_splitkv``, called with ``num_splits=0``: without dropout, when ``num_splits_heuristic``
picks more than one split, fp32 ``softmax_lse_accum`` (splits, B, H, S) and ``out_accum`` (splits, B, H, S, Dv
rounded to 32) live during the forward kernel). They appear only for grids smaller than the card
(B x H x ceil(S / 64) < 0.8 x 2 x SMs: 211 on an H100's 132 SMs, i.e. short rows with few heads), depend on the
card's SM count, which a plan does not fix, and die with the kernel. With attention dropout the memory is exact; the
backward values use a fresh dropout mask.
"""
from __future__ import annotations

import contextlib

import torch

from lora_kit.memory.tracker import untracked

FA2 = "flash_attention_2"
KIT_NAME = "lora_kit_fa2_emulated"


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _head_rounded(d: int) -> int:
    """flash_api.cpp: ``head_size <= 192 ? round_multiple(head_size, 32) : 256`` (of the size rounded to 8)."""
    d = _round(d, 8)
    return _round(d, 32) if d <= 192 else 256


def _values(q, k, v, scale, causal, window, softcap, dropout, positions=None, key_mask=None):
    """Attention output (B, S, H, Dv) from (B, S, H, D) inputs, computed with CPU operators (values only);
    ``positions`` (packed rows): attention stays within each example (position_ids restart at each); ``key_mask``
    (B, Sk): keys that are not padding."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    S, Sk = q.shape[1], k.shape[1]
    mask = None
    if window is not None or softcap or (causal and S != Sk) or positions is not None or key_mask is not None:
        i = torch.arange(S, device=q.device)[:, None] + (Sk - S)
        j = torch.arange(Sk, device=q.device)[None, :]
        mask = (j <= i) if causal else torch.ones(S, Sk, dtype=torch.bool, device=q.device)
        if window is not None:
            mask = mask & (i - j <= window)
        if positions is not None:
            example = (positions.reshape(-1) == positions.min()).cumsum(0)
            mask = mask & (example[:, None] == example[None, :])
        if key_mask is not None:  # (B, 1, S, Sk); a query whose keys are all padding attends to itself
            mask = (mask & key_mask[:, None, None, :]) | (j == i)
    if softcap:
        scores = (qh.float() @ kh.float().transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        if dropout:
            probs = torch.nn.functional.dropout(probs, dropout)
        return (probs @ vh.float()).to(q.dtype).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=dropout,
                                                           is_causal=causal and mask is None, scale=scale)
    return out.transpose(1, 2)


class FlashAttnFunc(torch.autograd.Function):
    """flash-attn 2's ``FlashAttnFunc`` (q, k, v: (B, S, H, D) fp16 / bf16) with ``mha_fwd`` / ``mha_bwd``'s buffers;
    with ``cu_seqlens`` (packed rows: B = 1, ``positions`` restarting per example), ``FlashAttnVarlenFunc`` with
    ``mha_varlen_fwd`` / ``mha_varlen_bwd``'s: the same forward buffers over the T tokens (out (T, H, Dv), softmax_lse
    fp32 (H, T)), cu_seqlens kept for backward, and backward's per-example padding of 128 rows: softmax_d fp32
    (H, T + 128 x examples), dq_accum fp32 (T + 128 x examples, H, D rounded to 32)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, softcap, dropout, cu_seqlens=None, positions=None):
        B, S, H, _ = q.shape
        out = torch.empty((B, S, H, v.shape[3]), dtype=q.dtype, device=q.device)  # mha_fwd: out
        lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)  # mha_fwd: softmax_lse
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)  # mha_fwd: rng_state
        with untracked():
            out.copy_(_values(q, k, v, scale, causal, window, softcap, dropout, positions))
        ctx.save_for_backward(q, k, v, out, lse, rng_state, *(() if cu_seqlens is None else (cu_seqlens,)))
        ctx.args = (scale, causal, window, softcap, dropout, positions)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng_state, *cu = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # FlashAttnFunc.backward
        if dout.stride(-1) != 1:  # _flash_attn_backward: maybe_contiguous
            dout = dout.contiguous()
        B, S, H, D = q.shape
        Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
        f32 = dict(dtype=torch.float32, device=q.device)
        if cu:  # mha_varlen_bwd: each example padded by 128 rows
            rows = S + 128 * (cu[0].shape[0] - 1)
            softmax_d = torch.empty((H, rows), **f32)
            dq_accum = torch.empty((rows, H, _head_rounded(D)), **f32)
        else:  # mha_bwd
            softmax_d = torch.empty((B, H, _round(S, 128)), **f32)
            dq_accum = torch.empty((B, _round(S, 128), H, _head_rounded(D)), **f32)
        grouped, rep = Hk != H, H // Hk
        if grouped:  # mha_bwd: MQA / GQA gradients per query head, summed over each group after the kernel
            dk_x = torch.empty((B, Sk, H, D), dtype=q.dtype, device=q.device)
            dv_x = torch.empty((B, Sk, H, Dv), dtype=q.dtype, device=q.device)
        with untracked():
            with torch.enable_grad():
                qg = q.detach().requires_grad_()
                kg = k.detach().repeat_interleave(rep, dim=2).requires_grad_()
                vg = v.detach().repeat_interleave(rep, dim=2).requires_grad_()
                o = _values(qg, kg, vg, *ctx.args)
                gq, gk, gv = torch.autograd.grad(o, (qg, kg, vg), dout)
            dq.copy_(gq)
            (dk_x if grouped else dk).copy_(gk)
            (dv_x if grouped else dv).copy_(gv)
            del o, gq, gk, gv, qg, kg, vg
        if grouped:
            torch.sum(dk_x.view(B, Sk, Hk, rep, D), dim=3, out=dk)
            torch.sum(dv_x.view(B, Sk, Hk, rep, Dv), dim=3, out=dv)
            del dk_x, dv_x
        del softmax_d, dq_accum
        return dq, dk, dv, None, None, None, None, None, None, None


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def _outside_fake():
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()


_KNOWN: dict = {}  # id(fake tensor) -> (the fake tensor, its real values): simulate's batch (values_known)


@contextlib.contextmanager
def values_known(fake: dict, real: dict):
    """While simulating, the real values behind the fake batch tensors (packed rows are found from position_ids'
    values, as transformers finds them)."""
    added = [k for k in fake if k in real and id(fake[k]) not in _KNOWN]
    for k in added:
        _KNOWN[id(fake[k])] = (fake[k], real[k])
    try:
        yield
    finally:
        for k in added:
            _KNOWN.pop(id(fake[k]), None)


def _values_of(t):
    """``t`` itself, or the real tensor behind a fake one of simulate's batch; None for a fake one the model made (its
    own position_ids count from 0 over the whole row: one example)."""
    if not _is_fake(t):
        return t
    fake, real = _KNOWN.get(id(t), (None, None))
    return real if fake is t else None


def _cu_seqlens(position_ids, real):
    """transformers' ``prepare_fa_kwargs_from_position_ids``: the same tensors, with ``nonzero``'s output (whose size
    depends on the values) allocated at its size and filled out of sight."""
    pos = position_ids.reshape(-1)
    starts = pos == pos.min()
    with untracked(), _outside_fake():
        found = (real.reshape(-1) == real.min()).nonzero()
    index = torch.empty((found.shape[0], 1), dtype=torch.int64, device=pos.device)  # (starts).nonzero()
    if not _is_fake(index):
        with untracked():
            index.copy_(found)
    del starts, found
    cu_seqlens = torch.cat((index.view(-1).to(torch.int32), torch.tensor(pos.size(), dtype=torch.int32,
                                                                        device=pos.device)))
    return cu_seqlens, cu_seqlens.diff().max()


def flash_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' ``flash_attention_forward`` + ``_flash_attention_forward`` (unpadded rows, or one row of packed
    examples found from position_ids) with :class:`FlashAttnFunc` in place of ``flash_attn_func`` /
    ``flash_attn_varlen_func``."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, fa_peft_integration_check
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("the FlashAttention-2 emulation finds packed rows from position_ids; drop the collator's "
                         "cu_seq_lens (return_flash_attn_kwargs=False).")
    training = torch.is_grad_enabled() and query.requires_grad
    if attention_mask is not None and training:
        raise ValueError("the FlashAttention-2 emulation covers unpadded or packed rows in training; plan "
                         "padding='none' or 'packed' (or attn_implementation='sdpa' for padded batches).")
    if s_aux is not None:
        raise ValueError("the FlashAttention-2 emulation has no attention sinks (s_aux); use attn_implementation="
                         "'eager' for this model.")
    seq_len = query.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:
        v = torch.nn.functional.pad(v, [0, head_dim - v_head_dim])
    q, k, v = fa_peft_integration_check(q, k, v, get_target_dtype(q, module))
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"FlashAttention-2 takes fp16 / bf16 q/k/v, this step gives {q.dtype}; set dtype='bfloat16' "
                         "or autocast=True.")
    if head_dim % 8 or head_dim > 256:
        raise ValueError(f"the FlashAttention-2 emulation covers head sizes that are multiples of 8 up to 256, "
                         f"this model has {head_dim}; use attn_implementation='sdpa'.")
    causal = is_causal if is_causal is not None else module.is_causal
    window = sliding_window - 1 if sliding_window is not None and k.size(1) > sliding_window else None
    scale = scaling if scaling is not None else head_dim ** -0.5
    args = (scale, bool(causal), window, softcap or 0.0, float(dropout or 0.0))
    if attention_mask is not None:  # padded rows outside training (adapter checks, generation): values only
        out = _values(q, k, v, *args, key_mask=attention_mask[:, -k.size(1):].bool())
        return (out[..., :v_head_dim] if v_head_dim != head_dim else out), None
    position_ids = kwargs.get("position_ids")
    packed = _is_packed_sequence(position_ids, q.size(0))  # its int64 temporaries at batch 1
    if isinstance(packed, torch.Tensor):
        real = _values_of(position_ids)
        with untracked(), _outside_fake():
            packed = real is not None and bool(_is_packed_sequence(real, 1))
    if packed:  # _prepare_from_posids: q/k/v flattened to (T, H, D) views, cu_seqlens from the position_ids
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cu_seqlens, max_length = _cu_seqlens(position_ids, real)
        out = FlashAttnFunc.apply(q, k, v, *args, cu_seqlens, position_ids)
        del max_length
    else:
        out = FlashAttnFunc.apply(q, k, v, *args)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    AttentionInterface.register(KIT_NAME, flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(KIT_NAME, flash_attention_mask)


def model_attn_implementation(attn_implementation: str, device="cpu") -> str:
    """The name to build a model with: ``"flash_attention_2"`` itself on CUDA (transformers loads flash_attn, or says
    what is missing), the emulation (:data:`KIT_NAME`) on a CPU or the meta device; other implementations unchanged."""
    if attn_implementation != FA2:
        return attn_implementation
    if torch.device(device).type == "cuda":
        return FA2
    _register()  # idempotent: transformers' interfaces are dicts
    return KIT_NAME


def check_supported(model) -> None:
    """transformers' own check for ``flash_attention_2`` (``_supports_flash_attn``), which a registered name skips."""
    if not getattr(model, "_supports_flash_attn", False):
        raise ValueError(f"transformers has no attn_implementation='flash_attention_2' for "
                         f"{type(model).__name__}; pass attn_implementation='sdpa'.")
