"""plan.json / sweeps.json are built by the package with their assumptions stated."""
from __future__ import annotations

import json

import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.plan import time_constants
from lora_kit.plan.planner import compare_methods, placeholder_epoch
from lora_kit.plan.records import PLAN_BATCH, plan_record, sweeps_record
from lora_kit.plan.timing import TimeModel


def test_plan_record_states_every_assumption_and_is_json():
    table = compare_methods("llama-3.1-8b", gpus=["L4", "A100-80GB"], seq_len=2048, lora_rank=8)
    rec = plan_record(table, "llama-3.1-8b", seq_len=2048, lora_rank=8)
    json.dumps(rec, allow_nan=False)  # NaN (rows that do not fit) became null
    a = rec["assumptions"]
    assert a["dtype"] == "bfloat16" and a["gradient_checkpointing"] is True and a["lora_rank"] == 8
    assert a["optimizer"] == "adamw" and a["seq_len"] == 2048 and "method" not in a
    assert rec["epoch"] == placeholder_epoch(10_000, 2048) and "a placeholder, not your data" in rec["epoch"]["note"]
    assert rec["batch_size"] == PLAN_BATCH and len(rec["rows"]) == len(table) == 6
    assert rec["recommendation"] == table.attrs["recommendation"]
    unfit = [r for r in rec["rows"] if not r["fits"]]
    assert all(r["epoch_cost"] is None for r in unfit)


def test_sweeps_record_keeps_the_estimate_and_its_settings():
    est = estimate("tiny", seq_len=64, batch_size=16, dtype="float32", gradient_checkpointing=False)
    rec = sweeps_record("llama-3.1-8b", "A100-80GB", 8192, {"n": 3}, est)
    json.dumps(rec, allow_nan=False)
    assert rec["run_estimate"]["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert rec["run_estimate"]["settings"]["batch_size"] == 16 and rec["run_estimate"]["phase"] == est.phase


def test_plan_record_takes_the_epoch_and_margin_the_table_used():
    table = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], seq_len=1024, num_examples=500, margin=0.2)
    rec = plan_record(table, "llama-3.1-8b", seq_len=1024, margin=0.2)
    assert rec["epoch"] == placeholder_epoch(500, 1024) and rec["epoch"]["tokens"] == 500 * 1024
    assert rec["margin"] == 0.2
    packed = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], seq_len=1024, dataset_tokens=3_000_000)
    assert plan_record(packed, "llama-3.1-8b", seq_len=1024)["epoch"]["tokens"] == 3_000_000


def test_sweeps_record_keeps_the_longest_seq_len_per_setting():
    est = estimate("tiny", seq_len=64, batch_size=16, dtype="float32", gradient_checkpointing=False)
    best = {"lora, checkpointing on": 32768, "qlora, checkpointing off": 8192}
    rec = sweeps_record("llama-3.1-8b", "A100-80GB", best, {"n": 3}, est)
    assert rec["max_seq_len_batch1"] == best and json.loads(json.dumps(rec))["max_seq_len_batch1"] == best


def test_plan_record_keeps_the_time_error_the_intervals_used():
    """The run card reads the interval's factor from plan.json: the fitted model's, or a calibrated model's."""
    table = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], seq_len=1024, methods=("lora",))
    rec = json.loads(json.dumps(plan_record(table, "llama-3.1-8b", seq_len=1024)))
    assert rec["time_error_factor"] == table.attrs["time_error_factor"] == time_constants.ERROR_FACTOR_UNCALIBRATED
    row = rec["rows"][0]
    assert row["epoch_hours_high"] / row["epoch_hours"] == pytest.approx(rec["time_error_factor"])
    narrow = compare_methods("llama-3.1-8b", gpus=["A100-80GB"], seq_len=1024, methods=("lora",),
                             time_model=TimeModel(error_factor=1.05))
    rec = plan_record(narrow, "llama-3.1-8b", seq_len=1024)
    assert rec["time_error_factor"] == 1.05
    assert rec["rows"][0]["epoch_hours"] / rec["rows"][0]["epoch_hours_low"] == pytest.approx(1.05)


def test_plan_record_keeps_the_cuda_attention_note_of_the_runs_row():
    """With the run's GPU and method the plan records whether CUDA runs that row's attention in the math kernel
    (QLoRA's fp32 q/k/v with grouped K/V before torch 2.14), at the row's micro-batch; LoRA in bf16 records None."""
    import torch
    from lora_kit.memory.cuda_kernels import EFFICIENT_GQA_FROM, cuda_attention_note, torch_version
    from lora_kit.settings import as_step
    table = compare_methods("llama-3.1-8b", gpus=["H100-SXM"], seq_len=2048)
    rec = json.loads(json.dumps(plan_record(table, "llama-3.1-8b", seq_len=2048, gpu="H100-SXM", method="qlora")))
    row = next(r for r in rec["rows"] if r["method"] == "qlora")
    assert row["batch_size"] > 1  # the note is for the row's micro-batch, not the planning default
    note = rec["attention_note"]
    if torch_version(torch.__version__) < EFFICIENT_GQA_FROM:
        assert "math kernel (fp32 q/k/v with grouped K/V): up to +" in note and "Fix:" in note
        one = cuda_attention_note("llama-3.1-8b", as_step(None, method="qlora", seq_len=2048), compute_capability=9.0)
        assert note != one  # B x heads x S x S scores: the row's batch costs more than batch 1
    else:
        assert note is None
    lora = plan_record(table, "llama-3.1-8b", seq_len=2048, gpu="H100-SXM", method="lora")
    assert lora["attention_note"] is None
    assert "attention_note" not in plan_record(table, "llama-3.1-8b", seq_len=2048)
