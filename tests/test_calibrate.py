"""The fitted closed form of simulate (lora_kit.memory.calibrate): exact where its assumptions hold."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

from lora_kit.memory.calibrate import fit
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
    for B, S in ((1, 4096), (5, 3072)):
        assert f.peak(cfg.num_hidden_layers, B, S) == simulate(cfg, step, batch_size=B, seq_len=S).peak_allocated_bytes
    assert isinstance(f.peak(10**6, 10**4, 10**7), int)  # exact integers at any size: no wrap, no float bytes


def test_trace_ends_where_the_peak_is():
    r = simulate(_cfg(2), Step(dtype="float32"), seq_len=256, trace=True)
    assert max(b for _, _, b in r.trace) == r.peak_allocated_bytes
    assert {ph for ph, _, _ in r.trace} >= {"forward", "backward", "optimizer"}


def test_what_cannot_be_aligned_is_refused_by_name():
    with pytest.raises(ValueError, match="sft"):
        fit(_cfg(), Step(loop="sft"))
