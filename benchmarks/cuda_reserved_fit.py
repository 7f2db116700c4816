"""The data the closed-form reserved term of :mod:`lora_kit.memory.device` is fitted on: allocator replays of
``simulate``'s steps across models, methods and shapes.

Per case: ``simulate``'s peak allocated bytes and its parts at the peak; what stays allocated all step (weights,
quantization constants, adapters, optimizer states: the *resident* bytes) and the rest (gradients and activations at
the peak: the *transient* bytes); the largest single allocation of the step; and the reserved bytes of PyTorch's
caching allocator replayed (:mod:`lora_kit.memory.allocator`, both settings) over the steady-state sequence
(``benchmarks/cuda_h200.py``: what was live before the step, then the step twice). QLoRA cases replay the load
too: ``prepare_model_for_kbit_training`` up-casts the 16-bit embedding and ``lm_head`` to fp32, so their 16-bit
blocks are freed into the cache before the first step (the blocks the H200 run shows after load).

Then the fit: the least-squares coefficients of the replays' reserved - peak (less QLoRA's cached embedding block)
on (largest allocation, peak, one layer's MLP activation as ``device_kwargs`` gives it), and
:func:`lora_kit.memory.device.reserved_bytes` against every replay (ratio closed form / replay, per setting),
printed and saved (``--score`` re-scores the saved replays without simulating again).

    python benchmarks/cuda_reserved_fit.py [--quick] [--score] [--out benchmarks/results/cuda_reserved_fit.json]
    python benchmarks/cuda_reserved_fit.py --at-capacity L40S   # the QLoRA paper step replayed within a card
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from calibrate_accuracy import machine  # noqa: E402
from cuda_h200 import EventTracker, simulate_with_events  # noqa: E402
from lora_kit.memory.allocator import OutOfMemory, replay  # noqa: E402
from lora_kit.memory.device import OUTSIDE_BYTES  # noqa: E402
from lora_kit.memory.fits import versions  # noqa: E402
from lora_kit.memory.specs import model_spec  # noqa: E402
from lora_kit.plan.gpus import get_gpu  # noqa: E402
from lora_kit.results import write_json_atomic  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "cuda_reserved_fit.json"
RESIDENT = ("weights", "quant_constants", "adapters", "optimizer_states")  # allocated all step
GIB = 2 ** 30

# (model, method, seq_len, batch_size, gradient checkpointing): small catalog models of five families, the three
# methods, short and long rows, with and without checkpointing
CASES = [(m, meth, S, B, ck)
         for m in ("smollm2-360m", "qwen2.5-0.5b", "llama-3.2-1b", "gemma-2-2b", "pythia-1b")
         for meth, S, B, ck in (("lora", 512, 4, False), ("lora", 2048, 1, True), ("lora", 2048, 4, True),
                                ("qlora", 2048, 1, True), ("qlora", 1024, 4, True), ("full", 1024, 2, False),
                                ("full", 2048, 2, True))]
CASES += [("mistral-7b", "lora", 4096, 1, True), ("mistral-7b", "qlora", 2048, 2, True),
          ("mistral-7b", "lora", 1024, 2, False)]
# long rows (8-32k tokens per micro-batch) of 7-9B models, where a decoder layer's own blocks (its MLP's activations:
# hundreds of MiB each) fragment the cache: the settings of published A100 runs (fms-acceleration: FlashAttention-2,
# packed rows, LoRA r 16 on q/k/v/o, QLoRA with autocast) and of the held-back H200 rows (settings only, from
# issue 34's text; their measured figures are not in this repository). A 6th field: settings beside the defaults.
FMS = {"attn_implementation": "flash_attention_2", "padding": "none", "lora_alpha": 16,
       "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
FMS_QLORA = {**FMS, "autocast": True, "qlora_prepare": "peft", "double_quant": True}
CASES += [("mistral-7b", "qlora", 4096, 4, True, FMS_QLORA), ("mistral-7b", "qlora", 4096, 8, True, FMS_QLORA),
          ("mistral-7b", "lora", 4096, 4, True, FMS), ("mistral-7b", "lora", 4096, 8, True, FMS),
          ("mistral-7b", "full", 4096, 4, True, FMS), ("llama-3.1-8b", "qlora", 4096, 2, True, FMS_QLORA),
          ("qwen2.5-7b", "qlora", 4096, 2, True, {"double_quant": True}), ("mistral-7b", "lora", 4096, 4, True),
          ("gemma-2-9b", "qlora", 2048, 1, True, {"double_quant": True}),
          ("llama-3.1-8b", "qlora", 4096, 4, True, {"double_quant": True, "optimizer": "paged_adamw_8bit"}),
          ("llama-3.2-3b", "full", 2048, 8, True)]
# the QLoRA paper's step on 65-70B models (512 tokens, r 64 on every linear, paged 32-bit AdamW): bitsandbytes'
# dequantised weights (336-448 MiB each) fragment the cache layer after layer
PAPER = {"lora_rank": 64, "lora_alpha": 16, "optimizer": "paged_adamw_32bit", "double_quant": True}
CASES += [("llama-65b", "qlora", 512, 1, True, PAPER), ("llama-2-70b", "qlora", 512, 1, True, PAPER)]
QUICK = [c for c in CASES if c[0] in ("qwen2.5-0.5b", "llama-3.2-1b")]


def load_prefix(model: str, method: str) -> tuple[list, list]:
    """QLoRA's load, as the allocator sees it: the 16-bit embedding and ``lm_head`` (one if tied) before the fp32
    copies ``prepare_model_for_kbit_training`` makes (allocated first, freed once those exist)."""
    if method != "qlora":
        return [], []
    spec = model_spec(model)
    n = 1 if spec.tied_embeddings else 2
    size = spec.vocab_size * spec.hidden_size * 2
    return [("alloc", ("load", i), size) for i in range(n)], [("free", ("load", i)) for i in range(n)]


def sequence(case) -> tuple:
    """(settings, simulate's result, the allocation sequence replayed, the largest allocation of the step)."""
    model, method, S, B, ck, *extra = case
    kw = dict(method=method, seq_len=S, batch_size=B, gradient_checkpointing=ck, dtype="bfloat16", optimizer="adamw")
    if method != "full":
        kw.update(lora_rank=16, lora_alpha=32, lora_targets="all-linear")
    kw.update({k: v for k, v in (extra[0] if extra else {}).items() if method != "full" or not k.startswith("lora")})
    if model_spec(model).model_type == "gemma2":
        kw["attn_implementation"] = "eager"  # transformers runs Gemma-2 with eager attention only
    sim, events = simulate_with_events(model, **kw)
    pre, post = load_prefix(model, method)
    n_live = EventTracker.last.device_events()[1]  # the allocations live before the step (weights, adapters,
    # optimizer states; paged ones are outside the allocator)
    seq = pre + events[:n_live] + post + events[n_live:]
    return kw, sim, seq, max(e[2] for e in events[n_live:] if e[0] == "alloc")


def at_capacity(gpu: str) -> None:
    """The QLoRA paper's step on LLaMA-65B / Llama-2-70B replayed with only ``gpu``'s CUDA capacity less the context
    and QLoRA's memory outside the allocator to reserve from (free-and-retry as torch does at an OOM)."""
    g = get_gpu(gpu)
    cap = int(g["cuda_capacity_bytes"]) - int(g["context_bytes"]) - OUTSIDE_BYTES["qlora"]
    for case in CASES[-2:]:
        _, sim, seq, _ = sequence(case)
        for name, exp in (("default", False), ("expandable", True)):
            try:
                st = replay(seq, capacity=cap, expandable_segments=exp)
                got = f"reserved {st.max_reserved / GIB:.2f} GiB, {st.num_alloc_retries} free-and-retry"
            except OutOfMemory as e:
                got = f"out of memory: {e}"
            print(f"{case[0]:<12} {name:<10} peak allocated {sim.peak_allocated_bytes / GIB:.2f} GiB; capacity "
                  f"{cap / GIB:.2f} GiB on the {gpu}: {got}", flush=True)


def one(case) -> dict:
    t0 = time.perf_counter()
    kw, sim, seq, largest = sequence(case)
    model = case[0]
    rep = {name: replay(seq, expandable_segments=exp).max_reserved for name, exp in (("default", False),
                                                                                       ("expandable", True))}
    bd = sim.breakdown
    resident = sum(bd[k] for k in RESIDENT)
    return {"model": model, "settings": kw, "peak_allocated": sim.peak_allocated_bytes, "breakdown": bd,
            "resident": resident, "transient": sim.peak_allocated_bytes - resident, "largest": largest,
            "replayed_reserved": rep, "events": len(seq), "seconds": round(time.perf_counter() - t0, 1)}


def scored(rows: list[dict]) -> dict:
    """The closed form (``lora_kit.memory.device.reserved_bytes`` with ``device_kwargs``, from ``simulate``'s peak)
    of each allocator setting against that setting's replay: the ratio per row and setting, and min / median / max.
    Also the least-squares fit of the replays' reserved - peak on (largest allocation, peak), the data the constants
    were rounded from."""
    from lora_kit.memory.device import device_kwargs, reserved_bytes
    from lora_kit.settings import as_step
    out = {}
    for r in rows:
        kw = device_kwargs(model_spec(r["model"]), as_step(None, **r["settings"]))
        r["layer"], r["embedding_bytes"] = kw["layer"], kw["embedding_bytes"]
        kw.pop("num_gpus")
        r["closed_form_reserved"] = {name: int(reserved_bytes(r["peak_allocated"], allocator=name, **kw))
                                     for name in ("default", "expandable")}
    for name in ("default", "expandable"):
        q = [r["closed_form_reserved"][name] / r["replayed_reserved"][name] for r in rows]
        x = np.array([[r["largest"], r["peak_allocated"], r["layer"]] for r in rows], dtype=float)
        y = np.array([r["replayed_reserved"][name] - r["peak_allocated"] - r["embedding_bytes"] for r in rows],
                     dtype=float)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        out[name] = {"min": min(q), "median": statistics.median(q), "max": max(q), "rows": len(q),
                     "least_squares": dict(zip(("largest", "peak", "layer"), map(float, coef)))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two models only")
    p.add_argument("--score", action="store_true", help="score the closed form on the saved replays (--out) only")
    p.add_argument("--missing", action="store_true", help="replay only the cases the saved results (--out) lack")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--at-capacity", metavar="GPU", default="",
                   help="only replay the QLoRA paper's 65B / 70B step within GPU's capacity (e.g. L40S); "
                        "writes nothing")
    a = p.parse_args(argv)
    if a.at_capacity:
        at_capacity(a.at_capacity)
        return 0
    t0 = time.perf_counter()
    rows, saved = [], {}
    if a.score or a.missing:
        import json
        saved = json.loads(Path(a.out).read_text())
        rows = saved["rows"]
    have = {(r["model"], r["settings"]["method"], r["settings"]["seq_len"], r["settings"]["batch_size"],
             r["settings"]["gradient_checkpointing"], r["settings"].get("optimizer")) for r in rows}
    todo = [] if a.score else QUICK if a.quick else CASES
    if a.missing:
        todo = [c for c in CASES if (*c[:5], (c[5] if len(c) > 5 else {}).get("optimizer", "adamw")) not in have]
    for c in todo:
        r = one(c)
        rows.append(r)
        d, e = r["replayed_reserved"]["default"], r["replayed_reserved"]["expandable"]
        print(f"{c[0]:<14}{c[1]:<6}{c[2]:>6}{c[3]:>3}{'ck' if c[4] else '  ':>4}  peak {r['peak_allocated'] / GIB:7.3f}"
              f"  transient {r['transient'] / GIB:7.3f}  largest {r['largest'] / GIB:6.3f}  reserved default "
              f"{d / GIB:7.3f} ({d / r['peak_allocated'] - 1:+.3f})  expandable {e / GIB:7.3f}"
              f" ({e / r['peak_allocated'] - 1:+.3f})", flush=True)
    s = scored(rows)
    for name, v in s.items():
        ls = v["least_squares"]
        print(f"closed form / replay ({name}): min {v['min']:.3f} median {v['median']:.3f} max {v['max']:.3f}; "
              f"least squares of the replays (less QLoRA's embedding block): {ls['largest']:.3f} x largest + "
              f"{ls['peak']:.4f} x peak + {ls['layer']:.2f} x layer")
    command = " ".join(["python benchmarks/cuda_reserved_fit.py", *(argv if argv is not None else sys.argv[1:])])
    meta = {"date": datetime.date.today().isoformat(), "command": command, "machine": machine(),
            "versions": versions(), "seconds": round(time.perf_counter() - t0, 1)}
    if saved.get("_meta") and a.score:  # re-scored: the replays are the saved run's
        meta = {**saved["_meta"], "scored": {"date": meta["date"], "command": command}}
    elif saved.get("_meta"):  # cases added to the saved run
        meta = {**saved["_meta"], "added": {**meta, "cases": len(todo)}}
    write_json_atomic(a.out, {"_about": __doc__.split("\n\n")[0], "_meta": meta, "summary": s, "rows": rows})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
