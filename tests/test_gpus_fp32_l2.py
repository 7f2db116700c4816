"""The catalog's FP32 CUDA-core peak and L2 size: sourced per row, and what the time model reads."""
import math

from lora_kit.plan import time_constants as C
from lora_kit.plan.gpus import gpu_table
from lora_kit.plan.timing import fp32_flops, l2_bytes


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
