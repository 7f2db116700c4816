"""The loop users run next: transformers' ``Trainer`` and TRL's ``SFTTrainer``, measured and modelled.

The ``loop`` step field names the training loop the memory figures are for:

- ``"kit"``: lora_kit's step (``lora_kit.training.train_step``: foreach AdamW, no clipping, mean loss);
- ``"trainer"``: ``transformers.Trainer`` with its defaults: the fused AdamW (``optim="adamw_torch_fused"``, the
  default since torch 2.8: updates each tensor in place, so ``foreach``'s ``sqrt(v)`` copy of every state is not
  made), weight-decay groups, gradient clipping at ``max_grad_norm=1.0`` (``clip_grad_norm_``: one fp32 norm per
  gradient, live until the clip ends), the loss summed over ``num_items_in_batch`` (counted before the step) and
  its running-loss scalar;
- ``"sft"``: TRL's ``SFTTrainer`` (1.16) on top of that: its fused LM head computes per-token log-probabilities in
  tiles (``trl.kernels.ChunkedLogProbFunction``: up to 4096 tokens x 32768 vocabulary entries per tile), so the
  ``(batch, seq, vocab)`` logits, their fp32 copy and the saved log-softmax are never built; it keeps the
  shifted hidden states (a contiguous copy) and per-token statistics for backward instead.

SFTConfig also changes two step fields by default: ``gradient_checkpointing=True`` and ``bf16=True`` (autocast).
``loop`` does not change them: set ``gradient_checkpointing`` / ``autocast`` as your config has them.

Three levels, as everywhere in ``lora_kit.memory``: :func:`measure_real_loop` runs the real ``Trainer`` /
``SFTTrainer`` (``lora_kit.trainer_loops.run_real_loop``: its own ``train()``, data loader, compute_loss, clipping, optimizer) with the live-bytes tracker
entered for the measured step; ``simulate`` runs the same step through ``train_step`` with the Trainer's own
optimizer construction (:func:`lora_kit.training.loop_optimizer`), TRL's own fused head and a reproduction of
``SFTTrainer.compute_loss`` (:func:`lora_kit.training.sft_loss`), checked byte for byte against the real loops
(``tests/test_loops.py``); ``estimate`` adds the terms of :func:`loop_terms`.

CPU vs CUDA, for ``"sft"``: on CUDA the tile statistics run in a Triton kernel (in place), and only the labelled
positions are scored; on a CPU (no Triton) they run as torch operations on each whole tile, with several fp32
tile-sized temporaries, and every position is scored. The CPU figures here are the CPU path; on a GPU the head's
temporaries are smaller, so the CPU figure is an upper bound there (``benchmarks/gpu_validate.py`` measures it).
"""
from __future__ import annotations

import time

from lora_kit.memory.breakdown import _is_tensor, label_training_state, tracked_peak
from lora_kit.memory.device import alloc_bytes as _r

SFT_TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
SFT_VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE


# -- the real loops, measured ---------------------------------------------------------------------------------
def track_fetched(tracker, trainer, batches: list, num_items, paged: bool = False) -> None:
    """Register with ``tracker`` what is live once a Trainer step's batches are fetched: the training state
    (labelled: weights, adapters, optimizer states), the batches, ``num_items_in_batch`` and the running loss."""
    label_training_state(tracker, trainer.model, trainer.optimizer, paged=paged)
    for b in batches:
        tracker.track(v for v in b.values() if _is_tensor(v))
    tracker.track([t for t in (num_items, trainer._tr_loss) if _is_tensor(t)])


def measure_real_loop(net, batch: dict, s, steps: int = 2, tokenizer=None) -> dict:
    """Peak of the last of ``steps`` steps of the real ``Trainer`` / ``SFTTrainer``
    (:func:`lora_kit.trainer_loops.run_real_loop`) training ``net`` on ``batch``, on the CPU. The tracker is
    entered once the measured step's batches are fetched (everything live then is registered, as
    ``measure_step`` does) and left at ``on_step_end``. Returns peak, breakdown, phase, wall seconds and the
    optimizer class."""

    from lora_kit.memory.tracker import LiveBytesTracker  # torch: imported here, estimate stays torch-free
    from lora_kit.trainer_loops import LoopHooks, run_real_loop
    tracker = LiveBytesTracker()
    paged = s.optimizer.startswith("paged_")
    state = {"on": False, "t0": 0.0, "wall": 0.0}

    class Measure(LoopHooks):
        def start(self, trainer, batches, num):
            track_fetched(tracker, trainer, batches, num, paged)
            tracker.phase = "forward"
            tracker.reset_peak()
            tracker.__enter__()
            state.update(on=True, t0=time.perf_counter())

        def loss(self):
            tracker.phase = "backward"

        def clip(self, trainer):
            tracker.phase = "optimizer"
            label_training_state(tracker, trainer.model)

        def end(self):
            if state["on"]:
                tracker.__exit__(None, None, None)
                state.update(on=False, wall=time.perf_counter() - state["t0"])

    trainer = run_real_loop(net, batch, s, steps, tokenizer, Measure())
    peak, breakdown = tracked_peak(tracker)
    return {"peak": peak, "breakdown": breakdown, "phase": tracker.peak_phase, "wall": state["wall"],
            "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                              else trainer.optimizer).__name__}


# -- estimate's terms ------------------------------------------------------------------------------------------
def loop_terms(loop: str, optimizer: str, n_trainable: int) -> dict:
    """What ``loop`` changes in the optimizer phase, for ``estimate`` (arrays broadcast):

    - ``foreach_temp``: 1 if the optimizer step makes foreach's ``sqrt(v)`` copy of every state (the kit's
      ``torch.optim.AdamW(foreach=True)``), 0 with the Trainer's fused AdamW;
    - ``clip``: bytes ``clip_grad_norm_`` adds on top of the gradients before the optimizer step: one 0-dim fp32
      norm per gradient (512 bytes each), their stack, the total norm and the clip coefficient;
    - ``scalars``: the Trainer's ``num_items_in_batch`` and running loss, live the whole step.
    """
    if loop == "kit":
        return {"foreach_temp": 1, "clip": 0, "scalars": 0}
    clip = n_trainable * 512 + int(_r(4 * n_trainable)) + 3 * 512
    return {"foreach_temp": 0 if optimizer == "adamw" else 1, "clip": clip, "scalars": 2 * 512}


def sft_cpu_tiles(B, S, V: int, fp32_tiles: int = 7):
    """The fused head's tile temporaries on the CPU path (torch operations on a whole tile), which CUDA's in-place
    Triton kernel does not make: ``fp32_tiles`` fp32 tiles and one bool tile of ``min(B*(S-1), 4096) x min(V, 32768)``
    (measured on the function alone, fp32 and bf16 alike: 3 + 1 in forward, 7 + 1 in backward)."""
    import numpy as np
    n, c = np.minimum(B * (S - 1), SFT_TOKEN_TILE), min(V, SFT_VOCAB_TILE)
    return fp32_tiles * _r(n * c * 4) + _r(n * c)
