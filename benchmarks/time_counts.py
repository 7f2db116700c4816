"""What the step-time model counts, against the operators a real step runs: FLOPs by dtype, element-wise bytes.

The time model (:mod:`lora_kit.plan.timing`) prices a step from counts it derives in closed form: each matmul's
FLOPs in the dtype it runs in (16-bit on tensor cores, fp32 on CUDA cores) and the bytes every element-wise kernel
moves (norms, rotary, residual adds, SiLU x up, LoRA's casts, scaling and adds, QLoRA's casts and peft's clone,
the loss). This benchmark runs the real step (transformers, peft, bitsandbytes; random init, CPU) under a
``TorchDispatchMode`` that sees every operator eager PyTorch dispatches, and sets the model's counts
(``device_parts(...)["counts"]``) beside what the operators do, per stage (forward; checkpointing's recompute;
backward):

- **FLOPs** of ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` and bitsandbytes' 4-bit matmul, keyed by the dtype of
  their input (what decides the tensor-core or CUDA-core peak);
- **bytes** of every other operator that computes (its tensor inputs read, its outputs written; a view moves
  nothing, ``copy_`` reads its source and writes its destination, ``embedding`` reads the rows it
  gathers). Attention (SDPA's fused kernel: CUDA picks
  another one, priced apart) and bitsandbytes' dequantisation (priced by ``dequant_factor``) are left out of
  both sides.

Eager PyTorch launches one kernel per operator on CUDA as on the CPU, so these bytes are what the GPU's
element-wise kernels move (before the L2 cache keeps some of it on chip); the CPU-only difference the kit knows
of (peft's no-argument ``torch.is_autocast_enabled()``) is emulated by ``lora_kit.training.autocast_query``.
Optimizer traffic is not counted here (``_optimizer_seconds`` prices it by bytes per parameter).

    .venv/bin/python benchmarks/time_counts.py            # real 7B-wide block (1 layer), ~1-2 min on 2 cores
    .venv/bin/python benchmarks/time_counts.py --small    # the test's small config, seconds
    .venv/bin/python benchmarks/time_counts.py --families # other blocks (Qwen3, OLMo 2, Gemma 3, GPT-NeoX), small,
                                                          # written to results/time_counts_families.json
"""
from __future__ import annotations

import argparse
import collections
import sys
from datetime import date
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

OUT = Path(__file__).parent / "results" / "time_counts.json"
OUT_FAMILIES = OUT.with_name("time_counts_families.json")
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm"}
NO_BYTES = {"detach", "alias", "lift_fresh", "_unsafe_view", "view", "t", "_reshape_alias", "empty", "empty_like",
            "new_empty", "new_empty_strided", "empty_strided", "set_", "resize_"}
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
               "vocab_size", "head_dim")
GRID = [dict(method="lora"), dict(method="lora", autocast=True), dict(method="lora", gradient_checkpointing=False),
        dict(method="lora", lora_targets=["q_proj", "v_proj"]), dict(method="qlora"),
        dict(method="qlora", autocast=True), dict(method="qlora", qlora_prepare="none"), dict(method="full"),
        dict(method="full", gradient_checkpointing=False), dict(method="full", autocast=True),
        dict(method="lora", lora_dropout=0.1), dict(method="qlora", autocast=True, lora_dropout=0.1),
        dict(method="qlora", dtype="float32"), dict(method="qlora", dtype="float32", autocast=True)]


def _nbytes(t) -> int:
    """Bytes an operator reads or writes of ``t``: its elements, at most its storage (a broadcast read)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return n


class Census(TorchDispatchMode):
    """FLOPs by (stage, input dtype) and bytes by (stage, operator) of every operator dispatched inside it.
    ``stage`` is set by the caller ("forward" / "backward"); inside backward, an operator run with grad mode on is
    checkpointing's recompute (the autograd engine runs backward functions with it off; the recompute turns it
    on), counted as "recompute"."""

    def __init__(self):
        super().__init__()
        self.stage = "forward"
        self.flops = collections.Counter()
        self.bytes = collections.Counter()
        self.left_out = collections.Counter()

    def _stage(self) -> str:
        return "recompute" if self.stage == "backward" and torch.is_grad_enabled() else self.stage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, _, name = func._schema.name.partition("::")
        if func.is_view or name in NO_BYTES:
            return out
        stage = self._stage()
        if name in MATMULS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm", "addbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops[(stage, str(a.dtype).removeprefix("torch."))] += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
            return out
        if name == "_grouped_mm":  # experts: (S, K) x (E, K, N) by offsets, or (K, S) x (S, N) per group (weight grad)
            a, b = args[0], args[1]
            f = 2 * a.shape[0] * a.shape[1] * b.shape[-1]
            self.flops[(stage, str(a.dtype).removeprefix("torch."))] += f
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        if ns == "bitsandbytes":
            if name == "gemm_4bit":  # (A, B, shapeB, ...): A @ dequant(B).t(), B holding shapeB = (out, in)
                a, shape = args[0], args[2]
                self.flops[(stage, str(a.dtype).removeprefix("torch."))] += 2 * (a.numel() // a.shape[-1]) * a.shape[-1] * shape[0]
            self.left_out[f"dequant:{name}"] += moved
            return out
        if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
            self.left_out[f"attention:{name}"] += moved
            return out
        if name == "copy_":
            moved = _nbytes(args[0]) + _nbytes(args[1])
        elif name == "embedding":  # reads the rows it gathers, not the whole table
            moved = 2 * _nbytes(out) + _nbytes(args[1])
        self.bytes[(stage, name)] += moved
        return out


def census(cfg, step) -> Census:
    """One real micro-step (forward and backward, no optimizer) of a random-init model of ``cfg`` for ``step``
    (a ``Step``), counted by :class:`Census`."""
    from lora_kit.memory.measure import build_real_model
    from lora_kit.training import autocast_context, autocast_query
    net, _opt, batch = build_real_model(cfg, step)
    c = Census()
    with c, autocast_query():
        with autocast_context(step.autocast, step.dtype, "cpu"):
            loss = net(**batch).loss
        c.stage = "backward"
        loss.backward()
    return c


def model_counts(cfg, step) -> dict:
    """The time model's counts for one micro-step, in the census' terms (attention and dequantisation left out)."""
    from lora_kit.plan.gpus import get_gpu
    from lora_kit.plan.timing import device_parts
    counts = device_parts(cfg, get_gpu("H200"), step)["counts"]
    flops, moved = collections.Counter(), collections.Counter()
    for key, v in counts["flops"].items():
        part, cls = key.split("/")
        if part != "attention":
            flops["float32" if cls == "float32" else "16-bit"] += v
    for key, v in counts["bytes"].items():
        stage, part = key.split("/")
        if part not in ("attention", "dequant"):
            moved[stage] += v
    return {"flops": dict(flops), "bytes": dict(moved)}


def compare(cfg, step) -> dict:
    """One row: the census and the model's counts side by side, with their ratios (model / real)."""
    c = census(cfg, step)
    real_flops = collections.Counter()
    for (_stage, dtype), v in c.flops.items():
        real_flops["float32" if dtype == "float32" else "16-bit"] += v
    real_bytes = collections.Counter()
    for (stage, _op), v in c.bytes.items():
        real_bytes[stage] += v
    m = model_counts(cfg, step)
    row = {"settings": step.to_dict(),
           "tokens": step.batch_size * step.seq_len,
           "real": {"flops": dict(real_flops), "bytes": dict(real_bytes)}, "model": m,
           "top_operators": [[f"{s}:{op}", v] for (s, op), v in c.bytes.most_common(12)],
           "left_out": dict(c.left_out)}
    rb, mb = sum(real_bytes.values()), sum(m["bytes"].values())
    row["bytes_ratio"] = mb / rb if rb else None
    row["flops_ratio"] = {k: (m["flops"].get(k, 0.0) / v if v else None) for k, v in real_flops.items()}
    for k, v in m["flops"].items():
        if v and k not in real_flops:
            row["flops_ratio"][k] = float("inf")
    row["stage_bytes_ratio"] = {s: (m["bytes"].get(s, 0.0) / v if v else None) for s, v in real_bytes.items()}
    return row


def config(small: bool):
    """Llama-family configs: ``small`` the test's (seconds); else a block of Llama-3.1-8B's widths (one layer,
    GQA 32 / 8 heads, a 32k vocabulary so the CPU can hold the logits)."""
    from transformers import LlamaConfig
    if small:
        return LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=2048, max_position_embeddings=2048, head_dim=32)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       num_hidden_layers=1, vocab_size=32000, max_position_embeddings=4096)


FAMILIES = {"qwen3": {}, "olmo2": {}, "gemma3_text": {}, "gpt_neox": {"num_key_value_heads": None, "head_dim": None},
            "mistral": {}}


def family_config(model_type: str):
    """The small config's shapes in another family's block (``FAMILIES``: keys it does not take dropped)."""
    from transformers import AutoConfig
    kw = {k: v for k, v in {**config(True).to_dict(), **FAMILIES[model_type]}.items()
          if k in CONFIG_KEYS and v is not None}
    return AutoConfig.for_model(model_type, **kw)


def families() -> list[dict]:
    """model / real for the blocks of :data:`FAMILIES` (LoRA and full fine-tuning, small config), printed."""
    from lora_kit.settings import as_step
    print(f"{'family, method':30s} {'16-bit FLOPs':>13s} {'fp32 FLOPs':>11s} {'bytes':>6s}  (model / real)")
    rows = []
    for mt in FAMILIES:
        for method in ("lora", "full"):
            r = compare(family_config(mt), as_step(None, seq_len=128, batch_size=2, gradient_checkpointing=True,
                                                   method=method))
            rows.append({"family": mt, **r})
            fr = r["flops_ratio"]
            print(f"{mt + ', ' + method:30s} {fr.get('16-bit') or 0:13.3f} {fr.get('float32') or 0:11.3f} "
                  f"{r['bytes_ratio']:6.3f}  " + " ".join(f"{s} {v:.3f}" for s, v in r["stage_bytes_ratio"].items()))
    return rows


def main(argv=None) -> int:
    from lora_kit.results import write_json_atomic
    from lora_kit.settings import as_step
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="the test's small config (seconds)")
    ap.add_argument("--families", action="store_true", help=f"other families' blocks on the small config ({OUT_FAMILIES})")
    ap.add_argument("--json", type=Path, default=None, help=f"write the rows (default {OUT} without --small)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    sys.path.insert(0, str(Path(__file__).parent))
    from calibrate_accuracy import machine
    if a.families:
        rows = families()
        out = a.json or OUT_FAMILIES
        write_json_atomic(out, {"_meta": {"date": date.today().isoformat(), "machine": machine(),
                                          "command": "python benchmarks/time_counts.py --families",
                                          "config": {k: v for k, v in config(True).to_dict().items() if k in CONFIG_KEYS},
                                          "shape": dict(seq_len=128, batch_size=2)}, "rows": rows})
        print(f"wrote {out}")
        return 0
    cfg = config(a.small)
    shape = dict(seq_len=128, batch_size=2) if a.small else dict(seq_len=512, batch_size=1)
    rows = []
    print(f"{'settings':58s} {'16-bit FLOPs':>13s} {'fp32 FLOPs':>11s} {'bytes':>6s}  (model / real)")
    for kw in GRID:
        st = as_step(None, **{**shape, "gradient_checkpointing": True, **kw})
        r = compare(cfg, st)
        rows.append(r)
        fr = r["flops_ratio"]
        label = ", ".join(f"{k}={v}" for k, v in kw.items())
        print(f"{label:58s} {fr.get('16-bit') or 0:13.3f} {fr.get('float32') or 0:11.3f} {r['bytes_ratio']:6.3f}  "
              + " ".join(f"{s} {v:.3f}" for s, v in r["stage_bytes_ratio"].items()))
    out = a.json or (None if a.small else OUT)
    if out:
        write_json_atomic(out, {"_meta": {"date": date.today().isoformat(), "machine": machine(),
                                          "command": "python benchmarks/time_counts.py",
                                          "config": {k: v for k, v in cfg.to_dict().items() if k in CONFIG_KEYS},
                                          "shape": shape}, "rows": rows})
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
