"""simulate equals a real CPU step on every kernel path ATen and oneDNN can take on this CPU.

ATen picks its CPU kernels by the CPU's capability (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2,
AVX512 ...); ``ATEN_CPU_CAPABILITY`` forces a lower one, which is how a machine without AVX-512 (or without its
BF16 instructions) runs. bf16 linears go to oneDNN, which picks its own kernels by ISA; ``ONEDNN_MAX_CPU_ISA``
caps it: AVX512_CORE is an AVX-512 CPU without BF16 (oneDNN's ``gemm:jit:bf16`` instead of ``brg_matmul``), AVX2
one without AVX-512 (torch then runs its own bf16 gemm: no oneDNN matmul at all; ``ONEDNN_VERBOSE`` shows which).
Issue 32's Pythia-1B case (LoRA on ``query_key_value``, bf16, sdpa, no checkpointing,
peak in ``_log_softmax_backward_data``) was reported 128 MiB above ``simulate`` on another machine; here the same
architecture at a small size runs in a subprocess per forced path, and the real step must peak at simulate's byte
and allocate the same storages in the same order (``benchmarks/trace_diff.py`` does this at full size).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, torch
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.memory.specs import load_config
from lora_kit.memory.tracker import first_divergence
cfg = load_config(dict(model_type="gpt_neox", vocab_size=1000, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True,
                       tie_word_embeddings=False, hidden_act="gelu", pad_token_id=0, bos_token_id=0, eos_token_id=0))
kw = dict(method="lora", lora_targets=["query_key_value"], lora_rank=8, seq_len=128, batch_size=1,
          gradient_checkpointing=False, attn_implementation="sdpa", dtype="bfloat16")
real = measure_config(cfg, trace=True, **kw)
sim = simulate(cfg, trace=True, **kw)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "real": real.peak_allocated_bytes,
                  "simulate": sim.peak_allocated_bytes, "phases": [real.phase, sim.phase],
                  "divergence": first_divergence(real.allocations, sim.allocations)}))
"""


def _run(env_set: dict) -> tuple[dict, set]:
    """SCRIPT under ``env_set`` in a fresh process: its result and the oneDNN matmul kernels it ran."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.update(env_set, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", ONEDNN_VERBOSE="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    out = json.loads(next(ln for ln in reversed(lines) if ln.startswith("{")))
    assert out["real"] == out["simulate"] and out["phases"] == ["backward", "backward"], out
    assert out["divergence"] is None, out
    return out, {ln.split(",")[6] for ln in lines if ",primitive,exec,cpu,matmul," in ln}


# A CPU below AVX-512 has no AMX either: forcing ATen alone on an AMX CPU leaves oneDNN free to say it can pack
# for AMX, and torch's CPU flash attention then fails ("pack_vnni2 is only supported when avx512 is supported",
# seen on an Intel Xeon with AMX). oneDNN is capped at the same ISA, as on the machine being emulated.
ONEDNN_ISA_OF = {"default": "SSE41", "avx2": "AVX2"}


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_simulate_equals_real_step_on_a_forced_cpu_path(capability):
    out, _ = _run({"ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA_OF[capability]})
    assert out["capability"] == capability.upper()  # the forced path is the one that ran


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_simulate_equals_real_step_under_a_onednn_isa_cap(isa):
    _, kernels = _run({"ONEDNN_MAX_CPU_ISA": isa})
    if isa == "AVX2":  # below AVX-512 torch keeps bf16 matmuls out of oneDNN: its own kernels ran
        assert not kernels, kernels
    else:  # the cap held: no kernel of an ISA above it (brg_matmul:avx512_core_bf16, ..._amx)
        assert not any("avx512_core_bf16" in k or "amx" in k for k in kernels), kernels
