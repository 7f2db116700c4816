"""The smoke run: a few real training steps with the planned settings, measured and verified.

``smoke_run(settings, **overrides)`` loads the model (embedded "tiny", local folder or hub id),
quantizes it for QLoRA, attaches the adapter (seed set right before), trains ``max_steps``
optimizer steps on a verified slice of the dataset whose longest examples lead, then saves the
adapter (safetensors), reloads it into a fresh base and verifies it, and generates on control
prompts with base and adapter side by side. Every phase rewrites ``<run_dir>/smoke/smoke.json``
atomically, so a crash keeps what was measured and says where it stopped.

Every step field is run as it says, or refused up front, by name, with what to change
(:func:`check_runnable`, one rule per field in :data:`RUNS`), before the run folder is touched or a
model loaded. The loop is the step's ``loop``: ``"kit"``, the kit's plain PyTorch step (see
:mod:`lora_kit.run.loop` for why and for what the instrumentation costs); ``"trainer"`` / ``"sft"``,
transformers' ``Trainer`` / TRL's ``SFTTrainer`` itself (``train()`` with its optimizer, clipping,
scheduler and loss) on the same examples and batches, measured step by step the same way. With a TRL
SFT config as ``from_config`` (:func:`lora_kit.plan.config_import.run_settings` makes the settings
from one), the SFTTrainer takes the config's other trainer fields too, and smoke.json's ``loop``
records what it ran with, read back from the trainer and the model. Batches follow ``padding``
(:func:`lora_kit.run.batches.collate`). Memory: CUDA
``max_memory_allocated``/``reserved`` per step on a GPU; on CPU the live-bytes tracker on the first
``measure_steps`` steps (all steps when ``memory_limit_bytes`` emulates a smaller device). The
step that ``estimate`` and ``simulate`` describe is the *second* step (index 1); their numbers are
shown beside its measured peak with the relative error.

Out of memory in any phase is caught: the phase and memory at failure are recorded, memory is
freed, results are written and the changes that would fit are listed: the planner's one fix
ladder (``lora_kit.plan.planner.fixes``, least loss of quality first) on the device that ran out.
Other errors are recorded and re-raised.

Memory parts: a measured step's ``peak_breakdown`` (and ``peaks.breakdown_at_design_step``) uses
the estimate's six parts (``lora_kit.memory.breakdown.BREAKDOWN_KEYS``) and sums to the measured
peak, so :func:`breakdown_rows` lays measured, estimated and simulated parts side by side.

Under ``torchrun --nproc_per_node N -m lora_kit.run.smoke --params run.yaml`` each rank trains its
share of the data: with DDP, or, when ``sharding`` is "fsdp" or "zero3", with PyTorch FSDP2 wrapped as
accelerate wraps it (:func:`lora_kit.run.distributed.shard_fsdp2`; the optimizer is built after
sharding; QLoRA, CPU offload and bitsandbytes optimizers are refused with a ValueError). Rank r's
micro-batch k of step t is block ``(t * grad_accum + k) * N + r`` of ``batch_size`` examples of the one
training order, so N ranks train exactly what one process trains with ``grad_accum * N`` (same
examples, same loss average). Rank 0 gathers every rank's peaks and writes the one result; under
FSDP2 the adapter is gathered whole from the shards (every rank takes part), the trained model's
logits are taken collectively, and rank 0 alone writes the adapter, then reloads it into a fresh
single-process base and verifies it while the other ranks wait at a barrier. ``estimate`` and
``simulate`` then describe the step that ran: per GPU, ``num_gpus=N``, that sharding.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_kit.check.stack import cuda_memory, versions
from lora_kit.data import (check_base_mix, control_source, field_settings, is_conversational, load_examples, long_examples_line,
                           mix_examples, run_data, to_examples, write_run_data)
from lora_kit.loading import fix_bnb_cpu_repack, load_model, load_tokenizer, resolve_model
from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.estimate import estimate
from lora_kit.memory.flash_attention import model_attn_implementation
from lora_kit.fsdp import layer_class
from lora_kit.memory.sharded import label_fsdp
from lora_kit.memory.simulate import simulate as simulate_step
from lora_kit.memory.tracker import LiveBytesTracker
from lora_kit.noise import quiet
from lora_kit.prompting import PromptFormat
from lora_kit.results import (LineLog, NotWritten, active_run, check_output_dir, clean_leftovers, disk_full,
                              interrupts, read_record, run_identity, run_lock, same_run, settled, signal_name, touch,
                              write_json_atomic)
from lora_kit.run import adapter_io
from lora_kit.run import batches as smoke_data
from lora_kit.run import distributed as dist_util
from lora_kit.run.alloc_conf import apply_default as default_allocator
from lora_kit.run.accelerate_config import write_accelerate_config
from lora_kit.run.loop import throughput, train_steps, trainer_steps
from lora_kit.run.oom import fit_suggestions, free_memory, is_oom, memory_now
from lora_kit.settings import STEP_FIELDS, Settings, coerce_value, from_dict, load_settings, read_params
from lora_kit.training import attach_adapter, autocast_context, build_optimizer

PHASES = ("load", "quantize", "adapter", "train", "save", "reload", "verify", "generate")
log = logging.getLogger("lora_kit.run.smoke")


@dataclass
class SmokeResult:
    """What the smoke run measured; ``record`` is exactly what smoke.json holds."""
    record: dict
    run_dir: Path
    model: object = field(default=None, repr=False)  # the trained (reloaded) PeftModel, rank 0, when complete

    @property
    def status(self) -> str:
        return self.record["status"]

    @property
    def ok(self) -> bool:
        return self.record["status"] == "complete"

    @property
    def adapter_dir(self) -> Path:
        return self.run_dir / "adapter"

    def steps_frame(self):
        import pandas as pd
        return pd.DataFrame([{k: v for k, v in s.items() if k != "peak_breakdown"} for s in self.record["steps"]])

    def memory_table(self):
        """DataFrame: measured peak (design step) beside estimate and simulate, with the relative error."""
        import pandas as pd
        measured = (self.record.get("peaks") or {}).get("design_step_peak_bytes")
        rows = [{"source": "measured", "peak_bytes": measured, "error_vs_measured": 0.0 if measured else None}]
        for k, v in (self.record.get("memory_model") or {}).items():
            if isinstance(v, dict):
                rows.append({"source": k, "peak_bytes": v.get("peak_allocated_bytes"),
                             "error_vs_measured": v.get("error_vs_measured"), "note": v.get("error")})
            else:
                rows.append({"source": k, "peak_bytes": v if isinstance(v, int) else None, "note": None
                             if isinstance(v, int) else v})
        return pd.DataFrame(rows)

    def breakdown_frame(self):
        """DataFrame, part by part: bytes measured at the design step beside estimate and simulate."""
        import pandas as pd
        rows = self.record.get("memory_parts") or breakdown_rows(self.record)
        return pd.DataFrame(rows).set_index("part").astype(float)  # NaN where a source has no number

    def summary(self) -> str:
        return summary(self.record)

    def __getitem__(self, key):
        return self.record[key]


class _Run:
    """Holds the record and writes it after each phase (rank 0 only)."""

    def __init__(self, out: Path, record: dict, write: bool):
        self.out, self.record, self.write_enabled = out, record, write
        self._last_write = 0.0
        self.log = None  # smoke.log's AppendLog: what it could not write is recorded in smoke.json

    def write(self) -> None:
        if self.write_enabled:
            lost = self.log.failure() if self.log is not None else None
            if lost:
                self.record["not_written"] = [lost]
            write_json_atomic(self.out / "smoke.json", touch(self.record))
            self._last_write = time.monotonic()

    def write_ending(self) -> None:
        """The last write; a full disk is logged, not raised over the run's own outcome."""
        try:
            self.write()
        except NotWritten as e:
            log.error("%s", e)

    def start(self, phase: str, tracker=None) -> None:
        self.current = self.record["current"] = phase
        if tracker is not None:
            tracker.phase = phase
        self.record["phases"][phase] = {"status": "running", "started": time.time()}
        self.t0 = time.perf_counter()
        log.info("phase %s started", phase)
        self.write()  # a reader sees which phase is running (and, with the pid, whether it still is)

    def done(self, phase: str, status: str = "done", note: str | None = None) -> None:
        rec = self.record["phases"][phase]
        rec.update(status=status, seconds=time.perf_counter() - self.t0 if rec.get("status") == "running" else 0.0)
        if note:
            rec["note"] = note
        log.info("phase %s %s%s", phase, status, f" ({note})" if note else "")
        self.write()

    def skip(self, phase: str, note: str) -> None:
        self.record["phases"][phase] = {"status": "not applicable", "note": note}
        self.write()


# How the smoke run runs each Step field (every field is here: tests/test_smoke_fields.py), and for the values it
# cannot run in a launch, the refusal: ``why(s, world)`` -> None (runs) or what to change. The values themselves are
# checked once, by the Step (lora_kit.settings.check_values); this says only what a launch runs of valid ones.
def _sharding_not_run(s, world):
    if world > 1 and s.sharding in ("zero1", "zero2"):
        return (f"sharding={s.sharding!r} is DeepSpeed ZeRO-{s.sharding[-1]}, which the smoke run does not run; under "
                "torchrun it runs 'ddp' (DDP) and 'fsdp' / 'zero3' (FSDP2): set sharding='ddp' or 'fsdp' for the smoke "
                "run (the plan's figures for your setting are notebook 02's and lora-kit estimate's)")
    if world > 1 and s.sharding in dist_util.SHARDED:
        try:  # FSDP2's own limits (QLoRA, bitsandbytes optimizers); CPU offload is refused for every launch below
            dist_util.check_sharded(s.replace(cpu_offload=False))
        except ValueError as e:
            return str(e).rstrip(".")
    return None


def _loop_not_run(s, world):
    if s.loop != "kit" and world > 1:
        return (f"loop={s.loop!r} runs the {'SFTTrainer' if s.loop == 'sft' else 'Trainer'} in one process; launch "
                "the smoke run without torchrun, or set loop='kit' for the multi-process run")
    return None


def _liger_not_run(s, world):
    import importlib.util
    if s.liger_kernel and not (torch.cuda.is_available() and importlib.util.find_spec("liger_kernel")):
        return ("liger_kernel=True needs a CUDA GPU and liger-kernel installed (its kernels are Triton); "
                + ("install liger-kernel" if torch.cuda.is_available() else "run the smoke run on a GPU")
                + ", or set liger_kernel=False for this run (the plan still sizes it)")
    return None


def apply_liger(model, s) -> None:
    """``liger_kernel=True`` with loop 'kit': what the Trainer's ``use_liger_kernel=True`` does (transformers
    ``integrations/liger.py`` ``apply_liger_kernel``); the Trainer and SFTTrainer do it themselves."""
    if s.liger_kernel and s.loop == "kit":
        from transformers.integrations.liger import apply_liger_kernel
        apply_liger_kernel(model, None)  # the Trainer's own call: _apply_liger_kernel_to_instance(unwrapped model)


RUNS = {
    "method": ("loads the base in dtype ('qlora': 4-bit NF4) and trains every weight ('full') or LoRA adapters", None),
    "dtype": ("the dtype the base weights are loaded in", None),
    "autocast": ("torch.autocast over the forward passes (the Trainer's bf16 / fp16 flags with loop trainer / sft)",
                 None),
    "qlora_prepare": ("QLoRA readied as the step resolves it: peft's prepare_model_for_kbit_training, or no up-casts "
                      "with adapters and 4-bit storage in dtype", None),
    "double_quant": ("bitsandbytes' double quantisation of the 4-bit constants (qlora)", None),
    "seq_len": ("rows are truncated / dropped to it (long_examples) and padded to it (padding)", None),
    "batch_size": ("rows per micro-batch", None),
    "lora_rank": ("the adapter's r", None),
    "lora_alpha": ("the adapter's lora_alpha", None),
    "lora_targets": ("the adapter's target_modules", None),
    "lora_dropout": ("the adapter's lora_dropout, through the fused dropout kernel CUDA runs (a bool mask kept for "
                     "backward, lora_kit.training.FusedDropout)", None),
    "gradient_checkpointing": ("non-reentrant checkpointing, enabled as the HF Trainer enables it", None),
    "attn_implementation": ("the model's attention kernel", None),
    "optimizer": ("the optimizer class (a paged one runs unpaged off CUDA: same states)", None),
    "num_gpus": ("the ranks launched run (a note when they differ); one process writes the accelerate config for "
                 "num_gpus and measures one GPU", None),
    "sharding": ("one process: the one-GPU step, with the launch config for sharding written; under torchrun: "
                 "'none' / 'ddp' as DDP, 'fsdp' / 'zero3' as FSDP2", _sharding_not_run),
    "cpu_offload": ("not run", lambda s, world: (
        "cpu_offload=True is not run by the smoke run (it offloads nothing: FSDP2's CPUOffloadPolicy and DeepSpeed's "
        "offload are not launched by it); set cpu_offload=False for the smoke run, or run only the planning notebooks "
        "(lora-kit run --only 00 01 02), which size offload") if s.cpu_offload else None),
    "grad_accum": ("micro-batches per optimizer step", None),
    "padding": ("batches built as it says (lora_kit.run.batches.collate): 'max_length' to seq_len with a mask, "
                "'longest' to the batch's longest row, 'none' seq_len rows without a mask", None),
    "loop": ("'kit': lora_kit's step; 'trainer' / 'sft': transformers' Trainer / TRL's SFTTrainer train() on the same "
             "batches", _loop_not_run),
    "liger_kernel": ("Liger Kernel applied as the Trainer's use_liger_kernel=True applies it (loop 'kit': "
                     "transformers' apply_liger_kernel, the Trainer's own call; 'trainer' / 'sft': the flag); CUDA "
                     "only", _liger_not_run),
}


def check_runnable(s, world: int | None = None, memory_limit_bytes: int | None = None) -> dict | None:
    """Refuse, before anything is loaded, the step fields of ``s`` (Settings) this launch of ``world`` processes
    cannot run: one ValueError naming each field, its value and what to change (:data:`RUNS`). Also reads
    ``s.from_config`` when ``s.loop == "sft"`` (a TRL SFT config: TRL's parser rejects what ``trl sft`` would) and
    returns its mapping, the SFTConfig fields the SFTTrainer runs with; else None."""
    world = dist_util.world_size() if world is None else world
    problems = [msg for name in STEP_FIELDS if RUNS[name][1] is not None
                for msg in [RUNS[name][1](s, world)] if msg]
    problems += _model_problems(s)
    if memory_limit_bytes is not None and s.loop != "kit":
        problems.append(f"memory_limit_bytes (an emulated device) runs the kit's loop only; loop={s.loop!r}: drop "
                        "memory_limit_bytes, or set loop='kit'")
    config = None
    if s.loop == "sft" and s.from_config:
        try:
            from lora_kit.plan.config_import import trl_config
            config = trl_config(s.from_config)
        except ValueError as e:
            problems.append(f"from_config: {e}".rstrip("."))
    if problems:
        raise ValueError(f"the smoke run cannot run {'these settings' if len(problems) > 1 else 'this setting'}: "
                         + "; ".join(problems) + ". Nothing was loaded.")
    return config


def _model_problems(s) -> list[str]:
    """The step checks that need the model (``lora_kit.memory.specs.check_targets``: LoRA target names, rank,
    attention implementation), where its config can be read here; a model that cannot is left to the load."""
    from lora_kit.memory.specs import check_targets, model_spec
    try:
        spec = model_spec(s.model)
    except (ValueError, OSError):
        return []
    try:
        check_targets(spec, s.method, s.lora_rank, s.lora_targets, s.attn_implementation)
    except ValueError as e:
        return [str(e).rstrip(".")]
    return []


def _settings(settings, overrides):
    if settings is None:
        return from_dict(overrides)
    if not isinstance(settings, Settings):
        raise ValueError(f"settings must be a lora_kit.Settings or None, got {type(settings).__name__}.")
    return settings.replace(**overrides) if overrides else settings


def _load_examples(s, examples=None, write: bool = True) -> tuple[list[dict], dict]:
    """Training examples of the run (+ ``base_mix`` share of base-task rows) and where they came from.

    ``examples``: rows given to smoke_run (fields as in settings), else the training part of
    :func:`lora_kit.data.run_data` -- the held-out part (a split of ``dataset`` when no
    ``heldout_dataset`` is set) is written to ``<run_dir>/data/heldout.jsonl`` so 04 evaluates exactly
    the rows this run did not train on.
    """
    if examples is not None:
        rows, info = to_examples(list(examples), "examples", **field_settings(s)), {"source": "examples argument"}
    else:
        d = run_data(s)
        rows = d["train"]
        info = {"source": s.dataset, "heldout": d["heldout_source"], "split": d["split"], "heldout_rows": len(d["heldout"])}
        if write:
            info["heldout_file"] = str(write_run_data(s.run_dir, "heldout", d["heldout"]))
    if s.base_mix > 0:
        rows = mix_examples(rows, load_examples(check_base_mix(s)), s.base_mix, seed=s.seed)
        info["base_mix"] = s.base_mix
    return rows, info


def _control_prompts(s, n: int = 4) -> tuple[list[dict], str]:
    source = control_source(s.control_dataset, s.model)
    try:
        fields = {} if source.startswith(("tiny:", "generic:")) else field_settings(s, "control")
        return load_examples(source, split=None, limit=n, **fields), source
    except Exception as e:  # noqa: BLE001 - no control set: fall back, and say so in smoke.json
        log.warning("control prompts from %r unavailable (%s); using training prompts", source, e)
        return [], f"unavailable: {e}"


def _memory_model(s, model_path: str, measured: int | None, world: int, simulate: bool,
                  width: int | None = None) -> dict:
    """estimate / simulate beside the measured peak (per-GPU ddp / fsdp too when several processes run).

    They describe the step that ran: one GPU (``sharding="none"``), or, under FSDP2, one GPU of
    ``num_gpus=world`` and ``sharding="fsdp"`` (FSDP2 ran, also for "zero3": ``estimate``'s zero3 is DeepSpeed's,
    with its gradient bucket; simulate, and estimate, which may fit or simulate FSDP2's step, then run in a spawned
    process: a fake FSDP2 world cannot start in a process that joined the real one). With ``padding="longest"`` the
    design step's batches were ``width`` tokens wide (their longest row), and the figures are for that width; with
    ``padding="packed"`` each micro-batch was one row of its examples' ``width`` tokens at most, planned as
    ``batch_size`` rows of ``ceil(width / batch_size)`` tokens (the same tokens, fewer than ``batch_size`` over)."""
    step = {"num_gpus": world, "sharding": "fsdp"} if dist_util.runs_sharded(s) else {"num_gpus": 1,
                                                                                      "sharding": "none"}
    if width:
        step["seq_len"] = smoke_data.ran_seq_len(s.padding, s.seq_len, s.batch_size, width)
    ran = s.step.replace(**step)
    out = {}
    models = {"estimate": estimate, "simulate": simulate_step} if simulate else {"estimate": estimate}
    for name, fn in models.items():
        try:
            if step["sharding"] != "none" and torch.distributed.is_initialized():  # (estimate may fit FSDP2 too)
                r = dist_util.in_fresh_process(fn, model=model_path, step=ran)
            else:
                r = fn(model_path, ran)
            out[name] = {"peak_allocated_bytes": int(r.peak_allocated_bytes), "breakdown": dict(r.breakdown),
                         "phase": getattr(r, "phase", None), **step}
            if measured:
                out[name]["error_vs_measured"] = (int(r.peak_allocated_bytes) - measured) / measured
        except Exception as e:  # noqa: BLE001 - a failing model of memory must not lose the measurement
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    if world > 1:
        for sharding in ("ddp", "fsdp"):
            try:
                kw = dict(model=model_path, step=s.step.replace(num_gpus=world, sharding=sharding))
                r = dist_util.in_fresh_process(estimate, **kw) if sharding == "fsdp" and \
                    torch.distributed.is_initialized() else estimate(**kw)
                out[f"estimate_{sharding}_per_gpu"] = int(r.peak_allocated_bytes)
            except Exception as e:  # noqa: BLE001
                out[f"estimate_{sharding}_per_gpu"] = f"{type(e).__name__}: {e}"
    return out


def breakdown_rows(rec: dict) -> list[dict]:
    """The peak's parts (:data:`~lora_kit.memory.breakdown.BREAKDOWN_KEYS`, then "total") in bytes:
    measured at the design step beside ``estimate`` and ``simulate`` (None where a source has no
    number: on CUDA only the measured total is known). One vocabulary, so the parts line up;
    smoke.json keeps them as ``memory_parts`` for the run card."""
    models = rec.get("memory_model") or {}
    totals = {"measured": (rec.get("peaks") or {}).get("design_step_peak_bytes")}
    parts = {"measured": (rec.get("peaks") or {}).get("breakdown_at_design_step")}
    for name in ("estimate", "simulate"):
        v = models.get(name)
        if isinstance(v, dict):
            totals[name], parts[name] = v.get("peak_allocated_bytes"), v.get("breakdown")
    rows = [{"part": k, **{n: (b or {}).get(k) for n, b in parts.items()}} for k in BREAKDOWN_KEYS]
    return rows + [{"part": "total", **totals}]


def _linear_names(model) -> list[str]:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names - {"lm_head"})


def smoke_run(settings=None, *, examples: list[dict] | None = None, control_prompts: list[str] | None = None,
              memory_limit_bytes: int | None = None, measure_steps: int = 3, simulate: bool = True,
              progress: bool = True, cpu_threads: int | None = None, overwrite: bool = False,
              **overrides) -> SmokeResult:
    """Run the smoke run; returns a :class:`SmokeResult` (also in ``<run_dir>/smoke/smoke.json``).

    ``settings``: a :class:`lora_kit.Settings` (or None for defaults); ``overrides``: any Settings
    field. ``examples``: rows (dicts with the prompt/response fields) instead of ``settings.dataset``.
    ``control_prompts``: prompts for the base-vs-adapter generations (default: the control dataset).
    ``memory_limit_bytes``: emulate a device of that size on CPU (the live-bytes tracker raises
    ``torch.OutOfMemoryError`` past it; the tracker then runs on every step -- slower).
    ``measure_steps``: how many leading steps the tracker measures on CPU (>= 2 to include the
    second step, the one estimates describe). ``simulate``: also run ``lora_kit.memory.simulate``.
    ``cpu_threads``: torch CPU threads for this run (restored after). On a CPU shared with other
    jobs, 1 thread can be several times faster than 2 (OpenMP threads spin waiting for each other);
    None keeps torch's setting.
    ``overwrite``: a ``run_dir`` whose ``smoke/smoke.json`` records a complete smoke run of another run is
    refused (ValueError) unless ``overwrite=True``, which moves that run's ``smoke/``, ``data/`` and ``mix/``
    aside to ``<run_dir>/replaced-<its id>/`` first -- as ``lora-kit run --overwrite`` does with a whole run.
    One smoke run writes into a folder at a time (:func:`lora_kit.results.run_lock`; a smoke run inside a
    ``lora-kit run`` shares that run's lock); what a killed one left behind (temp files, half-saved adapter
    folders) is removed at the start.
    Out of memory returns a result with ``status == "failed at <phase>"``; other errors re-raise. A file that
    cannot be written (full disk, read-only) raises :class:`lora_kit.results.NotWritten` naming it.
    """
    s = _settings(settings, overrides)
    check_output_dir(s.run_dir, create=False)
    if measure_steps < 1:
        raise ValueError(f"measure_steps must be >= 1, got {measure_steps}.")
    if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                    or cpu_threads < 1):
        raise ValueError(f"cpu_threads must be a positive integer or None, got {cpu_threads!r}.")
    config = check_runnable(s, None, memory_limit_bytes)
    lock = contextlib.ExitStack()
    if dist_util.rank() == 0 and active_run(s.run_dir) is None:  # inside a lora-kit run, that run holds the lock
        lock.enter_context(run_lock(s.run_dir))
    try:
        _claim_folder(s, overwrite)
    except BaseException:
        lock.close()
        raise
    threads_before = torch.get_num_threads()
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    allocator = default_allocator()  # before CUDA starts: expandable segments unless the environment set it
    created = dist_util.init_if_launched()
    rank, world = dist_util.rank(), dist_util.world_size()
    out = Path(s.run_dir) / "smoke"
    record = {"run": run_identity("smoke_run", s.run_dir), "kind": "lora_kit.run.smoke", "status": "running",
              "settings": s.to_dict(), "stack": versions(),
              "launch": {"world_size": world, "device": str(dist_util.device()), "sharding": dist_util.engine(s),
                         "torch_threads": torch.get_num_threads(), "memory_limit_bytes": memory_limit_bytes},
              "allocator": allocator,  # the CUDA caching allocator setting this run started with
              "cuda_memory": cuda_memory(dist_util.device()),  # mem_get_info of this rank's GPU; None on CPU
              "phases": {p: {"status": "pending"} for p in PHASES},
              "measurement": {
                  "method": "cuda max_memory_allocated per step" if torch.cuda.is_available()
                  else "live-bytes tracker (lora_kit.memory.tracker)",
                  "tracked_steps": "all" if memory_limit_bytes else list(range(min(measure_steps, s.max_steps))),
                  "design_step": 1 if s.max_steps > 1 else 0,
                  "padding": s.padding,
                  "note": "peak of the second step (index 1) is what estimate/simulate describe, at that step's "
                          "width (each step's seq_len: seq_len, its longest row with padding='longest', its "
                          "packed row's tokens over batch_size rows with padding='packed'); "
                          "untracked steps record time, loss and process RSS only"},
              "steps": [], "oom": None, "error": None}
    if world > 1 and s.num_gpus not in (1, world):  # the plan's N is not the launch's: say which one is measured
        record["launch"]["note"] = (f"settings plan num_gpus={s.num_gpus}; this run has {world} ranks: the measured "
                                    f"peaks, estimate and simulate describe {world}")
    run = _Run(out, record, write=rank == 0)
    handler = None
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _close(None, created, threads_before, lock)
            raise NotWritten(out, e) from None
        handler = LineLog(out / "smoke.log", fresh=True)  # whole records; a full disk is recorded, never raised
        run.log = handler.log
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    tracker = None
    if memory_limit_bytes is not None or not torch.cuda.is_available():
        tracker = LiveBytesTracker(limit_bytes=memory_limit_bytes)
    state: dict = {"config": config}
    result = SmokeResult(record, out)
    try:
        run.write()
        with interrupts(sigint=False):  # SIGTERM -> Interrupted; Ctrl-C is a KeyboardInterrupt already
            _phases_measured(s, run, state, tracker, memory_limit_bytes, examples, control_prompts, measure_steps,
                             simulate, progress)
        record["status"] = "complete"
        record.pop("current", None)
        result.model = state.get("reloaded")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: record the ending, keep the steps so far, stop
        phase = getattr(run, "current", "load")
        if record["phases"][phase].get("status") == "running":
            record["phases"][phase]["status"] = "interrupted"
        record["status"] = f"interrupted at {phase}"
        record["ending"] = f"{signal_name(e)} during {phase}; {len(record['steps'])} steps recorded"
        log.error("smoke run interrupted (%s) during %s", signal_name(e), phase)
        run.write_ending()
        _close(handler, created, threads_before, lock)
        raise
    except BaseException as e:
        phase = getattr(run, "current", "load")
        record["phases"][phase].update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
        record["status"] = f"failed at {phase}"
        if not is_oom(e):
            record["error"] = f"{type(e).__name__}: {e}"[:2000]
            log.exception("smoke run failed at %s", phase)
            run.write_ending()
            _close(handler, created, threads_before, lock)
            if isinstance(e, OSError) and not isinstance(e, NotWritten) and disk_full(e):
                raise NotWritten(Path(e.filename or out), e) from e  # which file, and what to do
            raise
        record["oom"] = {"phase": phase, "step_phase": getattr(tracker, "phase", None),
                         "memory_at_failure": memory_now(tracker), "error": str(e)[:1000]}
        state.clear()
        import traceback
        traceback.clear_frames(e.__traceback__)  # frames of the failed phase hold the model: let it go
        free_memory()
        record["oom"]["memory_after_free"] = memory_now(tracker)
        try:
            on_gpu = torch.cuda.is_available() and not memory_limit_bytes
            dev = dist_util.device()  # this rank's GPU; its capacity is mem_get_info's total, read at the start
            limit = memory_limit_bytes or ((record["cuda_memory"] or {}).get("cuda_total_bytes") if on_gpu else None)
            record["oom"]["suggestions"] = fit_suggestions(
                {**s.to_dict(), "model": record.get("model", {}).get("path", s.model)}, limit, cuda=on_gpu,
                name=torch.cuda.get_device_name(dev) if on_gpu else None)
        except Exception as se:  # noqa: BLE001 - suggestions are advice; the failure record matters more
            record["oom"]["suggestions"] = {"error": f"{type(se).__name__}: {se}"}
        log.error("out of memory in phase %s: %s", phase, e)
    run.write_ending()
    _close(handler, created, threads_before, lock)
    return result


def _close(handler, created: bool, threads: int, lock: contextlib.ExitStack) -> None:
    lock.close()
    torch.set_num_threads(threads)
    if handler is not None:
        log.removeHandler(handler)
        handler.close()
    dist_util.shutdown(created)


def _phases_measured(s, run, state, tracker, memory_limit_bytes, examples, control_prompts, measure_steps,
                     simulate, progress):
    if tracker is not None and memory_limit_bytes is not None:
        with tracker:  # an emulated device: everything, every phase, counts against the limit
            _phases(s, run, state, tracker, True, examples, control_prompts, measure_steps, simulate, progress)
    else:
        _phases(s, run, state, tracker, False, examples, control_prompts, measure_steps, simulate, progress)


def _phases(s, run, state, tracker, always_on, examples, control_prompts, measure_steps, simulate, progress):
    rec, rank, world, dev = run.record, dist_util.rank(), dist_util.world_size(), dist_util.device()
    qlora = s.method == "qlora"

    # load: tokenizer, data (verified slice), base model (4-bit at load time for QLoRA)
    run.start("load", tracker)
    path = resolve_model(s.model)
    tok = load_tokenizer(path, trust_remote_code=s.trust_remote_code, padding_side="right")
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path, trust_remote_code=s.trust_remote_code)
    smoke_data.check_context(s.seq_len, config)
    rows, source = _load_examples(s, examples, write=rank == 0)
    fmt = PromptFormat(tok, s.prompt_format, train_on=s.train_on, conversational=is_conversational(rows))
    per_step = s.batch_size * s.grad_accum
    order, rec["data"] = smoke_data.verified_slice(
        tok, rows, s.seq_len, per_step * s.max_steps * world, seed=s.seed, n_first=per_step * world, fmt=fmt,
        long_examples=s.long_examples)
    rec["data"].update(source)
    if rank == 0:  # the rows actually trained on: 04's overlap check compares held-out prompts with them
        rec["data"]["trained_file"] = str(write_run_data(s.run_dir, "trained", [rows[i] for i in
                                                                                sorted({e["row"] for e in order})]))
    log.info("%s", long_examples_line(rec["data"]))
    mine = _rank_share(order, rank, world, s.batch_size)
    state["train_prompts"], state["fmt"] = [rows[e["row"]] for e in mine[:4]], fmt
    model = load_model(path, method=s.method, dtype=s.dtype, double_quant=s.double_quant,
                       attn_implementation=model_attn_implementation(s.attn_implementation, dev),
                       trust_remote_code=s.trust_remote_code, device=str(dev), storage_in_dtype=not s.step.kbit_prepared)
    if tracker is not None:
        tracker.track(list(model.parameters()) + list(model.buffers()))
    rec["model"] = {"path": path, "parameters": sum(p.numel() for p in model.parameters()),
                    "linear_names": _linear_names(model), "max_position_embeddings":
                    getattr(config, "max_position_embeddings", None)}
    state["model"] = model
    run.done("load")

    run.start("quantize", tracker)
    if qlora:
        n4 = fix_bnb_cpu_repack(model)
        if n4 == 0:
            raise RuntimeError("method='qlora' but the loaded model has no 4-bit layers; check bitsandbytes.")
        run.done("quantize", note=f"{n4} Linear4bit layers (NF4, double_quant={s.double_quant}, quantized while "
                                  "loading); " + ("prepare_model_for_kbit_training runs in the adapter phase"
                                                  if s.step.kbit_prepared else "qlora_prepare='none': no up-casts"))
    else:
        run.done("quantize", status="not applicable", note=f"method={s.method!r} keeps weights in {s.dtype}")

    run.start("adapter", tracker)
    model = attach_adapter(model, s.method, s.seed, s.lora_rank, s.lora_alpha, s.lora_dropout, s.lora_targets,
                           s.gradient_checkpointing, s.step.kbit_prepared)
    apply_liger(model, s)
    sharded = dist_util.runs_sharded(s)
    if sharded:  # FSDP2 over every rank, before the optimizer exists (it must hold the sharded parameters)
        model, rec["launch"]["fsdp"] = dist_util.shard_fsdp2(model, s)
    state["model"] = model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rec["model"]["trainable_parameters"] = trainable
    optimizer = build_optimizer(model.parameters(), s.optimizer, s.learning_rate) if s.loop == "kit" else None
    state["optimizer"] = optimizer  # the Trainer / SFTTrainer builds its own
    run.done("adapter", note=f"{trainable} trainable parameters, seed {s.seed} set before creation")

    run.start("train", tracker)
    batches = _StepBatches(s, tok.pad_token_id, dev)

    def on_step(m):
        m["rows"], m["seq_len"] = batches.rows.get(m["step"]), batches.width.get(m["step"])
        m["tokens"] = batches.tokens.get(m["step"], m["tokens"])
        m["tokens_per_s"] = m["tokens"] / m["seconds"]
        rec["steps"].append(m)
        if m["measured"] or time.monotonic() - run._last_write > 10:
            run.write()

    if s.loop == "kit":
        train_model = model if sharded else dist_util.wrap_ddp(model)
        train_steps(train_model, optimizer, lambda step, k: batches.micro(mine, step, k), s.max_steps, s.grad_accum,
                    tracker=tracker, measure_steps=measure_steps, tracker_always_on=always_on,
                    progress=progress and rank == 0, on_step=on_step, label_module=model,
                    autocast_ctx=autocast_context(s.autocast, s.dtype, dev.type),
                    paged=s.optimizer.startswith("paged_") and dev.type != "cuda",
                    run_dir=s.run_dir if rank == 0 else None, label=label_fsdp if sharded else None)
    else:  # the user's loop itself: transformers' Trainer / TRL's SFTTrainer, on the same examples and batches
        with tempfile.TemporaryDirectory(dir=run.out, prefix=".trainer-", suffix=".tmp") as out_dir:  # kept: nothing
            _, trainer = trainer_steps(model, s, mine[:s.max_steps * s.grad_accum * s.batch_size], batches.collate,
                                       out_dir, tok, tracker=tracker, measure_steps=measure_steps,
                                       tracker_always_on=always_on, progress=progress, on_step=on_step,
                                       run_dir=s.run_dir, config=state.get("config"))
        rec["loop"] = _trainer_record(s, trainer, model)
        state["optimizer"] = trainer.optimizer
        train_model = trainer
        del trainer
    steps = rec["steps"]
    key = "cuda_max_allocated_bytes" if torch.cuda.is_available() else "peak_bytes"
    design = rec["measurement"]["design_step"]
    measured = steps[design].get(key) if len(steps) > design else None
    mine_peaks = {"rank": rank, "design_step_peak_bytes": measured,
                  "max_peak_bytes": max((x.get(key) or 0) for x in steps),
                  "cuda_max_reserved_bytes": max((x.get("cuda_max_reserved_bytes") or 0) for x in steps) or None,
                  "max_rss_bytes": max((x.get("rss_bytes") or 0) for x in steps) or None}
    rec["peaks"] = {**mine_peaks, "per_rank": dist_util.gather(mine_peaks),
                    "breakdown_at_design_step": steps[design].get("peak_breakdown") if len(steps) > design else None,
                    "phase_at_design_step": steps[design].get("peak_phase") if len(steps) > design else None}
    rec["throughput"] = throughput(steps)
    if rank == 0:
        rec["memory_model"] = _memory_model(s, path, measured, world, simulate,
                                            steps[design].get("seq_len") if len(steps) > design else None)
        rec["memory_parts"] = breakdown_rows(rec)
    if (world > 1 or s.num_gpus > 1) and rank == 0:  # the launch config for the multi-GPU run this plans
        rec["accelerate_config"] = str(write_accelerate_config(
            run.out / "accelerate_config.yaml", sharding=s.sharding if s.sharding != "none" else "ddp",
            num_gpus=max(world, s.num_gpus), cpu_offload=s.cpu_offload,
            dtype="bfloat16" if s.dtype == "float32" else s.dtype, grad_accum=s.grad_accum,
            gradient_checkpointing=s.gradient_checkpointing,
            layer_class=(rec["launch"].get("fsdp") or {}).get("layer_class") or layer_class(model)))
    run.done("train")
    del train_model

    if s.method == "full":
        for p in ("save", "reload", "verify", "generate"):
            run.skip(p, "method='full' trains the whole model: there is no adapter to save and verify")
        return
    probe = smoke_data.collate(_rank_share(order, 0, world, s.batch_size)[:4], s.seq_len, tok.pad_token_id)
    probe = {k: v.to(dev) for k, v in probe.items()}  # rank 0's first examples, on every rank
    if rank != 0:  # other ranks: rank 0 alone writes, reloads, verifies and generates
        if sharded:
            _trained_outputs(model, probe, sharded)  # the save's collectives: every rank takes part
        dist_util.barrier()
        return
    try:
        _verify_phases(s, run, state, tracker, tok, probe, path, control_prompts, sharded)
    finally:
        dist_util.barrier()


class _StepBatches:
    """The run's micro-batches, built as ``padding`` says (:func:`lora_kit.run.batches.collate`), with each step's
    width (the longest micro-batch's, for ``padding="longest"``), rows and real tokens (padding left out) recorded.
    ``micro(examples, step, k)`` for the kit's loop; ``collate(rows)`` for the Trainer's data loader, which asks for
    the micro-batches in order (so its n-th call is micro-batch n)."""

    def __init__(self, s, pad_id: int, dev):
        self.s, self.pad_id, self.dev = s, pad_id, dev
        self.width: dict = {}
        self.tokens: dict = {}
        self.rows: dict = {}
        self.calls = 0

    def _batch(self, rows: list, step: int) -> dict:
        b = smoke_data.collate(rows, self.s.seq_len, self.pad_id, self.s.padding)
        self.width[step] = max(self.width.get(step, 0), b["input_ids"].shape[1])
        self.tokens[step] = self.tokens.get(step, 0) + smoke_data.real_tokens(rows)
        self.rows[step] = self.rows.get(step, 0) + len(rows)
        return b

    def micro(self, examples: list, step: int, k: int) -> dict:
        i = (step * self.s.grad_accum + k) * self.s.batch_size
        return {key: v.to(self.dev) for key, v in self._batch(examples[i:i + self.s.batch_size], step).items()}

    def collate(self, rows: list) -> dict:
        step, self.calls = self.calls // self.s.grad_accum, self.calls + 1
        return self._batch(rows, step)


def _checkpointing_on(model) -> bool:
    """transformers 5's ``is_activation_checkpointing``; its deprecated alias (which warns) only where it is absent."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def _trainer_record(s, trainer, model) -> dict:
    """What the Trainer / SFTTrainer ran with, read back from the trainer and the model it trained: its class, its
    arguments that set the step, the adapter's configuration, whether checkpointing was on."""
    args = trainer.args
    keys = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "optim",
            "bf16", "fp16", "max_grad_norm", "weight_decay", "lr_scheduler_type", "warmup_steps", "seed", "max_length")
    ran = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    ran["optim"] = str(getattr(ran.get("optim"), "value", ran.get("optim")))
    ran["lr_scheduler_type"] = str(getattr(ran.get("lr_scheduler_type"), "value", ran.get("lr_scheduler_type")))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {"loop": s.loop, "trainer": type(trainer).__mro__[1].__name__, "args": ran,
           "optimizer": type(trainer.optimizer).__name__, "from_config": s.from_config or None,
           "gradient_checkpointing": _checkpointing_on(base)}
    peft = getattr(model, "peft_config", None)
    if peft:
        c = peft["default"]
        targets = c.target_modules
        out["adapter"] = {"r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
                          "target_modules": targets if isinstance(targets, str) else sorted(targets)}
    return out


def _rank_share(order: list, rank: int, world: int, batch_size: int) -> list:
    """The examples rank ``rank`` of ``world`` trains, in order: blocks of ``batch_size`` taken round robin, so
    micro-batch k of step t on rank r is block ``(t * grad_accum + k) * world + r`` -- what one process
    training with ``grad_accum * world`` takes as micro-batch ``k * world + r`` of step t."""
    blocks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return [e for b in blocks[rank::world] for e in b]


def _trained_outputs(model, probe: dict, sharded: bool):
    """(trained logits, base logits, adapter tensors to save) on ``probe``. Under FSDP2 a collective: the adapter is
    gathered whole from the shards and the forward passes all-gather the weights, so every rank calls this (the
    tensors are rank 0's; None elsewhere and without sharding: the model saves its own)."""
    full = dist_util.full_trainable_state(model) if sharded else None
    return adapter_io.logits(model, probe), adapter_io.logits(model, probe, adapter=False), full


def _verify_phases(s, run, state, tracker, tok, probe, path, control_prompts, sharded):
    rec, dev, model = run.record, dist_util.device(), state["model"]

    run.start("save", tracker)
    trained_logits, base_logits, full = _trained_outputs(model, probe, sharded)
    files = adapter_io.save_adapter(model, run.out / "adapter", state_dict=full,
                                    base_model_name=adapter_io.portable_model_name(s.model))
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    rec["checkpoint"] = {"dir": str(run.out / "adapter"), "files": files, "bytes": sum(files.values()),
                         "gathered_from_ranks": dist_util.world_size() if sharded else 1, "written_by_rank": 0,
                         "trained_dtype": str(next(iter(trained))).removeprefix("torch.") if len(trained) == 1 else None}
    del full
    for k in ("model", "optimizer"):  # free the trained model and optimizer before loading a fresh base
        state.pop(k, None)
    del model
    run.done("save", note=f"{sum(files.values())} bytes on disk")

    run.start("reload", tracker)
    base = load_model(path, method=s.method, dtype=s.dtype, double_quant=s.double_quant,
                      attn_implementation=model_attn_implementation(s.attn_implementation, dev),
                      trust_remote_code=s.trust_remote_code, device=str(dev), storage_in_dtype=not s.step.kbit_prepared)
    if s.step.kbit_prepared:  # same fp32 up-casts as in training, so logits are comparable
        from peft import prepare_model_for_kbit_training
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    reloaded, keys = adapter_io.load_adapter(base, run.out / "adapter")
    if trained == {torch.bfloat16}:  # SFTTrainer trains QLoRA adapters in bf16; peft reloads them in fp32: compare
        for name, p in reloaded.named_parameters():  # outputs computed as they trained (the saved values are equal)
            if "lora_" in name:
                p.data = p.data.to(torch.bfloat16)
    fix_bnb_cpu_repack(reloaded)
    state["reloaded"] = reloaded
    rec["reload"] = keys
    run.done("reload")

    run.start("verify", tracker)
    files_check = adapter_io.check_adapter_files(run.out / "adapter")
    tol = 1e-4 if s.method == "qlora" or s.dtype != "float32" else 1e-5
    verdict = adapter_io.compare_logits(trained_logits, adapter_io.logits(reloaded, probe), base_logits, tol)
    rec["verify"] = {**verdict, "files": files_check, "no_missing_or_unexpected_keys": True,
                     "passed": verdict["reload_equal"] and verdict["adapter_changes_outputs"]}
    if not rec["verify"]["passed"]:
        raise AssertionError(f"adapter verification failed: {verdict}")
    run.done("verify")

    run.start("generate", tracker)
    prompts, source = (control_prompts, "argument") if control_prompts else _control_prompts(s)
    if not prompts:
        prompts, source = state["train_prompts"], source + " -> first training prompts"
    rec["generations"] = {"source": source, "decoding": "greedy, left padding, stop at EOS or newline",
                          "max_new_tokens": s.max_new_tokens,
                          "prompt_format": state["fmt"].kind,
                          "rows": adapter_io.generate_side_by_side(reloaded, tok, prompts, s.max_new_tokens,
                                                                   state["fmt"])}
    run.done("generate")


def _claim_folder(s, overwrite: bool) -> None:
    """Before the smoke run writes anything into ``s.run_dir``: remove what a killed one left behind, and refuse
    (or, with ``overwrite``, move aside) a complete smoke run of another run there."""
    out = Path(s.run_dir) / "smoke"
    if dist_util.rank() == 0:
        left = clean_leftovers(out)
        if left:
            log.warning("removed what a killed smoke run left in %s: %s", out, ", ".join(left))
    old = settled(read_record(out / "smoke.json"))
    if not old or old.get("status") != "complete" or same_run(old, active_run(s.run_dir)):
        return
    old_id = (old.get("run") or {}).get("id") or "unknown"
    if not overwrite:
        raise ValueError(f"{str(out)!r} holds a complete smoke run (run {old_id}, its verified adapter and data); "
                         "a new smoke run would replace them. Pass overwrite=True (CLI: --overwrite) to move them "
                         f"aside to {str(Path(s.run_dir) / f'replaced-{old_id}')!r}, or choose another run_dir.")
    if dist_util.rank() == 0:
        dest = Path(s.run_dir) / f"replaced-{old_id}"
        dest.mkdir(parents=True, exist_ok=True)
        for part in ("smoke", "data", "mix"):
            if (Path(s.run_dir) / part).exists() and not (dest / part).exists():
                os.replace(Path(s.run_dir) / part, dest / part)
        log.warning("moved the previous smoke run %s aside: %s", old_id, dest)
    dist_util.barrier()


def check_own_folder(run_dir: str, world: int = 1) -> None:
    """Refuse a command-line smoke run into the folder of a ``lora-kit run`` it is not part of: it would
    replace that run's ``smoke/`` (the adapter its notebook 04 evaluated) and, carrying another run id,
    would not be shown on that run's card. ValueError naming a folder of its own."""
    owner = (read_record(Path(run_dir) / "pipeline.json") or {}).get("run")
    if not owner or active_run(run_dir) is not None:
        return
    mine = f"{str(run_dir).rstrip('/')}-{world}ranks" if world > 1 else f"{str(run_dir).rstrip('/')}-smoke"
    raise ValueError(
        f"run_dir {str(run_dir)!r} holds the lora-kit run {owner.get('id', '?')} (pipeline.json): this smoke run "
        "would replace its smoke/ (the adapter its notebook 04 evaluated) and that run's card would not show it "
        f"(another run id). Give it a folder of its own: -p run_dir {mine} ; then its run card: python -c "
        f"\"from lora_kit.ui.run_card import build_report; build_report('{mine}')\"")


def main(argv=None) -> int:
    """``python -m lora_kit.run.smoke --params run.yaml [-p key value ...]`` (works under torchrun)."""
    quiet()
    default_allocator()  # a launched rank sets it before anything can start CUDA
    p = argparse.ArgumentParser(prog="python -m lora_kit.run.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", help="YAML params file (Settings fields)")
    p.add_argument("--from-config", metavar="PATH", help="a TRL SFT config: its step, model and trainer fields run "
                                                         "under TRL's SFTTrainer (settings given here win)")
    p.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"), help="override a setting")
    p.add_argument("--memory-limit-bytes", type=int, default=None, help="emulate a device of this size (CPU)")
    p.add_argument("--measure-steps", type=int, default=3, help="steps the CPU tracker measures")
    p.add_argument("--no-simulate", action="store_true", help="skip lora_kit.memory.simulate")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--overwrite", action="store_true",
                   help="move a complete smoke run in run_dir aside to <run_dir>/replaced-<id> instead of refusing")
    a = p.parse_args(argv)
    try:
        if a.from_config:
            from lora_kit.plan.config_import import run_settings
            given = {**(read_params(a.params) if a.params else {}), **dict(a.p)}
            s, _ = run_settings(a.from_config, **{k: coerce_value(k, v) for k, v in given.items()})
        else:
            s = load_settings(a.params, dict(a.p))
        check_own_folder(s.run_dir, dist_util.world_size())
        check_runnable(s, memory_limit_bytes=a.memory_limit_bytes)
    except ValueError as e:  # the same on every rank: said once, not once per torchrun process
        if dist_util.rank() == 0:
            print(f"smoke run: {e}", file=sys.stderr)
        return 2
    try:
        r = smoke_run(s, memory_limit_bytes=a.memory_limit_bytes, measure_steps=a.measure_steps,
                      simulate=not a.no_simulate, cpu_threads=a.cpu_threads, overwrite=a.overwrite)
    except KeyboardInterrupt as e:  # one line, not a traceback: smoke.json holds the record
        print(f"smoke run interrupted ({signal_name(e)}); what was measured is in smoke/smoke.json",
              file=sys.stderr)
        return 143 if signal_name(e) == "SIGTERM" else 130
    except ValueError as e:
        print(f"smoke run: {e}", file=sys.stderr)
        return 2
    except NotWritten as e:  # full disk, read-only folder: the message names the file; smoke.json the phase
        print(f"smoke run: {e.strerror}", file=sys.stderr)
        return 1
    if dist_util.rank() == 0:
        print(summary(r.record))
    return 0 if r.ok else 1


def summary(rec: dict) -> str:
    """A few lines: status, per-rank measured peaks beside estimate / simulate (and ddp / fsdp per GPU)."""
    mib = lambda b: f"{b / 2**20:.2f} MiB" if isinstance(b, (int, float)) else str(b)  # noqa: E731
    lines = [f"smoke run: {rec['status']}"]
    if (rec.get("launch") or {}).get("sharding", "none") != "none":
        lines.append(f"  sharding: {rec['launch']['sharding']}")
    if rec.get("loop"):
        lp = rec["loop"]
        lines.append(f"  loop: {lp['loop']} ({lp['trainer']}.train()"
                     + (f", with {lp['from_config']})" if lp.get("from_config") else ")"))
    if (rec.get("launch") or {}).get("note"):
        lines.append(f"  note: {rec['launch']['note']}")
    if rec.get("data"):
        lines.append("  " + long_examples_line(rec["data"]))
    peaks = rec.get("peaks") or {}
    for r in peaks.get("per_rank", []):
        lines.append(f"  rank {r['rank']}: measured peak (step {rec['measurement']['design_step']}) "
                     f"{mib(r['design_step_peak_bytes'])}, max over measured steps {mib(r['max_peak_bytes'])}")
    for k, v in (rec.get("memory_model") or {}).items():
        if isinstance(v, dict):
            err = v.get("error_vs_measured")
            lines.append(f"  {k:<22}{mib(v.get('peak_allocated_bytes', v.get('error')))}"
                         + (f"  ({err:+.1%} vs measured)" if err is not None else ""))
        else:
            lines.append(f"  {k:<22}{mib(v)}")
    if rec.get("oom"):
        lines.append(f"  out of memory in {rec['oom']['phase']}; try: " + "; ".join(
            r["change"] for r in (rec["oom"].get("suggestions") or {}).get("ranked", [])[:3]))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
