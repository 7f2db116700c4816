"""The loops users run next, run for real: transformers' ``Trainer`` and TRL's ``SFTTrainer`` on a prepared model.

Training code both ``lora_kit.memory`` (which measures and models these loops: ``memory/loops.py``) and a run
use. :func:`loop_parts` gives ``train_step`` the loop's optimizer, clipping and loss; :func:`run_real_loop`
runs the library's own ``train()`` for a few steps on one fixed batch, with :class:`LoopHooks` called at the moments
a caller (the live-bytes tracker) needs; :func:`run_loop` runs it on a run's own examples, in their order, with the
hooks called at every step (the smoke run's ``loop="trainer"`` / ``"sft"``).
"""
from __future__ import annotations

import tempfile

import torch

from lora_kit.training import (TRAINER_MAX_GRAD_NORM, TRAINER_OPTIM, add_sft_head, loop_inputs, loop_optimizer,
                               sft_loss, trainer_loss)


def loop_parts(net, s, device_type: str = "cpu") -> tuple:
    """(optimizer, train_step keyword arguments, already-live loop tensors) of the loop ``s.loop`` for a
    prepared model: the SFT head added to it, the loop's optimizer, its clipping and loss, and the Trainer's
    running-loss scalar (live all training)."""
    loop = s.loop
    if loop == "sft":
        add_sft_head(net)
    opt = loop_optimizer(net, s.optimizer, loop, device_type)
    if loop == "kit":
        return opt, {}, []
    kw = {"max_grad_norm": TRAINER_MAX_GRAD_NORM, "loss_fn": sft_loss if loop == "sft" else trainer_loss,
          "accelerate_backward": True}
    return opt, kw, [torch.zeros((), device=device_type)]


class LoopHooks:
    """Called by :func:`run_real_loop` during the last step (by :func:`run_loop` at every step; the step is
    ``trainer.state.global_step``): ``start`` once its batches are fetched (before the forward), ``loss`` after
    ``compute_loss``, ``micro_loss`` with what ``training_step`` returns for each micro-batch (their sum is the
    step's loss the Trainer logs), ``clip`` before gradient clipping (and before the optimizer step when nothing is
    clipped), ``end`` at ``on_step_end``."""
    def start(self, trainer, batches: list, num_items) -> None: ...
    def loss(self) -> None: ...
    def micro_loss(self, value) -> None: ...
    def clip(self, trainer) -> None: ...
    def end(self) -> None: ...


def _hooked(base, hooks: LoopHooks, when):
    """``base`` (Trainer / SFTTrainer) calling ``hooks`` during the steps ``when(global_step)`` is true for."""
    class Hooked(base):
        _hooks_on = False

        def get_batch_samples(self, it, n, device):
            out, num = super().get_batch_samples(it, n, device)
            self._hooks_on = when(self.state.global_step)
            if self._hooks_on:
                hooks.start(self, out, num)
            return out, num

        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            if self._hooks_on:
                hooks.loss()
            return loss

        def training_step(self, *a, **k):
            out = super().training_step(*a, **k)
            if self._hooks_on:
                hooks.micro_loss(out)
            return out

        def _clip_grad_norm(self, model):
            if self._hooks_on:
                hooks.clip(self)
            return super()._clip_grad_norm(model)
    return Hooked


def _callback(hooks: LoopHooks):
    """A callback calling ``hooks.end`` at ``on_step_end``, and ``hooks.clip`` before the optimizer step when the
    Trainer clips nothing (``max_grad_norm`` 0); set its ``trainer`` once the trainer exists."""
    from transformers import TrainerCallback

    class Hooks(TrainerCallback):
        trainer = None

        def on_pre_optimizer_step(self, args, st, control, **kw):
            if args.max_grad_norm <= 0 and getattr(self.trainer, "_hooks_on", False):
                hooks.clip(self.trainer)

        def on_step_end(self, args, st, control, **kw):
            if getattr(self.trainer, "_hooks_on", True):
                hooks.end()
    return Hooks()


def run_real_loop(net, batch: dict, s, steps: int = 2, tokenizer=None, hooks: LoopHooks | None = None):
    """The real ``Trainer`` (``s.loop == "trainer"``) or ``SFTTrainer`` (``"sft"``) training ``net`` (prepared:
    adapter, checkpointing) on ``batch`` every step for ``steps`` steps on the CPU, with its defaults: its data
    loader (a collator returning ``batch``), batch prefetch and ``num_items_in_batch``, ``compute_loss``,
    backward, clipping, optimizer (built by the Trainer from ``optim``), scheduler and ``zero_grad``. A paged
    optimizer runs as its unpaged twin off CUDA (the same state layout). Returns the trainer."""
    from transformers import Trainer, TrainingArguments
    hooks = hooks or LoopHooks()
    batch = loop_inputs(batch, s.loop)  # the collator's batch: an all-ones mask for full rows, none when packed
    callback = _callback(hooks)

    def hooked(base):
        return _hooked(base, hooks, lambda step: step == steps - 1)

    common = dict(max_steps=steps, per_device_train_batch_size=batch["input_ids"].shape[0], use_cpu=True,
                  report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                  dataloader_num_workers=0, remove_unused_columns=False, gradient_checkpointing=False,
                  bf16=bool(s.autocast), optim=TRAINER_OPTIM[s.optimizer])
    rows = [{"input_ids": [0]} for _ in range(steps * batch["input_ids"].shape[0])]
    with tempfile.TemporaryDirectory() as out_dir:
        if s.loop == "sft":
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer
            if tokenizer is None:
                from lora_kit.loading import load_tokenizer
                tokenizer = load_tokenizer("tiny")
            args = SFTConfig(output_dir=out_dir, dataset_kwargs={"skip_prepare_dataset": True}, **common)
            trainer = hooked(SFTTrainer)(model=net, args=args, train_dataset=Dataset.from_list(rows),
                                         data_collator=lambda r: batch, processing_class=tokenizer,
                                         callbacks=[callback])
        else:
            args = TrainingArguments(output_dir=out_dir, **common)
            trainer = hooked(Trainer)(model=net, args=args, train_dataset=rows, data_collator=lambda r: batch,
                                      callbacks=[callback])
        callback.trainer = trainer
        _unpaged_off_cuda(trainer, s.optimizer)
        trainer.train()
    return trainer


def _unpaged_off_cuda(trainer, optimizer: str) -> None:
    """A paged bitsandbytes optimizer runs unpaged off CUDA (paging needs CUDA managed memory; same state layout)."""
    if optimizer.startswith("paged_") and trainer.args.use_cpu:
        trainer.create_optimizer()
        for g in trainer.optimizer.param_groups:
            g["is_paged"] = False


# SFTConfig / TrainingArguments fields a smoke run sets whatever the user's config says: where it writes, how many
# steps, no checkpoints, logs, reports or evaluation, one process, the model it prepared itself (checkpointing
# included), and its own data: tokenised, checked and batched by the run (lora_kit.run.batches), in its order
RUN_OWNED = ("output_dir", "max_steps", "num_train_epochs", "save_strategy", "save_steps", "logging_strategy",
             "logging_steps", "report_to", "disable_tqdm", "dataloader_num_workers", "remove_unused_columns",
             "train_sampling_strategy", "gradient_checkpointing", "gradient_checkpointing_kwargs",
             "activation_checkpointing", "use_cpu", "push_to_hub", "eval_strategy", "do_eval", "deepspeed", "fsdp",
             "fsdp_config", "tf32", "model_init_kwargs", "dataset_kwargs", "dataset_text_field", "dataset_num_proc",
             "packing", "padding_free", "pad_to_multiple_of", "completion_only_loss", "assistant_only_loss",
             "eos_token", "pad_token", "chat_template_path", "resume_from_checkpoint")
# ... and the step fields, from the Step (mapped from the config by lora_kit.plan.config_import when it gave them)
STEP_OWNED = ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "max_length", "optim",
              "bf16", "fp16", "seed", "use_liger_kernel")


def loop_args(s, out_dir, steps: int, config: dict | None = None):
    """The ``SFTConfig`` (``s.loop == "sft"``) or ``TrainingArguments`` (``"trainer"``) a run trains with: the
    config's own fields (``config``: a TRL SFT config mapping, as ``trl sft --config`` reads it; its ``ModelConfig`` /
    script fields are not trainer arguments and are left out), then the step's fields (:data:`STEP_OWNED`, from
    ``s``) and the run's (:data:`RUN_OWNED`). Gradient checkpointing is the prepared model's (the run enabled it as
    ``s.gradient_checkpointing`` says), so the Trainer is told not to enable it again."""
    from transformers import TrainingArguments
    if s.loop == "sft":
        from trl import SFTConfig as cls
    else:
        cls = TrainingArguments
    import dataclasses
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in (config or {}).items() if k in names and k not in RUN_OWNED + STEP_OWNED}
    half = s.autocast and s.dtype == "float16"
    fields.update(per_device_train_batch_size=s.batch_size, gradient_accumulation_steps=s.grad_accum,
                  learning_rate=s.learning_rate, optim=TRAINER_OPTIM[s.optimizer], bf16=bool(s.autocast and not half),
                  fp16=bool(half), seed=s.seed, use_liger_kernel=s.liger_kernel, output_dir=str(out_dir),
                  max_steps=steps, save_strategy="no",
                  logging_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
                  remove_unused_columns=False, train_sampling_strategy="sequential",
                  use_cpu=not torch.cuda.is_available(), eval_strategy="no", push_to_hub=False)
    fields["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    if s.loop == "sft":
        fields.update(max_length=s.seq_len, dataset_kwargs={"skip_prepare_dataset": True})
    return cls(**fields)


def run_loop(net, s, examples: list[dict], collate, out_dir, steps: int, tokenizer=None, hooks: LoopHooks | None = None,
             config: dict | None = None):
    """The real ``Trainer`` / ``SFTTrainer`` (``s.loop``) training ``net`` (prepared: adapter, checkpointing) for
    ``steps`` optimizer steps on ``examples`` in their order (``train_sampling_strategy="sequential"``: micro-batch k
    of step t is examples ``(t * grad_accum + k) * batch_size`` onwards), batched by ``collate(rows)``; arguments from
    :func:`loop_args`. ``hooks`` are called at every step. Returns the trainer (``trainer.model`` is ``net``)."""
    from datasets import Dataset
    from transformers import Trainer
    hooks = hooks or LoopHooks()
    callback = _callback(hooks)
    args = loop_args(s, out_dir, steps, config)
    data = Dataset.from_list([{"i": i} for i in range(len(examples))])  # rows by index: the collator builds them

    def batch(rows):
        return loop_inputs(collate([examples[r["i"]] for r in rows]), s.loop)
    if s.loop == "sft":
        from trl import SFTTrainer
        trainer = _hooked(SFTTrainer, hooks, lambda step: True)(
            model=net, args=args, train_dataset=data, data_collator=batch, processing_class=tokenizer,
            callbacks=[callback])
    else:
        trainer = _hooked(Trainer, hooks, lambda step: True)(model=net, args=args, train_dataset=data,
                                                             data_collator=batch, callbacks=[callback])
    callback.trainer = trainer
    from transformers.trainer_callback import PrinterCallback
    trainer.remove_callback(PrinterCallback)  # its end-of-training metrics line: the run records its own
    _unpaged_off_cuda(trainer, s.optimizer)
    trainer.train()
    # accelerate left its mixed-precision wrapper (bf16 / fp16 autocast) on the model's forward: what follows
    # (saving, comparing outputs with the reloaded adapter, generating) runs the model itself, without autocast
    if net.__dict__.pop("_original_forward", None) is not None:
        net.__dict__.pop("forward", None)
    return trainer
