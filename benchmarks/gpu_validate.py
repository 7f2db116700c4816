"""GPU validation: real training steps of random-init models on CUDA vs estimate and simulate.

For ~20 configurations (LoRA, QLoRA with bitsandbytes, full; checkpointing on/off; sdpa/eager;
five architecture families) it runs two real steps on the GPU (lora_kit.memory.measure: the second step's
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``), and compares

- ``estimate`` and ``simulate`` peak_allocated_bytes vs ``max_memory_allocated``, and ``estimate``'s peak with the
  two cuBLAS workspaces (``lora_kit.memory.device.cuda_allocated_bytes``, what that counter includes);
- their ``device_total_bytes`` vs the device level: CUDA context (``mem_get_info`` used bytes after
  CUDA init, before any model) + ``max_memory_reserved`` (nvidia-smi adds the memory outside torch's allocator,
  which the device total counts: :mod:`lora_kit.memory.device`);
- the closed-form reserved of :mod:`lora_kit.memory.device` from the estimate's peak vs ``max_memory_reserved``.

Per config it also replays ``simulate``'s allocation sequence through PyTorch's caching allocator
(:mod:`lora_kit.memory.allocator`, via ``benchmarks/cuda_h200.py``) for both allocator settings and compares the one
this process runs with (``env.allocator``: the variable torch reads, see :mod:`lora_kit.run.alloc_conf`) with
``max_memory_reserved``; ``env.cuda_memory`` is ``mem_get_info``'s total (the capacity) and free. For the other
setting run it again in a fresh process, e.g. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` with
another ``--out``; configs run one after another in one process (``empty_cache`` between them), the replay starts
empty for each.

Where a peak misses, two figures per config say where: ``measured_before`` (``memory_allocated`` as the measured step
starts) beside ``simulate_before`` (what simulate holds then), and ``peak_live``: the allocator's history of the
measured step (``torch.cuda.memory._record_memory_history``, Python stacks; ``--no-snapshot`` turns it off), summed
at its peak by the library line that allocated each block (with it a third step runs: the second, untraced, is
timed). Per config on a GPU also: ``measured_step_seconds`` beside the time model's ``model_step_seconds`` for that
card (:func:`lora_kit.plan.timing.step_time`, issue 35's figure), and ``sdpa_predicted`` / ``sdpa_observed``: the
attention kernel the kit names and the one this torch picks for the same call.

Prints one table and writes JSON (atomically) to ``--out``. Designed to finish in < 8 minutes on
one H200. CI never needs it. Without CUDA it says so and exits 0, unless ``--cpu-dry-run``: then
two tiny configurations run on the CPU (tracked real step) so the script itself is tested.

    python benchmarks/gpu_validate.py --out benchmarks/results/gpu_validate.json
    python benchmarks/gpu_validate.py --cpu-dry-run --out /tmp/gpu_validate_dry.json
    python benchmarks/gpu_validate.py --cpu-matrix --out /tmp/sim_vs_cpu.json   # 18 tiny CPU configs
    python benchmarks/gpu_validate.py --only "4L,qlora" --out /tmp/q.json   # the 65B step first, then every QLoRA row
    python benchmarks/gpu_validate.py --plan-only 9.0 --out /tmp/plan.json   # no GPU: the GPU configs but their steps
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (label, model, settings): random-init weights, so any catalog model runs without a download
GPU_CONFIGS = [
    ("llama1b lora sdpa s2048", "llama-3.2-1b", dict(method="lora", seq_len=2048)),
    ("llama1b lora ckpt s4096 b2", "llama-3.2-1b", dict(method="lora", seq_len=4096, batch_size=2,
                                                        gradient_checkpointing=True)),
    ("llama1b lora eager s1024", "llama-3.2-1b", dict(method="lora", seq_len=1024, attn_implementation="eager")),
    ("llama1b lora r64 qv s2048 b4", "llama-3.2-1b", dict(method="lora", seq_len=2048, batch_size=4, lora_rank=64,
                                                          lora_targets=["q_proj", "v_proj"])),
    ("llama1b lora dropout0.1 s2048", "llama-3.2-1b", dict(method="lora", seq_len=2048, lora_dropout=0.1)),  # the
    # fused dropout's 1-byte mask per adapter input (lora_kit.training.FusedDropout), as the plan counts it
    ("llama1b qlora s2048", "llama-3.2-1b", dict(method="qlora", seq_len=2048)),
    ("llama1b qlora ckpt s4096", "llama-3.2-1b", dict(method="qlora", seq_len=4096, gradient_checkpointing=True)),
    ("llama1b qlora nodq paged8 s2048", "llama-3.2-1b", dict(method="qlora", seq_len=2048, double_quant=False,
                                                             optimizer="paged_adamw_8bit")),
    ("llama1b full s1024", "llama-3.2-1b", dict(method="full", seq_len=1024)),
    ("llama1b full adamw8 ckpt s2048", "llama-3.2-1b", dict(method="full", seq_len=2048, optimizer="adamw_8bit",
                                                            gradient_checkpointing=True)),
    ("llama1b full autocast fp32 s1024", "llama-3.2-1b", dict(method="full", dtype="float32", autocast=True,
                                                              seq_len=1024)),
    ("qwen0.5b lora s4096 b2", "qwen2.5-0.5b", dict(method="lora", seq_len=4096, batch_size=2)),
    ("qwen0.5b qlora ckpt s8192", "qwen2.5-0.5b", dict(method="qlora", seq_len=8192, gradient_checkpointing=True)),
    ("qwen1.5b lora sgd s2048 b2", "qwen2.5-1.5b", dict(method="lora", seq_len=2048, batch_size=2, optimizer="sgd")),
    ("smollm360m full s2048 b4", "smollm2-360m", dict(method="full", seq_len=2048, batch_size=4)),
    ("smollm360m lora adafactor s1024 b8", "smollm2-360m", dict(method="lora", seq_len=1024, batch_size=8,
                                                                optimizer="adafactor")),
    ("gemma2-2b lora eager s1024", "gemma-2-2b", dict(method="lora", seq_len=1024, attn_implementation="eager")),
    ("gemma2-2b qlora eager ckpt s2048", "gemma-2-2b", dict(method="qlora", seq_len=2048, attn_implementation="eager",
                                                            gradient_checkpointing=True)),
    ("phi3-mini qlora s1024", "phi-3-mini", dict(method="qlora", seq_len=1024)),
    ("pythia1b lora s2048", "pythia-1b", dict(method="lora", seq_len=2048)),
    ("llama3b lora ckpt s2048 b2", "llama-3.2-3b", dict(method="lora", seq_len=2048, batch_size=2,
                                                        gradient_checkpointing=True)),
]


def cut_gpu_configs():
    """Catalog entries cut to a few layers (every block at its real widths). Mixture-of-experts, 2 layers: Mixtral's
    grouped_mm experts and DeepSeek-V2-Lite's multi-head latent attention, whose q/k heads (192) differ from v's
    (128): the CPU runs SDPA's math path (what estimate / simulate count); the row records the kernel CUDA picks
    (``sdpa_observed``, beside the kit's ``sdpa_predicted``: :func:`cuda_extras`). And the QLoRA paper's step on the LLaMA-65B config cut to 4 layers (512 tokens, r 64, paged
    32-bit AdamW): large 4-bit weights against few tokens, where the bf16 weight bitsandbytes' matmul dequantises
    inside itself can top the step (``kernel_extra``)."""
    from transformers import AutoConfig

    from lora_kit.memory.specs import catalog_config
    out = []
    for label, name, layers, kw in (
            ("deepseek-v2-lite 2L lora s2048 (MLA)", "deepseek-v2-lite", 2,
             dict(method="lora", seq_len=2048, gradient_checkpointing=False)),
            ("deepseek-v2-lite 2L lora ckpt s4096 (MLA)", "deepseek-v2-lite", 2,
             dict(method="lora", seq_len=4096, gradient_checkpointing=True)),
            ("mixtral 2L lora attn s2048", "mixtral-8x7b", 2,
             dict(method="lora", seq_len=2048, lora_targets=["q_proj", "v_proj"])),
            ("llama-65b 4L qlora paper step s512", "llama-65b", 4,
             dict(method="qlora", seq_len=512, lora_rank=64, lora_alpha=16, gradient_checkpointing=True,
                  optimizer="paged_adamw_32bit"))):
        c = {**catalog_config(name), "num_hidden_layers": layers}
        c = {k: v for k, v in c.items() if k not in ("hub_id", "params")}
        cfg = AutoConfig.for_model(c.pop("model_type"), **c)
        cfg.name_or_path = f"{name}[{layers} layers]"
        out.append((label, cfg, kw))
    return out


def tiny_configs(matrix: bool = False):
    """Two tiny CPU configs (the dry run), or with ``matrix`` a wider set: simulate vs a real CPU step."""
    from transformers import (Gemma2Config, GPTNeoXConfig, LlamaConfig, Phi3Config, Qwen2Config)
    small = dict(vocab_size=192, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    llama = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False, **small)
    qwen = Qwen2Config(num_hidden_layers=1, num_key_value_heads=2, tie_word_embeddings=True, **small)
    out = [("tiny-llama lora", llama, dict(method="lora", dtype="float32", seq_len=32, batch_size=2)),
           ("tiny-qwen2 qlora ckpt", qwen, dict(method="qlora", dtype="float32", seq_len=32, batch_size=2,
                                                gradient_checkpointing=True))]
    if not matrix:
        return out
    wide = LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False,
                       **{**small, "intermediate_size": 2048})
    b = dict(seq_len=48, batch_size=2)
    return out + [
        ("tiny-llama lora bf16 ckpt", llama, dict(method="lora", dtype="bfloat16", gradient_checkpointing=True, **b)),
        ("tiny-llama qlora bf16", llama, dict(method="qlora", dtype="bfloat16", **b)),
        ("tiny-llama qlora bf16 ckpt nodq", llama, dict(method="qlora", dtype="bfloat16", double_quant=False,
                                                        gradient_checkpointing=True, **b)),
        ("tiny-llama full bf16", llama, dict(method="full", dtype="bfloat16", **b)),
        ("tiny-llama full fp32 autocast", llama, dict(method="full", dtype="float32", autocast=True, **b)),
        ("tiny-llama lora eager ckpt b3", llama, dict(method="lora", dtype="float32", attn_implementation="eager",
                                                      gradient_checkpointing=True, seq_len=48, batch_size=3)),
        ("tiny-llama lora adafactor", llama, dict(method="lora", dtype="float32", optimizer="adafactor", **b)),
        ("tiny-llama full adamw_8bit bf16", llama, dict(method="full", dtype="bfloat16", optimizer="adamw_8bit", **b)),
        ("tiny-llama-wide qlora paged8 r64", wide, dict(method="qlora", dtype="float32", optimizer="paged_adamw_8bit",
                                                        lora_rank=64, lora_targets=["gate_proj", "up_proj"], **b)),
        ("tiny-qwen2 lora sgd", qwen, dict(method="lora", dtype="bfloat16", optimizer="sgd", **b)),
        ("tiny-gemma2 lora eager", Gemma2Config(num_hidden_layers=1, num_key_value_heads=2, head_dim=32, **small),
         dict(method="lora", dtype="float32", attn_implementation="eager", lora_rank=8, **b)),
        ("tiny-phi3 qlora bf16", Phi3Config(num_hidden_layers=1, num_key_value_heads=4, pad_token_id=0, **small),
         dict(method="qlora", dtype="bfloat16", lora_rank=8, **b)),
        ("tiny-gptneox lora", GPTNeoXConfig(num_hidden_layers=1, **small),
         dict(method="lora", dtype="float32", lora_rank=8, **b)),
        # padded batches (the collator's mask): GQA off, K/V repeated, mask cast per layer
        ("tiny-llama lora bf16 padded", llama, dict(method="lora", dtype="bfloat16", padding="max_length", **b)),
        ("tiny-llama lora bf16 ckpt padded longest", llama, dict(method="lora", dtype="bfloat16", padding="longest",
                                                                 gradient_checkpointing=True, **b)),
        ("tiny-gptneox lora bf16 qkv rotary0.25 padded", GPTNeoXConfig(num_hidden_layers=2, rotary_pct=0.25, **small),
         dict(method="lora", dtype="bfloat16", lora_rank=8, lora_targets=["query_key_value"], padding="max_length",
              **b)),
    ]


def _estimate(model, kw):
    try:
        from lora_kit.memory.estimate import estimate
    except ImportError as e:  # written by another part of the kit; the table says when it is missing
        return None, f"estimate unavailable: {e}"
    try:
        r = estimate(model, **kw)
        return r, ""
    except Exception as e:  # noqa: BLE001 - record and continue: one failure must not hide the rest
        return None, f"estimate failed: {type(e).__name__}: {e}"


def _closed_form_reserved(model, kw, est) -> int:
    """torch's reserved as ``lora_kit.memory.device`` puts it in closed form from the estimate's peak (the reserved
    term of the device total), beside ``max_memory_reserved``."""
    from lora_kit.memory.device import device_kwargs, reserved_bytes
    from lora_kit.memory.specs import model_spec
    from lora_kit.settings import as_step
    st = as_step(None, **kw)
    d = device_kwargs(model_spec(model), st)
    d.pop("num_gpus")
    return int(reserved_bytes(est.peak_allocated_bytes, **d))


def in_effect():
    from lora_kit.run.alloc_conf import in_effect as allocator_in_effect
    return allocator_in_effect()


def _pct(pred, real):
    return None if pred is None or not real else 100.0 * (pred - real) / real


def context_bytes():
    """Device memory used after CUDA init and one tiny allocation: context (+ other processes)."""
    import torch
    torch.ones(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_one(label, model, kw, device, ctx_bytes, snapshot_dir=None, plan_cc=None):
    """One config's row. ``plan_cc`` (``--plan-only``): no real step; simulate traced as on CUDA and the CUDA extras
    for a device of that compute capability, so everything but the measurement runs on a CPU."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_h200 import replayed, simulate_with_events
    row = {"label": label, "model": model if isinstance(model, str) else type(model).__name__, "settings": kw}
    est, why = _estimate(model, kw)
    row["estimate_peak"] = est.peak_allocated_bytes if est else None
    row["estimate_total"] = est.device_total_bytes if est else None
    row["closed_form_reserved"] = _closed_form_reserved(model, kw, est) if est else None
    row["notes"] = [why] if why else []
    t0, sim = time.perf_counter(), None
    try:
        sim, events = simulate_with_events(model, trace=device == "cuda" or plan_cc is not None, **kw)
        from cuda_h200 import EventTracker
        n_pre, live = EventTracker.last.device_events()[1], {}
        for e in events[:n_pre]:  # what simulate holds as the step starts (beside measured_before on the GPU)
            if e[0] == "alloc":
                live[e[1]] = e[2]
            else:
                live.pop(e[1], None)
        row["simulate_before"] = sum(live.values())
        row.update(simulate_peak=sim.peak_allocated_bytes, simulate_total=sim.device_total_bytes,
                   simulate_phase=sim.phase, simulate_seconds=round(time.perf_counter() - t0, 2),
                   replay=replayed(events))  # reserved of PyTorch's caching allocator over simulate's sequence
    except Exception as e:  # noqa: BLE001
        row.update(simulate_peak=None, simulate_total=None)
        row["notes"].append(f"simulate failed: {type(e).__name__}: {e}")
    if plan_cc is None:
        _measure(row, model, kw, device, ctx_bytes, snapshot_dir)
    else:
        row.update(measured_peak=None, measured_reserved=None, measured_total=None)
    row["estimate_err_pct"] = _pct(row["estimate_peak"], row["measured_peak"])
    if (device == "cuda" or plan_cc is not None) and est:
        major, minor = torch.cuda.get_device_capability() if plan_cc is None else (0, 0)
        try:
            cuda_extras(row, model, kw, est, sim, plan_cc or major + minor / 10)
        except Exception as e:  # noqa: BLE001 - recorded: the measured row and the configs after it still count
            row["notes"].append(f"CUDA extras failed: {type(e).__name__}: {str(e)[:300]}")
    row["simulate_err_pct"] = _pct(row.get("simulate_peak"), row["measured_peak"])
    row["estimate_total_err_pct"] = _pct(row["estimate_total"], row.get("measured_total"))
    row["closed_form_reserved_err_pct"] = _pct(row.get("closed_form_reserved"), row.get("measured_reserved"))
    row["simulate_total_err_pct"] = _pct(row.get("simulate_total"), row.get("measured_total"))
    if row.get("replay") and row.get("measured_reserved") is not None:  # on the setting this process runs with
        setting = "expandable" if in_effect()["expandable_segments"] else "default"
        row["replay_reserved_err_pct"] = _pct(row["replay"][setting]["max_reserved"], row["measured_reserved"])
    return row


def _measure(row, model, kw, device, ctx_bytes, snapshot_dir):
    """The real step's figures into ``row`` (two steps; with ``snapshot_dir``, what is live at its peak)."""
    import torch

    from lora_kit.memory.measure import measure_config
    t0 = time.perf_counter()
    try:
        snap = None if snapshot_dir is None else Path(snapshot_dir) / "snapshot.pickle"
        # with a snapshot, a third step: the second, untraced, is the one timed
        real = measure_config(model, device=device, snapshot=snap, steps=3 if snap else 2, **kw)
        row["measured_before"] = real.allocated_before_bytes
        if device == "cuda":  # seconds of a steady-state step beside the time model's for this GPU
            row["measured_step_seconds"] = real.earlier_step_seconds[-1] if snap else real.wall_seconds
            row.update(modelled_time(model, kw, torch.cuda.get_device_name()))
        if snap is not None:  # the step's own blocks live at its peak, by where they were allocated
            import pickle
            with open(snap, "rb") as f:
                row["peak_live"] = peak_live(pickle.load(f), before=real.allocated_before_bytes or 0)
            snap.unlink()
        row.update(measured_peak=real.peak_allocated_bytes, measured_reserved=real.reserved_bytes,
                   measured_total=(ctx_bytes + real.reserved_bytes) if real.reserved_bytes is not None else None,
                   measure_seconds=round(time.perf_counter() - t0, 2), losses=real.losses)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded, not hidden
        row.update(measured_peak=None, measured_reserved=None, measured_total=None)
        row["notes"].append(f"measure failed: {type(e).__name__}: {str(e)[:300]}")
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def modelled_time(model, kw: dict, device_name: str) -> dict:
    """The time model's step (lora_kit.plan.timing.step_time) on the catalog row of the GPU torch calls
    ``device_name``, or why not."""
    from lora_kit.plan.gpus import catalog_name, get_gpu
    from lora_kit.plan.timing import step_time
    name = catalog_name(device_name)
    if name is None:
        return {"model_step_note": f"{device_name} is not in the GPU catalog"}
    try:
        t = step_time(model, get_gpu(name), **kw)
    except Exception as e:  # noqa: BLE001 - recorded: the memory figures of the row still count
        return {"model_step_note": f"step_time failed: {type(e).__name__}: {str(e)[:200]}"}
    return {"model_step_seconds": t["step_seconds"], "model_gpu": name, "model_attention_kernel": t["attention_kernel"],
            "model_step_parts": t["parts_seconds"]}


def cuda_extras(row: dict, model, kw: dict, est, sim, cc: float) -> None:
    """What ``max_memory_allocated`` shows beside the estimate (the step's tensors + two cuBLAS workspaces), and, on
    the simulated step, CUDA's math-kernel fallback (fp32 q/k/v with grouped K/V) and the weights bitsandbytes' 4-bit
    matmul dequantises inside itself, for a device of compute capability ``cc``."""
    import torch

    from lora_kit.memory.device import cuda_allocated_bytes
    row["estimate_cuda_allocated"] = cuda_allocated_bytes(est.peak_allocated_bytes, cc, torch.__version__,
                                                          os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    row["estimate_cuda_allocated_err_pct"] = _pct(row["estimate_cuda_allocated"], row["measured_peak"])
    if sim is not None:
        from lora_kit.memory.cuda_kernels import kernel_extra, math_kernel_extra
        row["math_kernel_extra"] = math_kernel_extra(model, sim=sim, compute_capability=cc, **kw)
        row["kernel_extra"] = kernel_extra(model, sim=sim, compute_capability=cc, **kw)
    if kw.get("attn_implementation", "sdpa") == "sdpa":  # the SDPA backend the kit names for this step's call, and
        # on a GPU the one this torch picks for the same shapes, dtype and flags (torch._fused_sdp_choice)
        from lora_kit.memory.cuda_kernels import observed_backend, sdpa_backend, sdpa_call
        call = sdpa_call(model, **kw)
        row["sdpa_predicted"] = sdpa_backend(call, torch.__version__, cc).backend
        if torch.cuda.is_available():
            row["sdpa_observed"] = observed_backend(call)


LIBRARIES = ("bitsandbytes", "peft", "transformers", "lora_kit", "torch/nn/functional", "torch/utils/checkpoint")


def _where(frames: list) -> str:
    """The innermost frame of an allocation in one of :data:`LIBRARIES` (else the innermost frame), as
    path:line name."""
    frames = frames or []
    f = next((f for f in frames if any(lib in f.get("filename", "") for lib in LIBRARIES)), frames[0] if frames else {})
    name = f.get("filename", "?")
    name = name[name.rfind("site-packages/") + 14:] if "site-packages/" in name else name
    return f"{name}:{f.get('line', '?')} {f.get('name', '')}".strip()


def peak_live(snapshot: dict, before: int = 0, top: int = 20) -> dict:
    """What is live when a recorded step's allocated bytes peak, from ``torch.cuda.memory._snapshot()``'s trace
    (``device_traces``: ``alloc`` adds a block, ``free_requested`` takes it away, as the allocated counter does).
    ``before``: bytes allocated before recording began (in no trace entry). Returns the peak, the step's own bytes
    live then grouped by where they were allocated (largest first, ``top`` of them) and its largest blocks."""
    live, total, best, at = {}, 0, -1, {}
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e.get("action") == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > best:
                    best, at = total, dict(live)
            elif e.get("action") == "free_requested" and e.get("addr") in live:
                total -= live.pop(e["addr"])["size"]
    groups: dict = {}
    for e in at.values():
        g = groups.setdefault(_where(e.get("frames")), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_allocated": before + max(best, 0), "before": before, "step_live_at_peak": max(best, 0),
            "by_site": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in ranked[:top]],
            "largest": [{"bytes": e["size"], "where": _where(e.get("frames"))}
                        for e in sorted(at.values(), key=lambda e: -e["size"])[:10]]}


def select_configs(configs: list, only: str) -> list:
    """The configs whose label contains ``only``; for a comma-separated ``only``, those matching any part, ordered by
    the first part each matches (then as listed), so a list is also the order in which ``--budget-s`` spends its time.
    An empty ``only`` keeps every config in its order; empty parts of a list are ignored."""
    parts = [p.strip() for p in only.split(",") if p.strip()] if "," in only else [only]
    out, taken = [], set()
    for part in parts:
        for c in configs:
            if part in c[0] and c[0] not in taken:
                out.append(c)
                taken.add(c[0])
    return out


UNIT = ["GiB", 2**30]  # the CPU runs switch to MiB (tiny models)


def _fmt(b):
    return "-" if b is None else f"{b / UNIT[1]:8.3f}"


def _fp(p):
    return "-" if p is None else f"{p:+6.2f}%"


def print_table(rows):
    print(f"{'config':<36} {'measured':>9} {'simulate':>9} {'err':>8} {'estimate':>9} {'err':>8} | "
          f"{'dev.total':>9} {'sim.tot':>8} {'est.tot':>8}   ({UNIT[0]})")
    for r in rows:
        print(f"{r['label']:<36} {_fmt(r['measured_peak'])} {_fmt(r.get('simulate_peak'))} "
              f"{_fp(r['simulate_err_pct']):>8} {_fmt(r['estimate_peak'])} {_fp(r['estimate_err_pct']):>8} | "
              f"{_fmt(r.get('measured_total'))} {_fp(r['simulate_total_err_pct']):>8} "
              f"{_fp(r['estimate_total_err_pct']):>8}")
        for n in r["notes"]:
            print(f"    note: {n}")
    import statistics
    for key in ("simulate_err_pct", "estimate_err_pct", "estimate_cuda_allocated_err_pct", "simulate_total_err_pct",
                "estimate_total_err_pct", "replay_reserved_err_pct"):
        errs = [abs(r[key]) for r in rows if r.get(key) is not None]
        if errs:
            print(f"{key:<32} n={len(errs):2d} median |err| {statistics.median(errs):6.2f}%  max {max(errs):6.2f}%")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Real GPU steps vs lora_kit.memory.estimate and simulate.")
    ap.add_argument("--out", default="benchmarks/results/gpu_validate.json", help="JSON results path")
    ap.add_argument("--cpu-dry-run", action="store_true", help="no GPU: two tiny configs on the CPU (tests the script)")
    ap.add_argument("--cpu-matrix", action="store_true",
                    help="no GPU: 18 tiny configs on the CPU (simulate vs a real tracked CPU step)")
    ap.add_argument("--plan-only", type=float, default=None, metavar="CC",
                    help="no GPU: the GPU configs without their real step (simulate traced, replay, estimate, the "
                         "CUDA extras for compute capability CC, e.g. 9.0), to check the script before a GPU session")
    ap.add_argument("--only", default="",
                    help="run configs whose label contains this text; a comma-separated list runs those matching any, "
                         "in the list's order (under --budget-s the first ones run first)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new configs after this many seconds")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="CUDA: do not record the allocator's history of each measured step (peak_live per row)")
    args = ap.parse_args(argv)
    import torch

    from lora_kit.check.stack import cuda_memory
    from lora_kit.results import write_json_atomic
    if args.plan_only is not None:
        device, configs, ctx = "cpu", GPU_CONFIGS + cut_gpu_configs(), 0
    elif args.cpu_dry_run or args.cpu_matrix:
        device, configs, ctx = "cpu", tiny_configs(matrix=args.cpu_matrix), 0
        UNIT[:] = ["MiB", 2**20]
    elif not torch.cuda.is_available():
        print("gpu_validate: CUDA is not available on this machine; nothing measured. Run it on a CUDA GPU, "
              "or pass --cpu-dry-run to exercise the script on tiny CPU configs.")
        return 0
    else:
        device, configs, ctx = "cuda", GPU_CONFIGS + cut_gpu_configs(), context_bytes()
    configs = select_configs(configs, args.only)
    t_start = time.perf_counter()
    rows = []
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "context_bytes_measured": ctx, "allocator": in_effect(),
           "cuda_memory": cuda_memory() if device == "cuda" else None}  # mem_get_info: total = capacity
    try:
        import bitsandbytes
        import transformers
        env.update(transformers=transformers.__version__, bitsandbytes=bitsandbytes.__version__)
    except ImportError:
        pass
    print(f"gpu_validate on {env['device']}; CUDA context + other processes: {ctx / 2**20:.0f} MiB", flush=True)
    for label, model, kw in configs:
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"label": label, "skipped": f"time budget {args.budget_s:.0f} s spent"})
            print(f"skip {label}: time budget spent", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            row = run_one(label, model, kw, device, ctx,
                          snapshot_dir=tmp if device == "cuda" and not args.no_snapshot else None,
                          plan_cc=args.plan_only)
        rows.append(row)
        print(f"{label}: measured {_fmt(row['measured_peak'])} {UNIT[0]} simulate {_fp(row['simulate_err_pct'])} "
              f"estimate {_fp(row['estimate_err_pct'])} ({time.perf_counter() - t_start:.0f} s)", flush=True)
        write_json_atomic(args.out, {"env": env, "rows": rows})
    done = [r for r in rows if "skipped" not in r]
    print_table(done)
    print(f"total {time.perf_counter() - t_start:.0f} s; JSON: {args.out}")
    write_json_atomic(args.out, {"env": env, "rows": rows, "seconds": time.perf_counter() - t_start})
    return 0


if __name__ == "__main__":
    sys.exit(main())
