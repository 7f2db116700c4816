"""``liger_kernel=True``: Liger Kernel's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy as the Trainer applies
them, emulated on the CPU by ``lora_kit.memory.liger`` (what Liger's Python code allocates and saves; its Triton
kernels' values computed with torch ops). simulate (fake tensors) equals a real CPU step byte for byte, the values
are transformers' own, the logits never exist whole, and what is not emulated is refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from lora_kit.memory import fits, liger
from lora_kit.memory.estimate import estimate
from lora_kit.memory.measure import build_real_model, measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.memory.tracker import round_bytes
from lora_kit.settings import EMBEDDED, PLANNING, Step, from_dict


@pytest.mark.parametrize("kw", [dict(), dict(gradient_checkpointing=True), dict(method="full"),
                                dict(method="full", gradient_checkpointing=True)])
def test_simulate_equals_a_real_cpu_step_to_the_byte(kw):
    step = EMBEDDED.replace(liger_kernel=True, **kw)  # the embedded tiny Llama, padded batches of 16 x 64 tokens
    sim, real = simulate("tiny", step), measure_config("tiny", step)
    assert (sim.peak_allocated_bytes, sim.breakdown, sim.phase) == (real.peak_allocated_bytes, real.breakdown,
                                                                    real.phase)
    assert sim.peak_allocated_bytes != simulate("tiny", step.replace(liger_kernel=False)).peak_allocated_bytes
    assert any("liger_kernel" in n for n in sim.notes)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_emulated_kernels_compute_what_transformers_computes(method):
    """Same weights, same padded batch: the loss and every trainable gradient as without Liger."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    step = EMBEDDED.replace(method=method, batch_size=3, seq_len=20)
    grads = []
    for on in (False, True):
        net, _, batch = build_real_model(cfg, step.replace(liger_kernel=on), seed=1)
        torch.manual_seed(2)
        batch = {**batch, "input_ids": torch.randint(0, 256, batch["input_ids"].shape)}
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = net(**batch).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.requires_grad}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


def test_at_a_large_vocabulary_the_logits_terms_go():
    """Without Liger the backward of the loss holds three (tokens x vocabulary) fp32 tensors at once: the logits,
    their log-softmax and its gradient. Liger holds instead, next to what both keep, its input-gradient buffer
    (tokens x hidden), a chunk of logits and the next one (chunk rows x vocabulary), and the fp32 loss per token."""
    V, H, B, S = 32768, 64, 4, 64
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)
    step = EMBEDDED.replace(batch_size=B, seq_len=S)
    off, on = simulate(cfg, step), simulate(cfg, step.replace(liger_kernel=True))
    T = B * S
    logits = round_bytes(T * V * 4)
    chunk = liger.chunk_tokens(T, H, V)
    held = round_bytes(T * H * 4) + 2 * round_bytes(chunk * V * 4) + round_bytes(T * 4)
    drop = off.peak_allocated_bytes - on.peak_allocated_bytes
    assert abs(drop - (3 * logits - held)) < logits / 64, (drop, 3 * logits - held)
    assert off.phase == "backward" and on.breakdown["activations"] < logits


def test_chunk_rows_follow_liger():
    # fused_linear_cross_entropy.py's own example: BT = 4096 * 4, V = 32000, H = 4096 -> inc_factor 8, chunk 2048
    assert liger.chunk_tokens(4096 * 4, 4096, 32000) == 2048
    assert liger.chunk_tokens(8192, 4096, 128256) == 256  # Llama-3-8B, 8,192 tokens
    assert liger.chunk_tokens(100, 256, 320) == 64  # the tiny model: next_power_of_2(cdiv(100, 2))


def test_estimate_is_simulate_for_a_liger_step(tmp_path, monkeypatch):
    """The chunk of logits is a power of two of the tokens: no polynomial fit, estimate simulates the row (exact)."""
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path))
    monkeypatch.setenv("LORA_KIT_FIT", "auto")
    step = EMBEDDED.replace(liger_kernel=True)
    est, sim = estimate("tiny", step, batch_size=3, seq_len=96), simulate("tiny", step, batch_size=3, seq_len=96)
    assert (est.peak_allocated_bytes, est.breakdown) == (sim.peak_allocated_bytes, sim.breakdown)
    assert est.peak_allocated_bytes != estimate("tiny", step.replace(liger_kernel=False), batch_size=3,
                                                seq_len=96).peak_allocated_bytes


def test_a_fit_key_changes_only_with_liger_on():
    assert "liger_kernel" not in fits.categorical(PLANNING)  # every stored fit keeps its key and digest
    assert fits.categorical(PLANNING.replace(liger_kernel=True))["liger_kernel"] is True


def test_the_model_types_are_liger_kernel_0_6_4s():
    """``LIGER_MODEL_TYPES`` is liger-kernel 0.6.4 ``transformers/monkey_patch.py`` ``MODEL_TYPE_TO_APPLY_LIGER_FN``'s
    keys (38 of them, typed from the source: liger cannot be imported without Triton); the emulated ones are among
    them, and the SM count of RMSNorm's backward buffer is the planner's H100-SXM / H200 figure."""
    from lora_kit.plan.time_constants import SM_COUNT
    assert len(liger.LIGER_MODEL_TYPES) == len(set(liger.LIGER_MODEL_TYPES)) == 38
    assert set(liger.EMULATED) <= set(liger.LIGER_MODEL_TYPES)
    assert liger.RMS_NORM_SM_COUNT == SM_COUNT["H100-SXM"] == SM_COUNT["H200"]


@pytest.mark.parametrize("given,match", [
    (dict(model_type="gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=50257),
     "no kernels for model_type='gpt2'.*llama"),
    (dict(model_type="glm4", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0),
     "patches model_type='glm4'.*only for llama"),
])
def test_model_types_not_emulated_are_refused(given, match):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(**given)
    with pytest.raises(ValueError, match=match):
        simulate(cfg, Step(method="full", dtype="float32", liger_kernel=True), seq_len=16)


@pytest.mark.parametrize("loop", ["trainer", "sft"])
def test_the_trainers_loops_to_the_byte(loop):
    """The real Trainer / SFTTrainer step on the emulated kernels; TRL's SFTTrainer keeps its own fused LM head (it
    turns Liger's fused cross-entropy off), so only the layer kernels change there."""
    step = EMBEDDED.replace(liger_kernel=True, loop=loop, batch_size=4)
    sim, real = simulate("tiny", step), measure_config("tiny", step)
    assert (sim.peak_allocated_bytes, sim.breakdown, sim.phase) == (real.peak_allocated_bytes, real.breakdown,
                                                                    real.phase)


def test_sharding_not_emulated_is_refused():
    with pytest.raises(ValueError, match="sharding='fsdp'"):
        simulate("tiny", EMBEDDED.replace(liger_kernel=True, num_gpus=2, sharding="fsdp"))


def test_the_smoke_run_refuses_liger_without_cuda():
    from lora_kit.run.smoke import check_runnable
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may run Liger")
    with pytest.raises(ValueError, match="liger_kernel=True needs a CUDA GPU.*set liger_kernel=False"):
        check_runnable(from_dict({"liger_kernel": True}), world=1)


@pytest.mark.parametrize("extra,on,listed", [
    ({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rope": True, "liger_rms_norm": True,
      "liger_glu_activation": True, "liger_fused_linear_cross_entropy": True}, True, set()),
    ({"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rms_norm": True}, False, {"plugins"}),
])
def test_axolotls_liger_plugin_maps_to_the_field(tmp_path, extra, on, listed):
    """The plugin with the four kernels the Trainer's flag applies is ``liger_kernel``; a part of them is listed."""
    import yaml

    from lora_kit.plan.config_import import settings_from_config
    src = yaml.safe_load((Path(__file__).parent / "configs" / "axolotl_lora_mistral-7b.yml").read_text())
    path = tmp_path / "axolotl.yml"
    path.write_text(yaml.safe_dump({**src, **extra}))
    step, rep = settings_from_config(path)
    assert step.liger_kernel is on
    assert {n["key"] for n in rep.not_modelled} == listed


def test_the_time_model_prices_the_fused_head_by_its_chunks():
    """Liger runs the unfused head's matmuls, in forward, one chunk of rows at a time, and there are always about
    cdiv(vocab, hidden) chunks (32 for Llama-3-8B): each reads lm_head's weight (1 GB in bf16) again, which outweighs
    the fp32 passes over the logits it saves; fine-tuning lm_head, each chunk also casts and adds a vocabulary x
    hidden product."""
    from lora_kit.plan.gpus import gpu_table
    from lora_kit.plan.timing import device_parts
    gpu = {**gpu_table().set_index("name").loc["H100-SXM"].to_dict(), "name": "H100-SXM"}
    for T in (128, 4096, 65536):
        assert 16 < -(-T // liger.chunk_tokens(T, 4096, 128256)) <= 32

    def head(**kw):
        return [device_parts("llama-3.1-8b", gpu, liger_kernel=on, **kw)["parts"]["lm_head_loss"] for on in (False, True)]
    (lora_off, lora_on), (full_off, full_on) = head(method="lora", seq_len=4096), head(method="full", seq_len=4096)
    assert lora_off < lora_on and full_off < full_on
    assert full_on - lora_on > full_off - lora_off  # the per-chunk weight-gradient product


def test_the_emulated_head_reads_the_output_by_its_current_name():
    """transformers 5 renamed ``past_key_values`` to ``cache``: reading the old name logs a deprecation per process."""
    import logging
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger, handler = logging.getLogger("transformers.utils.generic"), Seen()
    logger.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers logs it once per process: let this step log it again
    try:
        measure_config("tiny", EMBEDDED.replace(liger_kernel=True, lora_rank=2, seq_len=16, batch_size=2))
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "deprecated" in m], seen
