"""The smoke run's training loop: plain PyTorch, instrumented cheaply.

Why our own loop and not ``transformers.Trainer``: the step must be exactly the one
``estimate`` / ``simulate`` predict (forward with labels, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``), an out-of-memory error must say in which phase it
happened (forward, backward, optimizer), and the peak must be measured per step. Trainer hides
those boundaries behind callbacks. The operations are the same ones Trainer runs (same peft model,
same optimizer classes, same checkpointing flags), so what runs here runs under Trainer.

Instrumentation cost, stated:
- every step: two ``perf_counter`` calls, one ``loss.item()``, tqdm (rate-limited), and on CUDA
  ``max_memory_allocated``/``reserved`` -- negligible (see ``benchmarks/smoke_overhead.py``);
- on CPU the live-bytes tracker (a ``TorchDispatchMode``: Python code on every operator, easily
  2-5x slower) runs only on the first ``measure_steps`` steps, unless a memory limit is emulated,
  in which case it runs on every step (it is the limit).
"""
from __future__ import annotations

import contextlib
import time

import torch
from tqdm.auto import tqdm


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc; None elsewhere). One small file read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return None


def train_steps(model, optimizer, micro_batches, max_steps: int, grad_accum: int, tracker=None,
                measure_steps: int = 3, tracker_always_on: bool = False, progress: bool = True,
                on_step=None, label_module=None) -> list[dict]:
    """Run ``max_steps`` optimizer steps; returns one metrics dict per step.

    ``micro_batches(step, k)`` returns the k-th micro-batch of optimizer step ``step``.
    ``label_module`` is the unwrapped module whose params/grads the tracker labels (DDP wraps).
    ``on_step(metrics)`` is called after each step (the caller rewrites its results there).
    """
    cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
    steps = []
    model.train()
    bar = tqdm(range(max_steps), desc="smoke steps", disable=not progress, leave=False)
    for step in bar:
        measured = tracker is not None and (tracker_always_on or step < measure_steps)
        if measured:
            tracker.label_module(label_module if label_module is not None else model, optimizer)
            tracker.reset_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        mode = tracker if measured and not tracker_always_on else contextlib.nullcontext()
        t0 = time.perf_counter()
        losses, tokens, padded = [], 0, 0
        with mode:
            for k in range(grad_accum):
                batch = micro_batches(step, k)
                if tracker is not None:
                    tracker.phase = "forward"
                loss = model(**batch).loss
                if tracker is not None:
                    tracker.phase = "backward"
                (loss / grad_accum).backward()
                losses.append(loss.detach())
                tokens += int(batch["attention_mask"].sum())
                padded += batch["input_ids"].numel()
                del loss, batch
            if tracker is not None:
                tracker.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss_value = float(torch.stack(losses).mean())
        seconds = time.perf_counter() - t0
        m = {"step": step, "seconds": seconds, "loss": loss_value, "tokens": tokens,
             "tokens_per_s": tokens / seconds, "padded_tokens_per_s": padded / seconds,
             "measured": measured, "rss_bytes": rss_bytes()}
        if measured:
            m["peak_bytes"] = int(tracker.peak_bytes)
            m["peak_phase"] = tracker.peak_phase
            m["peak_breakdown"] = tracker.peak_breakdown()
        if cuda:
            m["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            m["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        steps.append(m)
        if progress and (step % 10 == 0 or step == max_steps - 1):
            bar.set_postfix(loss=f"{loss_value:.4f}")
        if on_step is not None:
            on_step(m)
    return steps
