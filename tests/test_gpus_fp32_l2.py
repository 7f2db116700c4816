"""The catalog's FP32 CUDA-core peak and L2 size: sourced per row, and what the time model reads."""
import math

import pytest

from lora_kit.plan import time_constants as C
from lora_kit.plan.gpus import add_gpu, gpu_table, remove_user_gpus
from lora_kit.plan.timing import fp32_flops, l2_bytes, step_time


def test_fp32_and_l2_rows_name_their_source_and_drive_the_time_model():
    df = gpu_table()
    rows = df[df["fp32_tflops"].notna() | df["l2_mb"].notna()]
    assert set(C.FP32_TFLOPS) <= set(rows["name"]) and set(C.L2_MB) <= set(rows["name"])
    for r in rows.to_dict("records"):
        assert isinstance(r["fp32_l2_source"], str) and r["fp32_l2_source"].strip(), r["name"]
        assert 0 < r["fp32_tflops"] < r["fp16_tflops"], r["name"]  # CUDA cores are slower than tensor cores
        assert r["l2_mb"] > 0, r["name"]
        flops, basis = fp32_flops(r)
        assert basis == "the GPU row's fp32_tflops" and flops == r["fp32_tflops"] * 1e12
        assert l2_bytes(r) == r["l2_mb"] * 2 ** 20
        # the constants were fitted with time_constants' tables: the rows must not move them
        assert math.isclose(r["fp32_tflops"], C.FP32_TFLOPS[r["name"]]) and r["l2_mb"] == C.L2_MB[r["name"]]


def test_add_gpu_takes_fp32_and_l2_and_the_step_time_uses_them():
    """A user's card with its own FP32 peak and L2: numbers in the row, read by the time model."""
    card = dict(memory_gb=24, memory_bandwidth_gbs=300, bf16_tflops=100)
    fp32_step = dict(method="lora", dtype="float32", autocast=False, seq_len=256, batch_size=1)
    try:
        slow = add_gpu("MyCard", **card, fp32_tflops="10", l2_mb=48)  # a CSV-style string is read as a number
        assert (slow["fp32_tflops"], slow["l2_mb"]) == (10.0, 48.0)
        assert fp32_flops(slow) == (10e12, "the GPU row's fp32_tflops") and l2_bytes(slow) == 48 * 2 ** 20
        t_slow = step_time("qwen2.5-0.5b", slow, **fp32_step)["step_seconds"]
        fast = add_gpu("MyCard", **card, fp32_tflops=40, l2_mb=48)
        assert step_time("qwen2.5-0.5b", fast, **fp32_step)["step_seconds"] < t_slow  # fp32 matmuls at its peak
        for bad in ({"fp32_tflops": 0}, {"l2_mb": -1}):
            with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive number"):
                add_gpu("Other", **card, **bad)
    finally:
        remove_user_gpus()
