"""The SDPA kernel CUDA picks (lora_kit.memory.cuda_kernels): every dispatch rule on hand-built calls; what SDPA
really receives on real CPU steps of a tiny GQA model (recorded by wrapping the function); and the math kernel's
bytes against torch's profiler memory timeline of real CPU steps (the math kernel is composite: the same ops run
on every device)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_kit.memory import cuda_kernels as ck
from lora_kit.memory.cuda_kernels import (SdpaCall, cuda_attention_note, math_fallback_bytes, peak_with_math,
                                          sdpa_backend, sdpa_call)

GQA_FP32 = SdpaCall(batch=1, q_heads=32, kv_heads=8, seq_q=2048, seq_kv=2048, head_dim_qk=128, head_dim_v=128,
                    dtype="float32", enable_gqa=True, has_mask=False, is_causal=True)


def call(**changes) -> SdpaCall:
    return dataclasses.replace(GQA_FP32, **changes)


def tiny(layers=1, **kw):
    from transformers import LlamaConfig
    return LlamaConfig(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=4096), **kw})


# -- the rules, one by one --------------------------------------------------------------------------------------------
def test_fp32_grouped_kv_falls_to_math_before_torch_2_14():
    choice = sdpa_backend(GQA_FP32, "2.11.0+cu130", 9.0)
    assert choice.backend == "math"
    assert set(choice.rejected) == {"flash", "efficient"}  # default order: math before cuDNN
    assert "check_dtypes_flash_attention" in choice.rejected["flash"][0]
    first = sdpa_backend(GQA_FP32, "2.11", 9.0, prefer_cudnn=True)
    assert first.backend == "math" and "check_dtypes_low_precision" in first.rejected["cudnn"][0]
    eff = " ".join(choice.rejected["efficient"])
    assert "check_batch_size_and_num_heads_dense" in eff and "PR 191085" in eff
    assert sdpa_backend(GQA_FP32, "2.13", 9.0).backend == "math"
    assert sdpa_backend(GQA_FP32, (2, 14), 9.0).backend == "efficient"  # GQA in the memory-efficient kernel


def test_fp32_with_repeated_kv_takes_the_memory_efficient_kernel():
    assert sdpa_backend(call(enable_gqa=False, kv_heads=32), "2.11", 9.0).backend == "efficient"
    # enable_gqa=False with unequal heads is an error for every fused kernel (and for SDPA itself)
    assert sdpa_backend(call(enable_gqa=False), "2.11", 8.0).backend == "math"


def test_bf16_takes_flash_or_cudnn_by_priority():
    bf16 = call(dtype="bfloat16")
    assert sdpa_backend(bf16, "2.11", 8.0).backend == "flash"
    assert sdpa_backend(bf16, "2.11", 9.0).backend == "flash"
    assert sdpa_backend(bf16, "2.11", 9.0, prefer_cudnn=True).backend == "cudnn"  # check_prefer_cudnn_attention


def test_a_mask_rules_out_flash():
    masked = call(dtype="bfloat16", has_mask=True, is_causal=False, enable_gqa=False, kv_heads=32)
    choice = sdpa_backend(masked, "2.11", 8.0)
    assert choice.backend == "efficient" and "check_for_attn_mask" in choice.rejected["flash"][0]
    # check_attn_mask_shape accepts (B, 1, S, S)
    assert sdpa_backend(masked, "2.11", 9.0, prefer_cudnn=True).backend == "cudnn"


def test_head_dim_limits():
    big = call(dtype="bfloat16", head_dim_qk=320, head_dim_v=320, enable_gqa=False, kv_heads=32)
    choice = sdpa_backend(big, "2.11", 9.0, prefer_cudnn=True)
    assert choice.backend == "efficient"
    assert "check_head_dim_size_flash" in " ".join(choice.rejected["flash"])
    assert "check_cudnn_tensor_shapes" in " ".join(choice.rejected["cudnn"])
    odd = call(head_dim_qk=126, head_dim_v=126, enable_gqa=False, kv_heads=32)  # fp32 needs multiples of 4
    assert "check_head_dim_size_mem_efficient" in " ".join(sdpa_backend(odd, "2.11", 9.0).rejected["efficient"])
    # flash trains head dims in (192, 224] nowhere on sm86/89; on sm80 it does
    wide = call(dtype="bfloat16", head_dim_qk=208, head_dim_v=208)
    assert "sm86_89_or_120" in " ".join(sdpa_backend(wide, "2.11", 8.6).rejected["flash"])
    assert sdpa_backend(wide, "2.11", 8.0).backend == "flash"


def test_compute_capability_and_dtype_limits_on_older_cards():
    t4 = 7.5
    assert sdpa_backend(call(dtype="bfloat16"), "2.11", t4).backend == "math"  # no bf16 kernel before sm80
    assert sdpa_backend(call(dtype="float16", enable_gqa=False, kv_heads=32), "2.11", t4).backend == "efficient"
    assert "hardware_support" in " ".join(sdpa_backend(call(dtype="float16"), "2.11", t4).rejected["flash"])


def test_dropout_and_causal_shape_rules():
    drop = call(dtype="bfloat16", dropout=0.1)
    assert "check_cudnn_dropout" in " ".join(sdpa_backend(drop, "2.11", 9.0, prefer_cudnn=True).rejected["cudnn"])
    assert sdpa_backend(drop, "2.11", 9.0, prefer_cudnn=True).backend == "flash"  # flash takes dropout
    rect = call(dtype="bfloat16", seq_kv=4096)
    assert "check_flash_causal_non_square_seqlens" in " ".join(
        sdpa_backend(rect, "2.11", 8.0).rejected["flash"])


def test_observed_backend_asks_the_installed_torch():
    """On a GPU it checks sdpa_backend's prediction; here the installed CPU build answers with its own rules
    (sdp_utils_cpp.cpp: the CPU flash kernel takes fp32 and GQA but no dropout)."""
    small = call(seq_q=64, seq_kv=64)
    assert ck.observed_backend(small, "cpu") == "flash"
    assert ck.observed_backend(call(seq_q=64, seq_kv=64, dropout=0.1), "cpu") == "math"


def test_versions_and_bad_input():
    assert ck.torch_version("2.11.0+cu130") == (2, 11)
    with pytest.raises(ValueError, match="not a version"):
        ck.torch_version("latest")
    with pytest.raises(ValueError, match="enable_gqa needs torch >= 2.5"):
        sdpa_backend(GQA_FP32, "2.4")
    with pytest.raises(ValueError, match="fp32"):
        math_fallback_bytes(tiny(), method="lora", dtype="bfloat16", seq_len=64)
    with pytest.raises(ValueError, match="padding='none'"):
        math_fallback_bytes(tiny(), method="qlora", padding="longest", batch_size=2, seq_len=64)


# -- what the kit's step hands SDPA, from the step, and as recorded on real CPU steps -------------------------------------
def test_call_from_the_step():
    c = sdpa_call(tiny(), method="qlora", seq_len=32)
    assert (c.dtype, c.enable_gqa, c.kv_heads, c.has_mask, c.is_causal) == ("float32", True, 2, False, True)
    assert sdpa_call(tiny(), method="lora", dtype="bfloat16").dtype == "bfloat16"
    assert sdpa_call(tiny(), method="qlora", autocast=True).dtype == "bfloat16"
    padded = sdpa_call(tiny(), method="qlora", padding="longest", batch_size=2)
    assert (padded.has_mask, padded.enable_gqa, padded.kv_heads) == (True, False, 8)
    slid = sdpa_call(tiny(sliding_window=16), method="lora", seq_len=32)
    assert slid.has_mask and not slid.enable_gqa


@pytest.mark.parametrize("kw", [dict(method="qlora", dtype="bfloat16"), dict(method="lora", dtype="bfloat16"),
                                dict(method="full", dtype="float32"),
                                dict(method="qlora", dtype="bfloat16", padding="longest", batch_size=2)])
def test_sdpa_receives_what_the_module_assumes(kw, monkeypatch):
    from lora_kit.memory.measure import build_real_model
    from lora_kit.settings import as_step
    st = as_step(None, seq_len=16, gradient_checkpointing=False, **kw)
    net, _, batch = build_real_model(tiny(), st)
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append((q.dtype, k.dtype, v.dtype, tuple(q.shape), tuple(k.shape), enable_gqa, attn_mask is not None,
                     is_causal, q.requires_grad))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    net(**batch).loss.backward()
    c = sdpa_call(tiny(), st)
    dt = getattr(torch, c.dtype)
    assert seen == [(dt, dt, dt, (c.batch, c.q_heads, c.seq_q, c.head_dim_qk),
                     (c.batch, c.kv_heads, c.seq_kv, c.head_dim_qk), c.enable_gqa, c.has_mask, c.is_causal, True)]


def test_the_bf16_fix_needs_the_embeddings_too(monkeypatch):
    """The note's first fix, on a real QLoRA step: norms and LoRA layers in bf16 leave q/k/v fp32 (the fp32
    embedding output keeps the residual stream fp32); with the embeddings and lm_head too they are bf16, and
    CUDA's flash kernel takes them."""
    from lora_kit.memory.measure import build_real_model
    from lora_kit.settings import as_step
    net, _, batch = build_real_model(tiny(), as_step(None, method="qlora", seq_len=16, gradient_checkpointing=False))
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, **kw):
        seen.append(q.dtype)
        return real(q, k, v, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)

    def to_bf16(names):
        for name, p in net.named_parameters():
            if p.dtype == torch.float32 and any(n in name for n in names):
                p.data = p.data.to(torch.bfloat16)
        with torch.no_grad():
            net(**batch)
    to_bf16(("norm", "lora_"))
    to_bf16(("embed_tokens", "lm_head"))
    assert seen == [torch.float32, torch.bfloat16]
    fixed = call(dtype="bfloat16")
    assert sdpa_backend(fixed, "2.11", 8.0).backend == "flash"


# -- the math kernel's bytes against real CPU steps ------------------------------------------------------------------------
def _profiled_peak(net, batch, backend) -> int:
    from torch.nn.attention import sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    with sdpa_kernel([backend]), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                         record_shapes=True, with_stack=True) as prof:
        net(**batch).loss.backward()
    net.zero_grad(set_to_none=True)
    cur = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        cur += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("method,layers,batch,gc,drop", [("full", 2, 2, True, 0.0), ("full", 2, 1, False, 0.0),
                                                         ("qlora", 1, 2, False, 0.0), ("full", 2, 2, False, 0.1),
                                                         ("full", 2, 2, False, 0.0)])
def test_math_bytes_match_a_real_cpu_step(method, layers, batch, gc, drop):
    """The flash step's trace plus the math kernel's arithmetic gives the math step's peak (profiler and tracker
    differ by what only one of them sees, the same in both runs: compared through the flash run). fp32 q/k/v as
    QLoRA's recipe gives them: full fine-tuning in fp32, and QLoRA itself (its bitsandbytes kernels add a few
    scalar tensors the profiler sees: 64 bytes, as in test_tracker). With attention dropout the flash run is at
    p = 0 (the CPU's flash kernel takes none; CUDA's fused kernels keep the same tensors with it) and the math
    kernel's dropout is the CPU's (an fp32 noise tensor where CUDA keeps a bool mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lora_kit.memory.measure import build_real_model
    from lora_kit.memory.tracker import LiveBytesTracker
    from lora_kit.settings import as_step
    st = as_step(None, method=method, dtype="float32" if method == "full" else "bfloat16", seq_len=128,
                 batch_size=batch, gradient_checkpointing=gc)
    net, _, batch_ = build_real_model(tiny(layers, attention_dropout=drop), st)
    attention = [m for m in net.modules() if hasattr(m, "attention_dropout")]
    assert net.training and len(attention) == layers
    for m in attention:
        m.attention_dropout = 0.0
    tr = LiveBytesTracker(block=1, trace=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), tr:
        tr.phase = "forward"
        loss = net(**batch_).loss
        tr.phase = "backward"
        loss.backward()
        del loss
    net.zero_grad(set_to_none=True)
    flash = _profiled_peak(net, batch_, SDPBackend.FLASH_ATTENTION)
    for m in attention:
        m.attention_dropout = drop
    math_ = _profiled_peak(net, batch_, SDPBackend.MATH)
    fb = math_fallback_bytes(tiny(layers, attention_dropout=drop), st, block=1, device="cpu")
    assert math_ - flash > 2 * fb.scores_bytes  # the math kernel's S x S tensors dominate these steps
    assert abs((peak_with_math(tr.trace, fb) - math_) - (tr.peak_bytes - flash)) <= (0 if method == "full" else 64)


def test_peak_extra_counts_every_kept_layer_without_checkpointing():
    kw = dict(method="qlora", seq_len=1024, batch_size=1)
    one = math_fallback_bytes(tiny(1), gradient_checkpointing=False, **kw)
    four = math_fallback_bytes(tiny(4), gradient_checkpointing=False, **kw)
    assert four.peak_extra - one.peak_extra == 3 * one.saved_per_layer > 0
    assert math_fallback_bytes(tiny(4), gradient_checkpointing=True, **kw).peak_extra == one.peak_extra
    assert one.backward_extra > 2 * one.scores_bytes  # probabilities, their gradient and the softmax gradient


# -- the sentence for the plan / run card ------------------------------------------------------------------------------------
def test_note_names_the_kernel_the_cost_and_the_fix():
    note = cuda_attention_note(tiny(), method="qlora", seq_len=2048, torch_version_="2.11", peak_bytes=10 * 2**30)
    assert note.startswith("On CUDA with torch 2.11, this step's attention runs in the math kernel "
                           "(fp32 q/k/v with grouped K/V): up to +")
    assert "MiB per GPU (peak 10.4 GiB instead of 10.0 GiB)" in note
    assert "embeddings, norms and LoRA layers in bf16" in note and "autocast=True" in note
    assert "torch >= 2.14" in note
    assert cuda_attention_note(tiny(), method="qlora", seq_len=2048, torch_version_="2.14") is None
    assert cuda_attention_note(tiny(), method="lora", dtype="bfloat16", torch_version_="2.11") is None
    assert cuda_attention_note(tiny(), method="qlora", attn_implementation="eager", torch_version_="2.11") is None


def test_note_places_the_cost_on_a_simulated_step():
    from lora_kit.memory.simulate import simulate
    kw = dict(method="qlora", seq_len=256, batch_size=1, gradient_checkpointing=True)
    sim = simulate(tiny(2), trace=True, **kw)
    fb = math_fallback_bytes(tiny(2), **kw)
    placed = peak_with_math(sim.trace, fb)
    assert sim.peak_allocated_bytes < placed <= sim.peak_allocated_bytes + fb.peak_extra
    assert peak_with_math(sim.trace, fb, attention_only=True) == placed  # here the math kernel holds the peak
    note = cuda_attention_note(tiny(2), torch_version_="2.12", sim=sim, **kw)
    assert f": +{ck._gib(placed - sim.peak_allocated_bytes)} per GPU (peak {ck._gib(placed)} instead of" in note
    assert note == cuda_attention_note(tiny(2), torch_version_="2.12", exact=True, **kw)  # simulates the same step


# -- bitsandbytes' 4-bit matmul dequantising inside itself ------------------------------------------------------------
def _quantized(n=192, k=256, double_quant=True):
    import bitsandbytes.functional as F
    w = torch.randn(n, k, dtype=torch.bfloat16)
    return F.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")


@pytest.mark.parametrize("double_quant", [True, False])
def test_gemm_4bit_records_the_tensors_cudas_dequantising_path_holds(double_quant):
    """What the tracker records for ``bitsandbytes::gemm_4bit`` equals what CUDA's ``_dequant_linear_fallback`` holds
    beside the output, run op by op on real CPU tensors under a second tracker; CPU's own kernel holds one fp32
    absmax less (it frees the dequantised absmax before the weight)."""
    import bitsandbytes as bnb
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    from lora_kit.memory.tracker import LiveBytesTracker
    packed, qs = _quantized(double_quant=double_quant)
    a = torch.randn(3, 5, 256, dtype=torch.bfloat16, requires_grad=True)
    tr = LiveBytesTracker(trace=True)
    with tr:
        out = bnb.matmul_4bit(a, packed.t(), qs)
    (j, recorded), = tr.temporaries.items()
    assert tr.trace[j][1] == "gemm_4bit.default" and out.shape == (3, 5, 192)

    def held_inside(fn) -> int:
        t = LiveBytesTracker()
        with t:
            o = fn()  # kept alive: everything else made inside has died
        assert o.shape == (3, 5, 192)
        return t.peak_bytes - t.current_bytes

    ops = torch.ops.bitsandbytes
    absmax = (ops.dequantize_blockwise.default(qs.absmax, qs.state2.absmax, qs.state2.code, 256, torch.float32)
              if double_quant else None)

    def cuda_fallback():  # backends/cuda/ops.py: _dequant_linear_fallback, its allocations in order
        kept = [absmax, absmax + qs.offset] if double_quant else [qs.absmax]
        w = ops.dequantize_4bit.default(packed, kept[-1], qs.blocksize, qs.quant_type, qs.shape, a.dtype)
        return torch.nn.functional.linear(a.detach(), w)
    extra = -(-absmax.nbytes // 512) * 512 if double_quant else 0  # the fallback makes its first absmax inside
    assert recorded == held_inside(cuda_fallback) + extra
    assert recorded >= 192 * 256 * 2  # the dequantised weight, in A's dtype
    nested = dict(absmax_8bit=qs.absmax, absmax_code=qs.state2.code, absmax_offset=qs.offset) if double_quant else {}
    cpu = held_inside(lambda: _gemm_4bit_default_impl(a.detach(), packed, qs.shape, qs.state2.absmax if double_quant
                                                      else qs.absmax, qs.blocksize, qs.quant_type, **nested))
    assert cpu == recorded - extra


def test_simulate_records_what_a_real_step_records_and_places_it():
    """A fake step and a real CPU step record the same temporaries at the same operators; placed on the trace
    they raise the peak where weights are large against the activations (few tokens, a wide MLP: the LLaMA-65B
    rows of the QLoRA paper's step), and ``kernel_extra`` adds the math fallback on top at the same moments."""
    from lora_kit.memory.measure import measure_config
    from lora_kit.memory.simulate import simulate
    model = tiny(2, hidden_size=256, intermediate_size=8192, head_dim=32)
    kw = dict(method="qlora", dtype="bfloat16", seq_len=16, batch_size=1, gradient_checkpointing=True, lora_rank=4,
              optimizer="paged_adamw_32bit")  # as the paper's step: no optimizer state at the peak
    sim = simulate(model, trace=True, **kw)
    real = measure_config(model, trace=True, **kw)
    # the moments, in order (a fake step's trace also holds the device queries FakeTensorMode makes)
    moments = [(r.trace[j][1], r.trace[j][2], b) for r in (sim, real) for j, b in sorted(r.temporaries.items())]
    assert moments[:len(moments) // 2] == moments[len(moments) // 2:]
    assert len(sim.temporaries) == 2 * 2 * 7  # 2 layers x 7 linears, run twice under checkpointing
    assert sim.peak_allocated_bytes == real.peak_allocated_bytes
    moments = [sim.trace[j][2] + b for j, b in sim.temporaries.items()]
    assert max(moments) > sim.peak_allocated_bytes  # here a dequantised MLP weight tops the step
    fused = dict(torch_version_="2.14", compute_capability=9.0)  # fp32 grouped K/V takes a fused kernel there
    assert ck.math_kernel_extra(model, sim=sim, **fused, **kw) == 0
    assert ck.kernel_extra(model, sim=sim, **fused, **kw) == max(moments) - sim.peak_allocated_bytes
    math = dict(torch_version_="2.11", compute_capability=9.0)
    both = ck.kernel_extra(model, sim=sim, **math, **kw)
    assert both >= max(ck.math_kernel_extra(model, sim=sim, **math, **kw), max(moments) - sim.peak_allocated_bytes)


def test_attention_dropout_is_planned_as_cudas_fused_kernels_hold_it():
    """A config with attention dropout: CUDA's flash / memory-efficient kernels apply it inside and hold what they
    hold without it, so simulate plans the step at p = 0 and says so; a real CPU step runs the math kernel instead
    (the CPU's flash kernel takes no dropout) and holds the seq x seq probabilities and noise."""
    from lora_kit.memory.measure import measure_config
    from lora_kit.memory.simulate import simulate
    from lora_kit.settings import as_step
    st = as_step(None, method="lora", dtype="bfloat16", seq_len=128, batch_size=2, padding="none",
                 gradient_checkpointing=False)
    with_dropout, without = simulate(tiny(2, attention_dropout=0.1), st), simulate(tiny(2), st)
    assert with_dropout.peak_allocated_bytes == without.peak_allocated_bytes
    assert any(n.startswith("attention_dropout=0.1: simulated at 0") for n in with_dropout.notes)
    assert not any("attention_dropout" in n for n in without.notes)
    cpu = measure_config(tiny(2, attention_dropout=0.1), st).peak_allocated_bytes
    assert cpu > without.peak_allocated_bytes + 2 * 8 * 128 * 128 * 2  # at least one bf16 B x heads x S x S tensor
    assert sdpa_call(tiny(1, attention_dropout=0.1), st).dropout == 0.1


def test_estimate_says_when_the_math_kernel_breaks_the_verdict(capsys):
    """A user trial: `estimate` said "fits" while its note said the math kernel needs more than the card holds.
    The JSON carries the verdict with the math kernel (fit_math_kernel), the text says it; with the note's fix
    (autocast) there is none."""
    import json

    from lora_kit.memory.cuda_kernels import EFFICIENT_GQA_FROM, torch_version
    from lora_kit.ui.cli import main
    argv = ["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--gpu", "H100-SXM", "--seq-len", "8192",
            "--batch-size", "2"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    math = out["fit_math_kernel"]
    if torch_version() >= EFFICIENT_GQA_FROM:  # the memory-efficient kernel takes fp32 with grouped K/V
        assert math == {}
        return
    fb = math_fallback_bytes("llama-3.1-8b", seq_len=8192, batch_size=2, method="qlora")
    assert out["fit"]["fits"] and not math["fits"] and math["extra_bytes"] == fb.peak_extra
    assert math["device_total_bytes"] > out["device_total_bytes"] + fb.peak_extra * 0.99
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "CUDA runs this attention in the math kernel (see the note): up to" in text and "does NOT fit" in text
    assert main(argv + ["--json", "--autocast", "true"]) == 0
    assert json.loads(capsys.readouterr().out)["fit_math_kernel"] == {}
