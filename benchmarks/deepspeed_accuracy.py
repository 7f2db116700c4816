"""DeepSpeed ZeRO-2 / ZeRO-3 on CPU: each rank's measured peak vs ``estimate(sharding="zero2" / "zero3")``.

DeepSpeed is not a dependency of lora_kit; run this from a separate environment that has it, with lora_kit
importable (``PYTHONPATH``)::

    python3.11 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 \\
        deepspeed "transformers==5.24.*" peft==0.21.2 "accelerate==1.16.*"
    PYTHONPATH=. HF_HUB_OFFLINE=1 /tmp/dsvenv/bin/python benchmarks/deepspeed_accuracy.py

Each case is its own ``torchrun --nproc_per_node 2`` launch (``DS_ACCELERATOR=cpu``, gloo): the model and
batch of :func:`lora_kit.memory.measure.build_real_model`, ``torch.optim.AdamW(foreach=True)`` handed to
``deepspeed.initialize`` (fp32, no mixed precision), two steps (``engine(**batch).loss``, ``engine.backward``,
``engine.step``); the second is tracked with :class:`~lora_kit.memory.tracker.LiveBytesTracker`, which counts
every tensor alive when it starts (found through ``gc``: DeepSpeed's flat partitions and buffers included) and
every one made during the step. ``buckets``: DeepSpeed's defaults (what accelerate's plugin config, and so
``lora_kit.run.accelerate_config``, leaves them at: ``reduce_bucket_size`` 5e8 elements) or the HF Trainer's
``"auto"`` values (``hidden_size ** 2``, prefetch ``0.9 * hidden_size ** 2``, persistence ``10 * hidden_size``).
Writes ``benchmarks/results/deepspeed_accuracy.json``.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "deepspeed_accuracy.json"
STEP = dict(model="tiny", dtype="float32", seq_len=128, batch_size=2, gradient_checkpointing=False,
            optimizer="adamw", num_gpus=2)


def cases() -> list[dict]:
    return [dict(STEP, method=m, sharding=z, buckets=b)
            for b in ("trainer", "default") for z in ("zero2", "zero3") for m in ("full", "lora")]


def _zero_config(stage: int, buckets: str, h: int) -> dict:
    z = {"stage": stage}
    if buckets == "trainer":
        z.update(reduce_bucket_size=h * h, stage3_prefetch_bucket_size=int(0.9 * h * h),
                 stage3_param_persistence_threshold=10 * h)
    return z


def rank_main(case: dict, out: str) -> None:
    """One rank (under torchrun): this rank's peak of the second DeepSpeed step."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from lora_kit.memory.breakdown import label_training_state, tracked_peak
    from lora_kit.memory.measure import build_real_model
    from lora_kit.memory.specs import check_model_step, load_config
    from lora_kit.memory.tracker import LiveBytesTracker
    from lora_kit.training import optimizer_for
    deepspeed.init_distributed(dist_backend="gloo")
    from lora_kit.settings import as_step
    s = as_step({k: v for k, v in case.items() if k != "buckets"})
    check_model_step(case["model"], s)
    cfg = load_config(case["model"])
    net, _, batch = build_real_model(cfg, s.replace(optimizer="sgd"), seed=0)
    params = [p for p in net.parameters() if p.requires_grad]
    ds_cfg = {"train_micro_batch_size_per_gpu": s.batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": _zero_config(int(s.sharding[-1]), case["buckets"], cfg.hidden_size),
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    eng, opt, _, _ = deepspeed.initialize(model=net, optimizer=optimizer_for(params, s.optimizer, "cpu"),
                                          config=ds_cfg, model_parameters=params)

    def step(tracker=None):
        def phase(name):
            if tracker is not None:
                tracker.phase = name
        phase("forward")
        loss = eng(**batch).loss
        phase("backward")
        eng.backward(loss)
        del loss
        phase("optimizer")
        eng.step()
    step()
    gc.collect()
    tr = LiveBytesTracker()
    label_training_state(tr, net, getattr(opt, "optimizer", opt))
    tr.track([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
    tr.reset_peak()
    start, t0 = tr.current_bytes, time.perf_counter()
    with tr:
        step(tr)
    peak, bd = tracked_peak(tr)
    res = {"rank": dist.get_rank(), "peak_allocated_bytes": peak, "breakdown": bd, "phase": tr.peak_phase,
           "live_at_start_bytes": start, "wall_seconds": round(time.perf_counter() - t0, 2),
           "ds_zero_config": ds_cfg["zero_optimization"], "deepspeed": deepspeed.__version__}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, res)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks, indent=1))
    dist.destroy_process_group()


def main() -> None:
    from lora_kit.memory.device import DEEPSPEED_REDUCE_BUCKET
    from lora_kit.memory.estimate import estimate
    from lora_kit.memory.static import DTYPE_BYTES
    from lora_kit.memory.specs import model_spec
    from lora_kit.results import write_json_atomic
    rows = []
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for case in cases():
        kw = {k: v for k, v in case.items() if k != "buckets"}
        row = {"case": case, "estimate": estimate(**kw).peak_allocated_bytes}
        if case["buckets"] == "trainer":  # estimate counts the default bucket: swap in the Trainer's hidden_size**2
            h = model_spec(case["model"]).hidden_size
            row["estimate"] -= (DEEPSPEED_REDUCE_BUCKET - h * h) * DTYPE_BYTES[case["dtype"]]
            row["estimate_note"] = "estimate with reduce_bucket_size = hidden_size**2 instead of the default 5e8"
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "ranks.json"
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                str(case["num_gpus"]), __file__, "--rank", json.dumps(case), str(out)],
                               capture_output=True, text=True, env=env, check=False)
            if r.returncode:
                row["error"] = r.stderr[-2000:]
            else:
                row["ranks"] = json.loads(out.read_text())
                row["real"] = row["ranks"][0]["peak_allocated_bytes"]
        rows.append(row)
        if "real" in row:
            print(f"{case['sharding']} {case['method']:4s} buckets={case['buckets']:7s} real(rank 0) "
                  f"{row['real'] / 2**20:9.2f} MiB (ranks {[x['peak_allocated_bytes'] for x in row['ranks']]}) "
                  f"estimate {row['estimate'] / 2**20:8.2f} MiB {100 * (row['estimate'] / row['real'] - 1):+7.1f}%", flush=True)
        else:
            print(f"{case}: failed: {row['error']}", flush=True)
        write_json_atomic(OUT, {"rows": rows})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main()
