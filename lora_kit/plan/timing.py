"""Step time from FLOPs: an assumed utilization the user sees, replaced by a measured one (calibration).

Model of one training step (forward + backward + optimizer step), ``T = batch_size * seq_len`` tokens
per GPU, ``P`` = weights of every matmul the tokens pass through (the block linears plus the LM head;
the embedding is a lookup, not a matmul), ``s`` = seq_len, ``a`` = attention width (heads * head_dim),
``L`` = layers, ``r`` = LoRA rank:

- forward: ``2 T P`` (one multiply-add per weight per token) + attention ``4 T s a L * c`` (QK^T and
  AV; ``c`` = 0.5 with ``attn_implementation="sdpa"`` because flash/efficient kernels skip the masked
  half of a causal matrix, 1.0 with "eager");
- backward, full fine-tuning: ``2 x forward`` (input gradients + weight gradients), the usual ``6 T P``;
- backward, LoRA / QLoRA: the frozen weights still need *input* gradients (``2 T P``) but no weight
  gradients; attention backward is ``2 x`` its forward (it has no weights); the adapters cost
  ``6 T r (in + out)`` per adapted linear (small: r << width);
- gradient checkpointing: the decoder blocks' forward runs a second time during backward (the LM head
  is not recomputed);
- QLoRA dequantization: every pass through a 4-bit linear (forward, backward, and the recomputed
  forward) first expands its NF4 weights to the compute dtype: ``2.5 bytes`` moved per weight
  (0.5 read + 2 written), a memory-bound cost ``passes * P_lin * 2.5 / bandwidth``. It does not
  shrink with the batch, which is why QLoRA is much slower per token at small batches;
- optimizer step: memory-bound, ``16 bytes`` moved per trainable fp32 parameter for AdamW (read
  param, grad, two moments; write param and moments), ``/ bandwidth``;
- compute runs at ``mfu`` (model FLOPs utilization) of the GPU's dense tensor-core peak for the
  compute dtype; memory-bound parts at ``bandwidth_efficiency`` of the datasheet bandwidth.

Assumptions (each one shown to the user in :meth:`TimeModel.describe`):

- ``mfu = 0.35`` until calibrated: LoRA fine-tuning of 1-10B models with HF Trainer typically
  reaches 25-50 % of the dense bf16 peak; smaller models and short sequences reach less.
- compute rate by dtype: bfloat16 / autocast -> ``bf16_tflops`` (fp16 figure if bf16 is missing);
  float16 -> ``fp16_tflops``; float32 without autocast -> TF32 tensor cores at half the bf16 rate
  (true of the A100 / H100 / Ada datasheets).
- ``bandwidth_efficiency = 0.7`` of the datasheet memory bandwidth for the memory-bound parts.
- data parallel (num_gpus > 1): each GPU runs the same step on its own micro-batch; gradient
  all-reduce, ZeRO-3 / FSDP parameter gathers and CPU offload traffic are NOT modelled (they overlap
  with compute on NVLink machines, they do not over PCIe): treat multi-GPU times as a lower bound.
- padding: ``seq_len`` is the padded length, so tokens/s counts pad tokens as work; packing removes them.

Calibration: :func:`calibrate` takes a measured step time (e.g. a smoke run's median) and the
settings it ran with, and returns a :class:`TimeModel` whose ``mfu`` reproduces it exactly; the
memory-bound terms are kept and the remainder is attributed to compute. Given a second measured
step with far fewer tokens it also solves for a fixed per-step overhead (kernel launches, per-op
dispatch, Python), which matters on CPUs and for tiny models.

Accuracy (measured, ``benchmarks/time_model_accuracy.py --threads 1``, a hidden-256 4-layer Llama on
this repository's shared CPU, median wall of 5 round-robin repeats): calibrated on one LoRA step
(seq_len 128, batch 8), the predictions for seq_len 256, batch 16, checkpointing on and full
fine-tuning were within 6-11 %; seq_len 512 (-25 %: CPU attention does not skip the causal half)
and QLoRA (-22 %: bitsandbytes' CPU dequantization is slower than a bandwidth bound) missed, and a
16-token step was 84 % under (fixed per-step costs; the two-run calibration removes that). With two
threads on the loaded machine the same steps were 3-10x slower and too noisy to judge (a step
varied 3.9-6.0 s of CPU time between runs). Check it on your GPU with the same script.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from lora_kit.memory.specs import check_targets, model_spec
from lora_kit.settings import Step, as_step

DEQUANT_BYTES_PER_WEIGHT = 2.5  # NF4 read (0.5 B) + compute-dtype write (2 B)
OPTIMIZER_BYTES = {"adamw": 16, "paged_adamw_32bit": 16, "adamw_8bit": 10, "paged_adamw_8bit": 10,
                   "sgd": 8, "adafactor": 12}  # bytes moved per trainable parameter in optimizer.step()


@dataclass(frozen=True)
class TimeModel:
    """Utilization assumptions; ``source`` says whether they are assumed or measured."""
    mfu: float = 0.35  # fraction of the dense tensor-core peak the matmuls reach
    bandwidth_efficiency: float = 0.7  # fraction of datasheet memory bandwidth for memory-bound parts
    overhead_seconds: float = 0.0  # fixed cost per step (kernel launches, Python); 0 unless calibrated on 2 runs
    source: str = "assumed (typical LoRA fine-tuning on a datacenter GPU); calibrate with a measured step"

    def __post_init__(self):
        for name in ("mfu", "bandwidth_efficiency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v and math.isfinite(v)):
                raise ValueError(f"TimeModel.{name} must be a positive number, got {v!r}.")
        if not (isinstance(self.overhead_seconds, (int, float)) and self.overhead_seconds >= 0):
            raise ValueError(f"TimeModel.overhead_seconds must be >= 0, got {self.overhead_seconds!r}.")

    def describe(self) -> str:
        fixed = f", {self.overhead_seconds:.3g} s fixed per step" if self.overhead_seconds else ""
        return (f"step-time model: {self.mfu:.1%} of peak FLOP/s for matmuls, "
                f"{self.bandwidth_efficiency:.0%} of datasheet bandwidth for memory-bound parts{fixed} ({self.source})")

    def to_dict(self) -> dict:
        return asdict(self)


def _targets(spec, step: Step) -> list:
    """The adapted linears, checked by the one model check (as ``estimate`` does)."""
    names = check_targets(spec, "lora", step.lora_rank, step.lora_targets, "eager")  # attention is not checked here
    return [lin for lin in spec.linears if lin.name in names]


def flops_per_step(spec, step: Step | None = None, **overrides) -> dict:
    """FLOPs of one step on one GPU, by part (see the module docstring for each formula); the step is ``step``
    (default ``PLANNING``) with ``overrides``."""
    spec, st = model_spec(spec), as_step(step, **overrides)
    seq_len, T = int(st.seq_len), int(st.batch_size) * int(st.seq_len)  # Python ints: exact at any size
    p_lin = sum(lin.in_features * lin.out_features for lin in spec.linears) * spec.num_layers
    p_head = spec.vocab_size * spec.hidden_size
    causal = 0.5 if st.attn_implementation == "sdpa" else 1.0
    attn = 4.0 * T * seq_len * spec.num_heads * spec.head_dim * spec.num_layers * causal
    fwd_blocks = 2.0 * T * p_lin + attn
    fwd_head = 2.0 * T * p_head
    if st.method == "full":
        adapters = 0.0
        bwd = 2 * (fwd_blocks + fwd_head)
        recompute_adapters = 0.0
    else:
        ad = sum(st.lora_rank * (lin.in_features + lin.out_features) for lin in _targets(spec, st))
        adapters = 6.0 * T * ad * spec.num_layers
        recompute_adapters = 2.0 * T * ad * spec.num_layers
        bwd = 2.0 * T * (p_lin + p_head) + 2 * attn
    parts = {"forward": fwd_blocks + fwd_head, "backward": bwd, "adapters": adapters,
             "recompute": (fwd_blocks + recompute_adapters) if st.gradient_checkpointing else 0.0}
    parts["total"] = sum(parts.values())
    parts["attention"] = attn * (3 + (1 if st.gradient_checkpointing else 0))  # included above; shown for reference
    parts["tokens"] = T
    return parts


def trainable_params(spec, step: Step) -> int:
    spec = model_spec(spec)
    if step.method == "full":
        return spec.num_params
    return sum(step.lora_rank * (lin.in_features + lin.out_features) for lin in _targets(spec, step)) * spec.num_layers


def peak_flops(gpu: dict, dtype: str, autocast: bool) -> float:
    """Dense FLOP/s the matmuls run at on ``gpu`` (a catalog row) for the compute dtype (see assumptions)."""
    bf16, fp16 = gpu.get("bf16_tflops"), gpu.get("fp16_tflops")
    bf16 = bf16 if bf16 == bf16 and bf16 else fp16  # NaN / missing -> fp16 figure
    fp16 = fp16 if fp16 == fp16 and fp16 else bf16
    tf = {"bfloat16": bf16, "float16": fp16}.get(dtype, bf16 if autocast else (bf16 or 0) / 2)
    if not tf or tf != tf:
        raise ValueError(f"GPU {gpu.get('name')!r} has no tensor-core TFLOP/s in the catalog; add bf16_tflops.")
    return float(tf) * 1e12


def step_time(spec, gpu: dict, step: Step | None = None, time_model: TimeModel | None = None,
              **overrides) -> dict:
    """Predicted seconds per optimizer step (micro-batch per GPU) and tokens/s over all GPUs, for ``step``
    (default ``PLANNING``) with ``overrides``.

    ``gpu`` is a catalog row (``lora_kit.plan.gpus.get_gpu(name)``) or any dict with ``bf16_tflops`` /
    ``fp16_tflops`` and ``memory_bandwidth_gbs`` (e.g. a CPU described by the user).
    """
    tm = time_model or TimeModel()
    st = as_step(step, **overrides)
    f = flops_per_step(spec, st)
    compute_s = f["total"] / (peak_flops(gpu, st.dtype, st.autocast) * tm.mfu)
    bw = float(gpu["memory_bandwidth_gbs"]) * 1e9 * tm.bandwidth_efficiency
    memory_s = _memory_bound_seconds(spec, st, bw)
    total = compute_s + memory_s["dequant"] + memory_s["optimizer"] + tm.overhead_seconds
    return {"step_seconds": total, "compute_seconds": compute_s, "dequant_seconds": memory_s["dequant"],
            "optimizer_seconds": memory_s["optimizer"], "flops": f["total"],
            "tokens_per_step": f["tokens"] * st.num_gpus, "tokens_per_second": f["tokens"] * st.num_gpus / total,
            "mfu": tm.mfu, "time_model": tm.describe()}


def _memory_bound_seconds(spec, step: Step, bw) -> dict:
    spec = model_spec(spec)
    dequant = 0.0
    if step.method == "qlora":
        p_lin = sum(lin.in_features * lin.out_features for lin in spec.linears) * spec.num_layers
        passes = 3 if step.gradient_checkpointing else 2
        dequant = passes * p_lin * DEQUANT_BYTES_PER_WEIGHT / bw
    opt = trainable_params(spec, step) * OPTIMIZER_BYTES.get(step.optimizer, 16) / bw
    return {"dequant": dequant, "optimizer": opt}


def calibrate(measured_step_seconds: float, settings, gpu: dict, time_model: TimeModel | None = None,
              spec=None, second: tuple | None = None) -> TimeModel:
    """A TimeModel whose ``mfu`` reproduces ``measured_step_seconds`` for ``settings`` on ``gpu``.

    ``settings``: a :class:`lora_kit.settings.Settings`, or a dict of step fields and ``model``. The
    memory-bound terms (dequantization, optimizer) keep ``bandwidth_efficiency``; the rest of the
    measured time is attributed to the matmuls. Raises if the memory-bound terms alone exceed it.

    ``second=(seconds, settings)``: a second measured step with far fewer tokens (e.g. batch 1 and a
    short sequence). Then two numbers are solved for: ``mfu`` and a fixed ``overhead_seconds`` per
    step (kernel launches, Python, per-op dispatch), which dominates small models and CPUs.
    """
    for t in (measured_step_seconds, *(second[:1] if second else ())):
        if not (isinstance(t, (int, float)) and t > 0):
            raise ValueError(f"measured step seconds must be positive numbers, got {t!r}.")
    tm = time_model or TimeModel()

    def parts(sett):
        model = spec if spec is not None else (sett["model"] if isinstance(sett, dict) else sett.model)
        st = as_step(sett)
        p = step_time(model, gpu, st, time_model=replace(tm, overhead_seconds=0.0))
        return p["compute_seconds"] * tm.mfu, p["dequant_seconds"] + p["optimizer_seconds"], st.to_dict()

    a1, mem1, kw = parts(settings)
    budget1 = measured_step_seconds - mem1
    if budget1 <= 0:
        raise ValueError(f"measured {measured_step_seconds:.4g} s is less than the memory-bound part alone "
                         f"({mem1:.4g} s); check the GPU's memory_bandwidth_gbs.")
    label = f"{kw.get('method')}, seq_len {kw.get('seq_len')}, batch {kw.get('batch_size')}"
    if second is not None:
        a2, mem2, kw2 = parts(second[1])
        budget2 = second[0] - mem2
        if a1 == a2:
            raise ValueError("the two calibration runs need different token counts (seq_len x batch_size).")
        inv = (budget1 - budget2) / (a1 - a2)
        overhead = budget1 - a1 * inv
        if inv > 0 and overhead >= 0:
            return replace(tm, mfu=1 / inv, overhead_seconds=overhead, source=(
                f"calibrated on two measured steps: {measured_step_seconds:.4g} s ({label}) and {second[0]:.4g} s "
                f"({kw2.get('method')}, seq_len {kw2.get('seq_len')}, batch {kw2.get('batch_size')})"))
        # inconsistent pair (noise): fall back to the one-run calibration below
    return replace(tm, mfu=a1 / budget1, overhead_seconds=0.0,
                   source=f"calibrated on a measured step of {measured_step_seconds:.4g} s ({label})")
