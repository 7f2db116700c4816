"""attn_implementation="flash_attention_2": the CPU emulation of transformers' FA2 path and flash-attn's buffers
(lora_kit.memory.flash_attention), simulate == a real CPU step, estimate == simulate, and what CUDA planning says."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from lora_kit.memory.cuda_kernels import cuda_attention_note, flash_attention_cast
from lora_kit.memory.flash_attention import FA2, KIT_NAME, model_attn_implementation
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.memory.specs import load_config
from lora_kit.memory.tracker import first_divergence, round_bytes

# the embedded tiny Llama is multi-head (2 heads, 2 K/V heads, head size 64); this one groups its K/V heads
GQA = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
STEP = dict(dtype="bfloat16", seq_len=64, batch_size=2, lora_rank=4, attn_implementation=FA2)


@pytest.mark.parametrize("model, method, ckpt", [("tiny", "lora", False), ("tiny", "qlora", True),
                                                 ("gqa", "lora", True), ("gqa", "qlora", False)])
def test_simulate_equals_a_real_cpu_step_byte_for_byte(model, method, ckpt):
    cfg = load_config(dict(GQA)) if model == "gqa" else model
    kw = dict(STEP, method=method, gradient_checkpointing=ckpt)
    real, sim = measure_config(cfg, trace=True, **kw), simulate(cfg, trace=True, **kw)
    assert (real.peak_allocated_bytes, real.breakdown, real.phase) == (sim.peak_allocated_bytes, sim.breakdown,
                                                                      sim.phase)
    d = first_divergence(real.allocations, sim.allocations)
    if ckpt:  # the real step reads position_ids for packed rows (masking_utils), simulate is told there are none
        assert set(d["only_a"]) <= {f"forward {op}" for op in ("sub.Tensor", "cat.default", "ne.Scalar",
                                                               "cumsum.default", "eq.Scalar", "all.default")}
        assert not d["only_b"]
    else:
        assert d is None
    assert not any(op.startswith("_scaled_dot_product") for _, op, _ in real.allocations)  # values: out of sight
    # flash-attn's own buffers per layer (dq_accum's head size 32 / 64 is its own rounding to 32)
    heads, kv, dim, layers = (4, 2, 32, 2) if model == "gqa" else (2, 2, 64, 4)
    B, S = STEP["batch_size"], STEP["seq_len"]
    q_bytes, kv_bytes = round_bytes(B * S * heads * dim * 2), round_bytes(B * S * kv * dim * 2)
    fwd = [q_bytes, round_bytes(B * heads * S * 4), 512]  # mha_fwd: out, softmax_lse fp32, rng_state
    bwd = [round_bytes(B * heads * 128 * 4), round_bytes(B * 128 * heads * dim * 4)]  # mha_bwd: softmax_d, dq_accum
    if kv != heads:
        bwd += [q_bytes, q_bytes]  # mha_bwd: dk_expanded, dv_expanded (per query head), summed into dk, dv

    def made(phase, op):
        return Counter(n for ph, o, n in real.allocations if ph == phase and o == op)
    assert made("forward", "empty.memory_format") == Counter(fwd * layers)
    assert made("backward", "empty.memory_format") == Counter((bwd + (fwd if ckpt else [])) * layers)
    assert made("backward", "empty_like.default") == Counter([q_bytes, kv_bytes, kv_bytes] * layers)  # dq, dk, dv


@pytest.mark.parametrize("method, padding", [("qlora", "none"), ("lora", "packed"), ("lora", "max_length"),
                                             ("qlora", "longest")])
def test_estimate_of_a_fitted_fa2_step_equals_simulate_at_a_held_out_shape(tmp_path, monkeypatch, method, padding):
    """Packed rows' varlen buffers have 128 rows per example, and so have padded rows' (transformers' unpad path):
    their fit has a term in B (calibrate's per_row)."""
    from lora_kit.memory import fits
    from lora_kit.memory.estimate import estimate
    d = tmp_path / "my-glm4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="glm4", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384, pad_token_id=0,
        bos_token_id=0, eos_token_id=0)))
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path / "fits"))
    monkeypatch.setenv("LORA_KIT_FIT", "auto")
    fits._MEMO.clear()
    kw = dict(method=method, dtype="bfloat16", batch_size=3, seq_len=3072, gradient_checkpointing=True,
              attn_implementation=FA2, padding=padding)  # a shape the fit never ran
    est, sim = estimate(str(d), **kw), simulate(str(d), **kw)
    assert est.memory_model == "fitted"
    assert (est.peak_allocated_bytes, est.breakdown, est.phase) == (sim.peak_allocated_bytes, sim.breakdown, sim.phase)
    assert len(list((tmp_path / "fits").glob("glm4-*.json.gz"))) == 1  # its own fit: attn_implementation is in the key
    fits._MEMO.clear()  # read back from the file, as a new process would
    assert estimate(str(d), **kw).peak_allocated_bytes == sim.peak_allocated_bytes


def test_fa2_keeps_what_cpu_sdpa_keeps_plus_its_rng_state_and_casts_qlora_down():
    # LoRA in bf16, multi-head, no checkpointing: CPU SDPA's flash path keeps q, k, v, the output and an fp32
    # logsumexp (B, H, S) per layer, as flash-attn does; flash-attn keeps one more tensor, its 16-byte rng_state (one
    # 512-byte block), and the peak (in backward, with every layer's saved tensors live) is higher by exactly that
    kw = dict(STEP, method="lora", gradient_checkpointing=False)
    fa2, sdpa = simulate("tiny", **kw), simulate("tiny", **{**kw, "attn_implementation": "sdpa"})
    assert fa2.phase == sdpa.phase == "backward"
    assert fa2.peak_allocated_bytes - sdpa.peak_allocated_bytes == 512 * 4
    # QLoRA with checkpointing: SDPA keeps the fp32 q, k, v and output of the recomputed layer; FA2 keeps their bf16
    # casts (fa_peft_integration_check) and a bf16 output: half the bytes, so its peak is lower
    kw = dict(STEP, method="qlora", gradient_checkpointing=True)
    fa2, sdpa = simulate("tiny", **kw), simulate("tiny", **{**kw, "attn_implementation": "sdpa"})
    assert fa2.peak_allocated_bytes < sdpa.peak_allocated_bytes


@pytest.mark.parametrize("model, overrides, match", [
    ("tiny", dict(dtype="float32"), "set autocast=True, or dtype='bfloat16'"),
    (dict(GQA, head_dim=36), dict(padding="max_length"), "multiples of 8 up to 256, this model has 36"),
])
def test_what_fa2_is_not_planned_for_says_what_to_change(model, overrides, match):
    """Padded batches are planned (the unpad path); fp32 q/k/v and head sizes flash-attn does not take are not, in
    padded batches as in others."""
    from lora_kit.memory.estimate import estimate
    from lora_kit.memory.specs import check_attention
    from lora_kit.settings import Step
    kw = {**STEP, "method": "lora", **overrides}
    cfg = load_config(dict(model)) if isinstance(model, dict) else model
    for fn in (simulate, measure_config) + ((estimate,) if model == "tiny" else ()):
        with pytest.raises(ValueError, match=match):
            fn(cfg, **kw)
    for padding in ("max_length", "longest"):
        check_attention(Step(**{**STEP, "padding": padding}))  # no longer refused


def test_fa2_loads_flash_attn_on_cuda_and_the_emulation_elsewhere():
    assert model_attn_implementation(FA2, "cuda") == FA2
    assert model_attn_implementation(FA2, "cpu") == KIT_NAME == model_attn_implementation(FA2, "meta")
    assert model_attn_implementation("sdpa", "cpu") == "sdpa"
    assert "flash" not in KIT_NAME  # transformers would import flash_attn for such a name


def test_cuda_planning_never_falls_back_and_prices_the_casts():
    from lora_kit.plan.timing import attention_kernel, device_parts
    gpu = {"name": "H100 SXM", "compute_capability": 9.0, "bf16_tflops": 989.0, "memory_bandwidth_gbs": 3350.0}
    qlora = dict(method="qlora", seq_len=2048, dtype="bfloat16")
    assert attention_kernel("llama-3.1-8b", qlora, gpu, torch_version=(2, 13)) == "math"  # SDPA: fp32 with GQA
    assert attention_kernel("llama-3.1-8b", dict(qlora, attn_implementation=FA2), gpu, torch_version=(2, 13)) == "flash"
    fa2_time = device_parts("llama-3.1-8b", gpu, **qlora, attn_implementation=FA2)["micro_step_seconds"]
    assert fa2_time < device_parts("llama-3.1-8b", gpu, **qlora)["micro_step_seconds"]
    cast = flash_attention_cast("llama-3.1-8b", **qlora)
    # llama-3.1-8b: 32 query heads, 8 K/V heads, head size 128: q, k, v of 2048 tokens in bf16
    assert (cast.from_dtype, cast.to_dtype, cast.bytes_per_layer) == ("float32", "bfloat16",
                                                                       2048 * (32 + 8 + 8) * 128 * 2)
    note = cuda_attention_note("llama-3.1-8b", **qlora, attn_implementation=FA2)
    assert note.startswith("With flash_attention_2 attention never falls back to the math kernel")
    assert "fp32 q/k/v are cast to bf16 for it, 24.0 MiB per layer" in note
    assert cuda_attention_note("llama-3.1-8b", method="lora", dtype="bfloat16", attn_implementation=FA2) is None
    assert flash_attention_cast("llama-3.1-8b", method="lora", dtype="bfloat16").bytes_per_layer == 0


def test_the_emulation_computes_attention_values():
    """Loss and gradients of a real bf16 step through the emulation equal SDPA's (within bf16 rounding)."""
    import torch
    from transformers import AutoModelForCausalLM
    res = []
    for name in ("sdpa", model_attn_implementation(FA2, "cpu")):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(load_config(dict(GQA)), dtype=torch.bfloat16, attn_implementation=name)
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        res.append((loss.item(), [p.grad.float() for p in m.parameters()]))
    (la, ga), (lb, gb) = res
    assert abs(la - lb) < 1e-3
    assert max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(ga, gb)) < 0.05


@pytest.mark.parametrize("model, method, ckpt", [("tiny", "lora", False), ("gqa", "qlora", True)])
def test_packed_rows_take_the_varlen_path_and_simulate_equals_a_real_step(model, method, ckpt):
    cfg = load_config(dict(GQA)) if model == "gqa" else model
    kw = dict(STEP, method=method, gradient_checkpointing=ckpt, padding="packed", batch_size=3)
    real, sim = measure_config(cfg, trace=True, **kw), simulate(cfg, trace=True, **kw)
    assert (real.peak_allocated_bytes, real.breakdown, real.phase) == (sim.peak_allocated_bytes, sim.breakdown,
                                                                      sim.phase)
    d = first_divergence(real.allocations, sim.allocations)
    assert d is None or (ckpt and not d["only_b"])  # checkpointed: masking_utils' packed-row search, real step only
    heads, dim, layers = (4, 32, 2) if model == "gqa" else (2, 64, 4)
    T, n = 3 * STEP["seq_len"], 3  # one row of three examples
    # mha_varlen_bwd: softmax_d fp32 (H, T + 128 n) and dq_accum fp32 (T + 128 n, H, D rounded to 32)
    made = Counter(b for ph, op, b in real.allocations if ph == "backward" and op == "empty.memory_format")
    assert made[round_bytes(heads * (T + 128 * n) * 4)] >= layers
    assert made[round_bytes((T + 128 * n) * heads * dim * 4)] == layers
    # prepare_fa_kwargs_from_position_ids: cu_seqlens int32 (n + 1), kept for backward by flash-attn
    assert Counter(op for ph, op, _ in real.allocations if ph == "forward")["cat.default"] >= layers


@pytest.mark.parametrize("padding", ["max_length", "longest"])
@pytest.mark.parametrize("method, ckpt", [("lora", False), ("lora", True), ("qlora", False), ("qlora", True)])
def test_padded_rows_take_the_unpad_path_and_simulate_equals_a_real_step(padding, method, ckpt):
    kw = dict(STEP, method=method, gradient_checkpointing=ckpt, padding=padding)
    real, sim = measure_config("tiny", trace=True, **kw), simulate("tiny", trace=True, **kw)
    assert (real.peak_allocated_bytes, real.breakdown, real.phase) == (sim.peak_allocated_bytes, sim.breakdown,
                                                                      sim.phase)
    assert first_divergence(real.allocations, sim.allocations) is None
    heads, dim, layers = 2, 64, 4
    B, S = STEP["batch_size"], STEP["seq_len"]
    # measure.step_batch: the last quarter of every row is padding ('max_length'), of all rows but the first
    # ('longest'): T real tokens in B examples
    T = {"max_length": B * (S - S // 4), "longest": S + (B - 1) * (S - S // 4)}[padding]
    q_bytes, padded_bytes = round_bytes(T * heads * dim * 2), round_bytes(B * S * heads * dim * 2)

    def made(phase, op):
        return Counter(b for ph, o, b in real.allocations if ph == phase and o == op)
    assert made("forward", "index.Tensor")[q_bytes] == 3 * layers  # _upad_input: k, v, q gathered (copies)
    assert made("forward", "zeros.default")[padded_bytes] == layers  # pad_input: zeros (B x S, H, D)
    assert made("forward", "empty.memory_format")[round_bytes(T * 8)] >= layers  # _get_unpad_data: nonzero int64
    # index's backward: zeros (B x S, H, D) per gathered tensor, the gradient put in place (as on CUDA: no second
    # tensor of that size); pad_input's: the T rows of the gradient
    assert made("backward", "new_zeros.default")[padded_bytes] == 3 * layers
    assert not made("backward", "index_put.default")
    assert made("backward", "index.Tensor")[q_bytes] == layers + (3 * layers if ckpt else 0)  # + recomputed gathers
    # mha_varlen_bwd: softmax_d fp32 (H, T + 128 B) and dq_accum fp32 (T + 128 B, H, D rounded to 32)
    assert made("backward", "empty.memory_format")[round_bytes((T + 128 * B) * heads * dim * 4)] == layers


def test_padded_rows_train_with_sdpas_values_and_gradients():
    """A right-padded training batch (as measure.step_batch and TRL's collator pad) through the unpad path: loss and
    gradients equal SDPA's with the same padding mask (within bf16 rounding), q/k/v projections' gradients finite."""
    import torch
    from transformers import AutoModelForCausalLM
    ids = torch.randint(1, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    res = []
    for name in ("sdpa", model_attn_implementation(FA2, "cpu")):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(load_config(dict(GQA)), dtype=torch.bfloat16, attn_implementation=name)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        res.append((loss.item(), [p.grad.float() for p in m.parameters()]))
        for layer in m.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                assert bool(proj.weight.grad.isfinite().all()) and proj.weight.grad.abs().max() > 0
    (la, ga), (lb, gb) = res
    assert abs(la - lb) < 1e-3
    assert max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(ga, gb)) < 0.05


def test_packed_rows_are_planned_with_fa2_only_and_collated_as_transformers_flattens():
    from lora_kit.memory.estimate import estimate
    from lora_kit.run.batches import collate
    with pytest.raises(ValueError, match="padding='packed' is planned with attn_implementation='flash_attention_2'"):
        estimate("tiny", **{**STEP, "attn_implementation": "sdpa", "padding": "packed"})
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    b = collate(rows, seq_len=4, pad_id=0, padding="packed")
    assert {k: v.tolist() for k, v in b.items()} == {"input_ids": [[5, 6, 7, 8, 9]], "labels": [[-100, 6, 7, -100, 9]],
                                                      "position_ids": [[0, 1, 2, 0, 1]]}


def test_padded_rows_outside_training_get_attention_values_unpadded_and_with_a_cache():
    """Adapter checks and generation run padded batches without gradients: a left-padded prompt (as batched
    generation pads) takes the unpad path and gives SDPA's values on its real tokens; the next token's step, with a
    cache (keys longer than queries), gets the attention values only."""
    import torch
    from transformers import AutoModelForCausalLM
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    nxt = torch.randint(1, 256, (2, 1), generator=torch.Generator().manual_seed(2))
    logits = []
    for name in ("sdpa", model_attn_implementation(FA2, "cpu")):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(load_config(dict(GQA)), dtype=torch.bfloat16, attn_implementation=name)
        with torch.no_grad():
            first = m(input_ids=ids, attention_mask=mask, use_cache=True)
            step = m(input_ids=nxt, attention_mask=torch.cat((mask, torch.ones_like(nxt)), 1),
                     past_key_values=first.past_key_values, use_cache=True)
        logits.append((first.logits.float(), step.logits.float()))
    (a, a_next), (b, b_next) = logits
    real = mask.bool()
    assert ((a - b).abs()[real].max() / a.abs().max()).item() < 0.02
    assert ((a_next - b_next).abs().max() / a_next.abs().max()).item() < 0.02


@pytest.mark.parametrize("method, padding", [("lora", "none"), ("qlora", "packed")])
def test_trl_sft_loop_with_fa2_is_the_real_sft_step(method, padding):
    """TRL's SFTTrainer with FlashAttention-2: its collator's all-ones mask, which FA2's mask function drops (a test
    on values, answered from the real batch), or for padding-free rows no mask at all (position_ids only)."""
    kw = dict(STEP, method=method, seq_len=32, gradient_checkpointing=False, padding=padding, loop="sft")
    real, sim = measure_config("tiny", **kw), simulate("tiny", **kw)
    assert (real.peak_allocated_bytes, real.breakdown, real.phase) == (sim.peak_allocated_bytes, sim.breakdown,
                                                                      sim.phase)


def test_the_mask_override_for_unpadded_rows_leaves_transformers_registry_as_it_was():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks

    from lora_kit.memory.simulate import _real_mask_decisions
    model_attn_implementation(FA2)  # registers the emulation's mask function (globally)
    before = masks[KIT_NAME]
    with _real_mask_decisions(has_padding=False):
        assert masks[KIT_NAME] is not before  # overridden while simulating
    assert masks[KIT_NAME] is before and KIT_NAME not in masks._local_mapping
