"""The step-time model counts what a real step's operators do (benchmarks/time_counts.py), and a CPU step under
autocast takes the code path of the CUDA step it stands for (lora_kit.training.autocast_query)."""
import sys
from pathlib import Path

import pytest
import torch

from lora_kit.settings import as_step

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import time_counts  # noqa: E402

CFG = time_counts.config(small=True)
SHAPE = dict(seq_len=64, batch_size=2)


@pytest.mark.parametrize("kw", [
    dict(method="lora"),
    dict(method="lora", autocast=True),
    dict(method="lora", gradient_checkpointing=False),
    dict(method="qlora"),
    dict(method="qlora", autocast=True),
    dict(method="qlora", qlora_prepare="none"),
    dict(method="full"),
    dict(method="full", autocast=True),
    dict(method="lora", lora_dropout=0.1),
    dict(method="qlora", autocast=True, lora_dropout=0.1),
    dict(method="qlora", dtype="float32"),  # bitsandbytes computes in fp32: its 4-bit matmul is no autocast op
    dict(method="qlora", dtype="float32", autocast=True),
    dict(method="qlora", dtype="float32", qlora_prepare="none"),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_model_counts_match_the_real_steps_operators(kw):
    """Matmul FLOPs by dtype class exactly (checkpointing's early stop, the first block's free input gradients,
    fp32 adapters, autocast, QLoRA's compute dtype); element-wise bytes within the agreement benchmarks/time_counts.py measures
    (0.98-1.08 on its grid), per stage and in total."""
    step = as_step(None, **SHAPE, **{"gradient_checkpointing": True, **kw})
    r = time_counts.compare(CFG, step)
    real, model = r["real"], r["model"]
    for cls in set(real["flops"]) | {k for k, v in model["flops"].items() if v}:
        assert model["flops"].get(cls, 0.0) == pytest.approx(real["flops"].get(cls, 0.0), rel=1e-9), cls
    assert 0.92 <= r["bytes_ratio"] <= 1.12, r["bytes_ratio"]
    for stage, ratio in r["stage_bytes_ratio"].items():
        if real["bytes"][stage] > 0.01 * sum(real["bytes"].values()):
            assert 0.85 <= ratio <= 1.2, (stage, ratio)
    assert not step.gradient_checkpointing or real["bytes"].get("recompute", 0) > 0  # the census sees the recompute


def test_census_counts_what_an_operator_moves():
    """A view moves nothing; a cast reads one dtype and writes the other; a matmul is FLOPs, keyed by its dtype."""
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    w = torch.ones(16, 4, dtype=torch.bfloat16)
    with time_counts.Census() as c:
        y = x.t().float()  # a view, then a copy: 8 x 16 read in bf16 (2 B) and written in fp32 (4 B)
        x @ w
    assert dict(c.bytes) == {("forward", "_to_copy"): 8 * 16 * (2 + 4)}
    assert dict(c.flops) == {("forward", "bfloat16"): 2 * 8 * 16 * 4}
    assert y.dtype == torch.float32


def test_autocast_query_answers_for_the_cpu_and_is_restored():
    from lora_kit.training import autocast_context, autocast_query
    original = torch.is_autocast_enabled
    ctx = autocast_context(True, "bfloat16", "cpu")
    for _ in range(2):  # reusable: the kit's loops enter it once per step
        with ctx:
            assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_enabled("cuda")
        assert torch.is_autocast_enabled is original and not torch.is_autocast_enabled()
    with autocast_query():  # outside an autocast it changes no answer
        assert not torch.is_autocast_enabled()


def test_qlora_under_autocast_takes_the_cuda_path_on_a_cpu(monkeypatch):
    """peft's 4-bit LoRA layer keeps its adapter output in 16-bit under CUDA's autocast; the CPU step now does
    the same (a smaller peak than the fp32 copies the unpatched CPU path makes), and simulate still equals the
    real step byte for byte, with checkpointing's recompute on the same path."""
    from lora_kit.memory.measure import measure_config
    from lora_kit.memory.simulate import simulate
    kw = dict(method="qlora", autocast=True, seq_len=64, batch_size=2, gradient_checkpointing=False)
    real = measure_config("tiny", **kw).peak_allocated_bytes
    assert simulate("tiny", **kw).peak_allocated_bytes == real
    ckpt = dict(kw, gradient_checkpointing=True)
    assert simulate("tiny", **ckpt).peak_allocated_bytes == measure_config("tiny", **ckpt).peak_allocated_bytes
    import contextlib

    import lora_kit.training as training
    monkeypatch.setattr(training, "autocast_query", contextlib.nullcontext)
    assert measure_config("tiny", **kw).peak_allocated_bytes > real


@pytest.mark.parametrize("kw", [
    dict(method="lora", lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(method="lora"),  # all-linear: peft's LoRA on every expert stack and the router (materialized W + BA)
    dict(method="full"),
    dict(model_type="qwen2_moe", method="full"),  # a shared expert beside the routed ones: a dense MLP of the spec
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_mixture_of_experts_blocks_are_timed(kw):
    """The routed experts (grouped matmuls, router, gather, routing weights, rows put back and summed) are in the
    model's counts: matmul FLOPs exactly (LoRA on the experts included), element-wise bytes within what
    time_counts measures (Mixtral 0.96-0.99 in total: the backward of the experts' element-wise kernels is priced
    as the dense block's, a little short; no stand-in term; Qwen2-MoE's shared expert 1.01)."""
    from transformers import AutoConfig
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=2048, max_position_embeddings=2048, num_experts_per_tok=2)
    kw = dict(kw)
    if kw.pop("model_type", "mixtral") == "qwen2_moe":
        cfg = AutoConfig.for_model("qwen2_moe", **shape, num_experts=4, moe_intermediate_size=256,
                                   shared_expert_intermediate_size=512)
    else:
        cfg = AutoConfig.for_model("mixtral", **shape, num_local_experts=4, head_dim=32)
    r = time_counts.compare(cfg, as_step(None, **SHAPE, **kw))
    for cls, v in r["real"]["flops"].items():
        assert r["model"]["flops"].get(cls, 0.0) == pytest.approx(v, rel=5e-3), cls
    assert 0.93 <= r["bytes_ratio"] <= 1.05, r["bytes_ratio"]


@pytest.mark.parametrize("kw", [dict(method="lora"), dict(method="qlora", autocast=True)],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_lora_dropout_bytes_are_the_real_kernels_bytes(kw):
    """What LoRA dropout adds to a step, per stage, is what the real step's dropout kernels move (the fused
    ``native_dropout`` and its backward, on each adapter's input in the dtype it arrives in: the attention
    output's 16-bit under QLoRA's autocast, the stream's fp32 elsewhere)."""
    rows = [time_counts.compare(CFG, as_step(None, **SHAPE, gradient_checkpointing=True, lora_dropout=d, **kw))
            for d in (0.0, 0.1)]
    for stage in ("forward", "recompute", "backward"):
        real = rows[1]["real"]["bytes"][stage] - rows[0]["real"]["bytes"][stage]
        model = rows[1]["model"]["bytes"][stage] - rows[0]["model"]["bytes"][stage]
        assert real > 0 and model == pytest.approx(real, rel=1e-9), stage


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("model_type", sorted(set(time_counts.FAMILIES) - {"mistral"}))
def test_other_families_blocks_are_counted(model_type, method):
    """Beyond the Llama block the constants were read on: q/k norms (Qwen3, Gemma 3, OLMo 2), a norm after the MLP
    that makes checkpointing's recompute run its last projection (Gemma 3, OLMo 2: post-norm), LayerNorm, an
    ungated GELU MLP and partial rotary (GPT-NeoX), RMSNorm weighted in fp32 (Gemma 3, OLMo 2) and fp32 rotary
    (OLMo 2). Matmul FLOPs exactly; element-wise bytes within the band these families measure
    (``benchmarks/time_counts.py --families`` writes them), wider than the Llama grid's."""
    r = time_counts.compare(time_counts.family_config(model_type),
                            as_step(None, **SHAPE, gradient_checkpointing=True, method=method))
    real, model = r["real"], r["model"]
    for cls in set(real["flops"]) | {k for k, v in model["flops"].items() if v}:
        assert model["flops"].get(cls, 0.0) == pytest.approx(real["flops"].get(cls, 0.0), rel=1e-9), cls
    assert 0.92 <= r["bytes_ratio"] <= 1.08, r["bytes_ratio"]
