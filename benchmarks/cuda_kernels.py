"""The SDPA kernel CUDA picks on the shared H200 rows (``benchmarks/reference/cuda_h200.json``), and what the
math kernel adds to the kit's peak where it is picked (:mod:`lora_kit.memory.cuda_kernels`).

Per row: the backend ``sdpa_backend`` reads from PyTorch's dispatch rules for the row's torch and the H200
(sm90); where it is the math kernel, three figures beside the measured ``max_memory_allocated``:
``estimate`` (CPU semantics: the fused kernel's output and logsumexp), ``estimate + peak_extra`` (the math
kernel's extra as if the step's peak were at attention, an upper bound) and ``estimate + placed`` (the math
kernel's extra placed on ``simulate``'s trace of the step: its forward / backward peaks at each SDPA call, its
saved tensors from a kept forward to its backward; ``math_attention_peak`` is the largest of those moments at the
SDPA calls alone, beside ``simulate``'s peak).

On a machine with a GPU each row also records the backend that GPU's torch picks (``observed_backend``) beside
the prediction for that torch and card. Then the same figures, without a measurement, for the held-back QLoRA settings issue 34 describes (their measured
figures are not shared; whoever holds them scores these predictions): the LLaMA-65B config cut to 4 and 8 layers,
Qwen2.5-7B at 4096 x 2, Gemma-2-9B (eager) at 2048 x 1, Llama-3.1-8B at 4096 x 4, and the LoRA / full rows (Mistral-7B
at 4096 x 4, Llama-3.2-3B full at 2048 x 8). Every row also gives ``cuda_allocated`` (the estimate plus the two cuBLAS
workspaces torch's counter holds, :func:`lora_kit.memory.device.cuda_allocated_bytes`) and
``cuda_allocated_plus_placed`` (that plus, placed on the simulated step, the math-kernel extra and the weights
bitsandbytes' 4-bit matmul dequantises inside itself: :func:`lora_kit.memory.cuda_kernels.kernel_extra`): what
``max_memory_allocated`` should read.

    python benchmarks/cuda_kernels.py [--rows l8b-qlora-ckpt-s2048,...] [--no-held-back]
                                      [--out benchmarks/results/cuda_kernels.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lora_kit as lk  # noqa: E402
import torch  # noqa: E402
from cuda_h200 import REFERENCE, step_kwargs  # noqa: E402
from lora_kit.memory.cuda_kernels import (kernel_extra, math_fallback_bytes, math_kernel_extra,  # noqa: E402
                                          observed_backend, peak_with_math, sdpa_backend, sdpa_call)
from lora_kit.memory.device import cuda_allocated_bytes  # noqa: E402
from lora_kit.plan.gpus import get_gpu  # noqa: E402
from lora_kit.results import write_json_atomic  # noqa: E402

GIB = 2 ** 30
QLORA_PAPER = dict(method="qlora", lora_rank=64, lora_alpha=16, lora_targets="all-linear", seq_len=512, batch_size=1,
                   gradient_checkpointing=True, optimizer="paged_adamw_32bit", dtype="bfloat16")
HELD_BACK = [  # issue 34, "Done when": settings of the held-back H200 rows (torch 2.11, like the shared rows)
    ("llama-65b-4-layers", ("llama-65b", 4), QLORA_PAPER),
    ("llama-65b-8-layers", ("llama-65b", 8), QLORA_PAPER),
    ("qwen2.5-7b-qlora-s4096-b2", "qwen2.5-7b", dict(method="qlora", lora_rank=16, lora_alpha=32, seq_len=4096,
                                                      batch_size=2, gradient_checkpointing=True, optimizer="adamw")),
    ("gemma-2-9b-qlora-eager-s2048", "gemma-2-9b", dict(method="qlora", attn_implementation="eager", seq_len=2048,
                                                         batch_size=1, gradient_checkpointing=True)),
    ("l8b-qlora-s4096-b4-paged8", "llama-3.1-8b", dict(method="qlora", seq_len=4096, batch_size=4,
                                                        gradient_checkpointing=True, optimizer="paged_adamw_8bit")),
    # the two other held-back rows issue 34 names (LoRA, full): the workspaces are their only CUDA-side term
    ("mistral-7b-lora-s4096-b4", "mistral-7b", dict(method="lora", seq_len=4096, batch_size=4,
                                                     gradient_checkpointing=True)),
    ("l3b-full-s2048-b8", "llama-3.2-3b", dict(method="full", seq_len=2048, batch_size=8, gradient_checkpointing=True)),
]


def cut(name: str, layers: int):
    """The catalog config of ``name`` with ``layers`` decoder blocks."""
    from transformers import AutoConfig
    from lora_kit.memory.specs import catalog_config
    c = {k: v for k, v in catalog_config(name).items() if k not in ("hub_id", "params", "model_type")}
    c["num_hidden_layers"] = layers
    return AutoConfig.for_model(catalog_config(name)["model_type"], **c)


def measured_allocated(row: dict) -> int:
    return row.get("peak_allocated") or max(s["max_allocated"] for s in row["steps"])


def figures(model, kw: dict, torch_version: str, cc: float, meas: int | None) -> dict:
    """Backend, estimate and, where CUDA runs the math kernel, estimate plus its extra (upper bound, placed)."""
    call = sdpa_call(model, **kw)
    choice = sdpa_backend(call, torch_version, cc)
    est = lk.estimate(model=model, **kw).peak_allocated_bytes
    eager = kw.get("attn_implementation", "sdpa") == "eager"  # transformers' own matmul-softmax: no SDPA call
    res = {"settings": kw, "torch": torch_version, "compute_capability": cc,
           "backend": "eager" if eager else choice.backend, "why": "" if eager else choice.why(),
           "measured_max_allocated": meas, "estimate": est,
           "cuda_allocated": cuda_allocated_bytes(est, cc, torch_version)}  # + the two cuBLAS workspaces
    if torch.cuda.is_available() and not eager:  # on a GPU: what this machine's torch picks, beside the prediction
        here = sdpa_backend(call, torch.__version__, float(".".join(map(str, torch.cuda.get_device_capability()))))
        res["this_gpu"] = {"torch": torch.__version__, "name": torch.cuda.get_device_name(),
                           "predicted": here.backend, "observed": observed_backend(call)}
    sim = None
    if res["backend"] == "math" or kw.get("method") == "qlora":  # placed on a simulated step
        t0 = time.perf_counter()
        sim = lk.simulate(model, trace=True, **kw)
        res.update({"simulate": sim.peak_allocated_bytes, "simulate_phase": sim.phase,
                    "simulate_seconds": round(time.perf_counter() - t0, 1)})
    if res["backend"] == "math":
        fb = math_fallback_bytes(model, torch_version_=torch_version, **kw)
        placed = math_kernel_extra(model, sim=sim, torch_version_=torch_version, compute_capability=cc, **kw)
        res.update({"math": {k: v for k, v in fb.to_dict().items() if k != "call"}, "placed_extra": placed,
                    "math_attention_peak": peak_with_math(sim.trace, fb, attention_only=True),
                    "estimate_plus_peak_extra": est + fb.peak_extra, "estimate_plus_placed": est + placed})
    # what torch's counter would read: the workspaces, and placed on the step the math kernel where it runs and the
    # weights bitsandbytes' 4-bit matmul dequantises inside itself (kernel_extra: both at once)
    if sim is not None:
        res["kernel_extra"] = kernel_extra(model, sim=sim, torch_version_=torch_version, compute_capability=cc, **kw)
    res["cuda_allocated_plus_placed"] = res["cuda_allocated"] + (res.get("kernel_extra") or 0)
    if meas:
        res["ratio_estimate"] = est / meas
        if "math" in res:
            res["ratio_estimate_plus_peak_extra"] = res["estimate_plus_peak_extra"] / meas
            res["ratio_estimate_plus_placed"] = res["estimate_plus_placed"] / meas
        res["ratio_cuda_allocated_plus_placed"] = res["cuda_allocated_plus_placed"] / meas
    return res


def one(row: dict, torch_version: str, cc: float) -> dict:
    return {"case": row["case"], "model": row["model"],
            **figures(row["model"], step_kwargs(row), torch_version, cc, measured_allocated(row))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None, help="comma-separated case names (default: every shared step row)")
    p.add_argument("--no-held-back", action="store_true", help="skip the held-back settings' predictions")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_kernels.json"))
    a = p.parse_args(argv)
    ref = json.loads(REFERENCE.read_text())
    cap = next(r for r in ref["rows"] if r.get("case") == "capacity")
    torch_version = cap["versions"]["torch"]
    cc = float(get_gpu("H200")["compute_capability"])
    rows = [r for r in ref["rows"] if "settings" in r]
    if a.rows:
        rows = [r for r in rows if r["case"] in a.rows.split(",")]
    out = []
    print(f"torch {torch_version} (the rows'), sm{cc}")
    print(f"{'case':<32}{'backend':>10}{'meas GiB':>10}{'est/meas':>10}{'+upper/meas':>13}{'+placed/meas':>14}"
          f"{'placed GiB':>12}{'cuda+kernels/meas':>19}")
    for r in rows:
        res = one(r, torch_version, cc)
        out.append(res)
        up = f"{res['ratio_estimate_plus_peak_extra']:.4f}" if "math" in res else "-"
        pl = f"{res['ratio_estimate_plus_placed']:.4f}" if "math" in res else "-"
        pg = f"{res['placed_extra'] / GIB:.3f}" if "math" in res else "-"
        print(f"{r['case']:<32}{res['backend']:>10}{res['measured_max_allocated'] / GIB:>10.2f}"
              f"{res['ratio_estimate']:>10.4f}{up:>13}{pl:>14}{pg:>12}"
              f"{res['ratio_cuda_allocated_plus_placed']:>19.5f}", flush=True)
    held = []
    if not a.no_held_back:
        print(f"\n{'held back (no measurement here)':<32}{'backend':>10}{'est GiB':>10}{'+upper GiB':>12}"
              f"{'+placed GiB':>13}{'placed GiB':>12}{'kernels GiB':>13}{'cuda+kernels GiB':>18}")
        for case, model, kw in HELD_BACK:
            m = cut(*model) if isinstance(model, tuple) else model
            res = {"case": case, "model": model if isinstance(model, str) else f"{model[0]} cut to {model[1]} layers",
                   **figures(m, kw, torch_version, cc, None)}
            held.append(res)
            f = (lambda k: f"{res[k] / GIB:.2f}" if k in res else "-")
            print(f"{case:<32}{res['backend']:>10}{res['estimate'] / GIB:>10.2f}{f('estimate_plus_peak_extra'):>12}"
                  f"{f('estimate_plus_placed'):>13}{f('placed_extra'):>12}{f('kernel_extra'):>13}"
                  f"{f('cuda_allocated_plus_placed'):>18}", flush=True)
    versions = {k: metadata.version(k) for k in ("torch", "transformers", "peft", "bitsandbytes")}
    write_json_atomic(a.out, {
        "_about": __doc__.split("\n\n")[0],
        "_meta": {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "command": "python benchmarks/cuda_kernels.py",
                  "machine": f"{os.uname().machine} CPU (kit's figures); measured figures: the reference file",
                  "versions": versions},
        "reference": str(REFERENCE.relative_to(ROOT)), "rows": out,
        "held_back_predictions": held})
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
