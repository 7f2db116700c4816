"""The multi-GPU plan (issue 17, item 4): its numbers against independent counts -- FSDP2's own collectives
(simulate), the real peft model's gradients, the real safetensors files, estimate and the time model -- and
the run card's "Several GPUs" section showing them beside a smoke run's per-rank peaks."""
from __future__ import annotations

import json
import struct

import pytest

from lora_kit.memory.estimate import estimate
from lora_kit.memory.simulate import simulate
from lora_kit.plan.gpus import get_gpu, gpu_table
from lora_kit.plan.multi_gpu import multi_gpu_plan
from lora_kit.plan.planner import compare_methods
from lora_kit.plan.records import plan_record
from lora_kit.plan.timing import step_time
from lora_kit.ui.run_card import _gb, _gib, build_report

pytestmark = pytest.mark.usefixtures("one_thread")
TOY = dict(dtype="float32", seq_len=32, batch_size=2, gradient_checkpointing=False, optimizer="adamw")
LORA = dict(method="lora", lora_rank=4, lora_alpha=8)


def _safetensors_data_bytes(path) -> int:
    """Bytes of tensor data in a safetensors file: its size minus the 8-byte length and the JSON header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return len(raw) - 8 - n


@pytest.fixture(scope="module")
def fsdp_toy(random_llama_dir):
    """FSDP2 on 2 fake ranks (simulate) and the plan for the same step."""
    sim = simulate(str(random_llama_dir), **TOY, **LORA, num_gpus=2, sharding="fsdp")
    plan = multi_gpu_plan(str(random_llama_dir), "L40S", num_gpus=2, sharding="fsdp", **TOY, **LORA)
    return sim, plan


def test_fsdp_communication_is_what_fsdp2_moved(fsdp_toy):
    sim, plan = fsdp_toy
    c = plan["communication"]
    assert sim.collectives["all_gather_bytes"] > 0
    assert {k: c[k] for k in sim.collectives} == sim.collectives  # FSDP2's own all_gather / reduce_scatter calls
    n = plan["num_gpus"]
    assert c["per_rank_traffic_bytes"] == sum(sim.collectives.values()) * (n - 1) // n  # a ring: (N-1)/N per rank
    assert "fsdp_communication" in c["source"]


def test_per_gpu_memory_and_saving_vs_ddp(fsdp_toy, random_llama_dir):
    sim, plan = fsdp_toy
    m = plan["memory"]
    kw = dict(**TOY, **LORA, num_gpus=2)
    fsdp, ddp = (estimate(str(random_llama_dir), **kw, sharding=s) for s in ("fsdp", "ddp"))
    assert (m["per_gpu_peak_bytes"], m["per_gpu_device_total_bytes"]) == (fsdp.peak_allocated_bytes,
                                                                          fsdp.device_total_bytes)
    assert (m["ddp_per_gpu_peak_bytes"], m["ddp_per_gpu_device_total_bytes"]) == (ddp.peak_allocated_bytes,
                                                                                  ddp.device_total_bytes)
    assert m["saving_vs_ddp_bytes"] == ddp.peak_allocated_bytes - fsdp.peak_allocated_bytes
    assert m["saving_vs_ddp_pct"] == pytest.approx(100 * m["saving_vs_ddp_bytes"] / ddp.peak_allocated_bytes)
    assert abs(m["per_gpu_peak_bytes"] - sim.peak_allocated_bytes) <= 0.08 * sim.peak_allocated_bytes  # FSDP2 itself
    # on this 2-layer toy the gathered layers and buffers outweigh the sharded states: FSDP2 needs MORE than DDP,
    # and simulate's real FSDP2 step agrees on the sign
    assert (sim.peak_allocated_bytes > m["ddp_per_gpu_peak_bytes"]) == (m["saving_vs_ddp_bytes"] < 0)
    assert "not pooled" in m["not_pooled"] and "2 x L40S" in m["not_pooled"]
    l40s = get_gpu("L40S")
    assert m["capacity_bytes"] == l40s["capacity_bytes"] != m["cuda_capacity_bytes"] == l40s["cuda_capacity_bytes"]
    # each GPU's own capacity in the text is the CUDA-visible one that fits is judged on
    assert f"within its own {l40s['cuda_capacity_bytes'] / 2**30:.1f} GiB (CUDA-visible)" in m["not_pooled"]
    assert m["fits"] == (m["per_gpu_device_total_bytes"] <= (1 - plan["margin"]) * m["cuda_capacity_bytes"])


def test_time_adds_communication_at_the_catalog_bandwidth(fsdp_toy, random_llama_dir):
    _, plan = fsdp_toy
    t, row = plan["time"], get_gpu("L40S")
    assert plan["interconnect"]["gbs_per_direction"] == row["interconnect_gbs"] > 0
    assert t["comm_seconds"] == pytest.approx(plan["communication"]["per_rank_traffic_bytes"]
                                              / (row["interconnect_gbs"] * 1e9))
    compute = step_time(str(random_llama_dir), row, **TOY, **LORA, num_gpus=2)["step_seconds"]
    assert t["compute_step_seconds"] == pytest.approx(compute)
    assert t["step_seconds_not_overlapped"] == pytest.approx(compute + t["comm_seconds"])
    assert t["step_seconds_overlapped"] == pytest.approx(max(compute, t["comm_seconds"]))
    assert "lower bound" in t["assumption"]


def test_catalog_interconnect_is_per_direction():
    df = gpu_table()
    assert (df["interconnect_gbs"] > 0).all()
    assert get_gpu("H100-SXM")["interconnect_gbs"] == 900 / 2  # NVLink 4: 900 GB/s both directions together
    pcie4 = df[df["interconnect"].str.startswith("PCIe Gen4")]
    assert len(pcie4) >= 4 and (pcie4["interconnect_gbs"] == 64 / 2).all()


def test_ddp_volume_and_checkpoint_from_the_real_peft_model(random_llama_dir, tmp_path):
    """The gradient all-reduce and the files on disk, counted on the real model (bf16 base, peft's fp32 adapters)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(random_llama_dir, dtype=torch.bfloat16)
    full_grads = sum(p.numel() * p.element_size() for p in base.parameters())
    base.save_pretrained(tmp_path / "full", safe_serialization=True)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    lora_grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    kw = dict(seq_len=32, batch_size=2, dtype="bfloat16")
    for n in (2, 3, 8):
        plan = multi_gpu_plan(str(random_llama_dir), "H100-SXM", num_gpus=n, sharding="ddp", method="lora",
                              lora_rank=4, **kw)
        c = plan["communication"]
        assert c["all_reduce_bytes"] == lora_grads and c["per_rank_traffic_bytes"] == 2 * (n - 1) * lora_grads // n
        assert c["source"] == "arithmetic" and plan["memory"]["saving_vs_ddp_bytes"] == 0
        z = multi_gpu_plan(str(random_llama_dir), "H100-SXM", num_gpus=n, sharding="zero2", method="lora",
                           lora_rank=4, **kw)["communication"]
        assert z["reduce_scatter_bytes"] == z["all_gather_bytes"] == lora_grads  # ZeRO-2: DDP's volume, say so
        assert z["per_rank_traffic_bytes"] == c["per_rank_traffic_bytes"] and "arithmetic" in z["how"]
    assert plan["checkpoint"]["bytes"] == _safetensors_data_bytes(tmp_path / "adapter" / "adapter_model.safetensors")
    full = multi_gpu_plan(str(random_llama_dir), "H100-SXM", num_gpus=3, sharding="ddp", method="full", **kw)
    assert full["communication"]["per_rank_traffic_bytes"] == 2 * 2 * full_grads // 3
    assert full["checkpoint"]["bytes"] == _safetensors_data_bytes(tmp_path / "full" / "model.safetensors")
    sharded = multi_gpu_plan(str(random_llama_dir), "H100-SXM", num_gpus=3, sharding="fsdp", method="full",
                             **kw)["checkpoint"]
    assert "pytorch_model_fsdp_0" in sharded["sharded"]["where"]
    assert sharded["sharded"]["model_bytes_per_rank"] == -(-full_grads // 3)
    sharded = multi_gpu_plan(str(random_llama_dir), "H100-SXM", num_gpus=2, sharding="fsdp", method="lora",
                             lora_rank=4, **kw)["checkpoint"]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # save_state keeps the frozen base too
    assert sharded["sharded"]["model_bytes_per_rank"] == -(-whole // 2)


def test_one_gpu_has_no_multi_gpu_section():
    with pytest.raises(ValueError, match="num_gpus > 1"):
        multi_gpu_plan("tiny", "L4", num_gpus=1, sharding="none")
    table = compare_methods("tiny", gpus=["L4"], seq_len=64)
    assert "multi_gpu" not in plan_record(table, "tiny", seq_len=64)


def test_plan_record_describes_the_settings_row_else_the_recommended_one():
    step = {"seq_len": 64, "num_gpus": 2, "sharding": "ddp"}
    table = compare_methods("tiny", gpus=["L4", "T4"], **step)
    mine = plan_record(table, "tiny", gpu="t4", method="full", **step)["multi_gpu"]
    assert (mine["gpu"], mine["method"], mine["planned_as"]) == ("T4", "full", "ddp")
    rec = table.loc[table[table["fits"]]["epoch_cost"].idxmin()]
    other = plan_record(table, "tiny", gpu="H100-SXM", **step)["multi_gpu"]  # not in the table
    assert (other["gpu"], other["method"], other["batch_size"]) == (rec["gpu"], rec["method"], rec["batch_size"])


@pytest.fixture(scope="module")
def card(tmp_path_factory, fsdp_toy, random_llama_dir):
    """A run folder: the plan for 4 x L40S under fsdp (llama-3.1-8b) and a 2-rank smoke record of the toy model
    whose per-rank peaks are simulate's FSDP2 peak (what smoke.py writes, read defensively by the card)."""
    sim, _ = fsdp_toy
    d = tmp_path_factory.mktemp("run")
    step = dict(seq_len=2048, lora_rank=16, gradient_checkpointing=True, num_gpus=4, sharding="fsdp")
    table = compare_methods("llama-3.1-8b", gpus=["L40S", "H100-SXM"], margin=0.1, **step)
    plan = plan_record(table, "llama-3.1-8b", margin=0.1, gpu="L40S", method="lora", **step)
    (d / "plan.json").write_text(json.dumps(plan))
    est = {s: estimate(str(random_llama_dir), **TOY, **LORA, num_gpus=2, sharding=s).peak_allocated_bytes
           for s in ("ddp", "fsdp")}
    (d / "smoke").mkdir()
    (d / "smoke" / "smoke.json").write_text(json.dumps({
        "status": "complete", "settings": {"model": str(random_llama_dir), "sharding": "fsdp", "batch_size": 2},
        "launch": {"world_size": 2, "device": "cpu", "sharding": "fsdp (FSDP2, 2 ranks)",
                   "fsdp": {"policy": "accelerate", "layer_class": "LlamaDecoderLayer", "mesh": [2], "reshard_after_forward": True}},  # as the sharded smoke run records it
        "checkpoint": {"dir": str(d / "smoke" / "adapter"), "bytes": 37847, "gathered_from_ranks": 2,
                       "written_by_rank": 0},
        "peaks": {"design_step_peak_bytes": sim.peak_allocated_bytes,
                  "per_rank": [{"rank": r, "design_step_peak_bytes": sim.peak_allocated_bytes,
                                "max_peak_bytes": sim.peak_allocated_bytes} for r in (0, 1)]},
        "memory_model": {"simulate": {"peak_allocated_bytes": sim.peak_allocated_bytes, "num_gpus": 2,
                                      "sharding": "fsdp"},
                         "estimate_ddp_per_gpu": est["ddp"], "estimate_fsdp_per_gpu": est["fsdp"]}}))
    build_report(d)
    return {"md": (d / "report.md").read_text(), "plan": plan, "sim": sim, "est": est}


def test_card_shows_the_plan_for_several_gpus(card):
    mg = card["plan"]["multi_gpu"]
    table_row = next(r for r in card["plan"]["rows"] if r["gpu"] == "L40S" and r["method"] == "lora")
    assert (mg["gpu"], mg["num_gpus"], mg["batch_size"]) == ("L40S", 4, table_row["batch_size"])
    sec = card["md"].split("## Several GPUs")[1].split("\n## ")[0]
    m, c, t, ck = mg["memory"], mg["communication"], mg["time"], mg["checkpoint"]
    for said in ("**4 x L40S**", "Memory is not pooled: 4 x L40S",
                 f"peak allocated **{_gib(m['per_gpu_peak_bytes'])}**", f"**{_gib(m['per_gpu_device_total_bytes'])}**",
                 f"DDP would need {_gib(m['ddp_per_gpu_peak_bytes'])}",
                 f"saves **{_gib(m['saving_vs_ddp_bytes'])} per GPU ({m['saving_vs_ddp_pct']:.1f} %)**",
                 f"all-gather {_gb(c['all_gather_bytes'])}", f"**{_gb(c['per_rank_traffic_bytes'])}**",
                 f"{get_gpu('L40S')['interconnect_gbs']:g} GB/s per direction",
                 "an assumption until a multi-GPU run measures it", f"**{t['step_seconds_not_overlapped']:.3g} s**",
                 f"**{_gib(ck['bytes'])}**", "adapter_model.safetensors", "pytorch_model_fsdp_0"):
        assert said in sec, said
    assert t["step_seconds_not_overlapped"] > t["compute_step_seconds"] == table_row["step_seconds"]
    assert "--nproc_per_node 4 -m lora_kit.run.smoke" in card["md"].split("## What to check next")[1]


def test_card_shows_measured_ranks_beside_the_estimate(card):
    sec = card["md"].split("## Several GPUs")[1].split("\n## ")[0]
    peak, est = card["sim"].peak_allocated_bytes, card["est"]["fsdp"]
    rows = [line for line in sec.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2
    for line in rows:
        cells = [x.strip() for x in line.strip("|").split("|")]
        assert cells[1] == _gib(peak) and cells[4] == _gib(est) and cells[3] == _gib(card["est"]["ddp"])
        assert cells[5] == _gib(card["sim"].peak_allocated_bytes) and cells[6] == f"{(est - peak) / peak * 100:+.1f} %"
    assert "2 processes" in sec and "sharding fsdp (FSDP2, 2 ranks)" in sec and "not the planned llama-3.1-8b" in sec
    assert "gathered from 2 ranks and written by rank 0 alone" in sec
