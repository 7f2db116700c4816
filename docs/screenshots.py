"""Rebuild the figure and table screenshots in docs/ at a notebook's width (900 px), in Chromium.

    .venv/bin/python docs/screenshots.py [--eval-run runs/<name>]

Figures are those of notebooks 01, 02 and 04 for their default plan (llama-3.1-8b on the default GPUs,
the embedded tiny model's data); the evaluation figures need a run whose notebook 04 ran
(``--eval-run``). Needs kaleido and a Chromium (``BROWSER_PATH`` or ``chromium`` on PATH); never
downloads one.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import plotly.io as pio

import lora_kit as lk
from lora_kit.plan import figures as F
from lora_kit.ui import tables
from lora_kit.ui.notebook import chromium_path

DOCS = Path(__file__).resolve().parent
GPUS = ["T4", "L4", "A10G", "RTX-4090", "L40S", "A100-80GB", "H100-SXM"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-run", help="a run folder with eval/eval.json (notebook 04 ran)")
    args = ap.parse_args()
    browser = chromium_path()
    if browser is None:
        raise SystemExit("no Chromium found: set BROWSER_PATH (e.g. apt-get install chromium)")
    os.environ.setdefault("BROWSER_PATH", browser)
    plan = lk.compare_methods(model="llama-3.1-8b", seq_len=2048, lora_rank=16, gradient_checkpointing=True,
                              gpus=GPUS, margin=0.1)
    curve = lk.sweep("llama-3.1-8b", method=["full", "lora", "qlora"], seq_len=[256, 512, 1024, 2048, 4096, 8192],
                     batch_size=1, gradient_checkpointing=True, lora_rank=16)
    lengths = lk.dataset_lengths("tiny:dates", "tiny", seq_len=64, split="train", model="tiny")
    figs = {
        "fig-01-cost-vs-time": F.cost_time_scatter(plan, title="llama-3.1-8b: time vs cost per epoch (example prices)"),
        "fig-01-memory-vs-seq-len": F.memory_vs_seq_len(
            curve, gpus=GPUS[:4], title="llama-3.1-8b: memory per GPU vs sequence length (batch 1, checkpointing)"),
        "fig-02-token-lengths": F.length_histogram(lengths, seq_len=64, title="tiny:dates: tokens per example"),
        "fig-02-breakdown-run": F.breakdown_bar(lk.estimate("tiny", method="lora", seq_len=64, batch_size=16),
                                                gpu="A100-80GB",
                                                title="tiny lora: estimated peak per part (seq_len 64, batch 16)"),
    }
    pair = lk.sweep(["llama-3.1-8b", "tiny"], method=["lora", "qlora"], seq_len=[256, 1024, 2048, 4096, 8192, 32768],
                    batch_size=1, gradient_checkpointing=[True, False], lora_rank=16)
    grid = lk.sweep("llama-3.1-8b", gpu="A100-80GB", method=["lora", "qlora"], seq_len=[256, 512, 1024, 2048, 4096, 8192],
                    batch_size=1, gradient_checkpointing=[False, True], lora_rank=16)
    tabs = {"table-01-methods": (tables.method_table(plan), 740),  # the notebooks' tables, as they show them
            "table-01-qlora-vs-lora": (tables.qlora_vs_lora_table(lk.qlora_vs_lora(pair)), 760),
            "table-02-sweep": (tables.sweep_table(grid), 720)}
    if args.eval_run:
        from lora_kit.evaluation.evaluate import load_result
        ev = load_result(args.eval_run)
        figs["fig-04-paired-diff"] = ev.diff_histogram()
        figs["fig-04-control-changes"] = ev.control_changes()
        tabs["table-04-examples"] = (tables.examples_table(
            ev.examples_table(split="control", changed_only=True).head(15)), 440)
    pio.write_images(list(figs.values()), [str(DOCS / f"{n}.png") for n in figs], width=F.NOTEBOOK_WIDTH,
                     height=[f.layout.height for f in figs.values()])
    with tempfile.TemporaryDirectory() as tmp:
        for name, (styler, height) in tabs.items():
            page = Path(tmp) / f"{name}.html"
            page.write_text('<html><body style="font-family: sans-serif; font-size: 13px; margin: 8px">'
                            + styler.to_html() + "</body></html>", encoding="utf-8")
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--screenshot={DOCS / (name + '.png')}", f"--window-size=900,{height}", page.as_uri()],
                           check=True, capture_output=True, timeout=120)
    print("\n".join(sorted(str(p.relative_to(DOCS.parent)) for p in DOCS.glob("*-*.png"))))


if __name__ == "__main__":
    main()
