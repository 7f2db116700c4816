"""Measuring the peak memory of a real training step: the ground truth for estimate and simulate.

- On CUDA: ``torch.cuda.reset_peak_memory_stats()`` at the start of the measured step, then
  ``max_memory_allocated`` (what estimate/simulate predict) and ``max_memory_reserved`` (the
  caching allocator's footprint; nvidia-smi adds the CUDA context on top).
- On CPU: the same :class:`~lora_kit.memory.tracker.LiveBytesTracker` the simulator uses, on real tensors,
  with every already-live tensor (weights, optimizer state, batch) registered first. CPU has no
  caching allocator, so ``reserved_bytes`` is None there.

The batch is padded as the ``padding`` setting says (:func:`step_batch`: a real attention mask with
padded rows and -100 labels, as the collator builds them). The step is the one design.md defines
(:func:`train_step`): forward with labels keeping only the loss (as the HF Trainer's ``compute_loss``
does), ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``; the *last* of ``steps`` steps is measured (the second by
default, so the optimizer state exists). The breakdown uses the same keys as ``estimate``.
Trade-off: the CPU tracker runs Python on every operator, so a tracked CPU step is several times
slower than an untracked one; use tiny models.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from lora_kit.loading import DTYPE_MAP, load_model
from lora_kit.memory.breakdown import label_training_state, tracked_peak
from lora_kit.memory.specs import check_model_step, load_config
from lora_kit.memory.tracker import LiveBytesTracker
from lora_kit.settings import Step, as_step
from lora_kit.training import attach_adapter, autocast_context, optimizer_for, train_step



@dataclass
class MeasureResult:
    peak_allocated_bytes: int  # CUDA: max_memory_allocated; CPU: tracked live bytes (512-rounded)
    reserved_bytes: int | None  # CUDA: max_memory_reserved; None on CPU
    breakdown: dict  # same keys as estimate (CPU only; on CUDA only the total is known: {})
    phase: str  # phase holding the peak (CPU only; "" on CUDA)
    device: str
    wall_seconds: float  # the measured step
    losses: list = field(default_factory=list)
    trace: list | None = None  # trace=True (CPU): per operator of the step, (phase, operator, live bytes)
    allocations: list | None = None  # trace=True (CPU): (phase, operator, bytes) per new storage (tracker.allocations)
    temporaries: dict | None = None  # trace=True (CPU): operator index -> bytes held inside it (SimResult's twin)
    allocated_before_bytes: int | None = None  # live as the measured step starts (weights, adapters, optimizer
    # states, the batch; CUDA: memory_allocated(); CPU: tracked, paged states left out); the rest of the peak is the
    # step's own
    earlier_step_seconds: list | None = None  # CUDA: the wall seconds of each step before the measured one (the
    # loss read back each step, so the device has finished; the last is a steady-state step that no snapshot slowed)

    def to_dict(self) -> dict:
        return asdict(self)


# -- measuring --------------------------------------------------------------------------------
def measure_step(model, batch: dict, optimizer, steps: int = 2, device=None, autocast_ctx=None,
                 paged: bool = False, trace: bool = False, snapshot: str | None = None) -> MeasureResult:
    """Peak memory of the last of ``steps`` real training steps of a prepared model/optimizer/batch.

    ``device``: where the model lives (default: its first parameter's device). On CUDA the peak
    statistics are reset before the measured step; on CPU a LiveBytesTracker runs on it.
    ``paged=True`` (a paged bitsandbytes optimizer on CPU, i.e. its non-paged twin): its paged
    buffers are left out of the peak, as ``max_memory_allocated`` leaves managed memory out.
    ``trace=True`` (CPU): keep the tracker's per-operator trace and allocations, to set beside ``simulate``'s
    (``benchmarks/trace_diff.py`` names the first operator where a real step and ``simulate`` part).
    ``snapshot`` (CUDA): a file to write the caching allocator's history of the measured step to
    (``torch.cuda.memory._record_memory_history`` with Python stacks, then ``_dump_snapshot``: a pickle that
    https://pytorch.org/memory_viz opens; ``benchmarks/gpu_validate.py`` sums what is live at the peak).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (2 measures a steady-state step), got {steps!r}.")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if snapshot is not None and device.type != "cuda":
        raise ValueError(f"snapshot records CUDA's caching allocator; this step runs on {device.type!r} "
                         "(on the CPU, trace=True keeps the tracked step's operators and allocations).")
    losses, walls = [], []
    for _ in range(steps - 1):
        t0 = time.perf_counter()
        losses.append(float(train_step(model, batch, optimizer, autocast_ctx=autocast_ctx).loss))  # float(): waits
        walls.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = int(torch.cuda.memory_allocated(device))
        if snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")
        try:
            t0 = time.perf_counter()
            losses.append(float(train_step(model, batch, optimizer, autocast_ctx=autocast_ctx).loss))
            torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
            if snapshot is not None:
                torch.cuda.memory._dump_snapshot(str(snapshot))
        finally:
            if snapshot is not None:
                torch.cuda.memory._record_memory_history(enabled=None)
        return MeasureResult(int(torch.cuda.max_memory_allocated(device)),
                             int(torch.cuda.max_memory_reserved(device)), {}, "", str(device), wall, losses,
                             allocated_before_bytes=before, earlier_step_seconds=walls)
    tracker = LiveBytesTracker(trace=trace)
    label_training_state(tracker, model, optimizer, paged=paged)
    tracker.track(v for v in batch.values() if isinstance(v, torch.Tensor))
    tracker.reset_peak()
    before = tracker.current_bytes - tracker.current_breakdown().get("paged_optimizer_states", 0)
    t0 = time.perf_counter()
    with tracker:
        losses.append(float(train_step(model, batch, optimizer, tracker=tracker, autocast_ctx=autocast_ctx,
                                       on_grads=lambda: label_training_state(tracker, model)).loss))
    wall = time.perf_counter() - t0
    peak, breakdown = tracked_peak(tracker)
    return MeasureResult(peak, None, breakdown, tracker.peak_phase, str(device), wall, losses, tracker.trace,
                         tracker.allocations() if trace else None, dict(tracker.temporaries) if trace else None,
                         before)


def measure_config(model, step: Step | None = None, *, device: str = "cpu", seed: int = 0, steps: int = 2,
                   trace: bool = False, snapshot: str | None = None, **overrides) -> MeasureResult:
    """Build a random-init real model from ``model``'s config (same ``model``, ``step`` and overrides as
    ``estimate``) and measure one real step on ``device``. QLoRA quantizes with bitsandbytes (saved to a
    temporary folder and loaded as users load it). Only small models make sense on a CPU. ``loop="trainer"`` /
    ``"sft"`` runs the real ``Trainer`` / ``SFTTrainer`` (CPU only; ``lora_kit.memory.loops.measure_real_loop``).
    ``trace``, ``snapshot``: as :func:`measure_step` (loop "kit" only)."""
    s = as_step(step, **overrides)
    check_model_step(model, s)
    if s.liger_kernel:
        check_liger(load_config(model), s)
    net, opt, batch = build_real_model(load_config(model), s, device=device, seed=seed)
    if s.loop != "kit":
        if trace or snapshot:
            raise ValueError(f"trace / snapshot record loop='kit' steps; loop={s.loop!r} is measured untraced.")
        return _measure_loop(net, batch, s, steps, device)
    ctx = autocast_context(s.autocast, s.dtype, torch.device(device).type)
    return measure_step(net, batch, opt, steps=steps, device=device, autocast_ctx=ctx,
                        paged=s.optimizer.startswith("paged_") and torch.device(device).type != "cuda", trace=trace,
                        snapshot=snapshot)


def _measure_loop(net, batch, s, steps: int, device: str) -> MeasureResult:
    """The real Trainer / SFTTrainer step (``lora_kit.memory.loops.measure_real_loop``) as a MeasureResult."""
    from lora_kit.memory.loops import measure_real_loop
    if torch.device(device).type != "cpu":
        raise ValueError(f"loop={s.loop!r} is measured on the CPU here; on a GPU run your Trainer and read "
                         "torch.cuda.max_memory_allocated(), or measure loop='kit'.")
    r = measure_real_loop(net, batch, s, steps=steps)
    return MeasureResult(r["peak"], None, r["breakdown"], r["phase"], device, r["wall"], [])


def check_liger(cfg, s) -> None:
    """``liger_kernel=True`` as far as simulate / measure emulate it (:mod:`lora_kit.memory.liger`): a model type
    Liger patches and the kit emulates, on one GPU (or DDP); else a ValueError saying what to change."""
    from lora_kit.memory import liger
    liger.check(cfg.model_type)
    if s.sharding not in ("none", "ddp"):
        raise ValueError(f"liger_kernel=True is emulated on one GPU and DDP; for sharding={s.sharding!r} set "
                         "liger_kernel=False (or plan sharding='ddp').")


def build_real_model(cfg, s, device: str = "cpu", seed: int = 0):
    """(trainable model, optimizer, batch) of a random-init model for the settings ``s``."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from lora_kit.memory.flash_attention import FA2, check_supported, model_attn_implementation
    torch.manual_seed(seed)
    weight_dtype = "float32" if s.method == "full" and s.autocast else s.dtype
    with torch.device(device):  # initialise on the device: fast on a GPU, no host copy
        net = AutoModelForCausalLM.from_config(cfg, dtype=DTYPE_MAP[weight_dtype],
                                               attn_implementation=model_attn_implementation(s.attn_implementation,
                                                                                             device))
    if s.attn_implementation == FA2:
        check_supported(net)
    if s.method == "qlora":
        with tempfile.TemporaryDirectory() as d:
            net.save_pretrained(d, safe_serialization=True)
            del net
            net = load_model(d, method="qlora", dtype=s.dtype, double_quant=s.double_quant,
                             attn_implementation=model_attn_implementation(s.attn_implementation, device), device=device,
                             storage_in_dtype=not s.kbit_prepared)
    net = attach_adapter(net, s.method, seed, s.lora_rank, s.lora_alpha, s.lora_dropout, s.lora_targets,
                         s.gradient_checkpointing, s.kbit_prepared)
    net.train()  # from_pretrained returns eval mode, where checkpointing is off
    if s.liger_kernel:
        from lora_kit.memory import liger
        liger.apply(net, fused_linear_cross_entropy=s.loop != "sft")
    opt = optimizer_for(net.parameters(), s.optimizer, device_type=torch.device(device).type)
    ids = torch.randint(0, cfg.vocab_size, (s.batch_size, s.seq_len), device=device)
    return net, opt, step_batch(ids, s.padding)


def step_batch(ids, padding: str) -> dict:
    """The batch of the measured step for ``ids`` of shape (batch, seq_len), as a collator builds it.

    ``"none"``: equal-length rows, no attention mask (labels are the ids). ``"max_length"``: every row
    right-padded to seq_len (its last quarter, at least one token, is padding); ``"longest"``: padded to
    the longest row (row 0 is full, the others end in padding; one row alone has none). Pads are 0 in
    ``attention_mask`` and -100 in ``labels`` (a separate tensor). A padded batch makes transformers build
    a (batch, 1, seq, seq) attention mask; an all-ones mask does not. ``"packed"``: the rows concatenated into one
    (1, batch x seq_len) row with position_ids restarting at 0 for each and label -100 at each one's first token, as
    transformers' ``DataCollatorWithFlattening`` (TRL's ``padding_free``) builds it; no attention mask."""
    if padding == "none":
        return {"input_ids": ids, "labels": ids}
    B, S = ids.shape
    if padding == "packed":  # DataCollatorWithFlattening: -100 before each example, positions restarting
        flat = ids.reshape(1, B * S).clone()
        labels = flat.clone()
        labels[0, ::S] = -100
        return {"input_ids": flat, "labels": labels, "position_ids": torch.arange(S, device=ids.device).repeat(1, B)}
    mask = torch.ones_like(ids)
    mask[0 if padding == "max_length" else 1:, S - max(1, S // 4):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
