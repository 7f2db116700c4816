"""Step-time model: FLOP formulas on a tiny config, calibration round trip, assumptions visible."""
import pytest
from transformers import LlamaConfig

from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.timing import TimeModel, calibrate, flops_per_step, step_time, trainable_params
from lora_kit.settings import Step

CFG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4)
H, L, V, FFN = 256, 4, 512, 768
P_LIN = L * (4 * H * H + 3 * H * FFN)  # q,k,v,o + gate,up,down
P_HEAD = V * H


def test_full_is_six_n_plus_attention():
    T, s = 8 * 128, 128
    f = flops_per_step(CFG, method="full", seq_len=s, batch_size=8, attn_implementation="eager",
                       gradient_checkpointing=False)
    attn = 4 * T * s * H * L
    assert f["forward"] == 2 * T * (P_LIN + P_HEAD) + attn
    assert f["total"] == 6 * T * (P_LIN + P_HEAD) + 3 * attn


def test_lora_frozen_backward_adapters_and_checkpointing():
    T, s, r = 4 * 64, 64, 8
    ad = L * r * (4 * (H + H) + 2 * (H + FFN) + (FFN + H))  # r * (in + out) per adapted linear
    f = flops_per_step(CFG, method="lora", seq_len=s, batch_size=4, lora_rank=r, attn_implementation="eager", gradient_checkpointing=False)
    attn = 4 * T * s * H * L
    assert f["backward"] == 2 * T * (P_LIN + P_HEAD) + 2 * attn  # input grads only, no weight grads
    assert f["adapters"] == 6 * T * ad
    assert trainable_params(CFG, Step(lora_rank=r)) == ad
    ck = flops_per_step(CFG, method="lora", seq_len=s, batch_size=4, lora_rank=r, gradient_checkpointing=True,
                        attn_implementation="eager")
    assert ck["recompute"] == 2 * T * P_LIN + attn + 2 * T * ad  # blocks re-run forward, not the LM head
    full = flops_per_step(CFG, method="full", seq_len=s, batch_size=4, attn_implementation="eager", gradient_checkpointing=False)
    assert f["total"] < full["total"]
    sdpa = flops_per_step(CFG, method="lora", seq_len=s, batch_size=4, lora_rank=r, gradient_checkpointing=False)
    assert sdpa["total"] < f["total"]  # causal kernels skip the masked half
    qv = flops_per_step(CFG, method="lora", seq_len=s, batch_size=4, lora_rank=r, lora_targets=["q_proj", "v_proj"], gradient_checkpointing=False)
    assert qv["adapters"] == 6 * T * L * r * 4 * H


def test_qlora_adds_memory_bound_dequant_that_does_not_scale_with_batch():
    g = get_gpu("L4")
    lo = step_time("llama-3.1-8b", g, method="lora", seq_len=1024, batch_size=1, gradient_checkpointing=False)
    q1 = step_time("llama-3.1-8b", g, method="qlora", seq_len=1024, batch_size=1, gradient_checkpointing=False)
    q8 = step_time("llama-3.1-8b", g, method="qlora", seq_len=1024, batch_size=8, gradient_checkpointing=False)
    assert q1["step_seconds"] > lo["step_seconds"]
    assert q1["dequant_seconds"] == q8["dequant_seconds"] > 0
    assert q1["tokens_per_second"] < q8["tokens_per_second"]


def test_calibration_reproduces_measurement_and_scales():
    cpu = {"name": "cpu", "bf16_tflops": 1.0, "fp32_tflops": 1.0, "memory_bandwidth_gbs": 10.0}
    base = dict(model=CFG, method="lora", seq_len=128, batch_size=8, dtype="float32")
    tm = calibrate(0.8, base, cpu)
    assert "calibrated" in tm.source and tm.scale != 1.0 and tm.error_factor <= TimeModel().error_factor
    assert step_time(CFG, cpu, time_model=tm, **{k: v for k, v in base.items() if k != "model"})["step_seconds"] \
        == pytest.approx(0.8)
    big = step_time(CFG, cpu, time_model=tm, method="lora", seq_len=128, batch_size=16, dtype="float32")
    assert 1.5 < big["step_seconds"] / 0.8 < 2.1  # twice the tokens, fixed optimizer cost
    with pytest.raises(ValueError, match="positive"):
        calibrate(0, base, cpu)
    with pytest.raises(ValueError, match="positive"):
        TimeModel(matmul_efficiency=-0.1)


def test_assumptions_are_visible_and_dtype_rates():
    tm = TimeModel()
    assert f"{tm.matmul_efficiency:.0%}" in tm.describe() and "fitted" in tm.describe()
    g = get_gpu("A100-80GB")
    bf = step_time("llama-3.1-8b", g, dtype="bfloat16", seq_len=512, method="full")["parts_seconds"]["matmul"]
    f32 = step_time("llama-3.1-8b", g, dtype="float32", seq_len=512, method="full")["parts_seconds"]["matmul"]
    assert f32 / bf == pytest.approx(312 / 19.5, rel=0.05)  # fp32 on CUDA cores (allow_tf32 is off by default)
    t4 = step_time("llama-3.2-1b", get_gpu("T4"), dtype="bfloat16", seq_len=512)  # falls back to the fp16 figure
    assert t4["step_seconds"] > 0
    with pytest.raises(ValueError, match="lora_targets"):
        flops_per_step(CFG, method="lora", lora_targets=["nope"])


def test_two_run_calibration_recovers_fixed_overhead():
    cpu = {"name": "cpu", "bf16_tflops": 1.0, "fp32_tflops": 1.0, "memory_bandwidth_gbs": 10.0}
    truth = TimeModel(scale=1.7, overhead_seconds=0.5)
    big = dict(model=CFG, method="lora", seq_len=256, batch_size=8, dtype="float32")
    small = dict(model=CFG, method="lora", seq_len=16, batch_size=1, dtype="float32")

    def t(kw):
        return step_time(CFG, cpu, time_model=truth, **{k: v for k, v in kw.items() if k != "model"})["step_seconds"]

    tm = calibrate(t(big), big, cpu, second=(t(small), small))
    assert tm.scale == pytest.approx(1.7) and tm.overhead_seconds == pytest.approx(0.5)
    assert "two measured steps" in tm.source and "fixed per step" in tm.describe()
    with pytest.raises(ValueError, match="different token counts"):
        calibrate(1.0, big, cpu, second=(1.0, big))
