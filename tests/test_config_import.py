"""Plan from the user's own training config: five formats, each field mapped to the step, the rest listed.

The configs in tests/configs/ are written in each tool's documented format (TRL's ``trl sft --config`` YAML,
axolotl's and LLaMA-Factory's example layouts, torchtune's recipe configs, ``TrainingArguments.to_json_string()``)
for catalog models: LoRA, QLoRA and full fine-tuning for each tool.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_kit.memory.flash_attention import FA2
from lora_kit.memory.specs import check_attention
from lora_kit.plan.config_import import FORMATS, detect_format, settings_from_config
from lora_kit.settings import PLANNING
from lora_kit.ui.cli import main

CONFIGS = Path(__file__).parent / "configs"

# config -> (model planned, the step fields it sets, the keys listed as not modelled)
EXPECTED = {
    "trl_qlora_llama-3.1-8b.yaml": ("llama-3.1-8b", dict(
        method="qlora", dtype="bfloat16", autocast=True, double_quant=True, seq_len=4096, batch_size=2, lora_rank=32,
        lora_alpha=64, lora_targets="all-linear", gradient_checkpointing=True, attn_implementation="sdpa",
        optimizer="paged_adamw_8bit", grad_accum=8, padding="none", loop="sft"), {"packing"}),  # packed: FA2 only
    "trl_lora_qwen2.5-7b.yaml": ("qwen2.5-7b", dict(
        method="lora", dtype="bfloat16", autocast=True, seq_len=2048, batch_size=4, lora_rank=16, lora_alpha=32,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), gradient_checkpointing=True, optimizer="adamw",
        grad_accum=1, loop="sft"), set()),
    # TRL's defaults: ModelConfig.dtype float32 under bf16 autocast = fp32 master weights, bf16 compute; one row
    # a batch: never padded, so FlashAttention-2 runs it unmasked
    "trl_full_qwen2.5-0.5b.yaml": ("qwen2.5-0.5b", dict(
        method="full", dtype="bfloat16", autocast=True, seq_len=8192, batch_size=1, gradient_checkpointing=False,
        optimizer="adamw", grad_accum=16, attn_implementation=FA2, padding="longest", loop="sft", liger_kernel=True),
        set()),  # TRL's collator pads to the longest row: one row a batch pads nothing
    # packing with TRL's default 'bfd' strategy turns padding_free on: one flattened row of 4 x 2048 tokens
    "trl_lora_fa2_packing_llama-3.2-1b.yaml": ("llama-3.2-1b", dict(
        method="lora", dtype="bfloat16", autocast=True, seq_len=2048, batch_size=4, grad_accum=4,
        attn_implementation=FA2, padding="packed", loop="sft"), set()),
    "axolotl_qlora_llama-3.1-8b.yml": ("llama-3.1-8b", dict(
        method="qlora", dtype="bfloat16", autocast=True, double_quant=True, seq_len=4096, batch_size=2, lora_rank=32,
        lora_alpha=16, lora_targets="all-linear", gradient_checkpointing=True, optimizer="paged_adamw_32bit",
        grad_accum=4, attn_implementation=FA2, padding="packed", loop="trainer"), {"sample_packing"}),
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
        liger_kernel=True, attn_implementation=FA2, padding="longest"), set()),  # padded rows: unpad path
    "llamafactory_neat_packing_llama-3.2-1b.yaml": ("llama-3.2-1b", dict(
        method="lora", seq_len=2048, batch_size=4, grad_accum=2, attn_implementation=FA2, padding="packed",
        loop="trainer"), {"neat_packing"}),
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
    check_attention(step)  # an attention and rows the kit plans
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


@pytest.mark.parametrize("adapter_line, bits, fix", [("", "load_in_4bit", "adapter: qlora"),
                                                     ("adaptor: qlora\n", "load_in_4bit", "did you mean 'adapter'"),
                                                     ("", "load_in_8bit", "adapter: lora")])
def test_axolotl_quantized_base_without_adapter_is_refused(tmp_path, adapter_line, bits, fix):
    """axolotl with load_in_4bit / load_in_8bit and no adapter (left out, or mistyped) cannot train: transformers
    refuses a quantized base without adapters. Never planned as full fine-tuning of a 16-bit model."""
    ax = tmp_path / "ax.yml"
    ax.write_text(f"base_model: meta-llama/Llama-3.1-8B\n{bits}: true\n{adapter_line}lora_r: 16\n"
                  "sequence_len: 2048\nmicro_batch_size: 2\nbf16: auto\n")
    with pytest.raises(ValueError, match=f"{bits} without adapter.*{fix}"):
        settings_from_config(ax)
    ax.write_text(ax.read_text().replace(f"{bits}: true", f"{bits}: false"))  # full fine-tuning of a 16-bit base
    step, _ = settings_from_config(ax)
    assert step.method == "full" and step.dtype == "bfloat16"


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
    from lora_kit.plan.config_import import resolve_model
    # the variant word anywhere in the name (before a version or a date), not only at its end
    for given, name in (("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b"), ("google/gemma-2-9b-it", "gemma-2-9b"),
                        ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
                        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b")):
        assert resolve_model(given, notes=[]) == name, given
    assert resolve_model("mistralai/Mistral-7B-Instruct-v0.2", notes=[]) != "mistral-7b"  # another vocabulary


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
    assert "NOT MODELLED sample_packing" in out and "NOT MODELLED flash_attention" not in out
    assert "attn_implementation     <- flash_attention=True" in out
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


HEADS = {"trl": "model_name_or_path: Qwen/Qwen2.5-0.5B\nuse_peft: true\nbf16: true\nmax_length: 512\n"
                "per_device_train_batch_size: 4\n",
         "axolotl": "base_model: Qwen/Qwen2.5-0.5B\nadapter: lora\nlora_target_linear: true\nbf16: true\n"
                    "sequence_len: 512\nmicro_batch_size: 4\n",
         "llamafactory": "model_name_or_path: Qwen/Qwen2.5-0.5B\nfinetuning_type: lora\nbf16: true\ncutoff_len: 512\n"
                         "per_device_train_batch_size: 4\nuse_reentrant_gc: false\n"}


def _imported(tmp_path, tool, lines, **given):
    cfg = tmp_path / f"{tool}.yml"
    cfg.write_text(HEADS[tool] + lines)
    step, rep = settings_from_config(cfg, **given)
    check_attention(step)  # never a step the kit refuses
    return step, rep, {n["key"]: n["why"] for n in rep.not_modelled}


# (tool, config lines) -> (attn_implementation, padding, the keys listed as not modelled, a phrase of their why)
ROWS = [
    # TRL 1.16: packing's default strategy 'bfd' turns padding_free on (sft_trainer.py:916): packed rows
    ("trl", "attn_implementation: flash_attention_2\npacking: true\n", FA2, "packed", {}),
    ("trl", "attn_implementation: flash_attention_2\npacking: true\npacking_strategy: bfd_split\n", FA2, "packed", {}),
    ("trl", "model_init_kwargs:\n  attn_implementation: flash_attention_2\npacking: true\n", FA2, "packed", {}),
    # 'wrapped' rows are exactly max_length, never padded: unmasked rows, planned exactly
    ("trl", "attn_implementation: flash_attention_2\npacking: true\npacking_strategy: wrapped\n", FA2, "none", {}),
    ("trl", "attn_implementation: flash_attention_2\npacking: true\npacking_strategy: wrapped\npadding_free: true\n",
     FA2, "packed", {}),
    # no packing: the collator pads 4 rows to the longest; FlashAttention-2 then takes the unpad path, planned
    ("trl", "attn_implementation: flash_attention_2\n", FA2, "longest", {}),
    # packed rows under sdpa (a block-diagonal mask): planned as rows of max_length, and said how to plan them packed
    ("trl", "packing: true\n", "sdpa", "none", {"packing": "set attn_implementation: flash_attention_2"}),
    ("trl", "attn_implementation: eager\npacking: true\n", "eager", "none", {"packing": "block-diagonally"}),
    # flash-attn takes 16-bit q/k/v only: fp32 weights without autocast are planned with sdpa
    ("trl", "attn_implementation: flash_attention_2\nbf16: false\ndtype: float32\npacking: true\n", "sdpa", "none",
     {"attn_implementation": "turn bf16 on", "packing": "FlashAttention-2 only"}),
    ("axolotl", "flash_attention: true\nsample_packing: true\n", FA2, "packed", {"sample_packing": "assumed"}),
    ("axolotl", "flash_attention: true\nsample_packing: true\npad_to_sequence_len: true\n", FA2, "packed",
     {"sample_packing": "gathers q/k/v into copies"}),
    ("axolotl", "flash_attention: true\npad_to_sequence_len: true\n", FA2, "max_length", {}),
    ("axolotl", "sample_packing: true\n", "sdpa", "max_length", {"sample_packing": "set flash_attention: true"}),
    ("llamafactory", "flash_attn: fa2\nneat_packing: true\n", FA2, "packed", {"neat_packing": "configure_packing"}),
    ("llamafactory", "flash_attn: fa2\npacking: true\n", FA2, "none", {}),  # packs filled, mask all ones
    ("llamafactory", "flash_attn: fa2\n", FA2, "longest", {}),
    ("llamafactory", "neat_packing: true\n", "sdpa", "max_length", {"neat_packing": "set flash_attn: fa2"}),
    ("llamafactory", "flash_attn: sdpa\npacking: true\n", "sdpa", "none", {}),
]


@pytest.mark.parametrize("tool, lines, attn, padding, listed", ROWS)
def test_flash_attention_and_packing_map_to_the_step(tmp_path, tool, lines, attn, padding, listed):
    step, rep, nm = _imported(tmp_path, tool, lines)
    assert (step.attn_implementation, step.padding) == (attn, padding), rep.text()
    # the same tokens per micro-step: 4 rows (or packs) of 512 tokens, flattened into one row when packed
    assert (step.seq_len, step.batch_size) == (512, 4)
    assert set(nm) == set(listed), rep.not_modelled
    for key, phrase in listed.items():
        assert phrase in nm[key], nm[key]
    assert "issue 34" not in rep.text() and "planned as sdpa" not in rep.text()


def test_trl_packing_reports_where_it_came_from(tmp_path):
    step, rep, _ = _imported(tmp_path, "trl", "attn_implementation: flash_attention_2\npacking: true\n")
    assert rep.mapped["padding"] == "packing=\"packing=True, packing_strategy='bfd': padding_free\""
    assert any("pack of examples up to max_length" in n for n in rep.notes)
    assert "packing" not in rep.ignored and "packing_strategy" not in rep.ignored
    step, rep, _ = _imported(tmp_path, "trl", "attn_implementation: flash_attention_2\nper_device_train_batch_size: 1\n")
    # the padding TRL's collator uses, under FlashAttention-2 as under any kernel: one row a batch pads nothing
    assert (step.padding, rep.not_modelled) == ("longest", [])
    assert rep.mapped["padding"] == "padding='the SFT collator pads to the longest row' (trl default)"
    import torch

    from lora_kit.memory.measure import step_batch
    assert bool(step_batch(torch.ones(1, 8, dtype=torch.long), step.padding)["attention_mask"].all())


def test_trl_refuses_what_its_trainer_refuses(tmp_path):
    """SFTTrainer refuses padding_free without packing while max_length truncates nothing (sft_trainer.py:999),
    and packing without max_length (sft_trainer.py:1468)."""
    with pytest.raises(ValueError, match="padding_free without packing and max_length=512"):
        _imported(tmp_path, "trl", "attn_implementation: flash_attention_2\npadding_free: true\n")
    with pytest.raises(ValueError, match="packing without max_length: TRL's SFTTrainer refuses it"):
        _imported(tmp_path, "trl", "attn_implementation: flash_attention_2\npacking: true\nmax_length: null\n")
    step, _, nm = _imported(tmp_path, "trl", "attn_implementation: flash_attention_2\npadding_free: true\n"
                                              "max_length: null\n")
    assert (step.padding, step.seq_len, set(nm)) == ("packed", PLANNING.seq_len, {"max_length"})


def test_given_fields_win_and_the_step_check_runs(tmp_path):
    """What the caller gives wins; a refused combination is refused with the kit's message."""
    step, _, nm = _imported(tmp_path, "axolotl", "flash_attention: true\nsample_packing: true\n",
                            attn_implementation="sdpa")
    assert (step.attn_implementation, step.padding) == ("sdpa", "max_length") and "sample_packing" in nm
    step, _, nm = _imported(tmp_path, "llamafactory", "", attn_implementation=FA2)  # 'auto' -> sdpa, given FA2
    assert (step.attn_implementation, step.padding, set(nm)) == (FA2, "longest", set())  # padded: the unpad path
    with pytest.raises(ValueError, match="padding='packed' is planned with attn_implementation='flash_attention_2'"):
        _imported(tmp_path, "trl", "packing: true\n", padding="packed")


def test_an_imported_packed_fa2_step_is_estimated(tmp_path, monkeypatch):
    """The step an axolotl config with flash_attention and sample_packing maps to runs through estimate (fitted
    on the spot for the tiny model: no shipped fit holds FlashAttention-2)."""
    from lora_kit.memory import fits
    from lora_kit.memory.estimate import estimate
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path / "fits"))
    monkeypatch.setenv("LORA_KIT_FIT", "auto")
    fits._MEMO.clear()
    step, _ = settings_from_config(CONFIGS / "axolotl_qlora_llama-3.1-8b.yml", model="tiny", seq_len=64)
    assert (step.method, step.attn_implementation, step.padding, step.batch_size) == ("qlora", FA2, "packed", 2)
    est = estimate("tiny", step)
    assert est.settings["attn_implementation"] == FA2 and est.settings["padding"] == "packed"
    assert est.device_total_bytes >= est.peak_allocated_bytes > 0


@pytest.mark.parametrize("name, typo, meant", [("axolotl_lora_mistral-7b.yml", "lora_droput", "lora_dropout"),
                                               ("trl_lora_qwen2.5-7b.yaml", "lora_dropuot", "lora_dropout"),
                                               ("llamafactory_lora_llama-3.1-8b.yaml", "cutof_len", "cutoff_len")])
def test_a_mistyped_key_is_named_with_what_it_likely_meant(tmp_path, name, typo, meant):
    """A near miss of a key the kit reads is a typo the user's tool may ignore too: the report names it with "did
    you mean", and the step keeps that field at its tool's default (what the real run would do)."""
    import yaml
    cfg = yaml.safe_load((CONFIGS / name).read_text())
    cfg.pop(meant, None)
    cfg[typo] = 0.05 if "dropout" in meant else 1024
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    _, rep = settings_from_config(path)
    assert typo in rep.ignored
    assert sum(f"{typo!r}" in n and f"did you mean {meant!r}" in n for n in rep.notes) == 1, rep.notes
    assert "ignored (not read by the plan)" in rep.text()


@pytest.mark.parametrize("name, real_keys", [
    ("axolotl_lora_mistral-7b.yml", {"peft_use_rslora": True, "torch_dtype": "bfloat16", "loftq_config": None,
                                     "flash_attn_cross_entropy": False}),
    ("llamafactory_lora_llama-3.1-8b.yaml", {"use_rslora": True, "use_llama_pro": False}),
    ("trl_lora_qwen2.5-7b.yaml", {"torch_dtype": "bfloat16"})])
def test_a_real_key_the_kit_does_not_read_gets_no_typo_hint(tmp_path, name, real_keys):
    """Real keys of the tool that the kit does not read are listed as ignored, never 'corrected' into another key
    (``use_rslora`` is not a typo of ``use_dora``): a hint needs one slip from exactly one key the kit reads."""
    import yaml
    cfg = {**yaml.safe_load((CONFIGS / name).read_text()), **real_keys}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    _, rep = settings_from_config(path)
    assert not [n for n in rep.notes if "did you mean" in n], rep.notes


@pytest.mark.parametrize("lines,note", [
    ("fsdp:\n  - full_shard\nfsdp_config:\n  fsdp_version: 1\n", True),
    ("fsdp:\n  - full_shard\nfsdp_config:\n  fsdp_version: 2\n", False),
    ("fsdp_version: 1\nfsdp_config:\n  fsdp_offload_params: false\n", True),
])
def test_fsdp_1_is_planned_as_fsdp2_and_says_so(tmp_path, lines, note):
    cfg = tmp_path / "axolotl.yml"
    cfg.write_text("base_model: Qwen/Qwen2.5-0.5B\nsequence_len: 512\nadapter: lora\nlora_target_linear: true\n"
                   + lines)
    step, rep = settings_from_config(cfg, num_gpus=2)
    assert step.sharding == "fsdp"
    said = [n for n in rep.notes if "FSDP-1, planned as FSDP2" in n]
    assert bool(said) == note, rep.notes


def test_trainer_fsdp_config_version_1_says_fsdp_1(tmp_path):
    args = json.loads((CONFIGS / "trainer_args_fsdp.json").read_text())
    args["fsdp_config"] = {**(args.get("fsdp_config") or {}), "version": 1}
    path = tmp_path / "trainer_args.json"
    path.write_text(json.dumps(args))
    step, rep = settings_from_config(path, model="qwen2.5-7b", num_gpus=4)
    assert step.sharding == "fsdp" and any("fsdp_config.version=1: FSDP-1" in n for n in rep.notes), rep.notes
    step, rep = settings_from_config(CONFIGS / "trainer_args_fsdp.json", model="qwen2.5-7b", num_gpus=4)
    assert not any("FSDP-1" in n for n in rep.notes)


def test_axolotl_bf16_auto_says_what_it_is_on_a_gpu_without_bf16(tmp_path):
    """axolotl's bf16: auto is bf16 only where the GPU has it; the catalog's T4 does not (axolotl then turns fp16 on),
    so the note says how to plan that, and the override it names plans fp16 compute."""
    from lora_kit.plan.gpus import get_gpu
    assert get_gpu("T4")["compute_capability"] < 8.0  # the premise: a catalog GPU without bf16
    ax = tmp_path / "ax.yml"
    ax.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nsequence_len: 2048\nbf16: auto\n")
    step, rep = settings_from_config(ax)
    assert (step.dtype, step.autocast) == ("bfloat16", True)
    note = next(n for n in rep.notes if n.startswith("bf16: auto"))
    assert "T4" in note and "dtype float16" in note and "every GPU" not in note, note
    step, rep = settings_from_config(ax, dtype="float16")
    assert (step.dtype, step.autocast) == ("float16", True) and rep.mapped["dtype"] == "'float16' (given)"


@pytest.mark.parametrize("name", ["llamafactory_lora_llama-3.1-8b.yaml", "axolotl_lora_mistral-7b.yml",
                                  "trl_lora_qwen2.5-7b.yaml", "torchtune_lora_llama3_1_8b.yaml"])
def test_a_model_override_still_shows_the_configs_own_model(name):
    """--model replaces the config's model in the plan; the report keeps naming the model the config trains, so a
    user sees that another one was planned."""
    _, own = settings_from_config(CONFIGS / name)
    step, rep = settings_from_config(CONFIGS / name, model="llama-3.2-1b")
    assert rep.model == "llama-3.2-1b" and own.model != "llama-3.2-1b"
    assert rep.model_in_config == own.model_in_config and rep.model_in_config
    assert rep.text().splitlines()[0].endswith(f"model llama-3.2-1b (config: {own.model_in_config})")


def test_true_false_written_as_strings_read_as_the_tools_read_them(tmp_path):
    """axolotl (pydantic) and LLaMA-Factory (HfArgumentParser) read "false" as False: so does the kit (Python's
    bool("false") is True); a value that is no boolean is refused naming its key."""
    src = (CONFIGS / "axolotl_lora_mistral-7b.yml").read_text()
    for word, want in (("'false'", False), ("'true'", True), ("no", False)):
        p = tmp_path / f"ax_{want}.yml"
        p.write_text(src.replace("gradient_checkpointing: true", f"gradient_checkpointing: {word}"))
        step, _ = settings_from_config(p)
        assert step.gradient_checkpointing is want
    p = tmp_path / "ax_bad.yml"
    p.write_text(src.replace("gradient_checkpointing: true", "gradient_checkpointing: maybe"))
    with pytest.raises(ValueError, match="gradient_checkpointing='maybe' is not true or false"):
        settings_from_config(p)
    lf = tmp_path / "lf.yaml"
    lf.write_text((CONFIGS / "llamafactory_lora_llama-3.1-8b.yaml").read_text().replace("bf16: true",
                                                                                       "bf16: 'false'\nfp16: 'true'"))
    step, _ = settings_from_config(lf)
    assert step.dtype == "float16"


def test_a_spelled_out_key_is_named_with_the_key_the_tool_reads(tmp_path):
    """sequence_length / cutoff_length are not axolotl's / LLaMA-Factory's keys: the tool falls back to its default
    length silently; the kit's report names the key it meant."""
    ax = tmp_path / "ax.yml"
    ax.write_text((CONFIGS / "axolotl_lora_mistral-7b.yml").read_text().replace("sequence_len:", "sequence_length:"))
    _, rep = settings_from_config(ax)
    assert any("'sequence_length' is not a key the kit reads (did you mean 'sequence_len'?)" in n for n in rep.notes)
    lf = tmp_path / "lf.yaml"
    lf.write_text((CONFIGS / "llamafactory_lora_llama-3.1-8b.yaml").read_text().replace("cutoff_len:", "cutoff_length:"))
    _, rep = settings_from_config(lf)
    assert any("(did you mean 'cutoff_len'?)" in n for n in rep.notes)
