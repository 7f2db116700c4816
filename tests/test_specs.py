"""Model specs: the offline catalog equals the real models, and every accepted ``model`` form works."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from lora_kit.memory.specs import catalog, model_spec, spec_from_config, valid_targets


def _meta_params(cfg) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def _config(name: str):
    facts = {k: v for k, v in catalog()[name].items() if k not in ("hub_id", "params")}
    return AutoConfig.for_model(facts.pop("model_type"), **facts)


REQUIRED = ["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b",
            "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "mistral-7b", "gemma-2-2b", "gemma-2-9b",
            "gemma-2-27b", "phi-3-mini", "phi-3-medium", "smollm2-135m", "smollm2-360m", "smollm2-1.7b",
            "pythia-1b", "pythia-6.9b"]


def test_catalog_has_the_required_models():
    assert set(REQUIRED) <= set(catalog())


@pytest.mark.parametrize("name", REQUIRED)
def test_param_count_equals_meta_build_and_published(name):
    """Spec arithmetic == the real transformers model built on the meta device == the published count."""
    spec = model_spec(name)
    assert spec.num_params == _meta_params(_config(name)) == catalog()[name]["params"]


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
    with pytest.raises(ValueError, match="PretrainedConfig.*config.json.*catalog name.*llama-3.1-8b"):
        model_spec("someone/not-a-model")
