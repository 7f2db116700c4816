"""The loop users run next: a real CPU step of transformers' Trainer and TRL's SFTTrainer vs ours, estimate, simulate.

Usage (CPU, offline; 24 rows took ~14 min on 2 cores shared at load ~11)::

    HF_HUB_OFFLINE=1 python benchmarks/memory_accuracy.py --loops     # (this script)
    HF_HUB_OFFLINE=1 python benchmarks/loop_accuracy.py --limit 4

For each configuration (the embedded tiny model as the smoke run trains it, and 2-layer random-weight SmolLM2-135M /
Qwen2.5-0.5B; LoRA and full fine-tuning; checkpointing on/off; float32, which this CPU runs fast) and each loop --
``kit`` (lora_kit's step, measured by ``measure_config``), ``trainer`` (the real ``Trainer.train()`` with its
defaults) and ``sft`` (the real ``SFTTrainer.train()``) -- it prints the measured peak of the second step (live
bytes, 512-rounded), ``simulate`` and ``estimate`` beside it, and the loop's peak against the kit's. Results go to
``benchmarks/results/loop_accuracy.json`` (re-running skips rows already there unless ``--fresh``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from memory_accuracy import model_arg  # noqa: E402

from lora_kit.memory.estimate import estimate  # noqa: E402
from lora_kit.memory.measure import measure_config  # noqa: E402
from lora_kit.memory.simulate import simulate  # noqa: E402
from lora_kit.results import read_json, write_json_atomic  # noqa: E402

OUT = Path(__file__).parent / "results" / "loop_accuracy.json"
LOOPS = ("kit", "trainer", "sft")


def loop_cases() -> list[dict]:
    """The step configurations (the loop is added per row)."""
    cases = [dict(model="tiny", layers=None, method="lora", dtype="float32", seq_len=64, batch_size=16,
                  gradient_checkpointing=False, padding="max_length"),  # the smoke run's step
             dict(model="tiny", layers=None, method="full", dtype="float32", seq_len=16, batch_size=1,
                  gradient_checkpointing=False)]  # a short step: the optimizer phase holds the kit's peak
    for name in ("smollm2-135m", "qwen2.5-0.5b"):
        for method, gc in (("lora", False), ("lora", True), ("full", False)):
            cases.append(dict(model=name, layers=2, method=method, dtype="float32", seq_len=128, batch_size=2,
                              gradient_checkpointing=gc, padding="max_length"))
    return cases


def key(case: dict, loop: str) -> str:
    return ",".join(f"{k}={case[k]}" for k in sorted(case)) + f",loop={loop}"


def run(cases: list[dict], fresh: bool) -> dict:
    done = {} if fresh or not OUT.is_file() else read_json(OUT)
    for case in cases:
        m = "tiny" if case["layers"] is None else model_arg(case)
        kw = {k: v for k, v in case.items() if k not in ("model", "layers")}
        for loop in LOOPS:
            k = key(case, loop)
            if k not in done:
                t = time.perf_counter()
                real = measure_config(m, loop=loop, **kw)
                t_real = time.perf_counter() - t
                sim = simulate(m, loop=loop, **kw)
                done[k] = {"case": case, "loop": loop, "measured": real.peak_allocated_bytes, "phase": real.phase,
                           "simulate": sim.peak_allocated_bytes, "measure_seconds": round(t_real, 1)}
                write_json_atomic(OUT, done)
            row = done[k]
            row["estimate"] = estimate(m, loop=loop, **kw).peak_allocated_bytes  # cheap: always recomputed
            print(line(row, done.get(key(case, "kit"))), flush=True)
    write_json_atomic(OUT, done)
    return done


def line(row: dict, kit: dict | None) -> str:
    c = row["case"]
    desc = (f"{c['model']}{'' if c['layers'] is None else '[' + str(c['layers']) + 'L]'} {c['method']:4s} "
            f"S{c['seq_len']} B{c['batch_size']} {'gc' if c['gradient_checkpointing'] else '--'} {row['loop']:7s}")
    meas = row["measured"]
    vs_kit = "" if kit is None or row["loop"] == "kit" else f"  vs kit {100 * (meas - kit['measured']) / kit['measured']:+7.2f}%"
    return (f"{desc:48s} measured {meas / 2**20:9.2f} MiB ({row['phase'][:3]})  simulate {row['simulate'] - meas:+6d} B  "
            f"estimate {100 * (row['estimate'] - meas) / meas:+6.2f}%{vs_kit}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="only the first N configurations")
    ap.add_argument("--fresh", action="store_true", help="ignore rows already saved")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    cases = loop_cases()[: args.limit]
    done = run(cases, args.fresh)
    rows = [done[key(c, loop)] for c in cases for loop in LOOPS if key(c, loop) in done]
    exact = sum(r["simulate"] == r["measured"] for r in rows)
    errs = sorted(abs(100 * (r["estimate"] - r["measured"]) / r["measured"]) for r in rows)
    print(f"\n{len(rows)} rows: simulate byte-exact on {exact}; estimate |error| median {statistics.median(errs):.2f} %, "
          f"max {errs[-1]:.2f} %")


if __name__ == "__main__":
    main()
