"""Several GPUs, one record: per-GPU memory, what sharding saves, communication, time and checkpoint.

:func:`multi_gpu_plan` answers what a rental request for ``num_gpus`` GPUs must say (plan.json keeps it
as ``multi_gpu`` and the run card shows it under "Several GPUs"):

- **memory is not pooled**: N GPUs of 80 GB are not 80N GB; each GPU holds its own per-GPU peak
  (``estimate(..., num_gpus=N, sharding=...)``), beside the ddp figure and what the sharding saves;
- **communication per step and rank**, counted from the model: fsdp / zero3 (not QLoRA) from
  :func:`lora_kit.memory.fsdp_math.fsdp_communication`, the buffers FSDP2 all-gathers and reduce-scatters
  (equal to what ``simulate`` counts from FSDP2's own calls); everything else by arithmetic, and the
  record says so: ddp is a ring all-reduce of the trainable parameters' gradients, ``2 (N - 1) / N``
  of their bytes per rank; zero1 / zero2 reduce-scatter the gradients and all-gather the updated
  trainable parameters (the ZeRO paper's ``2 Psi``, the same volume as ddp); QLoRA under fsdp / zero3
  gathers its packed 4-bit weights (plus fp32 up-casts and adapters) twice, forward and backward;
- **time**: the compute step of :func:`lora_kit.plan.timing.step_time` plus ``per-rank traffic /
  interconnect_gbs`` (the catalog's GB/s per direction, no efficiency factor), not overlapped, and the
  overlapped lower bound ``max(compute, communication)``. Both are ASSUMPTIONS until a multi-GPU run
  measures its step; CPU-offload traffic over PCIe is not counted;
- **checkpoint on disk**: the adapter (LoRA / QLoRA: trainable parameters in fp32, peft's safetensors)
  or the whole model (full: every parameter in the training dtype), gathered and written once by
  rank 0; with fsdp, accelerate's ``save_state`` under ``SHARDED_STATE_DICT`` writes the training
  state as one shard per rank (sizes per rank given), under ``FULL_STATE_DICT`` gathered on rank 0.

Torch-free (the planner's import stays light).
"""
from __future__ import annotations

import math

from lora_kit.memory.estimate import estimate
from lora_kit.memory.static import DTYPE_BYTES
from lora_kit.memory.fsdp_math import fsdp_communication
from lora_kit.memory.specs import model_spec
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.planner import fit_verdict
from lora_kit.plan.timing import step_time, trainable_params
from lora_kit.settings import Step, as_step

GiB = 2 ** 30
OUTPUT_DIR = "<your trainer's output_dir>"  # where the real run writes; the plan does not know it
ADAPTER_BYTES = 4  # peft keeps (and saves) LoRA weights in fp32 unless told otherwise
ASSUMPTION = ("the kernel time model's compute step (timing.step_time) plus each rank's collective traffic at "
              "the catalog's interconnect bandwidth per direction (no efficiency factor, so communication is a lower "
              "bound); 'not overlapped' adds them, 'overlapped' takes the larger; CPU-offload traffic is not counted")


def grad_bytes(spec, step: Step) -> int:
    """Bytes of the trainable parameters' gradients (= of the trainable parameters): fp32 adapters for
    LoRA / QLoRA, every parameter in the training dtype for full fine-tuning (fp32 with autocast)."""
    n = trainable_params(spec, step)
    if step.method != "full":
        return n * ADAPTER_BYTES
    return n * (4 if step.autocast else DTYPE_BYTES[step.dtype])


def communication(spec, step: Step, sharding: str, one_gpu=None) -> dict:
    """Collective bytes of one optimizer step on rank 0 under ``sharding`` (the step's, or ddp for "none") and
    where the count comes from (see the module doc). ``one_gpu``: the step's single-GPU ``estimate`` (QLoRA under
    fsdp / zero3 reads its weight bytes)."""
    N, g = step.num_gpus, grad_bytes(spec, step)
    if sharding in ("none", "ddp"):
        return {"all_reduce_bytes": g, "all_gather_bytes": 0, "reduce_scatter_bytes": 0,
                "per_rank_traffic_bytes": 2 * (N - 1) * g // N, "source": "arithmetic",
                "how": "DDP: ring all-reduce of the trainable parameters' gradients, 2 (N - 1) / N of their bytes "
                       "sent (and received) per rank"}
    if sharding in ("zero1", "zero2"):
        return {"all_reduce_bytes": 0, "all_gather_bytes": g, "reduce_scatter_bytes": g,
                "per_rank_traffic_bytes": 2 * (N - 1) * g // N, "source": "arithmetic",
                "how": f"DeepSpeed ZeRO-{sharding[-1]} (arithmetic, the ZeRO paper's 2 x parameters): gradients "
                       "reduce-scattered and the updated trainable parameters all-gathered, (N - 1) / N of each "
                       "per rank; the same volume as DDP"}
    if step.method == "qlora":  # FSDP2 on 4-bit weights is not simulated
        ag = 2 * (one_gpu.breakdown["weights"] + one_gpu.breakdown["adapters"])
        return {"all_reduce_bytes": 0, "all_gather_bytes": ag, "reduce_scatter_bytes": g,
                "per_rank_traffic_bytes": (ag + g) * (N - 1) // N, "source": "arithmetic",
                "how": f"{sharding} with QLoRA (arithmetic): the packed 4-bit weights, fp32 up-casts and adapters "
                       "gathered twice (forward, backward), the adapters' gradients reduce-scattered; "
                       "quantization constants stay on every rank"}
    c = fsdp_communication(spec, step)
    return {"all_reduce_bytes": 0, **{k: c[k] for k in ("all_gather_bytes", "reduce_scatter_bytes",
                                                          "per_rank_traffic_bytes")},
            "source": "fsdp_communication: the buffers FSDP2 gathers and scatters, as simulate counts them",
            "how": "FSDP2 as accelerate wraps it: each decoder layer (and an untied embedding) all-gathered in "
                   "forward and again in backward, the LM head once; trainable gradients reduce-scattered; "
                   "(N - 1) / N of each buffer per rank" + (
                       "; DeepSpeed ZeRO-3 moves the same 3 x parameters, bucketed its own way" if sharding == "zero3"
                       else "")}


def checkpoint(spec, step: Step, sharding: str, output_dir: str, one_gpu=None,
               optimizer_bytes_per_rank: int = 0) -> dict:
    """What the run writes to disk and where (bytes are tensor data; safetensors adds a small JSON header).

    For fsdp's sharded training checkpoint: ``optimizer_bytes_per_rank`` (one rank's optimizer states) and,
    for QLoRA, ``one_gpu`` (the single-GPU ``estimate``, whose weights, quantization constants and adapters
    are its model state; other methods count parameters x bytes)."""
    n = trainable_params(spec, step)
    method, dtype = step.method, step.dtype
    if method == "full":
        e = 4 if step.autocast else DTYPE_BYTES[dtype]
        out = {"what": "the whole model", "bytes": n * e, "dtype": "float32" if e == 4 else dtype,
               "file": f"{output_dir}/model.safetensors (large models: model-0000x-of-0000y.safetensors)"}
    else:
        out = {"what": "the LoRA adapter", "bytes": n * ADAPTER_BYTES, "dtype": "float32",
               "file": f"{output_dir}/adapter_model.safetensors + adapter_config.json"}
    out["written_by"] = "rank 0, from the gathered state dict (the other ranks write nothing)"
    if sharding == "fsdp":
        out["sharded"] = {
            "where": f"{output_dir}/pytorch_model_fsdp_0/__<rank>_0.distcp (+ .metadata) and "
                     f"{output_dir}/optimizer_0/",
            "model_bytes_per_rank": -(-_state_bytes(spec, method, dtype, out["bytes"], one_gpu) // step.num_gpus),
            "optimizer_bytes_per_rank": int(optimizer_bytes_per_rank),
            "note": "the resumable training state of accelerate's save_state: with fsdp_state_dict_type "
                    "SHARDED_STATE_DICT one file per rank, about 1/N of the model's whole state (frozen weights "
                    "included unless adapter_only) and that rank's optimizer shard; with FULL_STATE_DICT rank 0 "
                    f"gathers it into {output_dir}/pytorch_model_fsdp.bin. The file above is what you keep"}
    return out


def _state_bytes(spec, method: str, dtype: str, trained_bytes: int, one_gpu) -> int:
    """The model's whole state dict in bytes: the trained weights plus, for LoRA, the frozen base in ``dtype``."""
    if method == "full":
        return trained_bytes
    if method == "qlora":
        return int(sum(one_gpu.breakdown[k] for k in ("weights", "quant_constants", "adapters")))
    return spec.num_params * DTYPE_BYTES[dtype] + trained_bytes


def multi_gpu_plan(model, gpu: str, step: Step | None = None, margin: float = 0.10, output_dir: str = OUTPUT_DIR,
                   steps_per_epoch: int | None = None, time_model=None, **overrides) -> dict:
    """The multi-GPU record for ``step`` (default ``PLANNING``, with ``overrides``; ``num_gpus`` > 1) on GPUs
    named ``gpu`` (see the module docstring). ``sharding="none"`` with several GPUs runs as DDP (the accelerate
    config lora_kit writes) and is planned as ddp. ``steps_per_epoch``: with it, hours per epoch with the
    communication included. Raises ValueError for one GPU or bad settings."""
    s = as_step(step, **overrides)
    if s.num_gpus < 2:
        raise ValueError(f"multi_gpu_plan needs num_gpus > 1, got {s.num_gpus!r}; one GPU has no multi-GPU section.")
    planned = "ddp" if s.sharding == "none" else s.sharding
    spec = model_spec(model)
    row = get_gpu(gpu)
    mine = estimate(spec, s.replace(sharding=planned))
    one = estimate(spec, s.replace(num_gpus=1, cpu_offload=False, sharding="none"))
    ddp = mine if planned == "ddp" else estimate(spec, s.replace(cpu_offload=False, sharding="ddp"))
    fit = fit_verdict(mine.device_total_bytes, row["name"], margin)
    N, cap = s.num_gpus, fit["cuda_capacity_bytes"]  # what fits is judged on
    saved = ddp.peak_allocated_bytes - mine.peak_allocated_bytes
    memory = {
        "per_gpu_peak_bytes": mine.peak_allocated_bytes, "per_gpu_device_total_bytes": mine.device_total_bytes,
        "ddp_per_gpu_peak_bytes": ddp.peak_allocated_bytes, "ddp_per_gpu_device_total_bytes": ddp.device_total_bytes,
        "saving_vs_ddp_bytes": saved, "saving_vs_ddp_pct": 100.0 * saved / ddp.peak_allocated_bytes,
        "capacity_bytes": fit["capacity_bytes"], "cuda_capacity_bytes": cap, "fits": fit["fits"],
        "headroom_bytes": int(fit["headroom_bytes"]),
        "not_pooled": (f"Memory is not pooled: {N} x {row['name']} is not {N * cap / GiB:.0f} GiB for one model. "
                       f"Each GPU must hold its own per-GPU peak ({mine.device_total_bytes / GiB:.1f} GiB with the "
                       f"CUDA context) within its own {cap / GiB:.1f} GiB (CUDA-visible); sharding ({planned}) only "
                       "divides what it shards across the GPUs.")}
    comm = communication(spec, s, planned, one)
    bw = row.get("interconnect_gbs")
    bw = float(bw) if isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0 else None
    st = step_time(spec, row, s, time_model=time_model)
    compute = st["step_seconds"]
    comm_s = comm["per_rank_traffic_bytes"] / (bw * 1e9) if bw else None
    serial = compute + comm_s if bw else None
    overlapped = max(compute, comm_s) if bw else None
    tokens = st["tokens_per_step"]
    time = {"compute_step_seconds": compute, "comm_seconds": comm_s, "step_seconds_not_overlapped": serial,
            "step_seconds_overlapped": overlapped, "tokens_per_step": tokens,
            "tokens_per_second_not_overlapped": tokens / serial if serial else None,
            "steps_per_epoch": steps_per_epoch,
            "epoch_hours_not_overlapped": steps_per_epoch * serial / 3600 if serial and steps_per_epoch else None,
            "epoch_hours_overlapped": steps_per_epoch * overlapped / 3600 if overlapped and steps_per_epoch else None,
            "time_model": st["time_model"],
            "assumption": ASSUMPTION if bw else ("no interconnect_gbs for this GPU in the catalog: add it "
                                                 "(lora_kit.plan.gpus.add_gpu(..., interconnect_gbs=...)) to time "
                                                 "the communication")}
    return {"model": spec.name if hasattr(spec, "name") else str(model), "gpu": row["name"], "num_gpus": N,
            "sharding": s.sharding, "planned_as": planned, "method": s.method, "dtype": s.dtype,
            "seq_len": s.seq_len, "batch_size": s.batch_size, "cpu_offload": s.cpu_offload,
            "margin": margin, "memory": memory, "communication": comm,
            "interconnect": {"name": row.get("interconnect"), "gbs_per_direction": bw,
                             "source": "lora_kit/catalog/gpus.csv interconnect_gbs (the datasheet's figure halved: "
                                       "per direction)"},
            "time": time, "checkpoint": checkpoint(spec, s, planned, output_dir, one_gpu=one,
                                                   optimizer_bytes_per_rank=mine.breakdown["optimizer_states"])}
