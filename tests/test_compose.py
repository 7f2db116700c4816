"""Settings composed from a fitted step and the static arithmetic (``lora_kit.memory.compose``), against the real
optimizers and ``simulate``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_kit.memory import estimate as est
from lora_kit.memory import fits
from lora_kit.memory.breakdown import PAGED_MIN_NUMEL
from lora_kit.memory.compose import SWAPPABLE, compose, static_terms
from lora_kit.memory.moe import expert_lora
from lora_kit.memory.simulate import simulate
from lora_kit.memory.specs import check_targets, model_spec
from lora_kit.memory.static import optimizer_states, optimizer_temp_bytes
from lora_kit.memory.tracker import LiveBytesTracker, round_bytes
from lora_kit.settings import PLANNING
from lora_kit.training import optimizer_for

OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
# (rows, cols): a vector (rows 1), matrices under and over bitsandbytes' 8-bit threshold and its paging threshold
SHAPES = ((1, 16), (1, 4096), (8, 64), (100, 40), (128, 64), (300, 400))


def _real_states(name: str, shapes, dtype) -> int:
    """State bytes the real optimizer keeps after two steps, storages once each, as simulate labels them (paged
    state1 / state2 of large tensors are outside the allocator's count)."""
    ps = [torch.nn.Parameter(torch.randn(*((c,) if r == 1 else (r, c)), dtype=dtype)) for r, c in shapes]
    opt = optimizer_for(ps, name)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    seen, total = set(), 0
    for p in ps:
        for k, v in opt.state[p].items():
            paged = name.startswith("paged_") and p.numel() >= PAGED_MIN_NUMEL and k in ("state1", "state2")
            if torch.is_tensor(v) and not paged and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += round_bytes(v.untyped_storage().nbytes())
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_state_bytes_are_the_real_optimizers(name, dtype):
    eb = torch.tensor([], dtype=dtype).element_size()
    tensors = [(r, c, 1, eb) for r, c in SHAPES]
    assert int(optimizer_states(name, tensors)) == _real_states(name, SHAPES, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adafactor_step_temporaries_of_one_tensor(dtype):
    """One tensor's step: the live bytes it adds at its largest moment are ``optimizer_temp_bytes``'."""
    for r, c in ((64, 64), (300, 400), (1, 4096)):
        p = torch.nn.Parameter(torch.randn(*((c,) if r == 1 else (r, c)), dtype=dtype))
        p.grad = torch.randn_like(p)
        opt = optimizer_for([p], "adafactor")
        opt.step()
        tr = LiveBytesTracker()
        with tr:
            tr.track([p, p.grad] + [v for v in opt.state[p].values() if torch.is_tensor(v)])
            base = tr.current_bytes
            opt.step()
        assert tr.peak_bytes - base == int(optimizer_temp_bytes("adafactor", [(r, c, 1, p.element_size())]))


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_another_optimizer_composed_from_the_adamw_fit_is_simulate_phase_by_phase(method, monkeypatch, tmp_path):
    """The tiny model's shipped AdamW fits, composed for every other optimizer whose step composes: each phase's peak
    (forward, backward, optimizer step) equals simulate's to the byte, at a length the fit was designed on."""
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    spec = model_spec("tiny")
    for opt in SWAPPABLE[1:]:
        step = PLANNING.replace(method=method, optimizer=opt, seq_len=512, batch_size=1, gradient_checkpointing=False)
        fit, _ = fits.lookup(spec.config, step.replace(optimizer="adamw"))
        targets = check_targets(spec, method, step.lora_rank, step.lora_targets, step.attn_implementation)
        B, S, r, N = (np.asarray([x]) for x in (1, 512, step.lora_rank, 1))
        tensors, _ = est._trainable_tensors(spec, step, targets, expert_lora(spec, targets), r)
        phases = compose(step, fit.phase_arrays(spec.num_layers, B, S, r), static_terms(spec, step, "adamw", tensors, N))
        real = {}
        for phase, _, live, _ in simulate("tiny", step, trace=True).trace:
            real[phase] = max(real.get(phase, 0), live)
        assert {ph: int(v[0][0]) for ph, v in phases.items()} == real, opt
        e = est.estimate("tiny", step)
        if method != "full":  # full fine-tuning is not composed at a model's depth (est._fit_for says why)
            assert e.memory_model.startswith(f"composed ({opt} states from a fit with adamw")


def test_adafactor_is_not_composed(monkeypatch, tmp_path):
    """Adafactor's step is not a swap of states (it holds the previous tensor's fp32 copies beside the current
    one's): without its own fit the estimate does not borrow AdamW's."""
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    spec = model_spec("smollm2-135m")  # AdamW's fit is shipped, Adafactor's is not
    assert est._fit_for(spec, PLANNING) is not None
    with pytest.raises(fits.MissingFit):
        est._fit_for(spec, PLANNING.replace(optimizer="adafactor"))


def test_sharding_composed_is_labelled_and_shards_the_static_parts(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    for sh in ("zero1", "zero2", "zero3", "fsdp"):
        step = PLANNING.replace(method="qlora", sharding=sh, num_gpus=4)
        one = est.estimate("tiny", step.one_gpu())  # its one-GPU step, QLoRA readied as sharded (zero3 / fsdp: none)
        e = est.estimate("tiny", step)
        assert e.memory_model == f"composed ({sh} over 4 GPUs by arithmetic)"
        assert e.breakdown["optimizer_states"] == -(-one.breakdown["optimizer_states"] // 4)
        if sh in ("zero3", "fsdp"):  # not parameters: FSDP leaves them whole on every GPU
            assert e.breakdown["quant_constants"] == one.breakdown["quant_constants"]


def test_full_fine_tuning_is_composed_only_from_a_fit_that_extrapolates_each_operator(monkeypatch, tmp_path):
    """Full fine-tuning with another optimizer or sharded is the AdamW fit composed when that fit extrapolates each
    operator in depth (``Fit.aligned``); from an older fit (each stack's largest operator only) it is not: at a
    model's depth the end of backward can outgrow the fitted phase peak once the states are small."""
    import dataclasses

    from lora_kit.memory import fits
    from lora_kit.memory.calibrate import ALIGNED
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    spec = model_spec("llama-3.2-1b")
    shipped = fits.lookup(spec.config, PLANNING.replace(method="full"))
    assert shipped is not None and shipped[0].aligned
    for kw in ({"optimizer": "sgd"}, {"sharding": "zero2", "num_gpus": 2}):
        assert est._fit_for(spec, PLANNING.replace(method="full", **kw))[2] == "adamw"
    older = dataclasses.replace(shipped[0], tables={k: v for k, v in shipped[0].tables.items()
                                                    if not k[2].startswith(ALIGNED)})
    monkeypatch.setattr(fits, "lookup", lambda config, step: (older, shipped[1]) if step.optimizer == "adamw" else None)
    fits._MEMO.clear()  # what was found before the older fit replaced it
    for kw in ({"optimizer": "sgd"}, {"sharding": "zero2", "num_gpus": 2}):
        with pytest.raises(fits.MissingFit):
            est._fit_for(spec, PLANNING.replace(method="full", **kw))
    assert est._fit_for(spec, PLANNING.replace(method="full")) is not None  # its own step: the fit itself