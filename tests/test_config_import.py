"""Plan from the user's own training config: five formats, each field mapped to the step, the rest listed.

The configs in tests/configs/ are written in each tool's documented format (TRL's ``trl sft --config`` YAML,
axolotl's and LLaMA-Factory's example layouts, torchtune's recipe configs, ``TrainingArguments.to_json_string()``)
for catalog models: LoRA, QLoRA and full fine-tuning for each tool.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_kit.plan.config_import import FORMATS, detect_format, settings_from_config
from lora_kit.settings import PLANNING
from lora_kit.ui.cli import main

CONFIGS = Path(__file__).parent / "configs"

# config -> (model planned, the step fields it sets, the keys listed as not modelled)
EXPECTED = {
    "trl_qlora_llama-3.1-8b.yaml": ("llama-3.1-8b", dict(
        method="qlora", dtype="bfloat16", autocast=True, double_quant=True, seq_len=4096, batch_size=2, lora_rank=32,
        lora_alpha=64, lora_targets="all-linear", gradient_checkpointing=True, attn_implementation="sdpa",
        optimizer="paged_adamw_8bit", grad_accum=8, padding="longest", loop="sft"), {"packing"}),
    "trl_lora_qwen2.5-7b.yaml": ("qwen2.5-7b", dict(
        method="lora", dtype="bfloat16", autocast=True, seq_len=2048, batch_size=4, lora_rank=16, lora_alpha=32,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), gradient_checkpointing=True, optimizer="adamw",
        grad_accum=1, loop="sft"), set()),
    # TRL's defaults: ModelConfig.dtype float32 under bf16 autocast = fp32 master weights, bf16 compute
    "trl_full_qwen2.5-0.5b.yaml": ("qwen2.5-0.5b", dict(
        method="full", dtype="bfloat16", autocast=True, seq_len=8192, batch_size=1, gradient_checkpointing=False,
        optimizer="adamw", grad_accum=16, attn_implementation="sdpa", loop="sft", liger_kernel=True),
        {"attn_implementation"}),
    "axolotl_qlora_llama-3.1-8b.yml": ("llama-3.1-8b", dict(
        method="qlora", dtype="bfloat16", autocast=True, double_quant=True, seq_len=4096, batch_size=2, lora_rank=32,
        lora_alpha=16, lora_targets="all-linear", gradient_checkpointing=True, optimizer="paged_adamw_32bit",
        grad_accum=4, padding="max_length", loop="trainer"), {"flash_attention", "sample_packing"}),
    "axolotl_lora_mistral-7b.yml": ("mistral-7b", dict(
        method="lora", dtype="float16", autocast=True, seq_len=2048, batch_size=4, lora_rank=16, lora_alpha=32,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), gradient_checkpointing=True, optimizer="adamw_8bit",
        grad_accum=2, padding="longest", attn_implementation="sdpa"), set()),
    # bf16 full fine-tuning in axolotl loads bf16 weights: pure bf16; ZeRO-2 on one GPU shards nothing
    "axolotl_full_qwen2.5-0.5b.yml": ("qwen2.5-0.5b", dict(
        method="full", dtype="bfloat16", autocast=False, seq_len=1024, batch_size=8, gradient_checkpointing=False,
        optimizer="adamw", grad_accum=1, sharding="none", num_gpus=1), set()),
    "llamafactory_lora_llama-3.1-8b.yaml": ("llama-3.1-8b", dict(
        method="lora", dtype="bfloat16", autocast=True, seq_len=2048, batch_size=1, lora_rank=8, lora_alpha=16,
        lora_targets="all-linear", gradient_checkpointing=True, optimizer="adamw", grad_accum=8, loop="trainer"),
        {"use_reentrant_gc"}),
    "llamafactory_qlora_qwen2.5-7b.yaml": ("qwen2.5-7b", dict(
        method="qlora", dtype="bfloat16", autocast=True, double_quant=False, seq_len=4096, batch_size=2,
        lora_rank=64, lora_alpha=16, lora_targets=("q_proj", "v_proj"), optimizer="paged_adamw_8bit", grad_accum=4,
        liger_kernel=True), {"flash_attn"}),
    # LLaMA-Factory up-casts trainable weights to fp32 under bf16: fp32 master weights, bf16 autocast
    "llamafactory_full_llama-3.2-1b.yaml": ("llama-3.2-1b", dict(
        method="full", dtype="bfloat16", autocast=True, seq_len=1024, batch_size=4, grad_accum=2,
        gradient_checkpointing=True, sharding="none"), {"use_reentrant_gc"}),
    "torchtune_lora_llama3_1_8b.yaml": ("llama-3.1-8b", dict(
        method="lora", dtype="bfloat16", autocast=False, seq_len=2048, batch_size=2, lora_rank=8, lora_alpha=16,
        lora_targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        gradient_checkpointing=True, optimizer="adamw", grad_accum=8, padding="none", loop="kit"),
        {"dtype", "loss._component_"}),
    "torchtune_qlora_llama3_1_8b.yaml": ("llama-3.1-8b", dict(
        method="qlora", dtype="bfloat16", seq_len=4096, batch_size=1, lora_rank=16, lora_alpha=32,
        lora_targets="all-linear", optimizer="paged_adamw_8bit", grad_accum=16), {"model._component_", "dtype"}),
    "torchtune_full_llama3_2_1b.yaml": ("llama-3.2-1b", dict(
        method="full", dtype="bfloat16", autocast=False, seq_len=PLANNING.seq_len, batch_size=4,
        gradient_checkpointing=False, optimizer="adamw", grad_accum=1), {"tokenizer.max_seq_len"}),
    "trainer_args_8bit.json": ("qwen2.5-7b", dict(
        batch_size=4, grad_accum=4, gradient_checkpointing=True, optimizer="adamw_8bit", autocast=True,
        loop="trainer"), set()),
    "trainer_args_fsdp.json": ("qwen2.5-7b", dict(
        batch_size=1, grad_accum=1, gradient_checkpointing=False, sharding="fsdp", cpu_offload=True, num_gpus=4),
        {"optim"}),
}
GIVEN = {"trainer_args_8bit.json": {"model": "qwen2.5-7b"}, "trainer_args_fsdp.json": {"model": "qwen2.5-7b",
                                                                                      "num_gpus": 4}}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_maps_field_by_field(name):
    model, fields, not_modelled = EXPECTED[name]
    step, rep = settings_from_config(CONFIGS / name, **GIVEN.get(name, {}))
    assert rep.model == model
    got = {k: getattr(step, k) for k in fields}
    assert got == fields
    assert {n["key"] for n in rep.not_modelled} == not_modelled, rep.not_modelled
    # every key of the config is accounted for: mapped, not modelled or ignored (nothing dropped in silence)
    assert not {"learning_rate", "output_dir"} & set(rep.mapped)
    assert set(rep.mapped) | set(rep.defaults) >= set(fields) - {"num_gpus"}


def test_each_format_is_detected_by_content():
    import yaml
    seen = {}
    for p in CONFIGS.iterdir():
        cfg = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
        seen[p.name] = detect_format(cfg)
    assert {p.split("_")[0] for p in seen} == {"trl", "axolotl", "llamafactory", "torchtune", "trainer"}
    assert all(fmt == p.split("_")[0] for p, fmt in seen.items()), seen
    assert set(seen.values()) == set(FORMATS)
    with pytest.raises(ValueError, match="cannot tell which tool"):
        detect_format({"foo": 1})


def test_their_parser_rejects_with_their_message(tmp_path):
    """TRL's parser and transformers' refuse what their tools refuse, with their own message."""
    bad = tmp_path / "sft.yaml"
    bad.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nbf16: true\nfp16: true\nmax_length: 512\n")
    with pytest.raises(ValueError, match="trl sft rejects this config: At most one of fp16 and bf16"):
        settings_from_config(bad)
    dump = json.loads((CONFIGS / "trainer_args_8bit.json").read_text())
    dump["not_a_training_argument"] = 1
    (tmp_path / "args.json").write_text(json.dumps(dump))
    with pytest.raises(ValueError, match="TrainingArguments rejects this config.*not_a_training_argument"):
        settings_from_config(tmp_path / "args.json", model="qwen2.5-7b")
    ax = tmp_path / "ax.yml"
    ax.write_text("base_model: Qwen/Qwen2.5-7B\nadapter: qlora\nsequence_len: 512\n")
    with pytest.raises(ValueError, match="qlora needs load_in_4bit"):
        settings_from_config(ax)


def test_trainer_json_needs_a_model():
    with pytest.raises(ValueError, match="names no model; pass model="):
        settings_from_config(CONFIGS / "trainer_args_8bit.json")


def test_unknown_hub_id_says_what_to_do(tmp_path):
    cfg = tmp_path / "ax.yml"
    cfg.write_text("base_model: someone/NotInTheCatalog-3B\nadapter: lora\nlora_target_linear: true\n")
    step, rep = settings_from_config(cfg)
    assert rep.model == "someone/NotInTheCatalog-3B"
    assert any("not in the catalog" in n and "local folder" in n for n in rep.notes)


def test_instruct_variant_maps_to_catalog_architecture():
    _, rep = settings_from_config(CONFIGS / "llamafactory_lora_llama-3.1-8b.yaml")
    assert rep.model == "llama-3.1-8b" and rep.model_in_config == "meta-llama/Meta-Llama-3.1-8B-Instruct"


def test_flags_win_and_multi_gpu_config_shards():
    step, rep = settings_from_config(CONFIGS / "llamafactory_full_llama-3.2-1b.yaml", num_gpus=8, seq_len=512)
    assert (step.num_gpus, step.sharding, step.seq_len) == (8, "zero3", 512)
    step, _ = settings_from_config(CONFIGS / "trl_lora_qwen2.5-7b.yaml", num_gpus=2)
    assert step.sharding == "ddp"  # several processes, no DeepSpeed / FSDP: DDP replicas


@pytest.mark.parametrize("name", ["trl_qlora_llama-3.1-8b.yaml", "axolotl_qlora_llama-3.1-8b.yml",
                                  "llamafactory_qlora_qwen2.5-7b.yaml", "torchtune_lora_llama3_1_8b.yaml",
                                  "trainer_args_fsdp.json"])
def test_cli_estimate_from_config_json(name, capsys):
    extra = ["--model", "qwen2.5-7b", "--num-gpus", "4"] if name.startswith("trainer") else []
    assert main(["estimate", "--from-config", str(CONFIGS / name), "--gpu", "L4", "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("settings", "not_modelled", "ignored", "peak_allocated_bytes", "device_total_bytes", "fit"):
        assert key in out, key
    assert out["fit"]["gpu"] == "L4" and isinstance(out["fit"]["fits"], bool)
    assert out["device_total_bytes"] >= out["peak_allocated_bytes"] > 0
    step, rep = settings_from_config(CONFIGS / name, **GIVEN.get(name, {}))
    assert {k: out["settings"][k] for k in ("method", "seq_len", "batch_size")} == \
        {"method": step.method, "seq_len": step.seq_len, "batch_size": step.batch_size}
    assert out["not_modelled"] == rep.not_modelled and out["ignored"] == rep.ignored


def test_cli_table_names_what_is_not_modelled(capsys):
    assert main(["estimate", "--from-config", str(CONFIGS / "axolotl_qlora_llama-3.1-8b.yml"), "--gpu", "L4"]) == 0
    out = capsys.readouterr().out
    assert "NOT MODELLED sample_packing" in out and "NOT MODELLED flash_attention" in out
    assert "does NOT fit" in out or "fits" in out


@pytest.mark.parametrize("tool,lines,flagged", [
    ("trl", "dtype: float32\nbf16: false\ntf32: true\n", True),   # fp32 compute on TF32 tensor cores
    ("trl", "dtype: float32\nbf16: false\ntf32: false\n", False),  # fp32 on CUDA cores: what the time model runs
    ("trl", "dtype: float32\nbf16: false\n", False),               # unset: PyTorch's default for matmuls (off)
    ("trl", "bf16: true\ntf32: true\n", False),                    # bf16 autocast: TF32 does not touch the matmuls
    ("axolotl", "adapter: lora\nlora_target_linear: true\ntf32: true\n", True),  # no bf16/fp16: fp32 weights
])
def test_tf32_on_with_fp32_compute_is_not_modelled(tmp_path, tool, lines, flagged):
    head = ("model_name_or_path: Qwen/Qwen2.5-0.5B\nmax_length: 512\n" if tool == "trl" else
            "base_model: Qwen/Qwen2.5-0.5B\nsequence_len: 512\n")
    cfg = tmp_path / f"{tool}.yml"
    cfg.write_text(head + lines)
    step, rep = settings_from_config(cfg)
    tf32 = [n for n in rep.not_modelled if n["key"] == "tf32"]
    assert bool(tf32) == flagged, rep.not_modelled
    if flagged:
        assert (step.dtype, step.autocast) == ("float32", False)
        assert tf32[0]["value"] is True and "CUDA cores as PyTorch does by default" in tf32[0]["why"]
