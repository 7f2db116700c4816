"""FSDP2 wrapping as a user's accelerate run does it: the training code a sharded run and ``simulate`` share.

The default is what a user gets from accelerate's FSDP2 (accelerate 1.16,
``fsdp2_prepare_model`` with ``TRANSFORMER_BASED_WRAP``): ``fully_shard`` on every decoder layer
(the classes in the model's ``_no_split_modules``), on the input embedding (its own unit), on the
tail ``[final norm, lm_head]`` with ``reshard_after_forward=False``, then on the root, which keeps
PyTorch's default (``None``: not resharded after forward); no mixed-precision policy unless
``autocast`` asks for one; the optimizer built after sharding; ``batch_size`` per GPU.
``policy="layers"`` is the plain recipe: every decoder layer, then
the root, ``reshard_after_forward=True`` everywhere.

``sharding`` values run on FSDP2 (:data:`SIMULATED`): ``fsdp`` and ``zero3`` shard parameters, gradients and
states; ``zero2`` keeps parameters gathered from forward to backward (``reshard_after_forward=False``).
``lora_kit.memory.sharded`` measures and simulates steps wrapped this way.
"""
from __future__ import annotations

import torch

SIMULATED = ("fsdp", "zero3", "zero2")  # sharding values run on FSDP2 (see the module docstring)
POLICIES = ("accelerate", "layers")


def _underlying(net):
    """The transformers model inside a PeftModel (or the model itself)."""
    get = getattr(net, "get_base_model", None)
    return get() if get is not None else net


def decoder_layers(net) -> list:
    """The modules accelerate wraps with ``TRANSFORMER_BASED_WRAP``: instances of ``_no_split_modules``."""
    names = set(getattr(_underlying(net), "_no_split_modules", None) or [])
    layers = [m for m in net.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(_underlying(net)).__name__} names no decoder layer class in _no_split_modules; "
                         "FSDP2 transformer-layer wrapping needs one.")
    return layers


def layer_class(net) -> str | None:
    """Class name of the decoder layers FSDP2 wraps one by one (accelerate's ``fsdp_transformer_layer_cls_to_wrap``);
    None when the model names none."""
    try:
        return type(decoder_layers(net)[0]).__name__
    except ValueError:
        return None


def _final_norm(net):
    """accelerate's ``_find_final_norm``: the last *Norm* among the base model's direct children. Asked of a
    PeftModel, as accelerate asks it, this finds none (its ``model`` is the CausalLM, whose children are the
    decoder and lm_head): a LoRA model's final norm stays in the root group."""
    prefix = getattr(net, "base_model_prefix", "")
    base = getattr(net, prefix, None) if prefix else net
    found = None
    for _, child in (base.named_children() if isinstance(base, torch.nn.Module) else ()):
        if "Norm" in type(child).__name__:
            found = child
    return found


def apply_fsdp2(net, mesh, sharding: str, policy: str = "accelerate", mp_policy=None):
    """Shard ``net`` in place with ``fully_shard`` as accelerate does (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not valid; choose one of {POLICIES}.")
    if sharding not in SIMULATED:
        raise ValueError(f"sharding={sharding!r} does not run on FSDP2; choose one of {SIMULATED}.")
    reshard = sharding != "zero2"
    kw = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in decoder_layers(net):
        fully_shard(layer, reshard_after_forward=reshard, **kw)
    if policy == "accelerate":
        inner = _underlying(net)
        emb, head = inner.get_input_embeddings(), inner.get_output_embeddings()
        tied = head is not None and emb.weight is getattr(head, "weight", None)
        if not tied and not isinstance(emb, FSDPModule):
            fully_shard(emb, reshard_after_forward=reshard, **kw)
        tail = [m for m in ((_final_norm(net), emb, head) if tied else (_final_norm(net), head))
                if m is not None and not isinstance(m, FSDPModule)]
        if tail:
            fully_shard(tail, reshard_after_forward=False, **kw)
        fully_shard(net, **kw)  # root: PyTorch's default (None -> not resharded after forward)
    else:
        fully_shard(net, reshard_after_forward=reshard, **kw)
    return net


def _mp_policy(s):
    """``autocast=True`` as accelerate's FSDP2 mixed precision: compute in the 16-bit dtype, fp32 master
    weights of the trainable parameters (accelerate up-casts them before sharding); None otherwise."""
    if not s.autocast:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from lora_kit.loading import DTYPE_MAP
    compute = DTYPE_MAP[s.dtype] if s.dtype != "float32" else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute)


def _upcast_trainable(net) -> None:
    for p in net.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def shard_for_training(net, mesh, s, policy: str = "accelerate"):
    """:func:`apply_fsdp2` for the step settings ``s`` (``sharding``, ``autocast``, ``dtype``): with autocast,
    trainable parameters up-cast to fp32 and accelerate's mixed-precision policy. Build the optimizer after."""
    if s.autocast:
        _upcast_trainable(net)
    return apply_fsdp2(net, mesh, s.sharding, policy, _mp_policy(s))
