#!/usr/bin/env python
"""Measure the embedded default's story: base vs LoRA / QLoRA adapter on the new task (dates),
and how much base-task (control) accuracy moves, with and without mixing in base-task examples.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tiny_story.py            # the model card's numbers
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tiny_story.py --runs lora:0 --steps 100

Prints one line per run (accuracies, train wall and CPU seconds) and writes everything as JSON.
Wall time depends on how contended the CPU is; CPU time is printed beside it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", default=["lora:0", "lora:0.25", "qlora:0", "qlora:0.25"],
                   help="method:base_share pairs")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-examples", type=int, default=400)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/benchmarks/tiny_story.json")
    a = p.parse_args(argv)

    import torch

    from lora_kit.results import write_json_atomic
    from lora_kit.embedded.story import story_run

    torch.set_num_threads(a.threads)
    results = []
    for spec in a.runs:
        method, share = spec.split(":")
        t0 = time.perf_counter()
        r = story_run(method, steps=a.steps, batch_size=a.batch_size, lr=a.lr, base_share=float(share),
                      seed=a.seed, test_examples=a.test_examples)
        r["total_wall_s"] = time.perf_counter() - t0
        results.append(r)
        print(f"{method:5s} base_share={float(share):.2f}: dates {r['dates_before']:.3f} -> {r['dates_after']:.3f} "
              f"(n={a.test_examples}); control {r['control_before']['exact_match']:.3f} -> "
              f"{r['control_after']['exact_match']:.3f}; train {a.steps} steps {r['train_wall_s']:.0f} s wall, "
              f"{r['train_cpu_s']:.0f} s CPU; final loss {r['losses'][-1]:.4f}", flush=True)
        print("   control per task after:", {k: round(v, 3) for k, v in r["control_after"]["per_task"].items()},
              flush=True)
        write_json_atomic(a.out, {"args": vars(a), "torch": torch.__version__, "results": results})
    print(f"wrote {a.out}")
    return results


if __name__ == "__main__":
    main()
