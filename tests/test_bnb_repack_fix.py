"""The kit's bitsandbytes CPU workaround is applied wherever it builds a 4-bit model.

On AVX512-BF16 CPUs, ``Linear4bit`` takes a repack path after a no-grad forward and later training
forwards silently lose the gradient to the layer input (docs: pitfalls). Here bitsandbytes is told
the CPU has AVX512-BF16 (``bitsandbytes.nn.modules.has_avx512bf16``, the detection ``Linear4bit.__init__``
reads), so every Linear4bit is born with the repack path on, whatever CPU CI lands on; then each way
the kit creates a 4-bit model runs for real, and every 4-bit forward is recorded: none may run with
the repack path on. The math is untouched (the recorder calls the real forward).
"""
from __future__ import annotations

import bitsandbytes.nn.modules as bnb_modules
import pytest

from lora_kit.embedded.story import story_run
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.run.smoke import smoke_run


@pytest.fixture
def forwards(monkeypatch):
    """AVX512-BF16 as bitsandbytes sees it, and a list of (repack path on?) for every Linear4bit forward."""
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    assert bnb_modules.Linear4bit(64, 64).support_avx512bf16_for_cpu  # the switch really flips the layer
    seen: list[bool] = []
    real = bnb_modules.Linear4bit.forward

    def recording_forward(self, x):
        seen.append(bool(self.support_avx512bf16_for_cpu))
        return real(self, x)

    monkeypatch.setattr(bnb_modules.Linear4bit, "forward", recording_forward)
    return seen


def test_smoke_run_and_simulate(forwards, tmp_path):
    r = smoke_run(method="qlora", run_dir=str(tmp_path), measure_steps=1, progress=False, simulate=True,
                  max_steps=2, batch_size=2, seq_len=32, lora_rank=4, lora_alpha=8, max_new_tokens=2, cpu_threads=1)
    assert r.ok, r.record.get("error")
    assert len(forwards) > 20 and not any(forwards)


def test_measure(forwards):
    measure_config("tiny", method="qlora", dtype="float32", seq_len=16, batch_size=1, lora_rank=4, lora_alpha=8,
                   gradient_checkpointing=False, steps=1)
    assert forwards and not any(forwards)


def test_simulate_alone(forwards):
    simulate("tiny", method="qlora", dtype="float32", seq_len=16, batch_size=1, lora_rank=4, lora_alpha=8)
    assert forwards and not any(forwards)


def test_story_harness(forwards):
    r = story_run("qlora", steps=2, batch_size=4, test_examples=2, control_examples=2, lora_rank=4)
    assert len(r["losses"]) == 2
    assert forwards and not any(forwards)
