"""Capacity as CUDA allocates it: the catalog's CUDA total and context per GPU, each with its source, and the check's
reading of ``torch.cuda.mem_get_info()`` (its total, never its free)."""
import json
import math
from pathlib import Path

import pytest
import torch

from lora_kit.check import stack
from lora_kit.memory.device import CUDA_CONTEXT_BYTES
from lora_kit.plan.gpus import FALLBACK_CAPACITY, FALLBACK_CONTEXT, get_gpu, gpu_table

H200 = json.loads((Path(__file__).parents[1] / "benchmarks" / "reference" / "cuda_h200.json").read_text())["rows"]
CAPACITY = next(r for r in H200 if r["case"] == "capacity")
STEP_ROW = next(r for r in H200 if "context_used" in r)


def test_every_cuda_reading_names_its_source_and_stays_below_nvidia_smi():
    df = gpu_table()
    seen = df["cuda_visible_bytes"].notna()
    assert seen.sum() >= 8
    assert df.loc[seen, "cuda_visible_source"].str.len().gt(20).all()
    assert df.loc[df["cuda_context_bytes"].notna(), "cuda_context_source"].str.len().gt(20).all()
    both = seen & df["cuda_total_mib"].notna()
    # the driver keeps a share of nvidia-smi's total: CUDA's total is smaller on every card read both ways
    assert (df.loc[both, "driver_share_bytes"] > 0).all()
    assert (df.loc[both, "driver_share_bytes"] < 2 ** 30).all()


def test_h200_capacity_and_context_are_the_measured_ones():
    g = get_gpu("H200")
    assert g["cuda_capacity_bytes"] == CAPACITY["cuda_total"]
    assert g["driver_share_bytes"] == CAPACITY["nvml_total"] - CAPACITY["cuda_total"]
    assert g["context_bytes"] == STEP_ROW["context_used"]
    assert g["cuda_capacity_bytes"] < g["capacity_bytes"]  # nvidia-smi's total, which no process can fill


def test_fallbacks_are_labelled():
    gb10 = get_gpu("GB10")  # unified memory: no CUDA reading named
    assert math.isnan(gb10["cuda_visible_bytes"]) and gb10["cuda_capacity_bytes"] == 128 * 10 ** 9
    assert gb10["cuda_capacity_basis"] == FALLBACK_CAPACITY
    assert gb10["context_bytes"] == CUDA_CONTEXT_BYTES and gb10["context_basis"] == FALLBACK_CONTEXT
    # the vendor-GB fallback understates the cards read since: B200 by about 10.7 GiB
    b200 = get_gpu("B200")
    assert (b200["cuda_capacity_bytes"] - b200["memory_gb"] * 1e9) / 2 ** 30 == pytest.approx(10.7, abs=0.1)


def test_check_takes_the_total_of_mem_get_info_not_its_free():
    r = stack.memory_reading(CAPACITY["cuda_free_after_context"], CAPACITY["cuda_total"])
    assert r["cuda_total_bytes"] == get_gpu("H200")["cuda_capacity_bytes"]
    # free after the context is the total less the context: reading it as the capacity counts the context twice
    assert r["cuda_total_bytes"] - r["cuda_free_bytes"] == STEP_ROW["context_used"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_check_without_cuda_reads_nothing():
    assert stack.cuda_memory() is None
    rep = stack.report(probes=False)
    assert rep["hardware"]["gpus"] == [] and "gpu           none" in stack.format_table(rep)
