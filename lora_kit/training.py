"""Turn a loaded base model into the thing that trains: adapter, checkpointing, optimizer.

The same choices users make with peft + transformers, in the order that matters:

- QLoRA: ``prepare_model_for_kbit_training`` (as users normally call it: it up-casts the
  non-quantized parameters -- norms, embeddings, lm_head -- to fp32, which costs memory on a
  bf16 model and is included in every number we measure), then ``get_peft_model``.
- The seed is set *immediately before* the adapter is created, so the same seed gives the same
  adapter initialisation whatever happened before (data loading, model loading).
- Gradient checkpointing as the HF Trainer does it: non-reentrant, input gradients enabled when
  the embedding is frozen. Trade-off: ~30 % more compute for activations of one layer at a time.
- Optimizers: ``adamw`` (torch, foreach), ``adamw_8bit`` / ``paged_adamw_8bit`` /
  ``paged_adamw_32bit`` (bitsandbytes; 8-bit states are 4x smaller than fp32, paged states can
  spill to host memory under pressure on CUDA), ``sgd`` (no state, usually worse results),
  ``adafactor`` (factored second moment, transformers' implementation).
"""
from __future__ import annotations

import torch

from lora_kit.loading import fix_bnb_cpu_repack


def lora_config(rank: int, alpha: int, dropout: float, targets):
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=targets if targets == "all-linear" else list(targets),
                      task_type="CAUSAL_LM")


def attach_adapter(model, method: str, seed: int, rank: int = 16, alpha: int = 32, dropout: float = 0.0,
                   targets="all-linear", gradient_checkpointing: bool = False):
    """Prepare ``model`` for ``method`` and return the model that trains (a PeftModel for LoRA/QLoRA)."""
    if method == "qlora":
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method != "full":
            model.enable_input_require_grads()  # frozen embedding: checkpointed blocks need a grad input
    if method == "full":
        torch.manual_seed(seed)
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import get_peft_model
    torch.manual_seed(seed)  # seed right before the adapter is created: reproducible init
    try:
        peft_model = get_peft_model(model, lora_config(rank, alpha, dropout, targets))
    except ValueError as e:
        raise ValueError(f"lora_targets={targets!r} does not fit this model ({e}); use 'all-linear' or "
                         "names of its linear layers, e.g. ['q_proj', 'v_proj'].") from e
    fix_bnb_cpu_repack(peft_model)
    return peft_model


def build_optimizer(params, name: str, lr: float):
    """The optimizer ``name`` over ``params`` (only trainable ones are passed)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: no parameter requires grad; check method and lora_targets.")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    bnb_names = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit",
                 "paged_adamw_32bit": "PagedAdamW32bit"}
    if name in bnb_names:
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ValueError(f"optimizer={name!r} needs bitsandbytes (pip install bitsandbytes); "
                             "or use optimizer='adamw'.") from e
        return getattr(bnb.optim, bnb_names[name])(params, lr=lr)
    raise ValueError(f"optimizer={name!r} is unknown; choose adamw, adamw_8bit, paged_adamw_8bit, "
                     "paged_adamw_32bit, sgd or adafactor.")
