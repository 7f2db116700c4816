"""Planner speed: a 10,000-row sweep (target <= 100 ms) and one widget change (target <= 100 ms).

Prints the median and the fastest of several repeats after a warm-up, wall and process CPU time
(the machine may be shared: CPU time says how much of the wall time was ours).

    .venv/bin/python benchmarks/planner_speed.py [--repeats 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lora_kit.plan.planner import sweep  # noqa: E402
from lora_kit.results import write_json_atomic  # noqa: E402
from lora_kit.settings import Settings  # noqa: E402


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up (imports, spec and catalog caches)
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"median_ms": 1e3 * statistics.median(walls), "min_ms": 1e3 * min(walls),
            "cpu_median_ms": 1e3 * statistics.median(cpus)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = "llama-3.1-8b"
    cases = {
        "sweep 10,000 rows, 1 group (100 seq_len x 100 batch), 1 GPU": lambda: sweep(
            model, seq_len=list(range(256, 256 + 100 * 64, 64)), batch_size=list(range(1, 101)), gpu="L4"),
        "sweep 10,000 rows, 8 groups (method x ckpt x optimizer) x 25 seq_len x 25 batch x 2 GPUs": lambda: sweep(
            model, method=["lora", "qlora"], gradient_checkpointing=[False, True],
            optimizer=["adamw", "paged_adamw_8bit"], seq_len=list(range(512, 512 + 25 * 256, 256)),
            batch_size=list(range(1, 26)), gpu=["L4", "H100-SXM"]),
    }
    results = {}
    for name, fn in cases.items():
        n = len(fn())
        r = timed(fn, args.repeats)
        results[name] = {**r, "rows": n}
        print(f"{name}: {n} rows, median {r['median_ms']:.1f} ms (fastest {r['min_ms']:.1f} ms, "
              f"process CPU {r['cpu_median_ms']:.1f} ms); target <= 100 ms")

    from lora_kit.ui.widgets import PlannerPanel
    panel = PlannerPanel(Settings(plan_model=model, dtype="bfloat16", seq_len=1024, batch_size=1, gpu="A100-80GB"))
    toggle = {"state": False}

    def change(widget, a, b):
        def fn():
            toggle["state"] = not toggle["state"]
            widget.value = a if toggle["state"] else b
        return fn

    widget_cases = {
        "widget: seq_len change, plan fits (verdict + figure)": change(panel.seq_len, 1024, 2048),
        "widget: GPU change to one it does not fit (verdict computes the cheapest fix)": change(panel.gpu, "L4",
                                                                                              "A100-80GB"),
        "widget: batch change on L4, does not fit either way": None,
    }
    for name, fn in widget_cases.items():
        if fn is None:
            panel.gpu.value = "L4"
            fn = change(panel.batch_size, 2, 4)
        r = timed(fn, args.repeats)
        results[name] = r
        print(f"{name}: median {r['median_ms']:.1f} ms (fastest {r['min_ms']:.1f} ms, process CPU "
              f"{r['cpu_median_ms']:.1f} ms); target <= 100 ms")
    print(f"\nverdict shown: {panel.last_plan['gpu']}: fits={panel.last_plan['fits']}, "
          f"fix={panel.last_plan['fix']['change'] if panel.last_plan['fix'] else None}")
    print(f"load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        write_json_atomic(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
