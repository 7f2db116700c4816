"""Liger Kernel (``use_liger_kernel=True``) on the CPU: what its Triton kernels allocate and save, with torch ops.

The HF Trainer's ``use_liger_kernel=True`` (transformers ``integrations/liger.py`` ``apply_liger_kernel``) calls
liger-kernel's ``_apply_liger_kernel_to_instance(model=unwrap_peft_model(model))``, which runs the model type's
``apply_liger_kernel_to_<type>`` with its defaults: rope, rms_norm, swiglu and fused_linear_cross_entropy on,
cross_entropy off (liger-kernel 0.6.4 ``transformers/monkey_patch.py``). Liger's kernels are Triton, which does not
run on a CPU, so :func:`apply` puts on the model instance, in the same places, ``torch.autograd.Function``\\ s that
compute the same values with torch ops but allocate and save exactly the tensors Liger's Python code does
(``liger_kernel/ops/*.py``, cited beside each allocation). What a Triton kernel keeps in registers or shared memory
is not a tensor: the values are computed outside the live-bytes tracker (:func:`_untracked`) and written into the
buffers Liger's code allocates; on fake tensors (``simulate``) there are no values and only the buffers are made.

Where Liger's allocation depends on the device, the CUDA one is taken: RMSNorm's backward partial weight
gradients have one row per streaming multiprocessor (:data:`RMS_NORM_SM_COUNT`).
"""
from __future__ import annotations

import contextlib
from types import MethodType

import torch

# liger-kernel 0.6.4 transformers/monkey_patch.py MODEL_TYPE_TO_APPLY_LIGER_FN (its keys, in its order): the model
# types _apply_liger_kernel_to_instance patches; any other type is left as it is (a log line, no error).
LIGER_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3", "glm4", "glm4v", "glm4v_moe", "internvl", "llama",
                     "llama4_text", "llama4", "llava", "granite", "mllama", "mllama_text_model", "mistral", "mixtral",
                     "olmo2", "olmo3", "qwen2", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl",
                     "qwen2_5_vl_text", "qwen3_next", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe",
                     "qwen3_vl_moe_text", "smollm3", "phi3", "paligemma", "falcon_h1", "smolvlm", "hunyuan_v1_dense",
                     "hunyuan_v1_moe")
# The types emulated here: their apply_liger_kernel_to_<type> (monkey_patch.py apply_liger_kernel_to_llama /
# _mistral / _qwen2 / _qwen3) all do the same to an instance: the module's apply_rotary_pos_emb -> LigerRopeFunction,
# model.forward -> lce_forward (LigerForCausalLMLoss), base_model.norm and each layer's input_layernorm /
# post_attention_layernorm -> LigerRMSNorm.forward (offset 0, casting "llama", in_place True), each layer's mlp ->
# LigerSwiGLUMLP.forward. Value: the transformers module whose apply_rotary_pos_emb Liger replaces.
EMULATED = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# rms_norm.py rms_norm_backward's _dW has one row per multiprocessor: an H100-SXM's / H200's
# (lora_kit.plan.time_constants.SM_COUNT)
RMS_NORM_SM_COUNT = 132
IGNORE_INDEX = -100


def check(model_type: str) -> None:
    """ValueError unless Liger patches ``model_type`` and it is emulated here."""
    if model_type not in LIGER_MODEL_TYPES:
        raise ValueError(f"liger_kernel=True: Liger Kernel 0.6.4 has no kernels for model_type={model_type!r} (the "
                         "Trainer would apply none); it patches " + ", ".join(LIGER_MODEL_TYPES) +
                         ". Set liger_kernel=False.")
    if model_type not in EMULATED:
        raise ValueError(f"liger_kernel=True: Liger patches model_type={model_type!r}, but lora_kit emulates its "
                         f"kernels only for {', '.join(EMULATED)}; set liger_kernel=False to plan without them.")


def _is_fake(*ts) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(t, FakeTensor) for t in ts)


@contextlib.contextmanager
def _untracked():
    """Values a Triton kernel computes in registers: outside every dispatch mode (the live-bytes tracker), no graph."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), torch.no_grad():
        yield


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- RMSNorm: liger_kernel/ops/rms_norm.py LigerRMSNormFunction (casting_mode "llama", offset 0, in_place True) ------
class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, eps):
        X, W = X.contiguous(), W.contiguous()  # ops/utils.py ensure_contiguous
        shape = X.shape
        X = X.view(-1, shape[-1])  # rms_norm_forward
        Y = torch.empty(X.shape, dtype=X.dtype, device=X.device)  # rms_norm_forward: Y
        RSTD = torch.empty(X.shape[0], dtype=torch.float32, device=X.device)  # rms_norm_forward: RSTD, fp32 ("llama")
        if not _is_fake(X):
            with _untracked():
                x = X.float()
                r = torch.rsqrt(x.pow(2).mean(-1) + eps)
                RSTD.copy_(r)
                Y.copy_((x * r[:, None]).to(X.dtype) * W)
        ctx.save_for_backward(X, W, RSTD)  # LigerRMSNormFunction.forward
        return Y.view(*shape)

    @staticmethod
    def backward(ctx, dY):
        X, W, RSTD = ctx.saved_tensors
        dY = dY.contiguous()  # ensure_contiguous
        shape = dY.shape
        dY = dY.view(-1, shape[-1])  # rms_norm_backward
        _dW = torch.empty((RMS_NORM_SM_COUNT, shape[-1]), dtype=torch.float32, device=W.device)  # rms_norm_backward
        dX = dY  # rms_norm_backward: in_place=True writes dX over dY
        if not _is_fake(dY):
            with _untracked():
                x, r = X.float(), RSTD[:, None]
                m = dY.float() * W.float()
                dx = r * m - r.pow(3) * (m * x).mean(-1, keepdim=True) * x
                _dW.zero_()[0] = (dY.float() * (x * r)).sum(0)
                dX.copy_(dx)
        dX = dX.view(*shape)
        dW = _dW.sum(dim=0).to(W.dtype)  # rms_norm_backward
        return dX, dW, None


def _rms_norm_forward(self, hidden_states):  # transformers/rms_norm.py LigerRMSNorm.forward
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


# -- SwiGLU: liger_kernel/ops/swiglu.py LigerSiLUMulFunction ---------------------------------------------------------
class SiLUMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()  # ensure_contiguous
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])  # swiglu_forward
        c = torch.empty_like(a)  # swiglu_forward: c
        if not _is_fake(a):
            with _untracked():
                c.copy_(torch.nn.functional.silu(a.float()).to(b.dtype) * b)
        ctx.save_for_backward(a, b)  # LigerSiLUMulFunction.forward: a and b, c recomputed in backward
        return c.view(*shape)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        dc = dc.contiguous()  # ensure_contiguous
        shape = dc.shape
        dc = dc.view(-1, shape[-1])  # swiglu_backward: the kernel writes da over a and db over b
        if not _is_fake(dc):
            with _untracked():
                a32, g = a.float(), dc.float()
                sig = torch.sigmoid(a32)
                silu = a32 * sig
                db = g * silu
                da = g * (silu * (1 - sig) + sig) * b.float()
                a.copy_(da)
                b.copy_(db)
        return a.view(*shape), b.view(*shape)


def _swiglu_forward(self, x):  # transformers/swiglu.py LigerSwiGLUMLP.forward
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


# -- RoPE: liger_kernel/ops/rope.py LigerRopeFunction (q and k rotated in place) ------------------------------------
def _rotate(x, cos, sin, backward: bool):
    """x (batch, seq, heads, dim) rotated as transformers' apply_rotary_pos_emb (its transpose for backward)."""
    cos, sin = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    x = x.float()
    half = x.shape[-1] // 2
    y = x * sin
    if backward:
        rot = torch.cat((y[..., half:], -y[..., :half]), dim=-1)
    else:
        rot = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return x * cos + rot


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # rope_forward
        q, k = q.contiguous(), k.contiguous()  # rope_forward
        cos, sin = cos.contiguous(), sin.contiguous()  # rope_forward
        if not _is_fake(q):
            with _untracked():
                q.copy_(_rotate(q, cos, sin, False))
                k.copy_(_rotate(k, cos, sin, False))
        ctx.save_for_backward(cos, sin)  # LigerRopeFunction.forward
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = dq.transpose(1, 2), dk.transpose(1, 2)  # rope_backward
        dq, dk = dq.contiguous(), dk.contiguous()  # rope_backward
        if not _is_fake(dq):
            with _untracked():
                dq.copy_(_rotate(dq, cos, sin, True))
                dk.copy_(_rotate(dk, cos, sin, True))
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None, None, None


def _liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # transformers/rope.py
    return RopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim)


# -- fused linear cross-entropy: liger_kernel/ops/fused_linear_cross_entropy.py -----------------------------------
class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction with the arguments LigerForCausalLMLoss passes (no bias, no class
    weights, no softcap, no z-loss, accum_dtype None): the logits exist one chunk of tokens at a time, and the
    gradients of the input and the weight are computed in forward and saved."""

    @staticmethod
    def forward(ctx, _input, weight, target, reduction):
        # fused_linear_cross_entropy_forward
        BT, H = _input.shape
        V = weight.shape[0]
        inc_factor = _cdiv(V, H)
        chunk_size = _next_power_of_2(_cdiv(BT, inc_factor))
        num_chunks = _cdiv(BT, chunk_size)
        input_requires_grad = _input.requires_grad
        grad_input = torch.zeros_like(_input)  # grad_input, made whether or not the input needs it
        grad_weight = torch.zeros_like(weight) if input_requires_grad and weight.requires_grad else None
        loss_1d = torch.zeros(BT, dtype=torch.float32, device=_input.device)  # loss_1d, fp32
        target_mask = target != IGNORE_INDEX  # target_mask
        fake = _is_fake(_input)
        n = target_mask.sum()  # total_n_non_ignore = target_mask.sum().item(): the sum freed at once
        total_n_non_ignore = None if fake else int(n.item())  # fake tensors have no value (only a kernel reads it)
        del n
        for chunk_id in range(num_chunks):
            start_idx = chunk_id * chunk_size
            end_idx = min((chunk_id + 1) * chunk_size, BT)
            _input_chunk = _input[start_idx:end_idx]
            logits_chunk = _input_chunk @ weight.t()  # chunk_size x V, in the matmul's dtype
            target_chunk = target[start_idx:end_idx]
            loss_1d_slice = loss_1d[start_idx:end_idx]
            logits_chunk = logits_chunk.contiguous()
            target_chunk = target_chunk.contiguous()
            if not fake:  # liger_cross_entropy_kernel: loss per row, the logits' gradient written over them
                with _untracked():
                    x = logits_chunk.float()
                    valid = target_chunk != IGNORE_INDEX
                    y = target_chunk.clamp(min=0)
                    lse = torch.logsumexp(x, dim=-1)
                    rows = (lse - x.gather(1, y[:, None])[:, 0]) * valid
                    grad = torch.softmax(x, dim=-1)
                    grad[torch.arange(len(y)), y] -= 1
                    grad *= valid[:, None]
                    if reduction == "mean":
                        rows, grad = rows / max(total_n_non_ignore, 1), grad / max(total_n_non_ignore, 1)
                    loss_1d_slice.copy_(rows)
                    if input_requires_grad:
                        logits_chunk.copy_(grad)
            loss_1d[start_idx:end_idx] = loss_1d_slice
            grad_logits_chunk = logits_chunk
            if input_requires_grad:
                grad_input[start_idx:end_idx] = grad_logits_chunk @ weight
            if grad_weight is not None and input_requires_grad:
                grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()
        loss = torch.sum(loss_1d)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        # LigerFusedLinearCrossEntropyFunction.forward
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        # fused_linear_cross_entropy_backward: torch.equal(grad_output, torch.tensor(1.0)), else element_mul_kernel
        # scales the saved gradients in place
        one = torch.tensor(1.0, device=grad_output.device)
        if not _is_fake(grad_output):
            with _untracked():
                if not torch.equal(grad_output, one):
                    grad_input.mul_(grad_output)
                    if grad_weight is not None:
                        grad_weight.mul_(grad_output)
        del one
        return grad_input, grad_weight, None, None


def _causal_lm_loss(hidden_states, lm_head_weight, labels, hidden_size, num_items_in_batch=None,
                    ignore_index=IGNORE_INDEX, shift_labels=None, **kwargs):
    """transformers/model/loss_utils.py LigerForCausalLMLoss and fixed_fused_linear_cross_entropy."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(hidden_states.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = FusedLinearCrossEntropyFunction.apply(hidden_states, lm_head_weight, shift_labels, reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


def _lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                 return_dict=None, cache_position=None, logits_to_keep=0, skip_logits=None, **kwargs):
    """transformers/model/llama.py lce_forward (mistral.py / qwen2.py / qwen3.py: the same steps)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    given = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                 inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
                 output_hidden_states=output_hidden_states, cache_position=cache_position)
    # Liger passes each of these; the unset ones (None) are left out here: transformers 5 warns on some names
    outputs = self.model(input_ids=input_ids, **{k: v for k, v in given.items() if v is not None}, **kwargs)
    hidden_states = outputs[0]
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    kept_hidden_states = hidden_states[:, slice_indices, :]
    shift_labels = kwargs.pop("shift_labels", None)
    logits = loss = None
    if skip_logits is None:
        skip_logits = self.training and (labels is not None or shift_labels is not None)
    if skip_logits:
        loss = _causal_lm_loss(kept_hidden_states, self.lm_head.weight, labels, self.config.hidden_size,
                               shift_labels=shift_labels, **kwargs)
    else:
        logits = self.lm_head(kept_hidden_states)
        if labels is not None or shift_labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, shift_labels=shift_labels,
                                      vocab_size=self.config.vocab_size, **kwargs)
    cache = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"  # renamed
    return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions, **{cache: getattr(outputs, cache, None)})


def _with_liger_rope(forward, module):
    """An attention forward that sees Liger's rope: apply_liger_kernel_to_<type> sets the modeling module's
    apply_rotary_pos_emb for the whole process; here only while this instance's attention runs."""
    def wrapped(*args, **kwargs):
        orig = module.apply_rotary_pos_emb
        module.apply_rotary_pos_emb = _liger_rotary_pos_emb
        try:
            return forward(*args, **kwargs)
        finally:
            module.apply_rotary_pos_emb = orig
    return wrapped


def _bind(module, name: str, fn) -> None:  # monkey_patch.py _bind_method_to_module
    module.__dict__[name] = MethodType(fn, module)


def _rms_norm(module) -> None:
    """monkey_patch.py _patch_rms_norm_module (a peft ModulesToSaveWrapper: both of its copies)."""
    targets = ([module.modules_to_save.default, module.original_module]
               if hasattr(module, "modules_to_save") and hasattr(module, "original_module") else [module])
    for m in targets:
        m.variance_epsilon = getattr(m, "variance_epsilon", None) or getattr(m, "eps", None) or 1e-6
        _bind(m, "forward", _rms_norm_forward)


def apply(model, fused_linear_cross_entropy: bool = True) -> None:
    """What the Trainer's ``use_liger_kernel=True`` does to ``model`` (a transformers model or a peft model around
    one), with this module's CPU functions in place of Liger's Triton ones. ``fused_linear_cross_entropy=False``:
    TRL's SFTTrainer (1.16 ``sft_trainer.py``: it sets ``liger_kernel_config["fused_linear_cross_entropy"] =
    False``, keeping its own fused LM head), the layer kernels only."""
    import importlib

    from transformers.trainer_utils import unwrap_peft_model  # what integrations/liger.py apply_liger_kernel patches
    base = unwrap_peft_model(model)
    model_type = base.config.model_type
    check(model_type)
    modeling = importlib.import_module(f"transformers.models.{EMULATED[model_type]}.modeling_{EMULATED[model_type]}")
    if fused_linear_cross_entropy:
        base.forward = MethodType(_lce_forward, base)
    inner = getattr(base, base.base_model_prefix, base)
    _rms_norm(inner.norm)
    for layer in inner.layers:
        _bind(layer.mlp, "forward", _swiglu_forward)
        _rms_norm(layer.input_layernorm)
        _rms_norm(layer.post_attention_layernorm)
        layer.self_attn.forward = _with_liger_rope(layer.self_attn.forward, modeling)
    base._lora_kit_liger = True


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Rows of the logits the fused cross-entropy holds at once (fused_linear_cross_entropy_forward's chunk_size)."""
    return _next_power_of_2(_cdiv(tokens, _cdiv(vocab, hidden)))

