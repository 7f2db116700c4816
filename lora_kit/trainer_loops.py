"""The loops users run next, run for real: transformers' ``Trainer`` and TRL's ``SFTTrainer`` on a prepared model.

Training code both ``lora_kit.memory`` (which measures and models these loops: ``memory/loops.py``) and a run
use. :func:`loop_parts` gives ``train_step`` the loop's optimizer, clipping and loss; :func:`run_real_loop`
runs the library's own ``train()`` for a few steps, with :class:`LoopHooks` called at the moments a caller
(the live-bytes tracker) needs.
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
    """Called by :func:`run_real_loop` during the last step: ``start`` once its batches are fetched (before the
    forward), ``loss`` after ``compute_loss``, ``clip`` before gradient clipping, ``end`` at ``on_step_end``."""
    def start(self, trainer, batches: list, num_items) -> None: ...
    def loss(self) -> None: ...
    def clip(self, trainer) -> None: ...
    def end(self) -> None: ...


def run_real_loop(net, batch: dict, s, steps: int = 2, tokenizer=None, hooks: LoopHooks | None = None):
    """The real ``Trainer`` (``s.loop == "trainer"``) or ``SFTTrainer`` (``"sft"``) training ``net`` (prepared:
    adapter, checkpointing) on ``batch`` every step for ``steps`` steps on the CPU, with its defaults: its data
    loader (a collator returning ``batch``), batch prefetch and ``num_items_in_batch``, ``compute_loss``,
    backward, clipping, optimizer (built by the Trainer from ``optim``), scheduler and ``zero_grad``. A paged
    optimizer runs as its unpaged twin off CUDA (the same state layout). Returns the trainer."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    hooks = hooks or LoopHooks()
    batch = loop_inputs(batch, s.loop)  # SFTTrainer's collator always builds an attention mask

    class _End(TrainerCallback):
        def on_step_end(self, args, st, control, **kw):
            hooks.end()

    def hooked(base):
        class Hooked(base):
            def get_batch_samples(self, it, n, device):
                out, num = super().get_batch_samples(it, n, device)
                if self.state.global_step == steps - 1:
                    hooks.start(self, out, num)
                return out, num

            def compute_loss(self, *a, **k):
                loss = super().compute_loss(*a, **k)
                hooks.loss()
                return loss

            def _clip_grad_norm(self, model):
                hooks.clip(self)
                return super()._clip_grad_norm(model)
        return Hooked

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
                                         callbacks=[_End()])
        else:
            args = TrainingArguments(output_dir=out_dir, **common)
            trainer = hooked(Trainer)(model=net, args=args, train_dataset=rows, data_collator=lambda r: batch,
                                      callbacks=[_End()])
        if s.optimizer.startswith("paged_"):
            trainer.create_optimizer()
            for g in trainer.optimizer.param_groups:
                g["is_paged"] = False
        trainer.train()
    return trainer
