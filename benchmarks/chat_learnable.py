#!/usr/bin/env python
"""Held-out gain of a learnable chat task ("always answer OK") on random-weight models of seven chat families.

The larger variant of ``tests/test_chat_learnable.py`` (issue 36): each family's model is built offline as that
test builds it (real architecture from ``AutoConfig.for_model``, real or documented chat template, random
weights), trained with ``lora_kit.train_adapters`` (notebook 03's call), reloaded and judged with
``lora_kit.evaluate`` (notebook 04's). Prints one row per family and ``train_on``: the final training loss, base
and adapter exact match on the held-out conversations, the paired gain with its 95 % interval, and wall and
process CPU seconds (the CPU may be shared). Runs live in a temporary folder; ``--out`` writes the rows as JSON.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/chat_learnable.py                       # 4 layers, hidden 128
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/chat_learnable.py --layers 2 --hidden 32 --steps 80 --rows 64 \\
        --eval 16                                                                      # the CI sizes
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/chat_learnable.py --train-on assistant all last --families mixtral
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> list[dict]:
    from test_chat_learnable import FAMILIES, LONG, learn_ok
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--train-on", nargs="+", default=["assistant"], choices=["assistant", "all", "last"])
    p.add_argument("--layers", type=int, default=LONG["model"]["layers"])
    p.add_argument("--hidden", type=int, default=LONG["model"]["hidden"])
    p.add_argument("--steps", type=int, default=LONG["steps"])
    p.add_argument("--rows", type=int, default=LONG["n_rows"], help="conversations; a quarter is held out")
    p.add_argument("--eval", type=int, default=LONG["n_eval"], help="held-out conversations judged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    rows = []
    print("| family | train_on | params (trained) | final loss | base EM | adapter EM | gain, points (95 % CI) | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in a.families:
        for train_on in a.train_on:
            with tempfile.TemporaryDirectory(prefix="chat_learnable-") as tmp:
                r = learn_ok(family, Path(tmp), steps=a.steps, n_rows=a.rows, n_eval=a.eval, seed=a.seed,
                             train_on=train_on, model={"layers": a.layers, "hidden": a.hidden})
                m = r["eval"].summary["metrics"]["heldout"]
                d = r["gain"]
                row = {"family": family, "train_on": train_on, "layers": a.layers, "hidden": a.hidden,
                       "steps": a.steps, "params": r["smoke"]["model"]["parameters"],
                       "trainable": r["smoke"]["model"]["trainable_parameters"], "final_loss": r["smoke"]["steps"][-1]["loss"],
                       "base_exact_match": m["base"]["exact_match"]["mean"],
                       "adapter_exact_match": m["adapter"]["exact_match"]["mean"],
                       "gain": d["diff"], "lo": d["lo"], "hi": d["hi"], "n": d["n"],
                       "wall_s": r["wall_s"], "cpu_s": r["cpu_s"]}
            rows.append(row)
            params = f"{row['params']:,} ({row['trainable']:,})"
            print(f"| {family} | {train_on} | {params} | {row['final_loss']:.4f} | {100 * row['base_exact_match']:.1f} "
                  f"| {100 * row['adapter_exact_match']:.1f} | {100 * d['diff']:+.1f} ({100 * d['lo']:+.1f} to "
                  f"{100 * d['hi']:+.1f}, n={d['n']}) | {r['wall_s']:.1f} | {r['cpu_s']:.1f} |", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
