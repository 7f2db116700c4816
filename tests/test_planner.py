"""Planner: sweep == estimate row by row, exact fit boundaries, fixes, method x GPU comparison, bad input."""
import math
import random

import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.planner import check_plan, compare_methods, fit_verdict, fixes, max_fit, sweep, verdict_text
from lora_kit.settings import LORA_FIELDS, METHODS

M = "llama-3.2-1b"


def _row_kwargs(row) -> dict:
    keys = ("method", "dtype", "autocast", "double_quant", "seq_len", "batch_size", "lora_rank", "lora_alpha",
            "lora_targets", "gradient_checkpointing", "attn_implementation", "optimizer", "num_gpus", "sharding",
            "cpu_offload", "grad_accum")
    kw = {k: (row[k].item() if hasattr(row[k], "item") else row[k]) for k in keys}
    if isinstance(kw["lora_targets"], tuple):
        kw["lora_targets"] = list(kw["lora_targets"])
    return {k: v for k, v in kw.items() if not (kw["method"] == "full" and k in LORA_FIELDS)}  # full ignores LoRA


def test_sweep_agrees_with_estimate_on_random_rows(monkeypatch):
    """Every categorical combination here is served by a shipped fit (or composed from one): nothing is fitted."""
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    df = sweep(M, method=list(METHODS), seq_len=[128, 1000, 4096], batch_size=[1, 3, 8], lora_rank=[8, 64],
               gradient_checkpointing=[False, True], optimizer=["adamw", "paged_adamw_8bit", "sgd"],
               gpu=["L4", "H100-SXM"])
    assert len(df) == 3 * 3 * 3 * 2 * 2 * 3 * 2
    assert set(df["gpu"]) == {"L4", "H100-SXM"}
    rng = random.Random(0)
    for i in rng.sample(range(len(df)), 25):
        row = df.iloc[i]
        e = estimate(M, **_row_kwargs(row))
        assert row["peak_allocated_bytes"] == e.peak_allocated_bytes
        assert row["device_total_bytes"] == e.device_total_bytes
        assert {k: int(row[k]) for k in e.breakdown} == e.breakdown
        assert row["phase"] == e.phase
        v = fit_verdict(e.device_total_bytes, row["gpu"], 0.10)
        assert row["fits"] == v["fits"] and row["headroom_gib"] == pytest.approx(v["headroom_bytes"] / 2 ** 30)
        assert row["headroom_pct"] == pytest.approx(100 * v["headroom_bytes"] / v["cuda_capacity_bytes"])


def test_sweep_multi_gpu_sharding_and_margin():
    df = sweep(M, method="full", num_gpus=[2, 4], sharding=["ddp", "zero3"], gpu="A100-80GB", margin=0.2)
    assert len(df) == 4
    cuda_gib = get_gpu("A100-80GB")["cuda_capacity_bytes"] / 2 ** 30  # judged on CUDA's total, not nvidia-smi's 80
    assert df["usable_gib"].tolist() == pytest.approx([0.8 * cuda_gib] * 4) and cuda_gib < 80
    assert df["capacity_gib"].tolist() == pytest.approx([80] * 4)  # shown as the catalog has it
    ddp = df[df["sharding"] == "ddp"]["peak_allocated_bytes"].to_numpy()  # the device total adds NCCL per rank
    z3 = df[df["sharding"] == "zero3"]["peak_allocated_bytes"].to_numpy()
    assert ddp[0] == ddp[1] and (z3 < ddp).all() and z3[1] < z3[0]  # memory pools only when sharded
    no_gpu = sweep(M, seq_len=[256, 512])
    assert "fits" not in no_gpu.columns and len(no_gpu) == 2


def test_sweep_bad_input():
    with pytest.raises(ValueError, match="Unknown sweep argument.*did you mean 'seq_len'"):
        sweep(M, seqlen=[1])
    with pytest.raises(ValueError, match="seq_len must be a positive integer .*got -1"):
        sweep(M, seq_len=[-1, 5])
    with pytest.raises(ValueError, match="empty list"):
        sweep(M, batch_size=[])
    with pytest.raises(ValueError, match="Unknown GPU"):
        sweep(M, gpu="Z80")
    with pytest.raises(ValueError, match="margin"):
        sweep(M, gpu="L4", margin=-0.1)
    with pytest.raises(ValueError, match="margin"):
        sweep(M, gpu="L4", margin=1.5)


@pytest.mark.parametrize("param,kw", [("seq_len", dict(method="qlora", batch_size=2)),
                                      ("batch_size", dict(method="lora", seq_len=1024)),
                                      ("lora_rank", dict(method="lora", batch_size=4))])
def test_max_fit_is_the_exact_boundary(param, kw):
    gpu = "L4"
    if param == "lora_rank":  # put the plan at the memory edge so that the rank decides
        kw = {**kw, "seq_len": max_fit("seq_len", model=M, gpu=gpu, **kw)}
    v = max_fit(param, model=M, gpu=gpu, **kw)
    assert v > 0
    usable = fit_verdict(0, gpu)["usable_bytes"]
    assert estimate(M, **{**kw, param: v}).device_total_bytes <= usable
    assert estimate(M, **{**kw, param: v + 1}).device_total_bytes > usable
    m8 = max_fit(param, model=M, gpu=gpu, multiple_of=8, **kw)
    assert m8 % 8 == 0 and v - 8 < m8 <= v


def test_max_fit_nothing_fits_and_bad_param():
    assert max_fit("seq_len", model="llama-3.1-70b", gpu="T4", method="full") == 0
    with pytest.raises(ValueError, match="param must be one of"):
        max_fit("hidden_size", model=M, gpu="L4")
    with pytest.raises(ValueError, match="needs method"):
        max_fit("lora_rank", model=M, gpu="L4", method="full")


def test_fixes_and_verdict():
    kw = dict(method="lora", dtype="bfloat16", seq_len=8192, batch_size=8)
    plan = check_plan(M, "L4", **kw)
    assert not plan["fits"] and plan["headroom_bytes"] < 0
    text = verdict_text(plan)
    assert "Does NOT fit on L4" in text and "GiB" in text and "%" in text and "Cheapest change" in text
    all_fixes = fixes("L4", model=M, **kw)
    assert all_fixes[0] == plan["fix"]
    for f in all_fixes:  # every proposed change really fits
        if "gpu" in f["settings"]:
            assert fit_verdict(f["device_total_bytes"], f["settings"]["gpu"])["fits"]
        else:
            e = estimate(M, **{**kw, **f["settings"]})
            assert e.device_total_bytes == f["device_total_bytes"] and fit_verdict(e.device_total_bytes, "L4")["fits"]
    ok = check_plan(M, "H200", **{**kw, "batch_size": 1})
    assert ok["fits"] and ok["fix"] is None and "Fits on H200" in verdict_text(ok)
    assert fixes("H200", model=M, **{**kw, "batch_size": 1}) == []


def test_compare_methods_table_and_recommendation():
    df = compare_methods("llama-3.1-8b", gpus=["L4", "A100-80GB", "H100-SXM"], seq_len=1024, dtype="bfloat16",
                         gradient_checkpointing=True, num_examples=5000, prices={"H100-SXM": 2.5})
    assert len(df) == 9 and set(df["method"]) == set(METHODS)
    full_l4 = df[(df["method"] == "full") & (df["gpu"] == "L4")].iloc[0]
    assert not full_l4["fits"] and math.isnan(full_l4["epoch_cost"])
    ok = df[df["fits"]]
    assert len(ok) >= 3
    for _, r in ok.iterrows():
        e = estimate("llama-3.1-8b", method=r["method"], seq_len=1024, dtype="bfloat16", gradient_checkpointing=True,
                     batch_size=int(r["batch_size"]))
        assert r["device_total_gib"] == pytest.approx(e.device_total_bytes / 2 ** 30)
        assert r["epoch_hours"] == pytest.approx(r["steps_per_epoch"] * r["step_seconds"] / 3600)
        assert r["epoch_cost"] == pytest.approx(r["epoch_hours"] * r["price_per_hour"])
        if r["batch_size"] < 64:  # the largest micro-batch that fits
            e2 = estimate("llama-3.1-8b", method=r["method"], seq_len=1024, dtype="bfloat16",
                          gradient_checkpointing=True, batch_size=int(r["batch_size"]) + 1)
            assert not fit_verdict(e2.device_total_bytes, r["gpu"])["fits"]
    h = df[df["gpu"] == "H100-SXM"]
    assert (h["price_source"] == "yours").all() and (df[df["gpu"] == "L4"]["price_source"] == "example").all()
    q = ok[ok["method"] == "qlora"]
    lo = ok[ok["method"] == "lora"]
    same = set(q["gpu"]) & set(lo["gpu"])
    for g in same:  # QLoRA is slower per token than LoRA on the same GPU at the same micro-batch
        a = compare_methods("llama-3.1-8b", gpus=[g], methods=["lora", "qlora"], seq_len=1024, batch_size=1,
                            dtype="bfloat16", gradient_checkpointing=True)
        assert a.iloc[1]["step_seconds"] > a.iloc[0]["step_seconds"]
    rec = df.attrs["recommendation"]
    assert "Cheapest per epoch" in rec and "EXAMPLE prices" in rec
    with pytest.raises(ValueError, match="non-negative"):
        compare_methods(M, gpus=["L4"], prices={"L4": -1})
    with pytest.raises(ValueError, match="margin"):
        compare_methods(M, gpus=["L4"], margin=-0.5)
    with pytest.raises(ValueError, match="method='dora' is not valid"):
        compare_methods(M, gpus=["L4"], methods=["dora"])


@pytest.mark.parametrize("bad", [dict(method="dora"), dict(seq_len=0), dict(batch_size=-2), dict(optimizer="adam"),
                                 dict(gradient_checkpointing="maybe"), dict(lora_targets=[])])
def test_planner_oom_and_timing_refuse_bad_steps_with_the_one_validator(bad):
    """No own positivity or choice checks: the planner, the OOM advice and the time model all answer
    with the message of making the Step."""
    from lora_kit.plan.gpus import get_gpu
    from lora_kit.plan.timing import step_time
    from lora_kit.run.oom import fit_suggestions
    from lora_kit.settings import PLANNING, Step
    with pytest.raises(ValueError) as want:
        Step(**bad)
    calls = [lambda: fixes("L4", model=M, **bad), lambda: check_plan(M, "L4", **bad),
             lambda: step_time(M, get_gpu("L4"), **bad),
             lambda: fit_suggestions({"model": M, **PLANNING.to_dict(), **bad}, 10**9, cuda=True)]
    if "method" in bad:
        calls.append(lambda: compare_methods(M, gpus=["L4"], methods=[bad["method"]]))
    for call in calls:
        with pytest.raises(ValueError) as got:
            call()
        assert str(got.value) == str(want.value)


def test_dataset_fit_suggestions_are_the_planner_ladder():
    """The dataset check offers the rungs of planner.fixes, in its order, a seq_len cut as truncation + packing."""
    from lora_kit.loading import load_tokenizer
    from lora_kit.plan.dataset_fit import dataset_lengths
    rows = [{"prompt": "x" * 60_000, "response": "y"}, {"prompt": "short", "response": "z"}]
    st = dataset_lengths(rows, load_tokenizer("tiny"), model="llama-3.1-8b", gpu="T4", method="lora",
                         gradient_checkpointing=False)
    ladder = fixes("T4", model="llama-3.1-8b", method="lora", gradient_checkpointing=False, seq_len=st.max,
                   batch_size=1)
    assert st.longest_fits is False and ladder
    rungs = [s["settings"] for s in st.suggestions]
    assert [dict(t) for t in dict.fromkeys(tuple(r.items()) for r in rungs)] == [f["settings"] for f in ladder]
    cut = [s for s in st.suggestions if "seq_len" in s["settings"]]
    assert cut[0]["settings"] == cut[1]["settings"] and "truncate to seq_len=" in cut[0]["change"] \
        and "pack/chunk into rows of" in cut[1]["change"] and "lose their tail" in cut[0]["effect"]
    assert all(fit_verdict(s["device_total_bytes"], s["settings"].get("gpu", "T4"))["fits"] for s in st.suggestions)


def test_longest_seq_len_stops_at_the_models_context_length(tmp_path):
    """A model with a 512-token context is never offered more tokens, however much memory is left."""
    import json
    from lora_kit.memory.specs import load_config
    cfg = load_config("qwen2.5-0.5b")
    cfg.max_position_embeddings = 512
    cfg.save_pretrained(tmp_path)
    assert max_fit("seq_len", str(tmp_path), gpu="H100-SXM") == 512
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == 512
    assert max_fit("seq_len", "qwen2.5-0.5b", gpu="T4") < load_config("qwen2.5-0.5b").max_position_embeddings


def test_fits_is_judged_on_the_cuda_visible_capacity():
    """nvidia-smi's total includes the driver's share, which no process can use: a plan between CUDA's total and
    nvidia-smi's does not fit. A GPU without a CUDA reading falls back to the vendor's GB, and says so."""
    h200 = get_gpu("H200")
    between = (h200["cuda_capacity_bytes"] + h200["capacity_bytes"]) // 2
    assert h200["cuda_capacity_bytes"] < between < h200["capacity_bytes"]
    v = fit_verdict(between, "H200", 0.0)
    assert not v["fits"] and v["cuda_capacity_bytes"] == h200["cuda_capacity_bytes"]
    assert v["capacity_bytes"] == h200["capacity_bytes"]  # kept for display
    assert fit_verdict(h200["cuda_capacity_bytes"], "H200", 0.0)["fits"]
    l4 = get_gpu("L4")
    assert l4["cuda_capacity_basis"].startswith("fallback") and fit_verdict(0, "L4", 0.0)["usable_bytes"] == 24e9
    plan = check_plan(M, "L4", seq_len=512)
    assert plan["fits"] and "from the vendor's GB (no CUDA reading in the catalog)" in verdict_text(plan)
    assert "CUDA-visible" in verdict_text(check_plan(M, "H200", seq_len=512))


def test_a_plan_says_when_cuda_runs_attention_in_the_math_kernel():
    """QLoRA's fp32 q/k/v with grouped K/V have no fused CUDA kernel before torch 2.14: the plan on an H100 says
    the math kernel, what it adds and the fix (cuda_kernels.cuda_attention_note). LoRA in bf16 takes flash: no note."""
    import torch
    from lora_kit.memory.cuda_kernels import EFFICIENT_GQA_FROM, torch_version
    qlora = check_plan("llama-3.1-8b", "H100-SXM", method="qlora", seq_len=2048)
    if torch_version(torch.__version__) < EFFICIENT_GQA_FROM:
        note = qlora["note"]
        assert "math kernel (fp32 q/k/v with grouped K/V)" in note and "up to +" in note
        assert "Fix:" in note and "autocast=True" in note and "torch >= 2.14" in note
        assert note in verdict_text(qlora)
    else:
        assert qlora["note"] == ""
    assert check_plan("llama-3.1-8b", "H100-SXM", method="lora", seq_len=2048)["note"] == ""


def test_a_seq_len_beyond_the_models_context_is_said():
    """The memory is planned as asked, and the note says the model's context (max_position_embeddings) is shorter;
    within the context there is no note."""
    from lora_kit.plan.planner import check_plan, verdict_text
    long = check_plan("tiny", "L4", method="lora", seq_len=2048)
    assert "seq_len 2,048 is longer than this model's context (256 positions" in long["note"]
    assert long["note"] in verdict_text(long)
    assert "context" not in check_plan("tiny", "L4", method="lora", seq_len=256)["note"]
