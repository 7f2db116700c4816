"""The fitted closed form (lora_kit.memory.calibrate) against simulate, beside today's estimate.

Families transformers can build that the catalog does not model (small configs of their real layers, 4 blocks) and
catalog models at full depth; each fitted from 2- and 3-block runs at short shapes, then judged at shapes it never
saw (longer sequences, full depth). Writes benchmarks/results/calibrate_accuracy.json.

    python benchmarks/calibrate_accuracy.py [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384, pad_token_id=0, bos_token_id=0, eos_token_id=0)
FAMILIES = {  # model_type -> extra config fields (small experts for the mixtures)
    "smollm3": {}, "olmo3": {}, "glm4": {"head_dim": 64}, "cohere2": {"head_dim": 64}, "stablelm": {},
    "starcoder2": {}, "gemma": {"head_dim": 64}, "ernie4_5": {"head_dim": 64}, "exaone4": {},
    "helium": {"head_dim": 64}, "seed_oss": {"head_dim": 64},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
}
STEP_OF = {"gpt_oss": {"attn_implementation": "eager"}}  # transformers runs GPT-OSS with eager attention only
CATALOG = ("llama-3.2-1b", "qwen2.5-0.5b", "pythia-1b", "gemma-3-1b")
STEPS = {"lora, checkpointing": dict(method="lora", gradient_checkpointing=True, dtype="float32"),
         "full, no checkpointing": dict(method="full", gradient_checkpointing=False, dtype="float32")}
TARGETS = ((2, 4096), (1, 8192))  # (micro-batch, tokens): never in the fit's design


def machine() -> str:
    """CPU model, family, whether it has AVX512-BF16 / AMX, cores, torch: what the CPU kernels (and so simulate's
    operator sequence on a CPU) depend on."""
    import os
    import torch
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    flags = info.get("flags", "").split()
    return (f"{info.get('model name', platform.processor() or platform.machine())} (family {info.get('cpu family', '?')}"
            f"; avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}; amx {'yes' if 'amx_tile' in flags else 'no'}), "
            f"{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}")


def small_config(model_type: str):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES[model_type]})
    cfg.name_or_path = f"small-{model_type}"
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three families, one step")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "calibrate_accuracy.json"))
    a = ap.parse_args()
    from lora_kit.memory.calibrate import fit
    from lora_kit.memory.estimate import estimate
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.specs import load_config
    from lora_kit.noise import quiet
    from lora_kit.settings import Step
    quiet()
    models = [(f"small-{mt}", lambda mt=mt: small_config(mt)) for mt in FAMILIES]
    models += [(name, lambda name=name: load_config(name)) for name in CATALOG]
    steps = STEPS
    if a.quick:
        models, steps = models[:2] + models[-1:], dict(list(STEPS.items())[:1])
    rows = []
    for name, make in models:
        cfg = make()
        for label, kw in steps.items():
            step = Step(**kw, **STEP_OF.get(getattr(cfg, "model_type", ""), {}))
            row = {"model": name, "step": label, "layers": cfg.num_hidden_layers}
            t0 = time.perf_counter()
            try:
                f = fit(cfg, step)
            except Exception as e:  # noqa: BLE001 - a family the fit cannot align is a result, not a crash
                rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                print(f"{name:22s} {label:24s} not fitted: {e}", flush=True)
                continue
            row.update(fit_seconds=round(time.perf_counter() - t0, 1), envelope_ops=f.size(), shapes=[])
            for B, S in TARGETS:
                sim = simulate(cfg, step, batch_size=B, seq_len=S).peak_allocated_bytes
                got = f.peak(cfg.num_hidden_layers, B, S)
                try:
                    est = estimate(cfg, step, batch_size=B, seq_len=S).peak_allocated_bytes
                except Exception as e:  # noqa: BLE001
                    est = f"{type(e).__name__}: {e}"
                row["shapes"].append({"batch_size": B, "seq_len": S, "simulate": sim, "fitted": got, "estimate": est,
                                      "fitted_error_pct": 100 * (got - sim) / sim,
                                      "estimate_error_pct": 100 * (est - sim) / sim if isinstance(est, int) else None})
                print(f"{name:22s} {label:24s} B={B} S={S}: fitted {100 * (got - sim) / sim:+.4f} %  estimate "
                      + (f"{100 * (est - sim) / sim:+.2f} %" if isinstance(est, int) else est), flush=True)
            rows.append(row)
    out = {"_meta": {"date": datetime.date.today().isoformat(), "command": "python benchmarks/calibrate_accuracy.py"
                     + (" --quick" if a.quick else ""), "machine": machine()}, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
