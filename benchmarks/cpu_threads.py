"""Training steps of the embedded tiny model with 1 vs 2 (or more) torch CPU threads.

Why ``lora_kit.ui.notebook.cpu_threads`` gives the tiny model one thread: its matrices are too small to
share, and on a busy machine OpenMP threads spin-wait for each other. LoRA r16 on all linear layers, AdamW,
batch 16 x 64 tokens (the main job's step); thread counts alternate in rounds so contention hits them alike;
wall and process CPU time per step and the load average are printed.

    .venv/bin/python benchmarks/cpu_threads.py [--threads 1 2] [--steps 20] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from lora_kit.loading import load_model
from lora_kit.training import attach_adapter, optimizer_for


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model = attach_adapter(load_model("tiny", method="lora"), "lora", seed=0)
    opt = optimizer_for(model.parameters(), "adamw")
    x = torch.randint(3, model.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))

    def steps(n: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    steps(3)  # warm-up
    print(f"{os.cpu_count()} CPUs; torch {torch.__version__}")
    for rnd in range(a.rounds):
        for threads in a.threads:
            torch.set_num_threads(threads)
            wall, cpu = steps(a.steps)
            print(f"round {rnd} threads {threads}: {wall * 1000:.0f} ms/step wall, {cpu * 1000:.0f} ms/step CPU "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
