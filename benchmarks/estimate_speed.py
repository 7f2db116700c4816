"""Speed of ``lora_kit.memory.estimate`` (targets: <= 1 ms per call; 10,000 configurations vectorized <= 100 ms).

Usage: ``HF_HUB_OFFLINE=1 python benchmarks/estimate_speed.py``. Prints wall and process CPU time
(the machine is shared: CPU time shows contention). Timing is printed, never asserted.
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from lora_kit.memory.estimate import estimate, estimate_arrays  # noqa: E402
from lora_kit.memory.specs import model_spec  # noqa: E402


def timed(fn, repeat: int):
    fn()  # warm (spec cache, imports)
    w, c = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - w) / repeat, (time.process_time() - c) / repeat


def main() -> None:
    cases = [dict(model="llama-3.1-8b", method="qlora", gradient_checkpointing=True, optimizer="paged_adamw_8bit"),
             dict(model="qwen2.5-7b", method="lora", seq_len=4096, batch_size=2),
             dict(model="llama-3.1-70b", method="full", num_gpus=8, sharding="zero3", cpu_offload=True),
             dict(model="qwen2.5-7b", method="lora", optimizer="adamw_8bit", num_gpus=4, sharding="zero2")]
    for kw in cases:
        wall, cpu = timed(lambda: estimate(**kw), 500)
        print(f"estimate({', '.join(f'{k}={v}' for k, v in kw.items())}): {wall * 1e3:.3f} ms wall, "
              f"{cpu * 1e3:.3f} ms CPU per call (target <= 1 ms); {estimate(**kw).memory_model}")
    spec = model_spec("llama-3.1-8b")
    seq = np.array([256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072])[:, None, None, None]
    batch = np.arange(1, 11)[None, :, None, None]
    rank = np.array([4, 8, 16, 32, 64, 128, 256, 8, 16, 32])[None, None, :, None]
    gpus = np.arange(1, 11)[None, None, None, :]
    n = np.broadcast(seq, batch, rank, gpus).size
    for method in ("lora", "qlora", "full"):
        kw = dict(method=method, seq_len=seq, batch_size=batch, num_gpus=gpus,
                  **({"lora_rank": rank} if method != "full" else {}))
        wall, cpu = timed(lambda: estimate_arrays(spec, **kw), 20)
        how = sorted(set(estimate_arrays(spec, **kw)["memory_model"].ravel().tolist()))
        print(f"estimate_arrays llama-3.1-8b {method:5s}: {n} configurations in {wall * 1e3:.1f} ms wall, "
              f"{cpu * 1e3:.1f} ms CPU (target <= 100 ms); {', '.join(how)}")


if __name__ == "__main__":
    main()
