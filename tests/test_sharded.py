"""Several GPUs: simulate's FSDP2 step on a fake process group equals real 2-process gloo ranks, byte for byte."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lora_kit.memory.estimate import estimate
from lora_kit.memory.fsdp_math import fsdp_communication
from lora_kit.memory.simulate import simulate
from lora_kit.memory.tracker import LiveBytesTracker
from lora_kit.settings import Step

STEP = dict(dtype="float32", seq_len=32, batch_size=2, gradient_checkpointing=False, optimizer="adamw",
            num_gpus=2, sharding="fsdp")
CASES = [dict(method="lora", lora_rank=4, lora_alpha=8), dict(method="full")]


def test_tracker_follows_in_place_storage_resizes():
    """FSDP2 frees a gathered parameter by resize_(0) and re-allocates it by resize_(n), outside the dispatcher."""
    w = torch.empty(1024)  # 4096 B, made before the tracker
    tr = LiveBytesTracker()
    tr.track([w])
    with tr:
        w.untyped_storage().resize_(0)
        assert tr.current_bytes == 0
        w.untyped_storage().resize_(8192)
        assert tr.current_bytes == tr.peak_bytes == 8192
    w.untyped_storage().resize_(0)  # outside the tracker: not followed, and resize_ is torch's own again
    assert tr.current_bytes == 8192 and "resize_" not in torch.UntypedStorage.__dict__


def _real_ranks(model_dir, out) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    settings = [{"model": str(model_dir), **STEP, **c} for c in CASES]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "lora_kit.memory.sharded", "--settings", json.dumps(settings), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_simulate_equals_real_two_process_fsdp2_per_rank(random_llama_dir, tmp_path):
    """The real FSDP2 step under torchrun (2 CPU processes, gloo), each rank tracked, vs simulate's rank 0.

    A real rank is not always deterministic: under CPU load (CI's other worker) a rank's tracked step has held
    96,768 B more than in other launches of the same step (seen 3 times in about 16 launches, either rank, LoRA
    case; cause not found -- a collective's buffers released late by gloo's worker thread is the suspect). So up
    to 3 launches: one must equal simulate byte for byte on every rank; none may be below it or 10 % above."""
    sims = [simulate(str(random_llama_dir), **STEP, **case) for case in CASES]
    assert not dist.is_initialized()  # the fake process group is gone again
    for attempt in range(3):
        recs = _real_ranks(random_llama_dir, tmp_path / f"ranks{attempt}.json")
        for case, rec, sim in zip(CASES, recs, sims):
            assert [x["rank"] for x in rec["ranks"]] == [0, 1]
            for x in rec["ranks"]:
                assert sim.peak_allocated_bytes <= x["peak_allocated_bytes"] <= 1.1 * sim.peak_allocated_bytes
                assert x["collectives"] == sim.collectives  # bytes FSDP2 all-gathered / reduce-scattered
        exact = all(x["peak_allocated_bytes"] == sim.peak_allocated_bytes and x["breakdown"] == sim.breakdown
                    and x["phase"] == sim.phase for rec, sim in zip(recs, sims) for x in rec["ranks"])
        if exact:  # every dimension divides by 2: both ranks hold the same shard sizes
            break
    assert exact, [(c, [x["peak_allocated_bytes"] for x in r["ranks"]], s.peak_allocated_bytes)
                   for c, r, s in zip(CASES, recs, sims)]
    for case, sim in zip(CASES, sims):
        comm = fsdp_communication(str(random_llama_dir), Step(**{**case, "dtype": "float32", "num_gpus": 2}))
        assert {k: comm[k] for k in sim.collectives} == sim.collectives  # the same count by arithmetic
        one_gpu = estimate(str(random_llama_dir), **{**STEP, "num_gpus": 1, "sharding": "none"}, **case)
        assert sim.breakdown["optimizer_states"] < one_gpu.breakdown["optimizer_states"]  # states are sharded
        # estimate: FSDP2's groups by arithmetic; on this 2-layer toy (where small terms weigh most) it was +5.5 %
        # for full fine-tuning; benchmarks/memory_accuracy.py --sharded holds the accuracy matrix
        est = estimate(str(random_llama_dir), **STEP, **case).peak_allocated_bytes
        assert abs(est - sim.peak_allocated_bytes) <= 0.08 * sim.peak_allocated_bytes, (case, est, sim)


@pytest.mark.parametrize("case", [dict(method="full", gradient_checkpointing=False, num_gpus=2),
                                  dict(method="lora", gradient_checkpointing=True, num_gpus=8)])
def test_estimate_follows_fsdp2_moments_on_four_layers(case):
    """The tiny model has 4 decoder layers, so a block's backward below the top one is a moment of its own: there
    the blocks above have freed what they saved (full, no checkpointing, N=2: was +3.2 %); a checkpointed block
    keeps none of its saved tensors in the forward (LoRA, checkpointing, N=8: was +3.0 %)."""
    kw = dict(dtype="float32", seq_len=512, batch_size=1, sharding="fsdp", **case)
    sim = simulate("tiny", **kw)
    est = estimate("tiny", **kw)
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) <= 0.02 * sim.peak_allocated_bytes, (est, sim)
    assert est.phase == sim.phase == "backward"


def test_sharded_simulate_refuses_what_it_cannot_show(random_llama_dir):
    with pytest.raises(ValueError, match="optimizer='adamw_8bit'"):
        simulate(str(random_llama_dir), **{**STEP, "optimizer": "adamw_8bit"}, method="lora")
