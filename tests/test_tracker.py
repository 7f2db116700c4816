"""LiveBytesTracker: rounding, views, frees, limits, fake tensors, and torch.profiler agreement."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lora_kit.memory.breakdown import BREAKDOWN_KEYS, label_training_state
from lora_kit.memory.tracker import LiveBytesTracker, round_bytes


def test_round_bytes():
    assert round_bytes(0) == 0
    assert round_bytes(1) == 512
    assert round_bytes(512) == 512
    assert round_bytes(513) == 1024
    assert round_bytes(513, block=1) == 513


def test_counts_allocations_views_and_frees():
    tr = LiveBytesTracker()
    with tr:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B -> 4096
        v = a[10:20]  # view: same storage, no new bytes
        b = torch.empty(10, dtype=torch.float16)  # 20 B -> 512
        assert tr.current_bytes == 4096 + 512
        del a  # the view keeps the storage alive
        assert tr.current_bytes == 4096 + 512
        del v
        assert tr.current_bytes == 512
        tr.phase = "second"
        c = torch.empty(2048, dtype=torch.uint8)
    assert tr.peak_bytes == 4096 + 512
    assert tr.peak_phase == ""
    del b, c
    assert tr.current_bytes == 0


def test_reset_peak_keeps_live_bytes_and_breakdown_sums_to_peak():
    w = torch.zeros(256)  # made before the tracker: must be registered
    tr = LiveBytesTracker()
    tr.label([w], "params")
    assert tr.current_bytes == 1024
    with tr:
        tmp = torch.ones(1024)
        del tmp
        tr.reset_peak()
        assert tr.peak_bytes == 1024
        tr.phase = "fwd"
        x = w * 2  # 1024 B
        y = torch.ones(100)  # 512 B
        del x
    assert tr.peak_bytes == 1024 + 1024 + 512
    assert tr.peak_phase == "fwd"
    bd = tr.peak_breakdown()
    assert bd == {"params": 1024, "other": 1536}
    assert sum(bd.values()) == tr.peak_bytes
    assert tr.current_breakdown() == {"params": 1024, "other": 512}
    del y


def test_limit_raises_out_of_memory_and_releases():
    tr = LiveBytesTracker(limit_bytes=10_000)
    with tr:
        small = torch.empty(100)
        with pytest.raises(torch.OutOfMemoryError, match="limit_bytes=10000"):
            torch.empty(10_000)
    assert tr.current_bytes == round_bytes(small.numel() * 4)


def test_bad_limit_is_a_value_error():
    with pytest.raises(ValueError, match="limit_bytes"):
        LiveBytesTracker(limit_bytes=0)


def test_works_under_fake_tensors():
    with FakeTensorMode():
        tr = LiveBytesTracker()
        with tr:
            a = torch.empty(1 << 30, dtype=torch.bfloat16)  # 2 GiB, never allocated
            b = a + 1
            del b
    assert tr.peak_bytes == 2 * (2 << 30)
    assert tr.current_bytes == 2 << 30
    del a


def _tiny_llama_step(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    x = torch.randint(0, 128, (2, 32))

    def step():
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    return m, opt, x, step


def test_matches_torch_profiler_on_a_real_cpu_step():
    """Exact bytes (block=1) of a training step agree with torch.profiler's memory timeline."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    m, opt, x, step = _tiny_llama_step()
    tr = LiveBytesTracker(block=1)
    label_training_state(tr, m, opt)
    tr.track([x])
    base = tr.current_bytes
    tr.reset_peak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        with tr:
            step()
    cur = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
    tracked = tr.peak_bytes - base
    assert peak > 100_000
    # the profiler also sees a few scalar tensors C++ wraps outside the dispatcher (bytes, not KB)
    assert abs(tracked - peak) <= 64, (tracked, peak)
    assert tr.current_bytes == base  # everything the step made was freed again


def test_breakdown_categories_on_a_real_step():
    m, opt, x, step = _tiny_llama_step()
    tr = LiveBytesTracker()
    label_training_state(tr, m, opt)
    tr.reset_peak()
    with tr:
        tr.phase = "forward"
        loss = m(input_ids=x, labels=x).loss
        tr.phase = "backward"
        loss.backward()
        label_training_state(tr, m, opt)  # the new gradients
        tr.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
    bd = tr.peak_breakdown()
    n_param_bytes = sum(round_bytes(p.numel() * 4) for p in m.parameters())
    assert set(bd) <= set(BREAKDOWN_KEYS) | {"other"}  # the one breakdown vocabulary (+ unlabelled)
    assert bd["weights"] >= n_param_bytes
    assert bd["optimizer_states"] >= 2 * n_param_bytes  # exp_avg + exp_avg_sq (+ step scalars)
    assert sum(bd.values()) == tr.peak_bytes
    assert tr.peak_phase in ("backward", "optimizer")
