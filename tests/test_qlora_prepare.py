"""QLoRA's two recipes (``Step.qlora_prepare``): peft's ``prepare_model_for_kbit_training`` (fp32 norms, embeddings,
lm_head and adapters) and none of it (TRL 1.16's SFTTrainer, Answer.AI's fsdp_qlora: everything but the 4-bit
weights in ``dtype``), which sharded QLoRA runs. Real steps on the embedded model against ``simulate``."""
from __future__ import annotations

import pytest

from lora_kit.memory import fits
from lora_kit.memory.estimate import estimate
from lora_kit.memory.measure import measure_config
from lora_kit.memory.simulate import simulate
from lora_kit.settings import Step

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(method="qlora", dtype="bfloat16", seq_len=64, batch_size=2)


@pytest.mark.parametrize("changes, prepared", [
    ({}, True), ({"sharding": "ddp", "num_gpus": 2}, True), ({"sharding": "zero2", "num_gpus": 2}, True),
    ({"sharding": "fsdp", "num_gpus": 2}, False), ({"sharding": "zero3", "num_gpus": 4}, False),
    ({"loop": "sft"}, False), ({"loop": "trainer"}, True),
    ({"qlora_prepare": "none"}, False), ({"qlora_prepare": "peft", "sharding": "fsdp", "num_gpus": 2}, True)])
def test_auto_resolves_as_the_recipe_users_run(changes, prepared):
    s = Step(method="qlora", **changes)
    assert s.kbit_prepared is prepared
    one = s.one_gpu()  # the one-GPU step a sharded figure is composed from keeps the recipe
    assert one.sharding == "none" and one.num_gpus == 1 and one.kbit_prepared is prepared
    assert not Step(method="lora", sharding="fsdp", num_gpus=2).kbit_prepared


def test_the_usual_recipe_keeps_its_fit_key():
    """Fits made before the field existed stay found: only the bare recipe adds to the key."""
    assert "qlora_prepare" not in fits.categorical(Step(method="qlora"))
    assert "qlora_prepare" not in fits.categorical(Step(method="lora", loop="sft"))
    assert fits.categorical(Step(method="qlora", loop="sft"))["qlora_prepare"] == "none"
    sharded = Step(method="qlora", sharding="fsdp", num_gpus=2)
    assert fits.categorical(sharded) == fits.categorical(sharded.one_gpu())


@pytest.mark.parametrize("gc", [True, False])
def test_bare_recipe_is_simulated_byte_for_byte(gc):
    real = measure_config("tiny", qlora_prepare="none", gradient_checkpointing=gc, **TINY)
    sim = simulate("tiny", qlora_prepare="none", gradient_checkpointing=gc, **TINY)
    assert sim.peak_allocated_bytes == real.peak_allocated_bytes
    assert sim.breakdown == real.breakdown and sim.phase == real.phase
    peft = simulate("tiny", gradient_checkpointing=gc, **TINY)
    # fp32 norms, embeddings, lm_head and adapters, and the fp32 residual stream they make: more bytes at the peak
    assert peft.breakdown["adapters"] == 2 * sim.breakdown["adapters"]
    assert peft.peak_allocated_bytes > sim.peak_allocated_bytes
    assert any("qlora_prepare='none'" in n for n in sim.notes)


def test_sft_loop_qlora_is_trls_step():
    """TRL 1.16's SFTTrainer calls no prepare_model_for_kbit_training and casts the adapters to bf16; the real
    SFTTrainer step on that model is what simulate describes."""
    kw = dict(TINY, seq_len=32, gradient_checkpointing=False, padding="max_length", loop="sft")
    real = measure_config("tiny", **kw)
    sim = simulate("tiny", **kw)
    assert sim.peak_allocated_bytes == real.peak_allocated_bytes and sim.breakdown == real.breakdown


def test_sharded_qlora_is_composed_from_the_bare_recipe():
    """FSDP over 2 GPUs: the per-GPU figure is composed from the one-GPU fit of the bare recipe, not of peft's."""
    kw = dict(TINY, lora_rank=8, sharding="fsdp", num_gpus=2)
    sharded = estimate("tiny", **kw)
    assert sharded.memory_model.startswith("composed")
    assert sharded.peak_allocated_bytes == estimate("tiny", qlora_prepare="none", **kw).peak_allocated_bytes
    assert sharded.peak_allocated_bytes < estimate("tiny", qlora_prepare="peft", **kw).peak_allocated_bytes
    bare = estimate("tiny", **{**kw, "sharding": "none", "num_gpus": 1, "qlora_prepare": "none"})
    assert sharded.breakdown["adapters"] < bare.breakdown["adapters"]  # sharded over the 2 GPUs


def test_cli_says_what_auto_resolved_to(capsys):
    from lora_kit.ui.cli import main
    for flags, resolved in ((["--num-gpus", "2", "--sharding", "fsdp"], "none"), ([], "peft")):
        assert main(["estimate", "--model", "tiny", "--method", "qlora", *flags]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "qlora_prepare" in x)
        assert line.rstrip().endswith(f"'auto' -> {resolved}")
