"""The fitted closed form of simulate (lora_kit.memory.calibrate): exact where its assumptions hold."""
from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from lora_kit.memory.breakdown import BREAKDOWN_KEYS
from lora_kit.memory.calibrate import Fit, fit
from lora_kit.memory.simulate import simulate
from lora_kit.settings import Step


def _cfg(layers: int = 6):
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)


@pytest.mark.parametrize("kw", [dict(method="lora", gradient_checkpointing=True, dtype="float32"),
                                dict(method="full", gradient_checkpointing=False, dtype="bfloat16")])
def test_fit_from_shallow_short_runs_predicts_deep_long_steps_to_the_byte(kw):
    cfg, step = _cfg(), Step(**kw)
    f = fit(cfg, step)  # 2 and 3 blocks, at most 4 x 2048 tokens
    for B, S, R in ((1, 4096, 16), (5, 3072, 64)):
        sim = simulate(cfg, step, batch_size=B, seq_len=S, **({"lora_rank": R} if step.method != "full" else {}))
        peak, parts, phase = f.peak(cfg.num_hidden_layers, B, S, R)
        assert (peak, phase) == (sim.peak_allocated_bytes, sim.phase)
        assert parts == tuple(sim.breakdown[k] for k in BREAKDOWN_KEYS[:5])  # the composition at the peak too
    assert isinstance(f.peak(10**6, 10**4, 10**7)[0], int)  # exact integers at any size: no wrap, no float bytes
    assert Fit.from_json(json.loads(json.dumps(f.to_json()))).peak(9, 3, 5000, 32) == f.peak(9, 3, 5000, 32)


def test_each_operator_is_extrapolated_in_depth_where_the_largest_one_changes():
    """Full fine-tuning with SGD on a tied vocabulary: two and three blocks peak at the top of backward (the logits'
    gradient), eight at the bottom block's backward with every gradient made. Extrapolating each stack's largest
    operator misses that; matching the operators across the stacks and extrapolating each does not."""
    import dataclasses

    from lora_kit.memory.calibrate import ALIGNED
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    step = Step(method="full", optimizer="sgd", dtype="bfloat16")
    f = fit(cfg, step)
    largest_only = dataclasses.replace(f, tables={k: v for k, v in f.tables.items() if not k[2].startswith(ALIGNED)})
    assert f.aligned and not largest_only.aligned
    sim = simulate(cfg, step, batch_size=1, seq_len=512)
    assert f.peak(8, 1, 512, 8)[::2] == (sim.peak_allocated_bytes, sim.phase)
    assert largest_only.peak(8, 1, 512, 8)[0] < sim.peak_allocated_bytes  # what an older fit said


def test_trace_ends_where_the_peak_is():
    r = simulate(_cfg(2), Step(dtype="float32"), seq_len=256, trace=True)
    assert max(b for _, _, b, _ in r.trace) == r.peak_allocated_bytes
    assert {ph for ph, _, _, _ in r.trace} >= {"forward", "backward", "optimizer"}
    at_peak = next(parts for _, _, b, parts in r.trace if b == r.peak_allocated_bytes)
    assert at_peak == tuple(r.breakdown[k] for k in BREAKDOWN_KEYS[:5])  # the parts at the peak are simulate's


def test_what_cannot_be_aligned_is_refused_by_name():
    with pytest.raises(ValueError, match="one GPU"):  # ZeRO-1 is composed, not fitted (FSDP2's own step is)
        fit(_cfg(), Step(sharding="zero1", num_gpus=2))
