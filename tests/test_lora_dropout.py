"""LoRA dropout is a step field: a real step keeps a dropped copy of each adapter's input and a bool mask (the fused
kernel CUDA runs, on every device: ``lora_kit.training.FusedDropout``), ``simulate`` and ``estimate`` count them,
the time model times them, and the training configs that set it plan with it."""
import pytest
import torch

import lora_kit as lk
from lora_kit.memory import fits
from lora_kit.memory.measure import measure_config
from lora_kit.memory.specs import model_spec
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.timing import step_time
from lora_kit.settings import PLANNING, as_step
from lora_kit.training import FusedDropout, attach_adapter, fuse_lora_dropout


def test_fused_dropout_is_dropout_with_a_bool_mask():
    torch.manual_seed(0)
    d = FusedDropout(0.25)
    x = torch.randn(4000, 50, requires_grad=True)
    y = d(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    assert torch.allclose(y[kept], x[kept] / 0.75)
    # autograd keeps the mask in bool, as CUDA's fused kernel does (a CPU F.dropout keeps a noise tensor of x's dtype)
    assert y.grad_fn._saved_result1.dtype == torch.bool
    y.sum().backward()
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.75)) and not x.grad[~kept].any()
    d.eval()
    assert d(x) is x and FusedDropout(0.0)(x) is x


def test_every_peft_dropout_of_the_adapter_is_fused():
    from lora_kit.loading import load_model
    model = attach_adapter(load_model("tiny", method="lora"), "lora", seed=0, dropout=0.1)
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.1]
    assert drops and all(type(m) is FusedDropout for m in drops)
    assert fuse_lora_dropout(model) == 0  # nothing left to replace


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_simulate_estimate_and_a_real_step_agree_with_dropout(method, ckpt):
    kw = dict(method=method, dtype="float32" if method == "lora" else "bfloat16", seq_len=64, batch_size=4,
              lora_dropout=0.1, gradient_checkpointing=ckpt)
    real = measure_config("tiny", as_step(None, **kw)).peak_allocated_bytes
    assert lk.simulate("tiny", **kw).peak_allocated_bytes == real
    assert lk.estimate("tiny", **kw).peak_allocated_bytes == real
    assert real > lk.estimate("tiny", **{**kw, "lora_dropout": 0.0}).peak_allocated_bytes


def test_dropout_is_its_own_fitted_step_and_leaves_the_old_keys_alone():
    base = PLANNING.replace(lora_dropout=0.0)
    assert "lora_dropout" not in fits.categorical(base)
    assert fits.categorical(base.replace(lora_dropout=0.05))["lora_dropout"] is True
    assert fits.categorical(base.replace(lora_dropout=0.05)) == fits.categorical(base.replace(lora_dropout=0.3))


def test_dropout_kernels_add_time_by_bytes():
    """Forward: read x, write the dropped copy and a 1-byte mask; backward: read the gradient and the mask, write
    one. On an A100 LoRA (fp32 adapter input) at 16k tokens that is a few percent of the step."""
    spec, gpu = model_spec("mistral-7b"), get_gpu("A100-80GB")
    kw = dict(method="lora", seq_len=4096, batch_size=4, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    off, on = (step_time(spec, gpu, lora_dropout=p, **kw) for p in (0.0, 0.1))
    assert on["parts_seconds"]["adapters"] > off["parts_seconds"]["adapters"]
    assert 1.0 < on["step_seconds"] / off["step_seconds"] < 1.1
    assert step_time(spec, gpu, lora_dropout=0.3, **kw)["step_seconds"] == on["step_seconds"]  # the rate costs no time


def test_training_configs_plan_with_their_dropout(tmp_path):
    from lora_kit.plan.config_import import settings_from_config
    path = tmp_path / "axolotl.yaml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nlora_r: 16\nlora_alpha: 32\n"
                    "lora_dropout: 0.05\nlora_target_linear: true\nsequence_len: 2048\nmicro_batch_size: 1\n"
                    "bf16: true\n")
    step, report = settings_from_config(path, model="llama-3.1-8b")
    assert step.lora_dropout == 0.05 and report.mapped["lora_dropout"] == "lora_dropout=0.05"
