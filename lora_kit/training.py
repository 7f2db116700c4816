"""Turn a loaded base model into the thing that trains: adapter, checkpointing, optimizer.

The same choices users make with peft + transformers, in the order that matters:

- QLoRA: ``prepare_model_for_kbit_training`` (as users normally call it: it up-casts the
  non-quantized parameters -- norms, embeddings, lm_head -- to fp32, which costs memory on a
  bf16 model and is included in every number we measure), then ``get_peft_model``; or, with
  ``Step.qlora_prepare`` resolved to "none" (sharded QLoRA), neither up-casts nor fp32 adapters.
- The seed is set *immediately before* the adapter is created, so the same seed gives the same
  adapter initialisation whatever happened before (data loading, model loading).
- Gradient checkpointing as the HF Trainer does it: non-reentrant, input gradients enabled when
  the embedding is frozen. Trade-off: ~30 % more compute for activations of one layer at a time.
- **The one training step** (:func:`train_step`) is what ``design.md`` defines and what the kit
  predicts, measures and runs everywhere -- ``measure``, ``simulate`` (on fake tensors), the smoke
  run's loop, the tiny-model story harness and the build script: forward with labels keeping only
  the loss (as the HF Trainer's ``compute_loss``), ``backward`` of ``loss / grad_accum`` per
  micro-batch, an optional gradient clip and scheduler step, ``optimizer.step()``,
  ``optimizer.zero_grad(set_to_none=True)``.
- Optimizers: ``adamw`` (torch, foreach), ``adamw_8bit`` / ``paged_adamw_8bit`` /
  ``paged_adamw_32bit`` (bitsandbytes; 8-bit states are 4x smaller than fp32, paged states can
  spill to host memory under pressure on CUDA), ``sgd`` (no state, usually worse results),
  ``adafactor`` (factored second moment, transformers' implementation).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lora_kit.loading import DTYPE_MAP, fix_bnb_cpu_repack


def lora_config(rank: int, alpha: int, dropout: float, targets):
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=targets if targets == "all-linear" else list(targets),
                      task_type="CAUSAL_LM")


def enable_checkpointing(model) -> None:
    """Non-reentrant gradient checkpointing as the HF Trainer sets it (transformers 5 calls it activation
    checkpointing; older versions only have ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class FusedDropout(torch.nn.Dropout):
    """``nn.Dropout`` through ``torch.native_dropout``: the fused kernel CUDA's ``F.dropout`` runs, whatever the
    device. It saves a bool mask for backward (1 byte per element); a CPU's ``F.dropout`` instead saves a noise
    tensor in the input's dtype, so without this a CPU step would keep 2-4 times the mask a GPU keeps. The same
    distribution and scaling (kept elements times 1 / (1 - p)); in eval, or at p = 0, the input unchanged."""

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


def fuse_lora_dropout(model) -> int:
    """Replace peft's LoRA dropout modules (``lora_dropout[adapter]``, ``nn.Dropout`` when p > 0) by
    :class:`FusedDropout` of the same p; returns how many."""
    n = 0
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for name, d in list(drops.items()):
                if type(d) is torch.nn.Dropout:
                    drops[name] = FusedDropout(d.p)
                    n += 1
    return n


def attach_adapter(model, method: str, seed: int, rank: int = 16, alpha: int = 32, dropout: float = 0.0,
                   targets="all-linear", gradient_checkpointing: bool = False, kbit_prepared: bool = True):
    """Prepare ``model`` for ``method`` and return the model that trains (a PeftModel for LoRA/QLoRA).
    ``kbit_prepared=False`` (QLoRA, ``Step.qlora_prepare`` resolved): no ``prepare_model_for_kbit_training``,
    the adapters cast to bf16, as TRL's ``SFTTrainer`` (1.16) does for a quantized model whatever its dtype
    (``sft_trainer.py``: "the PEFT adapter weights are converted to bf16") and Answer.AI's fsdp_qlora trains."""
    if method == "qlora" and kbit_prepared:
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif gradient_checkpointing:
        enable_checkpointing(model)
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
    fuse_lora_dropout(peft_model)  # the mask CUDA keeps, on every device
    if method == "qlora" and not kbit_prepared:
        for p in peft_model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
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


def optimizer_for(params, name: str, device_type: str = "cpu", lr: float = 1e-4):
    """:func:`build_optimizer`, except that off CUDA a paged bitsandbytes optimizer becomes its non-paged
    twin (same state layout; paging needs CUDA managed memory)."""
    if name.startswith("paged_") and device_type != "cuda":
        import bitsandbytes as bnb
        twin = bnb.optim.AdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW32bit
        return twin([p for p in params if p.requires_grad], lr=lr, is_paged=False)
    return build_optimizer(params, name, lr)


# -- the loops users run next: transformers' Trainer and TRL's SFTTrainer, with their defaults ------------------
TRAINER_OPTIM = {"adamw": "adamw_torch_fused", "adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
                 "paged_adamw_32bit": "paged_adamw_32bit", "sgd": "sgd", "adafactor": "adafactor"}
TRAINER_MAX_GRAD_NORM = 1.0  # TrainingArguments.max_grad_norm (SFTConfig keeps it)
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer's fused LM head computes (loss + its metrics)


def loop_optimizer(model, name: str, loop: str = "kit", device_type: str = "cpu", lr: float = 1e-4):
    """The optimizer ``loop`` builds for ``name``: ``"kit"``: :func:`optimizer_for`; ``"trainer"`` / ``"sft"``:
    what ``Trainer.create_optimizer`` builds for ``optim=TRAINER_OPTIM[name]`` ("adamw" is the Trainer's default,
    ``adamw_torch_fused``: no ``foreach`` temporaries), through the Trainer's own class/kwargs lookup and its
    weight-decay groups (norms and biases apart). Off CUDA a paged bitsandbytes optimizer runs unpaged."""
    if loop == "kit":
        return optimizer_for(model.parameters(), name, device_type, lr)
    import tempfile

    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=tempfile.gettempdir(), optim=TRAINER_OPTIM[name], learning_rate=lr,
                             report_to=[], use_cpu=device_type == "cpu")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    if kwargs.get("is_paged") and device_type != "cuda":
        kwargs["is_paged"] = False
    decay = set(Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return cls([{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], **kwargs)


def loop_batch(batch: dict, loop: str = "kit") -> dict:
    """The batch as ``loop`` hands it to the model: the Trainer adds ``num_items_in_batch`` (labelled tokens of
    the whole step, counted over the shifted labels before the step, divided by the parallel sizes: a float
    scalar), so the loss is a sum over them rather than a per-batch mean (after :func:`loop_inputs`)."""
    if loop == "kit":
        return batch
    batch = loop_inputs(batch, loop)
    return {**batch, "num_items_in_batch": batch["labels"][..., 1:].ne(-100).sum() / 1}


def loop_inputs(batch: dict, loop: str = "kit") -> dict:
    """The collator's batch for ``loop``: SFTTrainer's collator builds an attention mask, so an unpadded batch gets
    an all-ones mask (from which transformers builds no 4-D mask); a padding-free batch (position_ids, one packed
    row) gets none, as TRL's collator leaves it out there (TRL 1.16 sft_trainer.py, DataCollatorForLanguageModeling:
    a mask would make FlashAttention ignore the position_ids)."""
    if loop == "sft" and "attention_mask" not in batch and "position_ids" not in batch:
        return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    return batch


def trainer_loss(model, batch: dict):
    """``Trainer.compute_loss`` with its defaults: the model's loss over ``num_items_in_batch``, then multiplied
    in place by the number of processes (``average_tokens_across_devices=True``; 1 here, still an operation
    whose scalar autograd keeps for backward)."""
    loss = model(**batch).loss
    loss *= 1
    return loss


def add_sft_head(model) -> None:
    """What ``SFTTrainer.__init__`` does to the model: TRL's fused LM head (per-token log-probabilities in tiles,
    without the ``(batch, seq, vocab)`` logits) on the base model, computing the loss and its two metrics."""
    from trl.trainer.utils import add_fused_lm_head
    add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model, outputs=SFT_OUTPUTS)


def sft_loss(model, batch: dict):
    """``SFTTrainer.compute_loss`` (TRL 1.16, default ``loss_type="nll"``): the fused head's log-probabilities
    summed over ``num_items_in_batch``, and the entropy / token-accuracy metrics it logs."""
    inputs = {k: v for k, v in batch.items() if k != "num_items_in_batch"}
    inputs["use_cache"] = False
    outputs = model(**inputs, fused_lm_head=True)
    num = batch.get("num_items_in_batch")
    loss = (-outputs.log_probs).sum() / torch.as_tensor(outputs.label_mask.sum() if num is None else num).clamp(min=1)
    if num is not None:
        loss = loss * 1  # average_tokens_across_devices: times the number of processes (1 here)
    # the logged metrics (read with .item(), which allocates nothing on the device; skipped here so that fake
    # tensors, which have no values, run the same operations)
    num_valid = outputs.label_mask.sum().sum()
    entropy_sum, num_correct = outputs.entropy.detach().sum().sum(), outputs.is_top1.sum().sum()
    entropy_sum / num_valid, num_correct / num_valid
    if "attention_mask" in batch:
        batch["attention_mask"].sum().sum()
    return loss


def autocast_context(autocast: bool, dtype: str, device_type: str = "cpu"):
    """Mixed precision as the Trainer's bf16/fp16 flags do (bf16 compute when ``dtype`` is float32), with
    :class:`autocast_query` inside it. Reusable: each ``with`` enters it afresh."""
    if not autocast:
        return contextlib.nullcontext()
    compute = DTYPE_MAP[dtype] if dtype != "float32" else torch.bfloat16
    return _Autocast(device_type, compute)


class _Autocast:
    def __init__(self, device_type: str, dtype):
        self.device_type, self.dtype = device_type, dtype
        self._stack = None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.autocast(device_type=self.device_type, dtype=self.dtype))
        self._stack.enter_context(autocast_query())
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)


class autocast_query:  # noqa: N801 (used as a context, like torch.autocast)
    """Inside it, ``torch.is_autocast_enabled()`` without a device also answers True under the CPU's autocast
    (restored on exit).

    That no-argument query reports CUDA's autocast only, and peft's 4-bit LoRA layers decide by it whether to
    cast the adapters' input to fp32 and their output back (peft 0.21 ``tuners/lora/bnb.py``
    ``Linear4bit.forward``: ``requires_conversion = not torch.is_autocast_enabled()``). Without this a CPU step
    under the CPU's autocast takes the path of a CUDA step *without* autocast (an fp32 copy of every adapter
    output), not the path of the CUDA step it stands for. :func:`train_step` holds it over backward too, where
    checkpointing's recompute re-enters the autocast and must take the forward's path."""

    def __enter__(self):
        self._original = original = torch.is_autocast_enabled

        def is_autocast_enabled(*args, **kwargs):
            if args or kwargs:
                return original(*args, **kwargs)
            return original() or original("cpu")
        torch.is_autocast_enabled = is_autocast_enabled
        return self

    def __exit__(self, *exc):
        torch.is_autocast_enabled = self._original
        return False


@dataclass
class StepOutput:
    loss: torch.Tensor  # mean loss over the micro-batches (detached)
    tokens: int  # real (attention-mask) tokens trained on
    padded_tokens: int  # tokens including padding (what the GPU computes)


def train_step(model, micro_batches, optimizer, *, tracker=None, on_grads=None, autocast_ctx=None,
               scheduler=None, max_grad_norm: float | None = None, loss_fn=None,
               accelerate_backward: bool = False) -> StepOutput:
    """One optimizer step over ``micro_batches`` (a batch dict, or a sequence of them for gradient
    accumulation; a lazy sequence builds each micro-batch only when its turn comes, so only one is
    live at a time). ``tracker.phase`` is set per phase ("forward", "backward", "optimizer") when a
    live-bytes tracker is given; ``on_grads()`` runs between the last backward and the optimizer
    step (the tracker labels the fresh gradients there). The model output, and with it the logits,
    is dropped as soon as the loss is taken. ``loss_fn(model, batch)`` replaces ``model(**batch).loss``
    (e.g. :func:`sft_loss`, TRL's SFTTrainer loss); ``accelerate_backward=True`` divides the loss by the number
    of micro-batches before ``backward`` even for one, as accelerate's ``backward`` does under the Trainer."""
    batches = [micro_batches] if isinstance(micro_batches, dict) else micro_batches

    def phase(name):
        if tracker is not None:
            tracker.phase = name
    losses, tokens, padded = [], 0, 0
    with autocast_query() if autocast_ctx is not None else contextlib.nullcontext():
        for batch in batches:
            phase("forward")
            with autocast_ctx or contextlib.nullcontext():
                loss = model(**batch).loss if loss_fn is None else loss_fn(model, batch)
            phase("backward")
            (loss / len(batches)).backward() if len(batches) > 1 or accelerate_backward else loss.backward()
            losses.append(loss.detach())
            padded += batch["input_ids"].numel()
            tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            del loss, batch
    if on_grads is not None:
        on_grads()
    phase("optimizer")
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    return StepOutput(loss, tokens, padded)
