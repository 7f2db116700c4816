#!/usr/bin/env python
"""Evaluation on the embedded default: base vs a LoRA adapter on held-out dates and the control set.

Trains an adapter first (plain loop, ``--steps``) unless ``--adapter`` names one (e.g. the smoke
run's ``<run_dir>/smoke/adapter``), then runs ``lora_kit.evaluation.evaluate`` and prints the summary
sentences and the time evaluation took (wall and process CPU seconds; the CPU may be shared).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/eval_speed.py                     # train 300 steps
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/eval_speed.py --adapter runs/default/smoke/adapter
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/eval_speed.py --smoke      # lk.smoke_run defaults first
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


def train(model: str, method: str, steps: int, lr: float, batch_size: int, seed: int, out: Path) -> str:
    from lora_kit.data import load_examples
    from lora_kit.loading import load_model, load_tokenizer
    from lora_kit.embedded.story import train_adapter
    from lora_kit.training import attach_adapter
    tok = load_tokenizer(model)
    peft_model = attach_adapter(load_model(model, method=method), method, seed)
    r = train_adapter(peft_model, tok, load_examples("tiny:dates", split="train"), steps=steps,
                      batch_size=batch_size, lr=lr, seed=seed)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    print(f"trained {method} adapter: {steps} steps, {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU, "
          f"final loss {r['losses'][-1]:.4f} -> {out}", flush=True)
    return str(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--method", default="lora", choices=("lora", "qlora"))
    p.add_argument("--adapter", default=None, help="adapter folder; default: train one")
    p.add_argument("--smoke", action="store_true", help="train with lora_kit.smoke_run (its defaults) instead")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--train-batch-size", type=int, default=32)
    p.add_argument("--n-heldout", type=int, default=200)
    p.add_argument("--n-control", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--run-dir", default="runs/benchmarks/eval")
    a = p.parse_args(argv)

    import torch

    from lora_kit.evaluation.evaluate import evaluate
    torch.set_num_threads(a.threads)
    run_dir = Path(a.run_dir)
    if a.smoke and not a.adapter:
        from lora_kit.run.smoke import smoke_run
        w0, c0 = time.perf_counter(), time.process_time()
        sr = smoke_run(run_dir=str(run_dir), model=a.model, method=a.method, seed=a.seed, simulate=False,
                       progress=False)
        print(f"smoke_run ({sr.status}): {time.perf_counter() - w0:.0f} s wall, {time.process_time() - c0:.0f} s CPU",
              flush=True)
        a.adapter = str(run_dir / "smoke" / "adapter")
    adapter = a.adapter or train(a.model, a.method, a.steps, a.lr, a.train_batch_size, a.seed, run_dir / "adapter")
    w0, c0 = time.perf_counter(), time.process_time()
    r = evaluate(a.model, adapter, run_dir=run_dir, method=a.method, n_heldout=a.n_heldout, n_control=a.n_control,
                 batch_size=a.batch_size, seed=a.seed)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    s = r.summary
    n = s["heldout"]["n"] + s["control"]["n"]
    print(r.summary_sentence)
    for split, systems in s["metrics"].items():
        for name, m in systems.items():
            print(f"  {split:8s} {name:8s} exact match {100 * m['exact_match']['mean']:5.1f} %  "
                  f"chrF {m['chrf']['mean']:5.1f}  ref loss {m['ref_loss']['mean']:.3f}  "
                  f"perplexity {m['perplexity']:.2f}")
    print(f"evaluate(): {n} examples x {1 + len(r.adapters)} systems in {wall:.1f} s wall, {cpu:.1f} s CPU "
          f"(threads={a.threads}); per split/system: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in s["timing"].items() if k.endswith("_wall_s") and ":" in k))
    print(f"wrote {r.paths['json']} and {r.paths['csv']}")
    return s


if __name__ == "__main__":
    main()
