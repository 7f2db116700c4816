"""Model specs: the offline catalog equals the real models, and every accepted ``model`` form works."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from lora_kit.memory.specs import (
    catalog,
    catalog_config,
    catalog_source,
    check_targets,
    model_spec,
    moe_facts,
    spec_from_config,
    valid_targets,
)


def _meta_params(cfg) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def _config(name: str):
    facts = catalog_config(name)
    return AutoConfig.for_model(facts.pop("model_type"), **facts)


REQUIRED = ["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b",
            "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "mistral-7b", "gemma-2-2b", "gemma-2-9b",
            "gemma-2-27b", "phi-3-mini", "phi-3-medium", "smollm2-135m", "smollm2-360m", "smollm2-1.7b",
            "pythia-1b", "pythia-6.9b"]
ADDED = ["llama-3.3-70b", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-65b", "qwen3-0.6b", "qwen3-1.7b",
         "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen1.5-moe-a2.7b",
         "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "phi-4", "phi-4-mini", "mistral-nemo-12b",
         "mistral-small-24b", "mixtral-8x7b", "mixtral-8x22b", "deepseek-v2-lite", "olmo-2-7b", "olmo-2-13b",
         "olmo-2-32b", "granite-3.1-2b", "granite-3.2-8b"]
MOE = ["mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen1.5-moe-a2.7b", "deepseek-v2-lite"]


def test_catalog_has_the_required_models():
    assert set(REQUIRED + ADDED) <= set(catalog())
    assert len(catalog()) >= 40


@pytest.mark.parametrize("name", sorted(catalog()))
def test_param_count_equals_meta_build(name):
    """Spec arithmetic (closed form, or read from a meta build for other types) == the real transformers model
    built on the meta device from the catalog's config fields == the catalog's count. Full builds: even the
    235B MoE builds in ~0.1 s on the meta device (its experts are three fused tensors per layer)."""
    spec = model_spec(name)
    assert spec.num_params == _meta_params(_config(name)) == catalog()[name]["params"]


def _billions(text: str) -> tuple[float, float]:
    """'30.5B' -> (30.5e9, 0.05e9): the value and half a unit of its last digit (the source's rounding)."""
    digits = text.rstrip("B")
    return float(digits) * 1e9, 0.5 * 10 ** (9 - len(digits.partition(".")[2]))


def _active_params(spec) -> int:
    """Parameters one token uses: everything but the routed experts, plus experts_per_token of them per MoE block."""
    m = spec.moe
    per_expert = 3 * spec.hidden_size * m["expert_intermediate_size"]  # gate, up, down
    routed = len(m["moe_layers"]) * m["experts"] * per_expert
    return spec.num_params - routed + len(m["moe_layers"]) * m["experts_per_token"] * per_expert


@pytest.mark.parametrize("name", [n for n in sorted(catalog()) if catalog_source(n).get("published_params")])
def test_param_count_equals_the_published_count(name):
    """Within the rounding the model card uses: total, non-embedding (which checks the tying: an untied 151936 x
    4096 lm_head is 0.6B) and, for MoE, active parameters (which checks experts, experts per token, widths) within
    one unit of the last digit: cards differ on what counts as active (Qwen3-30B-A3B: 3.353B counted here with
    embeddings and router, "3.3B" on the card)."""
    spec, src = model_spec(name), catalog_source(name)
    embed = spec.vocab_size * spec.hidden_size * (1 if spec.tied_embeddings else 2)
    for key, count, units in (("published_params", spec.num_params, 1),
                              ("published_non_embedding_params", spec.num_params - embed, 1),
                              ("published_active_params", _active_params(spec) if spec.moe else None, 2)):
        if key in src:
            value, half_unit = _billions(src[key])
            assert abs(count - value) <= units * half_unit, (key, count, src[key])


@pytest.mark.parametrize("name", ADDED)
def test_every_added_entry_names_its_source(name):
    src, facts = catalog_source(name), catalog()[name]
    assert src["config"] == f"https://huggingface.co/{facts['hub_id']}/blob/main/config.json"
    assert src["read"] and all(isinstance(r, str) and r for r in src["read"])


def test_mixture_of_experts_entries():
    """MoE entries are read without crashing, exactly counted, and their expert facts come out of each family's
    own config names (Mixtral, Qwen-MoE with and without a shared expert, DeepSeek with a dense first block)."""
    assert [n for n in sorted(catalog()) if moe_facts(catalog_config(n))] == sorted(MOE)
    m = model_spec("mixtral-8x7b").moe
    assert (m["experts"], m["experts_per_token"], m["expert_intermediate_size"], m["shared_experts"]) == (8, 2, 14336,
                                                                                                        0)
    assert m["moe_layers"] == list(range(32))
    q = model_spec("qwen3-235b-a22b").moe
    assert (q["experts"], q["experts_per_token"], q["expert_intermediate_size"], len(q["moe_layers"])) == (128, 8, 1536,
                                                                                                           94)
    s = model_spec("qwen1.5-moe-a2.7b").moe
    assert (s["experts"], s["experts_per_token"], s["shared_experts"], s["shared_intermediate_size"]) == (60, 4, 1,
                                                                                                        5632)
    d = model_spec("deepseek-v2-lite")
    assert d.moe["moe_layers"] == list(range(1, 27)) and d.moe["shared_intermediate_size"] == 2 * 1408
    widths = {(lin.name, lin.out_features): lin.layers for lin in d.linears if lin.kind == "mlp_in"}
    assert widths[("gate_proj", 10944)] == 1 and widths[("gate_proj", 2 * 1408)] == 26  # dense block 0, shared 1-26
    assert valid_targets(d).count("gate_proj") == 1
    assert moe_facts(catalog_config("llama-3.1-8b")) == {} and model_spec("qwen3-8b").moe == {}
    cfg = _config("qwen3-30b-a3b")  # a reduced copy: every second block sparse, block 0 dense
    cfg.num_hidden_layers, cfg.decoder_sparse_step, cfg.mlp_only_layers = 4, 2, [1]
    assert moe_facts(cfg.to_dict())["moe_layers"] == [3]
    assert model_spec(cfg).num_params == _meta_params(cfg)


@pytest.mark.parametrize("name", sorted(catalog()))
def test_every_entry_takes_lora_on_all_linear_layers(name):
    """A planner default (rank 16, all-linear) is accepted for every entry (Qwen1.5-MoE's 1-wide shared-expert
    gate does not veto it)."""
    attn = "eager" if catalog()[name]["model_type"] == "gemma2" else "sdpa"
    assert check_targets(name, "lora", 16, "all-linear", attn) == tuple(valid_targets(name))


def test_architecture_facts():
    g = model_spec("gemma-2-9b")
    assert (g.head_dim, g.tied_embeddings, g.norms_per_layer, g.attn_softcap, g.final_softcap) == (256, True, 4,
                                                                                                     True, True)
    q = model_spec("qwen2.5-0.5b")
    assert q.tied_embeddings and [lin.bias for lin in q.linears][:4] == [True, True, True, False]
    assert not model_spec("qwen2.5-7b").tied_embeddings
    p = model_spec("pythia-1b")
    assert (p.parallel_residual, p.norm_bias, p.num_kv_heads, p.tied_embeddings, p.gated_mlp) == (True, True, 8,
                                                                                                    False, False)
    assert model_spec("llama-3.1-8b").num_kv_heads == 8
    g3 = model_spec("gemma-3-27b")
    assert (g3.head_dim, g3.num_kv_heads, g3.tied_embeddings, g3.vocab_size, g3.config["sliding_window"],
            g3.config["query_pre_attn_scalar"]) == (128, 16, True, 262208, 1024, 168)
    nemo = model_spec("mistral-nemo-12b")
    assert nemo.head_dim == 128 != nemo.hidden_size // nemo.num_heads  # head_dim from the config, not hidden / heads
    assert model_spec("phi-4-mini").tied_embeddings and not model_spec("phi-4").tied_embeddings
    assert model_spec("qwen3-4b").tied_embeddings and not model_spec("qwen3-8b").tied_embeddings
    assert (model_spec("llama-65b").num_kv_heads, model_spec("llama-65b").vocab_size) == (64, 32000)
    assert model_spec("llama-2-70b").num_kv_heads == 8 and model_spec("llama-2-13b").num_kv_heads == 40


def test_partial_rotary_read_where_the_config_puts_it():
    """A key present with null falls through to the next place (a saved Phi config carries both)."""
    from lora_kit.memory.specs import _rotary_fraction
    assert _rotary_fraction({"partial_rotary_factor": None, "rope_parameters": {"partial_rotary_factor": 0.5}}) == 0.5
    assert _rotary_fraction({"rotary_pct": 0.25}) == 0.25 and _rotary_fraction({"rope_scaling": None}) == 1.0


def test_valid_targets_follow_the_architecture():
    assert valid_targets("phi-3-mini") == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert valid_targets("pythia-1b") == ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
    assert valid_targets("llama-3.2-1b") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]


def test_every_model_form(tmp_path):
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    facts = lambda s: (s.num_params, s.linears, s.vocab_size, s.tied_embeddings)  # noqa: E731 (names differ)
    from_cfg = model_spec(cfg)
    cfg.save_pretrained(tmp_path)
    assert facts(model_spec(tmp_path)) == facts(from_cfg)
    assert facts(model_spec(str(tmp_path / "config.json"))) == facts(from_cfg)
    assert from_cfg.num_params == _meta_params(cfg)
    assert model_spec("meta-llama/Llama-3.1-8B") == model_spec("llama-3.1-8b")  # hub id of a catalog entry


def test_embedded_tiny_model():
    from lora_kit.loading import EMBEDDED_DIR
    if not (EMBEDDED_DIR / "config.json").is_file():
        pytest.skip("embedded model not built")
    cfg = json.loads((EMBEDDED_DIR / "config.json").read_text())
    spec = model_spec("tiny")
    assert spec.hidden_size == cfg["hidden_size"]
    assert spec.num_params == _meta_params(AutoConfig.for_model(cfg.pop("model_type"), **{
        k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")}))


def test_other_architectures_through_a_meta_build():
    """A model type without a closed form (OLMo) is read from its meta-device build."""
    cfg = AutoConfig.for_model("olmo", vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    spec = spec_from_config(cfg.to_dict())
    assert not spec.exact
    assert spec.num_params == _meta_params(cfg)
    assert "q_proj" in valid_targets(spec)


def test_unknown_model_offline_says_what_to_pass(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="Unknown model .someone/not-a-model.*catalog has .*llama-3.1-8b.*config.json.*PretrainedConfig"):
        model_spec("someone/not-a-model")


@pytest.mark.parametrize("model_type", ["gpt_neox", "falcon", "gpt2", "llama"])
def test_the_attention_output_projection_is_read_as_such(model_type):
    """Each block's linears get their role from where they sit: the projection after attention (o_proj, GPT-NeoX's
    ``attention.dense``, Falcon's ``self_attention.dense``, GPT-2's ``attn.c_proj``, a ``Conv1D``) is the attention
    output (the time model feeds it the attention kernel's dtype), the others in attention are its inputs."""
    cfg = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, n_embd=128, n_layer=2, n_head=4)
    spec = spec_from_config(cfg.to_dict())
    kinds = [(lin.name, lin.kind) for lin in spec.linears]
    out = {"gpt_neox": "dense", "falcon": "dense", "gpt2": "c_proj", "llama": "o_proj"}[model_type]
    assert [name for name, kind in kinds if kind == "attn_out"] == [out], kinds
    assert any(kind == "attn_in" for _, kind in kinds) and any(kind == "mlp_out" for _, kind in kinds), kinds


@pytest.mark.parametrize("model_type, upcast, rotary_fp32", [("olmo2", True, True), ("gemma3_text", True, False),
                                                             ("granite", False, False), ("olmo", False, True)])
def test_norm_and_rotary_dtypes_are_read_from_the_modelling_code(model_type, upcast, rotary_fp32):
    """The time model prices the block's element-wise kernels by the dtype they run in: a norm that multiplies by
    its weight in fp32 and casts last (Gemma 3, OLMo 2) and fp32 rotary (OLMo 2) are read by running the meta
    build's norm and rotary embedding once; Llama-like code (Granite; OLMo 1's weightless LayerNorm, though its
    rotary is OLMo 2's) keeps the 16-bit stream."""
    cfg = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               pad_token_id=0, eos_token_id=1, bos_token_id=1)
    spec = spec_from_config(cfg.to_dict())
    assert not spec.exact
    assert (spec.norm_upcast, spec.rotary_fp32) == (upcast, rotary_fp32)
    exact = {mt: spec_from_config(AutoConfig.for_model(mt, vocab_size=300, hidden_size=128, intermediate_size=256,
                                                       num_hidden_layers=2, num_attention_heads=4).to_dict())
             for mt in ("gemma2", "llama")}
    assert exact["gemma2"].norm_upcast and not exact["llama"].norm_upcast
