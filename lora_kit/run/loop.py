"""The smoke run's training loops, instrumented cheaply: the kit's plain PyTorch step (:func:`train_steps`) and,
for ``loop="trainer"`` / ``"sft"``, transformers' ``Trainer`` / TRL's ``SFTTrainer`` themselves
(:func:`trainer_steps`), recorded in the same per-step metrics.

Why the kit's own loop by default, and not ``transformers.Trainer``: the step must be exactly the one
``estimate`` / ``simulate`` predict -- it *is* the kit's one training step,
:func:`lora_kit.training.train_step`, which ``measure`` and ``simulate`` run too -- an
out-of-memory error must say in which phase it happened (forward, backward, optimizer), and the
peak must be measured per step, broken down in the estimate's parts
(:data:`lora_kit.memory.breakdown.BREAKDOWN_KEYS`, labelled by ``label_training_state``). Trainer hides
those boundaries behind callbacks. The operations are the same ones Trainer runs (same peft model,
same optimizer classes, same checkpointing flags), so what runs here runs under Trainer.

Instrumentation cost, stated:
- every step: two ``perf_counter`` calls, one ``loss.item()``, a progress update (rate-limited), and on CUDA
  ``max_memory_allocated``/``reserved`` -- negligible (see ``benchmarks/smoke_overhead.py``);
- on CPU the live-bytes tracker (a ``TorchDispatchMode``: Python code on every operator, easily
  2-5x slower) runs only on the first ``measure_steps`` steps, unless a memory limit is emulated,
  in which case it runs on every step (it is the limit).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch

from lora_kit import training
from lora_kit.memory.breakdown import label_training_state, tracked_peak
from lora_kit.progress import bar as progress_bar


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc; None elsewhere). One small file read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return None


class MicroBatches(Sequence):
    """The ``n`` micro-batches of optimizer step ``step``, built one at a time as the step reaches
    them (``micro_batches(step, k)``), so only one is live, as in a data loader."""

    def __init__(self, micro_batches, step: int, n: int):
        self.micro_batches, self.step, self.n = micro_batches, step, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> dict:
        if not 0 <= k < self.n:
            raise IndexError(k)
        return self.micro_batches(self.step, k)

    def __iter__(self):  # keeps no reference to a micro-batch it handed out (Sequence's default does)
        return (self.micro_batches(self.step, k) for k in range(self.n))


def train_steps(model, optimizer, micro_batches, max_steps: int, grad_accum: int, tracker=None,
                measure_steps: int = 3, tracker_always_on: bool = False, progress: bool = True,
                on_step=None, label_module=None, autocast_ctx=None, paged: bool = False, run_dir=None,
                label=None) -> list[dict]:
    """Run ``max_steps`` optimizer steps of :func:`lora_kit.training.train_step`; returns one metrics
    dict per step.

    ``micro_batches(step, k)`` returns the k-th micro-batch of optimizer step ``step``.
    ``label_module`` is the unwrapped module whose parameters / gradients the tracker labels (DDP
    wraps). ``autocast_ctx``: a mixed-precision context for the forward passes. ``paged``: the
    optimizer is a paged bitsandbytes one off CUDA (its paged states are left out of the peak, as
    ``max_memory_allocated`` leaves managed memory out). ``on_step(metrics)`` is called after each
    step (the caller rewrites its results there). A measured step records ``peak_bytes``,
    ``peak_phase`` and ``peak_breakdown`` (the estimate's parts, summing to ``peak_bytes``).
    Progress: a bar when ``progress``, else periodic lines when ``run_dir`` is in a ``lora-kit run``
    (:func:`lora_kit.progress.bar`). ``label(tracker, module, optimizer=None)`` labels the live training state
    for the breakdown (default :func:`~lora_kit.memory.breakdown.label_training_state`; FSDP2 runs pass
    :func:`lora_kit.memory.sharded.label_fsdp`, which also labels gathered parameters).
    """
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    labelled = label_module if label_module is not None else model
    if label is None:
        def label(tr, module, optimizer=None):
            label_training_state(tr, module, optimizer, paged=paged)
    steps = []
    model.train()
    bar = progress_bar(max_steps, "smoke steps", enabled=progress, run_dir=run_dir)
    for step in range(max_steps):
        measured = tracker is not None and (tracker_always_on or step < measure_steps)
        if measured:
            label(tracker, labelled, optimizer)
            tracker.reset_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        mode = tracker if measured and not tracker_always_on else contextlib.nullcontext()
        t0 = time.perf_counter()
        with mode:
            out = training.train_step(model, MicroBatches(micro_batches, step, grad_accum), optimizer,
                                      tracker=tracker, autocast_ctx=autocast_ctx,
                                      on_grads=(lambda: label(tracker, labelled)) if measured else None)
        loss_value, tokens, padded = float(out.loss), out.tokens, out.padded_tokens
        del out  # its loss tensor would otherwise be live (and counted) during the next step
        _record(steps, step, time.perf_counter() - t0, loss_value, tokens, padded, tracker if measured else None,
                cuda, bar, max_steps, on_step)
    bar.close()
    return steps


def throughput(steps: list) -> dict:
    """Mean step seconds and tokens/s of :func:`_record`'s ``steps``, step 0 (warm-up) left out when more ran: the
    rows' own tokens (``mean_tokens_per_s``) and every row slot, padding included (``mean_padded_tokens_per_s``,
    what a plan's micro-batch x seq_len per step counts; None for records without it)."""
    timed = steps[1:] or steps
    seconds = sum(x["seconds"] for x in timed)
    padded = [x for x in timed if x.get("padded_tokens_per_s") and x.get("seconds")]
    return {"mean_step_seconds": seconds / len(timed),
            "mean_tokens_per_s": sum(x.get("tokens", 0) for x in timed) / seconds,
            "mean_padded_tokens_per_s": (sum(x["padded_tokens_per_s"] * x["seconds"] for x in padded)
                                         / sum(x["seconds"] for x in padded)) if padded else None,
            "note": "excludes step 0 (warm-up) when more than one step ran; measured steps run under the tracker and "
                    "are slower on CPU"}


def _record(steps: list, step: int, seconds: float, loss: float, tokens: int, padded: int, tracker, cuda: bool, bar,
            max_steps: int, on_step) -> None:
    """A step's metrics (``tracker``: the step was measured by it), appended to ``steps``, shown, handed on."""
    m = {"step": step, "seconds": seconds, "loss": loss, "tokens": tokens, "tokens_per_s": tokens / seconds,
         "padded_tokens_per_s": padded / seconds, "measured": tracker is not None, "rss_bytes": rss_bytes()}
    if tracker is not None:
        m["peak_bytes"], m["peak_breakdown"] = tracked_peak(tracker)
        m["peak_phase"] = tracker.peak_phase
    if cuda:
        m["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        m["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    steps.append(m)
    if step % 10 == 0 or step == max_steps - 1:
        bar.set_postfix(loss=f"{loss:.4f}")
    bar.update(1)
    if on_step is not None:
        on_step(m)


def trainer_steps(net, s, examples: list[dict], collate, out_dir, tokenizer=None, tracker=None, measure_steps: int = 3,
                  tracker_always_on: bool = False, progress: bool = True, on_step=None, run_dir=None,
                  config: dict | None = None, tokens_of=None):
    """:func:`train_steps` for ``s.loop`` "trainer" / "sft": the real ``Trainer`` / ``SFTTrainer``
    (:func:`lora_kit.trainer_loops.run_loop`) trains ``net`` for ``s.max_steps`` steps on ``examples`` in order,
    and each step is recorded in the same metrics: the tracker is entered once the step's batches are fetched
    (what is live then -- the batches, ``num_items_in_batch``, the running loss -- is registered, as
    :func:`lora_kit.memory.loops.measure_real_loop` does) and left at ``on_step_end``; ``loss`` is the step's loss
    the Trainer logs (the sum of ``training_step``'s returns). ``tokens_of(step)``: the step's real tokens (default:
    the attention masks' sum). Returns (steps, trainer)."""
    from lora_kit.memory.loops import track_fetched
    from lora_kit.trainer_loops import LoopHooks, run_loop
    cuda = torch.cuda.is_available() and next(net.parameters()).is_cuda
    paged = s.optimizer.startswith("paged_") and not cuda
    steps: list[dict] = []
    bar = progress_bar(s.max_steps, "smoke steps", enabled=progress, run_dir=run_dir)

    class Measure(LoopHooks):
        entered = False

        def start(self, trainer, batches, num):
            self.step = trainer.state.global_step
            self.measured = tracker is not None and (tracker_always_on or self.step < measure_steps)
            self.loss_sum, self.padded = 0.0, sum(b["input_ids"].numel() for b in batches)
            self.tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                              for b in batches)
            if self.measured:
                track_fetched(tracker, trainer, batches, num, paged)
                tracker.phase = "forward"
                tracker.reset_peak()
                if not tracker_always_on:
                    tracker.__enter__()
                    self.entered = True
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def leave(self):
            if self.entered:
                tracker.__exit__(None, None, None)
                self.entered = False

        def loss(self):
            if self.measured:
                tracker.phase = "backward"

        def micro_loss(self, value):
            self.loss_sum += float(value)

        def clip(self, trainer):
            if self.measured:
                tracker.phase = "optimizer"
                label_training_state(tracker, trainer.model, paged=paged)

        def end(self):
            self.leave()
            tokens = tokens_of(self.step) if tokens_of is not None else self.tokens
            _record(steps, self.step, time.perf_counter() - self.t0, self.loss_sum, tokens, self.padded,
                    tracker if self.measured else None, cuda, bar, s.max_steps, on_step)

    measure = Measure()
    try:
        trainer = run_loop(net.train(), s, examples, collate, out_dir, s.max_steps, tokenizer, measure, config)
    finally:  # an error inside a measured step (out of memory) leaves the tracker's mode
        measure.leave()
        bar.close()
    return steps, trainer
