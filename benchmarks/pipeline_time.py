"""Time of the main job (``lora-kit run`` on the embedded default), per notebook.

    python benchmarks/pipeline_time.py [--out runs/bench-pipeline]

Target (issue 7): the whole pipeline in <= 5 minutes on a 2-core CPU. Prints wall time per
notebook and in total, and the load average before and after (contention inflates wall time).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

from lora_kit.ui.pipeline import run_pipeline
from lora_kit.settings import Settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench-pipeline")
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), os.times()
    rec = run_pipeline(Settings(), args.out, log=lambda *_: None)
    wall = time.perf_counter() - t0
    c1 = os.times()
    print(f"{'notebook':<26}{'wall s':>9}")
    for n in rec["notebooks"]:
        print(f"{n['notebook']:<26}{n['seconds']:>9.1f}")
    print(f"{'total':<26}{wall:>9.1f}   (target <= 300 s: {'met' if wall <= 300 else 'MISSED'})")
    print(f"kernel CPU time (children user+sys): {c1.children_user + c1.children_system - c0.children_user - c0.children_system:.1f} s;"
          f" load average before {load0:.1f}, after {os.getloadavg()[0]:.1f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


if __name__ == "__main__":
    main()
