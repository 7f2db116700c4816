"""``estimate`` against ``simulate`` on the whole validation set (``benchmarks/grid.py``: ``validation()``).

The simulate side is the golden file ``tests/golden/validation.json`` (``python benchmarks/grid.py --validation``
makes it). The catalog's rows are estimated from the fits shipped with the package; the 13 outside families' rows
from fits kept in ``tests/golden/fits`` (made here when missing: ``LORA_KIT_FITS`` points there). Prints every row
(error, how it was estimated), the median / max of the fitted rows, and writes
``benchmarks/results/validation.json``.

    HF_HUB_OFFLINE=1 python benchmarks/validation.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
TEST_FITS = ROOT / "tests" / "golden" / "fits"


def compare(row: dict) -> dict:
    """One golden simulate row against today's estimate: error in %, how it was estimated, seconds."""
    import grid

    from lora_kit import estimate
    t0 = time.perf_counter()
    e = estimate(grid.validation_model(row["model"]), **row["settings"])
    sim = row["peak_allocated_bytes"]
    return {"model": row["model"], "settings": row["settings"], "simulate": sim,
            "estimate": int(e.peak_allocated_bytes), "error_pct": 100 * (e.peak_allocated_bytes - sim) / sim,
            "memory_model": e.memory_model, "seconds": round(time.perf_counter() - t0, 2)}


def main() -> int:
    os.environ["LORA_KIT_FITS"] = str(TEST_FITS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import grid

    from lora_kit.memory.fits import versions
    from lora_kit.noise import quiet
    quiet()
    rows = [compare(r) for r in grid.load(grid.VALIDATION)]
    for r in rows:
        print(f"{r['model']:20s} {grid.dumps(r['settings']):110s} {r['error_pct']:+8.4f} %  {r['memory_model']}")
    fitted = [abs(r["error_pct"]) for r in rows if r["memory_model"].startswith(("fitted", "composed"))]
    summary = {"rows": len(rows), "fitted": len(fitted),
               "fitted_median_pct": statistics.median(fitted) if fitted else None,
               "fitted_max_pct": max(fitted, default=None),
               "not_fitted": [f"{r['model']} {grid.dumps(r['settings'])}: {r['error_pct']:+.2f} % ({r['memory_model']})"
                              for r in rows if not r["memory_model"].startswith(("fitted", "composed"))]}
    print(json.dumps(summary, indent=1))
    out = ROOT / "benchmarks" / "results" / "validation.json"
    out.write_text(json.dumps({"_meta": {"command": "python benchmarks/validation.py", "versions": versions()},
                               "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
