"""One training step, one breakdown vocabulary: the smoke loop, the story harness, measurement and
the build script all run ``lora_kit.training.train_step`` (seen by its calls, whatever name it was
imported under), and smoke.json's measured parts are the estimate's parts, summing to the peak."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lora_kit import training
from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.measure import measure_config
from lora_kit.run.smoke import smoke_run
from lora_kit.ui.run_card import render_markdown

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"Name {i}", "response": f"n{i}"} for i in range(30)]


@contextlib.contextmanager
def train_step_calls():
    """The arguments of every call of the real ``training.train_step`` made inside the block (a profile
    hook on its code object: no patching, so it sees calls through any imported name)."""
    code, calls = training.train_step.__code__, []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is code:
            a = frame.f_locals
            mb = a["micro_batches"]
            calls.append({"micro_batches": 1 if isinstance(mb, dict) else len(mb), "tracker": a["tracker"] is not None,
                          "on_grads": a["on_grads"] is not None, "scheduler": a["scheduler"] is not None,
                          "max_grad_norm": a["max_grad_norm"]})
    before = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield calls
    finally:
        sys.setprofile(before)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_smoke_loop_runs_the_one_step_with_grad_accum_and_tracked_steps(random_llama_dir, tmp_path, monkeypatch):
    # the run's estimate would fit this folder's architecture on the spot unless an earlier test in this worker did
    # (simulated steps, each a train_step call): the count below is the smoke loop's own steps, whatever the order
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    with train_step_calls() as calls:
        r = smoke_run(model=str(random_llama_dir), run_dir=str(tmp_path), examples=ROWS, control_prompts=["hi"],
                      progress=False, simulate=False, max_steps=3, batch_size=2, grad_accum=2, seq_len=32,
                      lora_rank=4, lora_alpha=8, max_new_tokens=2, measure_steps=2)
    assert r.ok
    assert len(calls) == 3 and all(c["micro_batches"] == 2 for c in calls)  # accumulation inside the one step
    assert [c["on_grads"] for c in calls] == [True, True, False]  # tracked steps label the fresh gradients
    assert all(s["tokens"] > 0 and s["measured"] == (s["step"] < 2) for s in r.record["steps"])


def test_story_harness_and_measure_run_the_one_step():
    from lora_kit.embedded.story import train_adapter
    from lora_kit.loading import load_model, load_tokenizer
    from lora_kit.training import attach_adapter
    tok = load_tokenizer("tiny")
    model = attach_adapter(load_model("tiny", method="lora"), "lora", seed=0, rank=4, alpha=8)
    with train_step_calls() as calls:
        out = train_adapter(model, tok, ROWS, steps=3, batch_size=4, warmup=1)
    assert len(out["losses"]) == 3
    assert calls == [{"micro_batches": 1, "tracker": False, "on_grads": False, "scheduler": True,
                      "max_grad_norm": 1.0}] * 3
    with train_step_calls() as calls:
        m = measure_config("tiny", dtype="float32", seq_len=16, batch_size=1, lora_rank=4, steps=2)
    assert [c["tracker"] for c in calls] == [False, True] and m.peak_allocated_bytes == sum(m.breakdown.values())


def test_build_script_pretrains_with_the_one_step(tmp_path):
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    a = build.parse_args(["--tiny-test", "--out", str(tmp_path)])
    data = build.make_data(a)
    held_out = data.pop("_held_out")
    tok = build.train_tokenizer([r["prompt"] + "\nAnswer: " + r["response"] for rows in data.values() for r in rows],
                                tmp_path)
    with train_step_calls() as calls:
        _, stats = build.pretrain(a, tok, held_out)
    assert calls == [{"micro_batches": 1, "tracker": False, "on_grads": False, "scheduler": True,
                      "max_grad_norm": 1.0}] * a.steps
    assert len(stats["loss_every_50"]) == 1


def test_smoke_breakdown_is_the_estimate_vocabulary_and_sums_to_the_peak(random_llama_dir, tmp_path):
    r = smoke_run(model=str(random_llama_dir), run_dir=str(tmp_path), examples=ROWS, control_prompts=["hi"],
                  progress=False, simulate=True, max_steps=2, batch_size=2, seq_len=32, lora_rank=4, lora_alpha=8,
                  max_new_tokens=2, measure_steps=2)
    assert r.ok
    for step in r.record["steps"]:
        assert tuple(step["peak_breakdown"]) == BREAKDOWN_KEYS
        assert sum(step["peak_breakdown"].values()) == step["peak_bytes"]
    peaks = r.record["peaks"]
    measured = peaks["breakdown_at_design_step"]
    assert sum(measured.values()) == peaks["design_step_peak_bytes"]
    # the training state is labelled, not lumped into activations: adapters and their AdamW moments
    assert measured["adapters"] > 0 and measured["optimizer_states"] >= 2 * measured["adapters"]
    assert measured["quant_constants"] == 0
    # part by part beside estimate and simulate, as smoke.json keeps it for the run card
    parts = r.record["memory_parts"]
    assert [p["part"] for p in parts] == [*BREAKDOWN_KEYS, "total"]
    for source in ("estimate", "simulate"):
        model = r.record["memory_model"][source]
        assert {p["part"]: p[source] for p in parts[:-1]} == model["breakdown"]
        assert parts[-1][source] == model["peak_allocated_bytes"]
    assert {p["part"]: p["measured"] for p in parts[:-1]} == measured
    # the weights, adapters and optimizer states are exact in every model of memory: the same bytes
    for part in ("weights", "adapters", "optimizer_states"):
        assert measured[part] == r.record["memory_model"]["simulate"]["breakdown"][part], part
    frame = r.breakdown_frame()
    assert list(frame.index) == [*BREAKDOWN_KEYS, "total"] and list(frame.columns) == ["measured", "estimate",
                                                                                        "simulate"]
    card = render_markdown({"run": None, "pipeline": None, "excluded": {}, "settings": {}, "stack": None,
                            "plan": None, "sweeps": None, "smoke": r.record, "eval": None})
    # the card writes the same parts for a reader ("optimizer states"), every one of them
    assert "Part by part" in card
    assert all(f"| {k.replace('_', ' ')} |" in card for k in BREAKDOWN_KEYS)


def test_smoke_labels_fresh_gradients(random_llama_dir, tmp_path):
    """Gradients are created during backward, after the step started: labelled there (on_grads), they
    are counted as gradients -- the same bytes simulate counts -- not as activations."""
    r = smoke_run(model=str(random_llama_dir), method="full", run_dir=str(tmp_path), examples=ROWS, progress=False,
                  simulate=True, max_steps=2, batch_size=2, seq_len=32, max_new_tokens=2, measure_steps=2)
    first = r.record["steps"][0]  # no optimizer state yet: the peak is where AdamW creates it, gradients live
    assert first["peak_phase"] == "optimizer"
    bd = first["peak_breakdown"]  # full fine-tuning: one gradient per weight, none counted as activations
    assert 0 < bd["gradients"] <= bd["weights"]
