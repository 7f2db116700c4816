"""Byte arithmetic is exact for every accepted setting (issue 38, item 2): no figure wraps around int64, the
estimate, the planner's sweeps, max_fit and the CLI give the same exact Python ints, and large settings are
never refused. Settings that stay inside int64 keep their figures (tests/test_estimate_grid.py pins them)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import lora_kit as lk
from lora_kit.memory import estimate as est_mod
from lora_kit.memory.device import device_kwargs, device_total
from lora_kit.memory.specs import model_spec
from lora_kit.plan.planner import max_fit, sweep
from lora_kit.plan.timing import flops_per_step
from lora_kit.settings import as_step

HUGE = dict(seq_len=5_000_000, batch_size=64, attn_implementation="eager", gradient_checkpointing=False)


def _quiet_estimate(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning fails the test
        return lk.estimate(model, **kw)


def test_eager_scores_do_not_wrap():
    e = _quiet_estimate("llama-3.1-8b", **HUGE)
    spec = model_spec("llama-3.1-8b")
    scores = HUGE["batch_size"] * spec.num_heads * HUGE["seq_len"] ** 2 * 2  # one layer's bf16 probabilities
    assert isinstance(e.peak_allocated_bytes, int) and e.peak_allocated_bytes > 2 ** 63
    assert e.peak_allocated_bytes > spec.num_layers * scores
    assert e.peak_allocated_bytes == sum(e.breakdown.values())
    kw = device_kwargs(spec, as_step(None, **{k: v for k, v in e.settings.items() if k != "model"}))
    assert e.device_total_bytes == device_total(e.peak_allocated_bytes, **kw) > e.peak_allocated_bytes
    sdpa = _quiet_estimate("llama-3.1-8b", **{**HUGE, "attn_implementation": "sdpa"})
    assert e.peak_allocated_bytes > sdpa.peak_allocated_bytes  # eager holds S x S scores: never below sdpa


@pytest.mark.parametrize("model", ["llama-3.1-8b", "tiny"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_largest_accepted_settings_grow_monotonically(model, attn, method):
    """The extremes the Step accepts: estimates grow with seq_len and batch, nothing warns or is refused (the fitted
    polynomials are evaluated the same way for every architecture: two models and both attention kinds)."""
    last = 0
    for seq_len, batch in ((1 << 20, 1 << 10), (1 << 22, 1 << 14), (1 << 24, 1 << 16)):
        e = _quiet_estimate(model, method=method, attn_implementation=attn, gradient_checkpointing=False,
                            seq_len=seq_len, batch_size=batch)
        assert e.peak_allocated_bytes > last
        assert e.peak_allocated_bytes == sum(e.breakdown.values())
        last = e.peak_allocated_bytes


def test_python_ints_agree_with_int64_where_both_fit():
    """The exact (object) path and the fast int64 path are the same arithmetic: fitted, and composed with sharding."""
    from lora_kit.memory.moe import expert_lora
    from lora_kit.memory.specs import check_targets
    spec = model_spec("llama-3.1-8b")
    for overrides in ({}, {"attn_implementation": "eager", "gradient_checkpointing": False},
                      {"method": "qlora", "sharding": "fsdp", "num_gpus": 8}, {"sharding": "zero1", "num_gpus": 3}):
        step = lk.settings.as_step(None, **overrides)
        t = check_targets(spec, step.method, step.lora_rank, step.lora_targets, step.attn_implementation)
        ex = expert_lora(spec, t)
        S, B = np.broadcast_arrays(np.array([[128], [4096], [32768]]), np.array([[1, 3, 16]]))
        r, N = (np.full(S.shape, v, dtype=np.int64) for v in (step.lora_rank, step.num_gpus))
        fitted = est_mod._fit_for(spec, step)
        fast = est_mod._fitted_arrays(spec, step, t, ex, fitted, S, B, r, N)
        exact = est_mod._fitted_arrays(spec, step, t, ex, fitted, *(a.astype(object) for a in (S, B, r, N)))
        assert fast["peak_allocated_bytes"].dtype == np.int64
        for k in ("peak_allocated_bytes", "weights", "gradients", "optimizer_states", "activations"):
            assert fast[k].tolist() == exact[k].tolist(), k


def test_sweep_rows_equal_the_scalar_estimate_beyond_int64():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = sweep("llama-3.1-8b", seq_len=[1024, 5_000_000], batch_size=[1, 64], attn_implementation="eager",
                   gradient_checkpointing=False, gpu="A100-80GB")
    for row in df.itertuples():
        e = lk.estimate("llama-3.1-8b", seq_len=int(row.seq_len), batch_size=int(row.batch_size),
                        attn_implementation="eager", gradient_checkpointing=False)
        assert int(row.peak_allocated_bytes) == e.peak_allocated_bytes
        assert int(row.device_total_bytes) == e.device_total_bytes
    assert df["device_total_gib"].dtype == np.float64 and df["headroom_gib"].dtype == np.float64
    assert not df[df["seq_len"] == 5_000_000]["fits"].any()


def test_max_fit_and_time_accept_the_largest_values():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n = max_fit("seq_len", "llama-3.1-8b", "A100-80GB", attn_implementation="eager", gradient_checkpointing=False,
                    batch_size=1 << 16)
        f = flops_per_step("llama-3.1-8b", seq_len=1 << 24, batch_size=1 << 16)
    assert n == 0
    assert f["tokens"] == (1 << 40) and f["total"] > 0


def test_cli_estimate_prints_exact_figures(capsys):
    from lora_kit.ui.cli import main
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["estimate", "--model", "llama-3.1-8b", "--seq-len", "5000000", "--batch-size", "64",
                     "--attn-implementation", "eager", "--gradient-checkpointing", "false", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["peak_allocated_bytes"] == _quiet_estimate("llama-3.1-8b", **HUGE).peak_allocated_bytes > 2 ** 63
