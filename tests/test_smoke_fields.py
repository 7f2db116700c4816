"""The smoke run runs every step field it accepts, and refuses up front, by name, what a launch cannot run.

Every ``Step`` field has its rule in ``lora_kit.run.smoke.RUNS``; a refusal comes before the run folder is touched
or a model loaded. ``padding`` is run as it says: the batches have the shape and mask the plan names, and the
memory figures beside the measured step describe that step (issue 36: ``padding: none`` was run padded to
``seq_len`` with a mask, and the smoke run reported a -7.7 % "estimate error" that was the mask)."""
from __future__ import annotations

import pytest
import torch

from lora_kit.memory.device import alloc_bytes
from lora_kit.run.batches import collate
from lora_kit.run.smoke import RUNS, check_runnable, main as smoke_main, smoke_run
from lora_kit.settings import STEP_FIELDS, from_dict
from lora_kit.ui.cli import main as cli_main

FAST = dict(max_steps=2, batch_size=2, seq_len=48, lora_rank=4, lora_alpha=8, max_new_tokens=2, learning_rate=1e-2,
            cpu_threads=1)


def test_every_step_field_has_a_rule():
    assert list(RUNS) == list(STEP_FIELDS)  # a new Step field is either run or refused, never ignored


@pytest.mark.parametrize("world,given,names", [
    (1, {"num_gpus": 2, "sharding": "zero2", "cpu_offload": True}, ["cpu_offload=True"]),
    (2, {"num_gpus": 2, "sharding": "zero2", "cpu_offload": True}, ["cpu_offload=True", "sharding='zero2'"]),
    (2, {"num_gpus": 2, "sharding": "zero1"}, ["sharding='zero1'"]),
    (2, {"num_gpus": 2, "sharding": "fsdp", "method": "qlora", "loop": "sft"}, ["method='qlora'", "loop='sft'"]),
])
def test_what_a_launch_cannot_run_is_refused_by_name_before_anything(world, given, names, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # as torchrun sets it; refused before any process group is joined
    import lora_kit.run.smoke as smoke

    def refuse(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the settings were found runnable")
    monkeypatch.setattr(smoke, "load_model", refuse)
    monkeypatch.setattr(smoke, "load_tokenizer", refuse)
    run = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        smoke_run(run_dir=str(run), progress=False, **{**FAST, **given})
    msg = str(e.value)
    assert msg.startswith("the smoke run cannot run") and "Nothing was loaded" in msg
    assert all(n in msg for n in names), msg
    assert msg.count(";") >= len(names) - 1 and "set " in msg  # one message, each with what to change
    assert not run.exists(), "nothing may be written before the settings are runnable"


def test_an_emulated_device_runs_the_kits_loop_only():
    with pytest.raises(ValueError, match="memory_limit_bytes .* loop='sft'"):
        check_runnable(from_dict({"loop": "sft"}), world=1, memory_limit_bytes=1 << 30)
    check_runnable(from_dict({"num_gpus": 4, "sharding": "zero3"}), world=1)  # one process: the one-GPU step, runs


def test_cli_refuses_before_any_notebook_or_rank_runs(tmp_path, capsys):
    rc = cli_main(["run", "--runs-dir", str(tmp_path), "-p", "num_gpus", "2", "-p", "sharding", "zero2",
                   "-p", "cpu_offload", "true"])
    assert rc == 2 and "cpu_offload=True is not run by the smoke run" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    assert smoke_main(["-p", "run_dir", str(tmp_path / "s"), "-p", "num_gpus", "2", "-p", "sharding", "zero2",
                       "-p", "cpu_offload", "true"]) == 2
    assert "set cpu_offload=False" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_padding_none_trains_what_the_masked_batch_trains():
    """Rows of seq_len tokens without a mask: pads follow the real tokens, so under causal attention the loss is
    the masked batch's."""
    from lora_kit.loading import load_model, load_tokenizer
    from lora_kit.prompting import PromptFormat
    tok = load_tokenizer("tiny", padding_side="right")
    fmt = PromptFormat(tok, "plain")
    rows = [fmt.encode({"prompt": p, "response": r}) for p, r in (("What is 2+2?", "4"), ("Name a colour", "red"))]
    none, masked = (collate(rows, 40, tok.pad_token_id, p) for p in ("none", "max_length"))
    longest = collate(rows, 40, tok.pad_token_id, "longest")
    assert "attention_mask" not in none and none["input_ids"].shape == masked["input_ids"].shape == (2, 40)
    assert longest["input_ids"].shape == (2, max(len(r["input_ids"]) for r in rows)) and "attention_mask" in longest
    assert torch.equal(none["labels"], masked["labels"])
    model = load_model("tiny", method="lora", dtype="float32").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**none).loss, model(**masked).loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(**longest).loss, model(**masked).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padding", ["none", "max_length", "longest"])
def test_smoke_run_runs_the_padding_it_is_given(padding, tmp_path):
    r = smoke_run(run_dir=str(tmp_path), padding=padding, measure_steps=2, progress=False, **FAST)
    rec = r.record
    assert r.ok and rec["settings"]["padding"] == rec["measurement"]["padding"] == padding
    steps = rec["steps"]
    assert all(st["rows"] == FAST["batch_size"] for st in steps)
    width = steps[1]["seq_len"]
    if padding == "longest":  # the longest rows lead, and the step is as wide as its longest row
        assert steps[0]["seq_len"] == rec["data"]["longest_lengths"][0] < FAST["seq_len"]
        assert width <= steps[0]["seq_len"]
    else:
        assert width == FAST["seq_len"]
    measured = rec["peaks"]["design_step_peak_bytes"]
    sim, est = rec["memory_model"]["simulate"], rec["memory_model"]["estimate"]
    assert sim.get("seq_len", FAST["seq_len"]) == est.get("seq_len", FAST["seq_len"]) == width
    # simulate's batch for padding="none" uses the ids as labels; the run's labels are a tensor of their own
    # (prompt and pads masked): that tensor is the whole difference. Padded batches: byte for byte, when the
    # step's rows are padded as simulate's are (row 0 full, the others padded)
    labels = alloc_bytes(FAST["batch_size"] * width * 8)
    if padding == "none":
        assert measured - sim["peak_allocated_bytes"] == labels, (measured, sim)
    elif padding == "max_length":
        assert measured == sim["peak_allocated_bytes"], (measured, sim)
    assert abs(sim["error_vs_measured"]) < 0.01 and abs(est["error_vs_measured"]) < 0.02, rec["memory_model"]


def test_a_packed_smoke_run_is_described_by_the_tokens_it_packed(tmp_path):
    """padding="packed": each micro-batch is one row of its examples (FlashAttention-2's varlen path, emulated on a
    CPU), shorter than batch_size x seq_len when the rows are; the memory model describes the tokens that ran, as
    batch_size rows of ceil(width / batch_size) tokens, not batch_size full rows."""
    r = smoke_run(run_dir=str(tmp_path), padding="packed", attn_implementation="flash_attention_2", dtype="bfloat16",
                  measure_steps=2, progress=False, **FAST)
    rec = r.record
    assert r.ok and rec["measurement"]["padding"] == "packed"
    design = rec["steps"][rec["measurement"]["design_step"]]
    assert design["seq_len"] == design["tokens"] < FAST["batch_size"] * FAST["seq_len"]  # one row, no padding
    planned = -(-design["seq_len"] // FAST["batch_size"])
    for name in ("estimate", "simulate"):
        m = rec["memory_model"][name]
        assert m["seq_len"] == planned and abs(m["error_vs_measured"]) < 0.02, rec["memory_model"]


@pytest.mark.parametrize("loop,method,autocast,trainer", [("trainer", "lora", False, "Trainer"),
                                                        ("trainer", "lora", True, "Trainer"),
                                                        ("sft", "qlora", False, "SFTTrainer")])
def test_smoke_run_runs_the_loop_it_is_given(loop, method, autocast, trainer, tmp_path):
    """loop="trainer" / "sft": the library's own train() runs the step, measured beside estimate and simulate for
    that loop (without a config: the loop's defaults, with the step's fields). With autocast the Trainer's bf16
    flag is on, and the adapter is verified on the model without accelerate's autocast wrapper."""
    r = smoke_run(run_dir=str(tmp_path), loop=loop, method=method, autocast=autocast, measure_steps=2,
                  progress=False, **{**FAST, "grad_accum": 1})
    rec = r.record
    assert r.ok and rec["verify"]["passed"] and rec["loop"]["trainer"] == trainer and rec["loop"]["from_config"] is None
    args = rec["loop"]["args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"], args["learning_rate"]) == (
        FAST["batch_size"], 1, FAST["learning_rate"])
    assert rec["loop"]["adapter"]["r"] == FAST["lora_rank"] and rec["loop"]["adapter"]["lora_alpha"] == FAST["lora_alpha"]
    measured = rec["peaks"]["design_step_peak_bytes"]
    assert measured > 0 and [st["rows"] for st in rec["steps"]] == [FAST["batch_size"]] * FAST["max_steps"]
    sim = rec["memory_model"]["simulate"]
    # SFTTrainer casts QLoRA adapters to bf16 and calls no prepare_model_for_kbit_training (TRL 1.16): the step's
    # qlora_prepare "auto" is "none" with loop "sft", so the smoke run and simulate run that recipe
    assert rec["checkpoint"]["trained_dtype"] == ("bfloat16" if loop == "sft" and method == "qlora" else "float32")
    assert rec["loop"]["args"]["bf16"] is autocast
    # with bf16 autocast under the Trainer, simulate was 1.9 % above the measured step here (the memory model's to
    # close); without, within 1 %
    bound = 0.03 if autocast else 0.01
    assert abs(sim["error_vs_measured"]) < bound, sim
