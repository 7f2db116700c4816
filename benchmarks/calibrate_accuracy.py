"""estimate (the fitted closed form, lora_kit.memory.calibrate) against simulate, beside the old arithmetic.

The issue's 52 rows (13 families transformers can build that the catalog does not model, small configs of their
real layers at 4 blocks; LoRA all-linear and full; checkpointing on and off; fp32; micro-batch 2, 512 tokens) plus
shapes the fit never saw (2 x 4096, 1 x 8192 tokens, and rank 64 with LoRA), and catalog models at their real depth.
Per (model, step): the arithmetic estimate (no fit visible), then the fit (made, or read from ``tests/golden/fits``
-- the validation set's fits, the same keys -- with the seconds it took when it was made), then ``estimate`` (now
fitted) and ``simulate`` at every shape. Writes benchmarks/results/calibrate_accuracy.json after every row; rows
already there are kept (an interrupted run resumes). Each row records its date and machine (``measured``; rows from
before that field carry the file's ``_meta`` of then); ``_meta`` names each machine and day with its rows.

    python benchmarks/calibrate_accuracy.py [--quick] [--catalog-only | --outside-only]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from grid import OUTSIDE, OUTSIDE_STEP, validation_model  # noqa: E402  (the 13 outside families, one definition)

CATALOG = ("llama-3.2-1b", "qwen2.5-0.5b", "pythia-1b", "gemma-3-1b")
STEPS = {f"{m}, checkpointing {'on' if gc else 'off'}": dict(method=m, gradient_checkpointing=gc, dtype="float32")
         for m in ("lora", "full") for gc in (True, False)}
SHAPES = ((2, 512, 16), (2, 4096, 16), (1, 8192, 16), (2, 4096, 64))  # (micro-batch, tokens, rank): (2, 512) is the
# issue's shape; the others were never in a fit's design


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three families, one step")
    ap.add_argument("--outside-only", action="store_true", help="only the 13 families outside the catalog")
    ap.add_argument("--catalog-only", action="store_true", help="only the catalog models at full depth")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "calibrate_accuracy.json"))
    a = ap.parse_args()
    os.environ.setdefault("LORA_KIT_FITS", str(ROOT / "tests" / "golden" / "fits"))
    from lora_kit.memory import fits
    from lora_kit.memory.estimate import estimate
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.specs import load_config
    from lora_kit.noise import quiet
    from lora_kit.settings import Step
    quiet()
    models = [] if a.catalog_only else [(f"small-{mt}", lambda mt=mt: validation_model(f"small-{mt}")) for mt in OUTSIDE]
    models += [] if a.outside_only else [(name, lambda name=name: load_config(name)) for name in CATALOG]
    steps = STEPS
    if a.quick:
        models, steps = models[:2] + models[-1:], dict(list(STEPS.items())[:1])
    old = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
    kept = {k: old.get("_meta", {}).get(k) for k in ("date", "machine")}  # rows from before per-row provenance
    done = {(r["model"], r["step"]): {**r, "measured": r.get("measured", kept)} for r in old.get("rows", [])}
    rows = []
    here = {"date": datetime.date.today().isoformat(), "machine": machine()}
    meta = {"command": " ".join(["python benchmarks/calibrate_accuracy.py", *sys.argv[1:]]),
            "versions": fits.versions()}
    for name, make in models:
        cfg = make()
        for label, kw in steps.items():
            step = Step(**kw, **OUTSIDE_STEP.get(getattr(cfg, "model_type", ""), {}))
            if (name, label) in done and "error" not in done[(name, label)]:
                rows.append(done[(name, label)])
                continue
            row = {"model": name, "step": label, "layers": cfg.num_hidden_layers, "measured": here, "shapes": []}
            shapes = [(B, S, R) for B, S, R in SHAPES if R == 16 or step.method != "full"]
            rank = (lambda R: {"lora_rank": R}) if step.method != "full" else (lambda R: {})
            os.environ["LORA_KIT_FIT"] = "auto"
            try:
                config = load_config(cfg).to_dict()
                f, info = fits.lookup(config, step) or fits.make(config, step)
            except Exception as e:  # noqa: BLE001 - a family the fit cannot align is a result, not a crash
                rows.append({**row, "error": f"{type(e).__name__}: {e}"})
                print(f"{name:22s} {label:24s} not fitted: {e}", flush=True)
                continue
            row.update(fit_seconds=info["seconds"], envelope_ops=f.size())
            for sh in shapes:
                B, S, R = sh
                sim = simulate(cfg, step, batch_size=B, seq_len=S, **rank(R)).peak_allocated_bytes
                new = _try(lambda: estimate(cfg, step, batch_size=B, seq_len=S, **rank(R)))
                err = {k: (100 * (v.peak_allocated_bytes - sim) / sim if not isinstance(v, str) else v)
                       for k, v in (("estimate", new),)}  # rows kept from before cedf41b+1 also hold the deleted
                # hand-written arithmetic's error ("arithmetic_error_pct"), measured then
                row["shapes"].append({"batch_size": B, "seq_len": S, "lora_rank": R if step.method != "full" else None,
                                      "simulate": sim, "memory_model": getattr(new, "memory_model", None),
                                      **{f"{k}_error_pct": v for k, v in err.items()}})
                v = err["estimate"]
                print(f"{name:22s} {label:24s} B={B} S={S} r={R}: estimate "
                      + (f"{v:+.4f} %" if not isinstance(v, str) else v), flush=True)
            rows.append(row)
            _write(a.out, meta, rows)
    _write(a.out, meta, rows)  # rows kept after the last one made are written too
    print(f"wrote {a.out}")


def _write(out: str, meta: dict, rows: list[dict]) -> None:
    prov = provenance(rows)
    meta = {"date": prov["date"], **meta, "machine": prov["machine"]}
    Path(out).write_text(json.dumps({"_meta": meta, "rows": rows}, indent=1))


def provenance(rows: list[dict]) -> dict:
    """The file's date and machine from its rows' ``measured``: one machine and day, or each with its rows."""
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        groups.setdefault((r["measured"]["date"], r["measured"]["machine"]), []).append(r["model"])
    if len(groups) <= 1:
        return dict(zip(("date", "machine"), next(iter(groups), (None, None))))
    dates = sorted(d for d, _ in groups)
    big = max(groups.values(), key=len)
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return {"date": f"{span} (per row: `measured`)", "machine": "per row (`measured`): " + "; ".join(
        f"{m}, {d}: {len(ms)} rows" + ("" if ms is big else f" ({', '.join(dict.fromkeys(ms))})")
        for (d, m), ms in groups.items())}


def _try(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - a refusal is a result
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
