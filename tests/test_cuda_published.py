"""benchmarks/cuda_published.py is honest about the published rows: every row comes back once, each in-scope row is
compared with the kit's figure of the metric its source reports, each out-of-scope row carries its reason, and the
allocation sequence it replays for FSDP2 steps is complete. Accuracy is the benchmark's to report, not asserted."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import lora_kit as lk
from lora_kit.plan.gpus import get_gpu
from lora_kit.memory.allocator import replay

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
bench = load_script("benchmarks/cuda_published.py", "cuda_published")
ROWS = json.loads(bench.REFERENCE.read_text())["rows"]
BASIS = {"allocated": "peak_allocated_bytes", "reserved": "reserved", "nvidia-smi": "device_total_bytes"}


@pytest.fixture(scope="module")
def compared():
    return bench.compare(ROWS, replay=False)


def test_every_reference_row_comes_back_once_in_order(compared):
    assert [r["id"] for r in compared] == [r["id"] for r in ROWS]
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    s = bench.summary(compared)
    assert s["rows"] == len(ROWS) and s["in_scope"] + s["out_of_scope"] == len(ROWS)
    assert s["in_scope"] == sum(r["in_scope"] for r in ROWS) > 0


def test_out_of_scope_rows_carry_their_reason_and_no_figure(compared):
    out = [r for r in compared if not r["in_scope"]]
    assert out
    for r in out:
        assert isinstance(r["reason"], str) and r["reason"].strip(), r["id"]
        assert "kit" not in r and "ratio" not in r


def test_in_scope_rows_compared_with_the_metric_they_report(compared):
    ref = {r["id"]: r for r in ROWS}
    for r in (r for r in compared if r["in_scope"]):
        row = ref[r["id"]]
        assert r["metric"] == row["metric"] in bench.METRICS
        assert r["measured"] == row["value_bytes"] > 0
        assert BASIS[r["metric"]] in r["kit"]["basis"]
        assert r["ratio"] == r["kit"]["figure"] / r["measured"]
        if r["metric"] in ("reserved", "nvidia-smi"):  # the estimate's figure; the replay beside it when it ran
            assert r["kit"]["replay_not_run"] == "replay not run (--no-replay)" and "replay_figure" not in r["kit"]
        if r["metric"] == "reserved":
            assert r["kit"]["figure"] == r["kit"]["device_basis"]["reserved"] >= r["kit"]["estimate_allocated"]


def test_verdicts_use_the_catalogs_cuda_capacity_or_say_why_not(compared):
    for r in (r for r in compared if r["in_scope"]):
        v = r["verdict"]
        assert v["happened"] in ("ran", "oom")
        if r["gpu"] is None:
            assert not v["judged"] and "not in the catalog" in v["why_not"]
            continue
        assert v["judged"] and v["capacity"] == get_gpu(r["gpu"])["cuda_capacity_bytes"]
        assert v["device_total"] == r["kit"]["estimate_device_total"]
        assert v["predicted"] == ("fits" if v["device_total"] <= v["capacity"] else "oom")
        assert v["right"] == ((v["happened"] == "oom") == (v["predicted"] == "oom"))


@pytest.mark.parametrize("metric", ["allocated", "nvidia-smi"])
def test_other_metrics_take_their_own_figure(metric):
    """The committed in-scope rows all report reserved; the same step reported as another metric takes that
    metric's figure (allocated: the peak plus torch's two cuBLAS workspaces; nvidia-smi: device total plus the
    card's driver share)."""
    row = copy.deepcopy(next(r for r in ROWS if r["in_scope"] and r["gpu"] == "L40S"))
    row["metric"] = metric
    (r,) = bench.compare([row], replay=False)
    est = lk.estimate(model=row["model"], **row["plan"])
    # allocated: the peak + two cuBLAS workspaces of an L40S (compute capability 8.9: PyTorch's ':4096:2:16:8')
    want = est.peak_allocated_bytes + 2 * (8 * 2 ** 20 + 128 * 1024) if metric == "allocated" else \
        est.device_total_bytes + int(get_gpu("L40S")["driver_share_bytes"])
    assert r["kit"]["figure"] == want and r["metric"] == metric


def test_a_metric_the_kit_has_no_figure_for_names_the_row():
    row = copy.deepcopy(next(r for r in ROWS if r["in_scope"]))
    row["metric"] = "unknown"
    with pytest.raises(ValueError, match=r"published_gpu_runs\[0\].*out of scope with a reason"):
        bench.compare([row], replay=False)


def test_committed_results_match_the_reference_rows():
    res = json.loads((ROOT / "benchmarks" / "results" / "cuda_published.json").read_text())
    assert [(r["id"], r["metric"], r["in_scope"]) for r in res["rows"]] == \
        [(r["id"], r["metric"], r["in_scope"]) for r in ROWS + bench.fms_rows()]
    for r in (r for r in res["rows"] if r["in_scope"] and r["metric"] in ("reserved", "nvidia-smi")):
        k = r["kit"]  # the estimate's figure; beside it the replay at full depth, or simulate's reason why not
        assert ("replay" in k and "replay_figure" in k) or "simulate cannot run this step" in k["replay_not_run"], \
            r["id"]


def test_replayed_fsdp2_sequence_is_complete(random_llama_dir):
    """FSDP2 frees and re-gathers parameters by resizing storages in place: with those resizes as events the
    replayed allocated peak (expandable segments: every block split to its request) equals simulate's."""
    plan = dict(method="lora", lora_rank=4, lora_alpha=8, dtype="float32", seq_len=32, batch_size=2,
                gradient_checkpointing=False, optimizer="adamw", num_gpus=2, sharding="fsdp")
    sim, events = bench.simulate_events(str(random_llama_dir), plan)
    assert any(isinstance(e[1], tuple) and "resized" in e[1] for e in events)
    assert replay(events, expandable_segments=True).max_allocated == sim.peak_allocated_bytes


def test_replayed_sequence_leaves_paged_optimizer_states_outside_the_allocator():
    """bitsandbytes keeps a paged optimizer's states in CUDA managed memory, outside torch's caching allocator:
    the replayed sequence leaves them out, so its allocated peak is simulate's (which leaves them out too), not
    simulate's plus the states (the replay of the QLoRA paper's step once counted them in its reserved)."""
    sim, events = bench.simulate_events("smollm2-135m", dict(method="full", optimizer="paged_adamw_32bit", seq_len=32,
                                                             batch_size=2, dtype="bfloat16",
                                                             gradient_checkpointing=False))
    assert any("paged optimizer state" in n for n in sim.notes)  # the embedding's states are paged
    assert replay(events, expandable_segments=True).max_allocated == sim.peak_allocated_bytes


def test_fms_acceleration_runs_give_both_metrics_or_an_out_of_memory_verdict():
    """Each finished single-GPU run of the committed CSV gives its allocated and nvidia-smi peaks; each run that
    did not finish is an out-of-memory verdict with no figure, and the committed results judge every one."""
    rows = bench.fms_rows()
    oom = [r for r in rows if r.get("outcome") == "oom"]
    ran = [r for r in rows if r.get("outcome") is None]
    assert oom and all(r["value_bytes"] is None for r in oom)
    assert sorted(r["metric"] for r in ran) == sorted(["allocated", "nvidia-smi"] * (len(ran) // 2))
    assert all(r["value_bytes"] > 2 ** 30 for r in ran)
    res = {r["id"]: r for r in json.loads((ROOT / "benchmarks/results/cuda_published.json").read_text())["rows"]}
    for r in rows:
        got = res[r["id"]]
        assert got["verdict"]["judged"] and got["verdict"]["happened"] == r.get("outcome", "ran")
        assert (got["ratio"] is None) == (r.get("outcome") == "oom")


def test_older_loss_is_the_same_loss_with_one_more_fp32_logits_copy(random_llama_dir):
    """The row-stack cross-check's transformers-4.48 loss gives the installed loss's value, and on a step whose peak
    has the loss close to its peak, simulate with it peaks higher, by at most the shifted fp32 logits (batch x
    (seq - 1) x vocab x 4 bytes, in 512-byte blocks); a stack from 4.49 on, or one naming nothing, gets no
    cross-check."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels = torch.randn(2, 7, 11), torch.randint(0, 11, (2, 7))
    labels[0, 3] = -100
    assert torch.allclose(bench._loss_with_shifted_copy(logits, labels, 11), ForCausalLMLoss(logits, labels, 11))
    plan = dict(method="lora", lora_rank=4, lora_alpha=8, dtype="float32", seq_len=64, batch_size=2,
                gradient_checkpointing=False, optimizer="adamw")
    row = {"id": "r", "model": str(random_llama_dir), "plan": plan, "metric": "allocated",
           "stack": {"transformers": "4.48.1"}}
    est = lk.estimate(model=row["model"], **plan)
    sim = lk.simulate(str(random_llama_dir), **plan)
    got = bench.row_stack(row, est, None)
    vocab = json.loads((random_llama_dir / "config.json").read_text())["vocab_size"]
    shifted = -(-(2 * 63 * vocab * 4) // 512) * 512
    assert got["differences"] == ["transformers <= 4.48: the causal-LM loss copies the shifted fp32 logits"]
    assert 0 < got["peak_allocated"] - sim.peak_allocated_bytes <= shifted
    for stack in ({"transformers": "4.49.0"}, {}):
        assert bench.row_stack({**row, "stack": stack}, est, None) is None
