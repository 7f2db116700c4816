"""Overhead of the smoke run's per-step instrumentation versus the same bare training loop.

Same model, adapter, optimizer and batches; the bare loop is forward, backward, step, zero_grad.
The instrumented loop is ``lora_kit.run.loop.train_steps`` with per-step timing, loss,
tokens/s, RSS, tqdm and an ``on_step`` callback, *outside* the tracker-measured steps (the
tracker runs only on the first ``measure_steps`` steps; its cost is reported separately).
Loops alternate in rounds so CPU contention hits both alike; wall and process CPU time are printed.

    .venv/bin/python benchmarks/smoke_overhead.py [--model DIR] [--steps 60] [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(model_dir: str, seed: int = 0):
    from lora_kit.loading import load_model
    from lora_kit.training import attach_adapter, build_optimizer
    model = attach_adapter(load_model(model_dir, "lora"), "lora", seed, rank=16, alpha=32)
    return model, build_optimizer(model.parameters(), "adamw", 1e-3)


def batches(n: int, batch: int, seq_len: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(4, vocab, (batch, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    return out


def bare(model, opt, data):
    model.train()
    for b in data:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def instrumented(model, opt, data, tracker=None, measure_steps=0):
    from lora_kit.run.loop import train_steps
    log = []
    train_steps(model, opt, lambda s, k: data[s], len(data), 1, tracker=tracker, measure_steps=measure_steps,
                progress=True, on_step=log.append)
    return log


def timed(fn, *a, **k):
    w, c = time.perf_counter(), time.process_time()
    fn(*a, **k)
    return time.perf_counter() - w, time.process_time() - c


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded tiny model, else a random Llama)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model_dir = a.model
    if model_dir is None:
        from lora_kit.loading import EMBEDDED_DIR
        if (EMBEDDED_DIR / "model.safetensors").is_file():  # the embedded default
            model_dir = str(EMBEDDED_DIR)
        else:  # fall back to the test fixture's random Llama
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import build_char_tokenizer, build_random_llama
            model_dir = tempfile.mkdtemp(prefix="smoke_overhead_")
            build_char_tokenizer(model_dir)
            build_random_llama(model_dir, hidden=256, layers=4, heads=4, kv_heads=4, ffn=768)
    model, opt = build(model_dir)
    vocab = model.config.vocab_size
    data = batches(a.steps, a.batch, a.seq_len, vocab)
    bare(model, opt, data[:3])  # warm-up: kernels, optimizer state
    res = {"bare": [], "instrumented": []}
    for _ in range(a.rounds):
        res["bare"].append(timed(bare, model, opt, data))
        res["instrumented"].append(timed(instrumented, model, opt, data))
    from lora_kit.memory.tracker import LiveBytesTracker
    tracked = timed(instrumented, model, opt, data[:5], tracker=LiveBytesTracker(), measure_steps=5)
    print(f"model {model_dir}, batch {a.batch} x seq_len {a.seq_len}, {a.steps} steps x {a.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}")
    for k, v in res.items():
        print(f"  {k:<13} wall/step median {statistics.median(w for w, _ in v) / a.steps * 1e3:8.2f} ms   "
              f"cpu/step median {statistics.median(c for _, c in v) / a.steps * 1e3:8.2f} ms")
    ratio_wall = statistics.median(w for w, _ in res["instrumented"]) / statistics.median(w for w, _ in res["bare"])
    ratio_cpu = statistics.median(c for _, c in res["instrumented"]) / statistics.median(c for _, c in res["bare"])
    print(f"  overhead ratio instrumented/bare: wall {ratio_wall:.3f}, process CPU {ratio_cpu:.3f} (target <= 1.05)")
    bare_step = statistics.median(w for w, _ in res["bare"]) / a.steps
    print(f"  tracker-measured step: {tracked[0] / 5 * 1e3:.2f} ms wall = {tracked[0] / 5 / bare_step:.2f}x a bare step "
          "(only the first measure_steps steps pay this)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
