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
  real values give), then ``flash_attn_varlen_func``. Padded rows (``padding="max_length"`` / ``"longest"``: the 2-D
  mask ``masking_utils.flash_attention_mask`` keeps when a row holds padding) take the unpad path: ``_upad_input``
  calls ``_get_unpad_data`` (int32 row lengths, the real tokens' int64 flat indices from ``nonzero``, allocated at
  the size the real mask gives, a 0-d max, int32 ``cu_seqlens``), then ``_index_first_axis`` on k, v, q: a
  ``reshape`` to (B x S, H, D) (a copy for the transposed rope outputs, a view for v) and a gather of the T real
  tokens' rows (copies, which flash-attn keeps; autograd keeps only the indices, and in backward ``index``'s
  zeros (B x S, H, D) with the gradient put back at the indices, in place as on CUDA: :class:`_IndexFirstAxis`);
  ``flash_attn_varlen_func`` over the T tokens; flash-attn's ``flash_attn/bert_padding.py: pad_input``
  (``IndexPutFirstAxis``: zeros (B x S, H, Dv) in q's dtype with the rows put at the indices, the indices kept;
  backward gathers the T rows of the gradient), which allocates what transformers' own ``_pad_input`` does (called
  here). The padded q/k/v stay referenced until it returns.
- flash-attn 2 ``flash_attn/flash_attn_interface.py: FlashAttnFunc.forward`` saves ``(q, k, v, out_padded,
  softmax_lse, rng_state)``; ``FlashAttnFunc.backward`` allocates ``dq, dk, dv = empty_like(q / k / v)``;
  ``_flash_attn_backward`` makes dout contiguous when its last stride is not 1 (``maybe_contiguous``).
- ``csrc/flash_attn/flash_api.cpp: mha_fwd``: ``out`` (B, S, H, Dv) in q's dtype, ``softmax_lse`` fp32 (B, H, S),
  ``rng_state`` int64[2].
- ``mha_bwd``: ``softmax_d`` fp32 (B, H, S rounded to 128), ``dq_accum`` fp32 (B, S rounded to 128, H, D rounded to
  32; ``loop = true``, non-deterministic), and for GQA / MQA ``dk_expanded`` / ``dv_expanded`` (B, S, H, D) in q's
  dtype, summed into dk / dv (``at::sum_out``) after the kernel.
- ``mha_varlen_fwd`` / ``mha_varlen_bwd`` (packed or unpadded rows, T tokens of n examples): the same buffers over
  T tokens (softmax_lse fp32 (H, T)), ``FlashAttnVarlenFunc`` keeping cu_seqlens for backward, and backward's 128
  spare rows per example: ``softmax_d`` fp32 (H, T + 128 n), ``dq_accum`` fp32 (T + 128 n, H, D rounded to 32).

Not emulated (refused: :func:`lora_kit.memory.specs.check_attention` and :func:`flash_attention_forward`): fp32 q/k/v
with nothing to cast them to (flash-attn takes fp16 / bf16 only), head sizes that are not a multiple of 8 or above
256, attention sinks, the collator's own cu_seq_lens. Padded rows with a cache (generation's decode steps, keys
longer than queries) get the attention values and no memory claim. Left out: ``mha_fwd``'s split-KV
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


def _values(q, k, v, scale, causal, window, softcap, dropout, cu_seqlens=None, key_mask=None):
    """Attention output (B, S, H, Dv) from (B, S, H, D) inputs, computed with CPU operators (values only);
    ``cu_seqlens`` (varlen: B = 1, the examples' token runs): attention stays within each example; ``key_mask``
    (B, Sk): keys that are not padding."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        kh, vh = kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)
    S, Sk = q.shape[1], k.shape[1]
    mask = None
    if window is not None or softcap or (causal and S != Sk) or cu_seqlens is not None or key_mask is not None:
        i = torch.arange(S, device=q.device)[:, None] + (Sk - S)
        j = torch.arange(Sk, device=q.device)[None, :]
        mask = (j <= i) if causal else torch.ones(S, Sk, dtype=torch.bool, device=q.device)
        if window is not None:
            mask = mask & (i - j <= window)
        if cu_seqlens is not None:
            example = torch.searchsorted(cu_seqlens[1:], torch.arange(S, dtype=cu_seqlens.dtype), right=True)
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
    with ``cu_seqlens`` (varlen: B = 1, the examples' tokens one after another), ``FlashAttnVarlenFunc`` with
    ``mha_varlen_fwd`` / ``mha_varlen_bwd``'s: the same forward buffers over the T tokens (out (T, H, Dv), softmax_lse
    fp32 (H, T)), cu_seqlens kept for backward, and backward's per-example padding of 128 rows: softmax_d fp32
    (H, T + 128 x examples), dq_accum fp32 (T + 128 x examples, H, D rounded to 32)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, softcap, dropout, cu_seqlens=None):
        B, S, H, _ = q.shape
        out = torch.empty((B, S, H, v.shape[3]), dtype=q.dtype, device=q.device)  # mha_fwd: out
        lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)  # mha_fwd: softmax_lse
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)  # mha_fwd: rng_state
        with untracked():
            out.copy_(_values(q, k, v, scale, causal, window, softcap, dropout, cu_seqlens))
        ctx.save_for_backward(q, k, v, out, lse, rng_state, *(() if cu_seqlens is None else (cu_seqlens,)))
        ctx.args = (scale, causal, window, softcap, dropout)
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
                o = _values(qg, kg, vg, *ctx.args, *cu)
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
        return dq, dk, dv, None, None, None, None, None, None


class _IndexFirstAxis(torch.autograd.Function):
    """``t[indices]`` on the first axis (transformers' ``_index_first_axis``, after its reshape): the gathered rows'
    copy; for backward autograd's ``IndexBackward0`` keeps the indices only and makes zeros of ``t``'s shape with the
    gradient put back at the indices, in place (torch/csrc/autograd/FunctionsManual.cpp: ``index_backward``,
    ``_index_put_impl_`` with accumulate). It puts them out of place (``index_put``: a second tensor of ``t``'s shape)
    when a dispatch mode is active (``isTensorSubclassLike``), as the live-bytes trackers are; a CUDA step has none,
    and this Function gives its bytes under the trackers too."""

    @staticmethod
    def forward(ctx, t, indices):
        ctx.save_for_backward(indices)
        ctx.rows = t.shape[0]
        return t[indices]

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        dt = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        dt.index_put_((indices,), grad, accumulate=True)
        return dt, None


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
    values, padded rows from the attention mask's, as transformers finds them)."""
    added = {id(fake[k]): (fake[k], real[k]) for k in fake if k in real and id(fake[k]) not in _KNOWN}
    if "attention_mask" in fake and "attention_mask" in real and "attention_mask" not in _KNOWN:
        added["attention_mask"] = (fake["attention_mask"], real["attention_mask"])  # see _real_mask
    _KNOWN.update(added)
    try:
        yield
    finally:
        for k in added:
            _KNOWN.pop(k, None)


def _real_mask(mask):
    """The real values behind the 2-D padding mask attention is handed: ``mask`` itself, or simulate's batch mask as
    transformers makes it (masking_utils' ``_preprocess_mask_arguments``: bool; ``flash_attention_mask``: its last
    key-length columns). Run outside fake mode."""
    if not _is_fake(mask):
        return mask
    return _KNOWN["attention_mask"][1].bool()[:, -mask.shape[1]:]


def _values_of(t):
    """``t`` itself, or the real tensor behind a fake one of simulate's batch; None for a fake one the model made (its
    own position_ids count from 0 over the whole row: one example)."""
    if not _is_fake(t):
        return t
    fake, real = _KNOWN.get(id(t), (None, None))
    return real if fake is t else None


def _nonzero(t, real):
    """``t.nonzero()`` (int64 (n, t.dim())): its size depends on the values, which fake tensors lack, so it is
    allocated at the size ``real()`` (the same test on the real batch's values) gives, and filled out of sight."""
    with untracked(), _outside_fake():
        found = real().nonzero()
    index = torch.empty(found.shape, dtype=torch.int64, device=t.device)
    if not _is_fake(index):
        with untracked():
            index.copy_(found)
    return index


def _cu_seqlens(position_ids, real):
    """transformers' ``prepare_fa_kwargs_from_position_ids``: the same tensors (``nonzero``: :func:`_nonzero`)."""
    pos = position_ids.reshape(-1)
    starts = pos == pos.min()
    index = _nonzero(starts, lambda: real.reshape(-1) == real.min())  # (starts).nonzero()
    del starts
    cu_seqlens = torch.cat((index.view(-1).to(torch.int32), torch.tensor(pos.size(), dtype=torch.int32,
                                                                        device=pos.device)))
    return cu_seqlens, cu_seqlens.diff().max()


def _unpad_data(mask):
    """transformers' ``_get_unpad_data`` on the 2-D padding mask: the real tokens' flat indices (int64, kept by the
    gathers' and ``pad_input``'s backward), int32 ``cu_seqlens`` (kept by flash-attn) and the longest row (``.item()``
    of a 0-d int32, its value unused here); ``nonzero``: :func:`_nonzero`."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = _nonzero(mask.flatten(), lambda: _real_mask(mask).flatten()).flatten()
    max_length = seqlens.max()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    del seqlens, max_length
    return indices, cu_seqlens


def flash_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' ``flash_attention_forward`` + ``_flash_attention_forward`` (unpadded rows, padded rows unpadded
    from the 2-D mask, or one row of packed examples found from position_ids) with :class:`FlashAttnFunc` in place
    of ``flash_attn_func`` / ``flash_attn_varlen_func``."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, _pad_input, fa_peft_integration_check
    if kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("the FlashAttention-2 emulation finds packed rows from position_ids; drop the collator's "
                         "cu_seq_lens (return_flash_attn_kwargs=False).")
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
    if attention_mask is not None and q.size(1) == k.size(1) == attention_mask.size(1):  # padded rows: unpad
        # _upad_input (_get_unpad_data, _index_first_axis of k, v, q), flash_attn_varlen_func, pad_input; the padded
        # q/k/v stay referenced (_flash_attention_forward's query_states ...): the module docstring
        indices, cu_seqlens = _unpad_data(attention_mask)
        ku, vu, qu = (_IndexFirstAxis.apply(t.reshape(-1, *t.shape[2:]), indices) for t in (k, v, q))
        out = FlashAttnFunc.apply(qu[None], ku[None], vu[None], *args, cu_seqlens)[0]
        out = _pad_input(out, indices, q.size(0), seq_len)
    elif attention_mask is not None:  # padded rows with a cache (generation): values only
        out = _values(q, k, v, *args, key_mask=attention_mask[:, -k.size(1):].bool())
        return (out[..., :v_head_dim] if v_head_dim != head_dim else out), None
    else:
        position_ids = kwargs.get("position_ids")
        packed = _is_packed_sequence(position_ids, q.size(0))  # its int64 temporaries at batch 1
        if isinstance(packed, torch.Tensor):
            real = _values_of(position_ids)
            with untracked(), _outside_fake():
                packed = real is not None and bool(_is_packed_sequence(real, 1))
        if packed:  # _prepare_from_posids: q/k/v flattened to (T, H, D) views, cu_seqlens from the position_ids
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            cu_seqlens, max_length = _cu_seqlens(position_ids, real)
            out = FlashAttnFunc.apply(q, k, v, *args, cu_seqlens)
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
