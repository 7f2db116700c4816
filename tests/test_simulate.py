"""simulate: a real step on fake tensors. Checked against a real tracked CPU step of the same
random-init model (measure_config), for LoRA / QLoRA / full, with and without checkpointing, and
across architecture families; plus the bad-input errors."""
from __future__ import annotations

import pytest
import torch

from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import SimResult, simulate

SMALL = dict(dtype="float32", seq_len=16, batch_size=2)


def llama(layers=2, tie=False):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)


def families():
    from transformers import Gemma2Config, GPTNeoXConfig, Phi3Config, Qwen2Config
    common = dict(vocab_size=192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4)
    return {
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        "gemma2": Gemma2Config(num_key_value_heads=2, head_dim=32, **common),
        "phi3": Phi3Config(num_key_value_heads=4, pad_token_id=0, **common),
        "gpt_neox": GPTNeoXConfig(**common),
    }


def _check_same(sim: SimResult, real) -> None:
    assert set(sim.breakdown) == set(BREAKDOWN_KEYS)
    assert sum(sim.breakdown.values()) == sim.peak_allocated_bytes
    # the target is <= 1 %; on these configs the fake step reproduces the real one byte for byte
    assert sim.peak_allocated_bytes == real.peak_allocated_bytes, (sim.breakdown, real.breakdown)
    assert sim.breakdown == real.breakdown
    assert sim.phase == real.phase


@pytest.mark.parametrize("method,gc,dtype", [("lora", False, "float32"), ("lora", True, "bfloat16"),
                                             ("qlora", False, "bfloat16"), ("qlora", True, "float32"),
                                             ("full", False, "bfloat16")])
def test_simulate_matches_a_real_cpu_step(method, gc, dtype):
    kw = dict(SMALL, method=method, gradient_checkpointing=gc, dtype=dtype)
    sim = simulate(llama(), **kw)
    _check_same(sim, measure_config(llama(), **kw))
    if method == "qlora":
        assert sim.breakdown["quant_constants"] > 0 and sim.breakdown["adapters"] > 0
    if method == "full":
        assert sim.breakdown["adapters"] == 0 and sim.phase == "optimizer"
    assert sim.device_total_bytes > sim.peak_allocated_bytes
    assert sim.settings["method"] == method and sim.wall_seconds > 0


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3", "gpt_neox"])
def test_simulate_matches_real_step_across_families(family):
    cfg = families()[family]
    attn = "eager" if family == "gemma2" else "sdpa"  # transformers has no SDPA path for Gemma2
    sim = simulate(cfg, method="lora", lora_rank=8, attn_implementation=attn, **SMALL)
    _check_same(sim, measure_config(cfg, method="lora", lora_rank=8, attn_implementation=attn, **SMALL))


def test_eager_attention_and_targets_and_optimizers_match_real():
    kw = dict(method="lora", attn_implementation="eager", lora_targets=["q_proj", "v_proj"],
              optimizer="sgd", **SMALL)
    _check_same(simulate(llama(1), **kw), measure_config(llama(1), **kw))
    kw = dict(method="lora", optimizer="adamw_8bit", lora_rank=32, **SMALL)
    _check_same(simulate(llama(1), **kw), measure_config(llama(1), **kw))


def test_peak_grows_with_seq_len_and_shrinks_with_checkpointing():
    a = simulate(llama(2), method="lora", dtype="bfloat16", seq_len=32, batch_size=2, gradient_checkpointing=False)
    b = simulate(llama(2), method="lora", dtype="bfloat16", seq_len=64, batch_size=2, gradient_checkpointing=False)
    c = simulate(llama(2), method="lora", dtype="bfloat16", seq_len=64, batch_size=2, gradient_checkpointing=True)
    assert b.breakdown["activations"] > a.breakdown["activations"]
    assert c.breakdown["activations"] < b.breakdown["activations"]
    assert a.breakdown["weights"] == b.breakdown["weights"] == c.breakdown["weights"]


def test_paged_optimizer_state_is_left_out_of_the_peak():
    cfg = llama(1)
    cfg.intermediate_size = 2048  # lora_B of gate/up at rank 64: 131072 elements >= 1e5 -> paged
    kw = dict(method="lora", lora_targets=["gate_proj", "up_proj"], lora_rank=64, **SMALL)
    paged = simulate(cfg, optimizer="paged_adamw_32bit", **kw)
    plain = simulate(cfg, optimizer="adamw", **kw)
    assert any("paged optimizer state" in n for n in paged.notes)
    assert paged.breakdown["optimizer_states"] < plain.breakdown["optimizer_states"]


def test_ddp_adds_gradient_buckets():
    one = simulate(llama(1), method="lora", **SMALL)
    ddp = simulate(llama(1), method="lora", num_gpus=2, sharding="ddp", **SMALL)
    assert ddp.breakdown["gradients"] > one.breakdown["gradients"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=0), "seq_len must be a positive integer"),
    (dict(batch_size=-1), "batch_size must be a positive integer"),
    (dict(method="full", lora_rank=8), "leave it at the default with method='full'"),
    (dict(sharding="zero2"), "needs num_gpus > 1"),
    (dict(optimizer="lion"), "optimizer='lion' is not valid"),
    (dict(lora_targets=["q_proj", "nope"]), r"valid names: \['q_proj'"),
    (dict(lora_rank=65), "lora_rank=65 is larger than the smallest targeted layer"),
    (dict(num_gpus=2, sharding="zero1"), "use lora_kit.memory.estimate"),
    (dict(num_gpus=2, sharding="fsdp", cpu_offload=True), "use lora_kit.memory.estimate for cpu_offload"),
    (dict(num_gpus=2, sharding="fsdp", method="qlora"), "cannot shard QLoRA"),
    (dict(cpu_offload=True), "cpu_offload=True needs sharding"),
])
def test_bad_input_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(llama(1), **kwargs)


def test_attention_the_architecture_lacks_says_which_to_use():
    with pytest.raises(ValueError, match="set attn_implementation='eager'"):
        simulate(families()["gemma2"], **SMALL)


def test_unknown_model_offline_says_how_to_pass_a_config(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="PretrainedConfig"):
        simulate("no-such-org/no-such-model")


def test_local_config_dir(tmp_path):
    llama(1).save_pretrained(tmp_path)
    res = simulate(str(tmp_path), **SMALL)
    assert res.peak_allocated_bytes == simulate(llama(1), **SMALL).peak_allocated_bytes
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("padding,batch_size,gc", [("max_length", 2, False), ("max_length", 2, True),
                                                   ("longest", 2, False), ("longest", 1, False)])
def test_padded_batch_matches_a_real_padded_step(padding, batch_size, gc):
    """The fake step runs the masked path a real padded batch takes (the (B, 1, S, S) mask, its per-layer
    cast, K/V repeated to every head on this GQA model); one row padded to the longest has no padding
    and no 4-D mask. Pinned: the padded step's extra bytes over the unpadded one."""
    kw = dict(SMALL, dtype="bfloat16", batch_size=batch_size, gradient_checkpointing=gc, padding=padding)
    sim = simulate(llama(), **kw)
    _check_same(sim, measure_config(llama(), **kw))
    extra = sim.peak_allocated_bytes - simulate(llama(), **{**kw, "padding": "none"}).peak_allocated_bytes
    # no padding in the batch: only attention_mask + labels (512 B each); padded: the mask's path too
    masked = padding == "max_length" or batch_size > 1
    assert extra == 2 * 512 if not masked else extra >= 2 * 512 and (gc or extra > 2 * 512 + 1024)
