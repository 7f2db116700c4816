"""estimate: exact static bytes against real tiny models, the phase model's invariants, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.device import DEEPSPEED_REDUCE_BUCKET
from lora_kit.memory.estimate import estimate, estimate_arrays
from lora_kit.memory.specs import check_targets, model_spec

R = lambda n: (n + 511) // 512 * 512  # noqa: E731 - the CUDA allocator's 512-byte granularity


def tiny_config(**kw):
    base = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return LlamaConfig(**base)


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = R(t.untyped_storage().nbytes())
    return sum(seen.values())


def test_lora_static_bytes_equal_a_real_peft_model_and_adamw_state():
    from peft import LoraConfig, get_peft_model
    cfg = tiny_config()
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(cfg).to(torch.bfloat16), LoraConfig(r=8, target_modules="all-linear"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=True)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    states = [v for s in opt.state.values() for v in s.values()]  # with each 0-dim step, as simulate counts it
    est = estimate_arrays(cfg, method="lora", dtype="bfloat16", lora_rank=8, seq_len=16)
    assert int(est["weights"]) == storage_bytes(frozen + list(model.buffers()))  # rotary tables: frozen too
    assert int(est["adapters"]) == storage_bytes(trainable)
    assert int(est["optimizer_states"]) == storage_bytes(states)


def test_full_static_bytes_and_optimizer_phase():
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg)
    params = list(model.parameters())
    e = estimate(cfg, method="full", dtype="float32", seq_len=8)
    assert e.breakdown["weights"] == storage_bytes(params + list(model.buffers()))
    assert e.breakdown["optimizer_states"] == 2 * storage_bytes(params) + 512 * len(params)  # exp_avg(_sq), step
    if e.phase == "optimizer":  # grads + foreach AdamW's sqrt(v) temporary
        assert e.breakdown["gradients"] == storage_bytes(params)
    sgd = estimate(cfg, method="full", dtype="float32", seq_len=8, optimizer="sgd")
    assert sgd.breakdown["optimizer_states"] == 0


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_weights_and_constants_equal_bitsandbytes(tmp_path, double_quant):
    pytest.importorskip("bitsandbytes")
    from peft import prepare_model_for_kbit_training
    from lora_kit.loading import load_model
    cfg = tiny_config()
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = prepare_model_for_kbit_training(load_model(str(tmp_path), method="qlora", dtype="bfloat16",
                                                       double_quant=double_quant), use_gradient_checkpointing=False)
    weights = storage_bytes(list(model.parameters()) + list(model.buffers()))
    consts = []
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            consts += [qs.absmax, qs.code]
            if qs.nested:
                consts += [qs.state2.absmax, qs.state2.code, qs.offset]
    e = estimate_arrays(cfg, method="qlora", dtype="bfloat16", double_quant=double_quant, seq_len=16)
    assert int(e["weights"]) == weights
    assert int(e["quant_constants"]) == sum(R(t.untyped_storage().nbytes()) for t in consts)


def test_breakdown_sums_to_peak_and_estimate_equals_the_vectorized_core():
    grid = dict(seq_len=np.array([256, 1024, 4096])[:, None], batch_size=np.array([1, 2, 8])[None, :])
    for kw in (dict(method="lora"), dict(method="qlora", gradient_checkpointing=True),
               dict(method="full", optimizer="adamw_8bit"),
               dict(method="lora", num_gpus=4, sharding="zero3", optimizer="adafactor")):
        arr = estimate_arrays("llama-3.2-1b", **kw, **grid)
        assert arr["peak_allocated_bytes"].dtype == np.int64
        assert np.array_equal(sum(arr[k] for k in BREAKDOWN_KEYS), arr["peak_allocated_bytes"])
        for i, s in enumerate((256, 1024, 4096)):
            for j, b in enumerate((1, 2, 8)):
                e = estimate("llama-3.2-1b", **kw, seq_len=s, batch_size=b)
                assert e.peak_allocated_bytes == arr["peak_allocated_bytes"][i, j]
                assert e.device_total_bytes == arr["device_total_bytes"][i, j] > e.peak_allocated_bytes
                assert e.breakdown == {k: int(arr[k][i, j]) for k in BREAKDOWN_KEYS}
                assert e.phase == arr["phase"][i, j]
                assert set(e.breakdown) == set(BREAKDOWN_KEYS) and all(v >= 0 for v in e.breakdown.values())


def test_what_users_expect_of_an_8b_plan():
    assert estimate("llama-3.1-8b").settings["gradient_checkpointing"] is True  # the planning default
    base = dict(model="llama-3.1-8b", seq_len=2048, gradient_checkpointing=False)
    peak = lambda **kw: estimate(**{**base, **kw}).peak_allocated_bytes  # noqa: E731
    assert peak(method="qlora") < peak(method="lora") < peak(method="full")
    assert peak(gradient_checkpointing=True) < peak()
    assert peak(seq_len=4096) > peak() > peak(seq_len=1024)
    assert peak(grad_accum=8) == peak()  # accumulation does not change the peak
    assert peak(attn_implementation="eager") > peak()
    adam = estimate(**base).breakdown["optimizer_states"]
    assert estimate(**base, optimizer="sgd").breakdown["optimizer_states"] == 0
    # paged states of tensors of 100,000 elements or more live outside the allocator; the LoRA A matrices (16 x 4096)
    # are smaller, so bitsandbytes keeps theirs on the device (the rule is checked on the real optimizers in
    # test_compose.py)
    paged = estimate(**base, optimizer="paged_adamw_32bit").breakdown["optimizer_states"]
    assert 0 < paged < estimate(**base).breakdown["optimizer_states"]
    assert 0.24 < estimate(**base, optimizer="adamw_8bit").breakdown["optimizer_states"] / adam < 0.27
    # several GPUs (a model whose 2-GPU FSDP2 step ships fitted: the others are composed from its one-GPU fit)
    full = dict(model="llama-3.2-1b", method="full", num_gpus=2, seq_len=2048, gradient_checkpointing=True)
    ddp, z1, z2, z3, fsdp = (peak(sharding=s, **full) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp"))
    assert ddp > z1 > z2 - DEEPSPEED_REDUCE_BUCKET * 2 > fsdp  # zero2 launches DeepSpeed: its bucket on top
    assert peak(sharding="zero3", cpu_offload=True, **full) < z3
    # zero3 launches DeepSpeed: FSDP2's figure plus DeepSpeed's gradient bucket (5e8 elements, bf16 here)
    assert z3 - fsdp == DEEPSPEED_REDUCE_BUCKET * 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="someone/unknown-model"), "Unknown model 'someone/unknown-model'.*catalog.*config.json.*PretrainedConfig"),
    (dict(seq_len=0), "seq_len must be a positive integer"),
    (dict(batch_size=-1), "batch_size must be a positive integer"),
    (dict(lora_rank=0), "lora_rank must be a positive integer"),
    (dict(num_gpus=0), "num_gpus must be a positive integer"),
    (dict(lora_rank=5000), r"lora_rank=5000 is larger than the smallest targeted layer dimension \(512\)"),
    (dict(method="full", lora_rank=8), "lora_rank only applies to method='lora' or 'qlora'"),
    (dict(method="full", lora_targets=["q_proj"]), "lora_targets only applies"),
    (dict(sharding="zero2"), "needs num_gpus > 1"),
    (dict(optimizer="adam"), "optimizer='adam' is not valid \\(did you mean 'adamw'\\?\\); choose one of 'adamw'"),
    (dict(lora_targets=["q_proj", "qkv"]), r"\['qkv'\] are not linear layers.*valid names: \['q_proj'"),
    (dict(method="dora"), "method='dora' is not valid"),
    (dict(dtype="int8"), "dtype='int8' is not valid"),
    (dict(attn_implementation="flash"), "attn_implementation='flash' is not valid"),
])
def test_bad_input_says_what_to_change(kwargs, match, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=match):
        estimate(**{"model": "llama-3.2-1b", **kwargs})


def test_phi3_targets_and_gemma2_attention():
    with pytest.raises(ValueError, match="valid names: \\['qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj'\\]"):
        estimate("phi-3-mini", lora_targets=["q_proj"])
    assert check_targets(model_spec("phi-3-mini"), "lora", 16, ["qkv_proj"], "sdpa") == ("qkv_proj",)
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        estimate("gemma-2-2b")
    assert model_spec("gemma-2-2b").head_dim == 256
    assert estimate("gemma-2-2b", attn_implementation="eager").peak_allocated_bytes > 0
