"""simulate against real CPU steps on the two cases "One memory model" named as drifted (-m long: minutes).

- Pythia-1B at full depth, LoRA on ``query_key_value`` r 8, seq 1024, batch 1, no checkpointing, sdpa, bf16: the
  real step and simulate peak at the same byte and allocate the same storages in the same order (random-init
  model). The issue's 3,511,384,064 B real peak (128 MiB above) does not reproduce on this machine (AMD EPYC,
  AVX512-BF16, no AMX, torch 2.13.0 CPU), nor on the kernel paths a CPU without AVX512-BF16 or AVX-512 takes,
  forced here: ATEN_CPU_CAPABILITY avx2 / default, ONEDNN_MAX_CPU_ISA AVX2 / AVX512_CORE / AVX512_CORE_VNNI /
  AVX512_CORE_BF16 / AVX512_CORE_AMX, combinations, torch.backends.mkldnn off (full depth: 3,377,166,336 B both
  sides on ATen own / avx2 / default and ATen avx2 x oneDNN own / AVX512_CORE / AVX512_CORE_VNNI; the rest on
  2-layer and small Pythia-shaped configs; numbers and commands in ``benchmarks/trace_diff.py``'s docstring).
  ``benchmarks/trace_diff.py`` names the first operator where a real step and simulate part on a machine where
  they do.
- The Llama-3.2-1B config cut to 4 layers (tied embeddings), LoRA r 16 all-linear, seq 1024, batch 1 per rank,
  checkpointing, bf16, 2 real FSDP2 ranks (torchrun, gloo): rank 0's peak is simulate's under the same wrapping.
  The plain recipe (every decoder layer, then the root, all resharded after forward: ``fsdp_policy="layers"``)
  peaks above accelerate's wrapping, which keeps the tied embedding's group gathered from forward to backward;
  comparing one recipe's real peak with the other's simulate is what looked like a 4.5 % miss.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.memory.specs import load_config
from lora_kit.memory.tracker import first_divergence

pytestmark = pytest.mark.long


def test_pythia_1b_full_depth_real_step_equals_simulate():
    kw = dict(method="lora", lora_targets=["query_key_value"], lora_rank=8, seq_len=1024, batch_size=1,
              gradient_checkpointing=False, attn_implementation="sdpa", dtype="bfloat16")
    real = measure_config("pythia-1b", trace=True, **kw)
    sim = simulate("pythia-1b", trace=True, **kw)
    assert (real.peak_allocated_bytes, real.breakdown, real.phase) == (sim.peak_allocated_bytes, sim.breakdown,
                                                                     sim.phase)
    assert first_divergence(real.allocations, sim.allocations) is None  # every storage, in order (trace_diff.py)


@pytest.mark.parametrize("policy", ["layers", "accelerate"])
def test_fsdp2_rank_0_equals_simulate_under_the_same_wrapping(policy, tmp_path):
    cfg = load_config("llama-3.2-1b")
    cfg.num_hidden_layers = 4
    cfg.save_pretrained(tmp_path / "model")
    step = dict(method="lora", lora_rank=16, seq_len=1024, batch_size=1, gradient_checkpointing=True,
                dtype="bfloat16", num_gpus=2, sharding="fsdp")
    out = tmp_path / "peaks.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                    "lora_kit.memory.sharded", "--settings", json.dumps({"model": str(tmp_path / "model"), **step}),
                    "--policy", policy, "--out", str(out)], check=True, env=env, capture_output=True, timeout=1200)
    rank0 = json.loads(out.read_text())["ranks"][0]
    sim = simulate(str(tmp_path / "model"), fsdp_policy=policy, **step)
    assert rank0["peak_allocated_bytes"] == sim.peak_allocated_bytes and rank0["phase"] == sim.phase
