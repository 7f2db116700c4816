"""Probes: each runs one real operation on this machine's device and says what it found.

A probe function returns a detail string (``pass``), raises :class:`WorkedAround` (``worked-around``:
a known trap is present on this stack and the kit's own workaround, checked by the probe, avoids it),
raises :class:`NotApplicable` (with why), or raises anything else (``fail``, with the error text).
Whether a failure matters depends on the plan: :func:`lora_kit.check.stack.verdict` decides. Models
are tiny and built from configs: the whole set takes seconds on a CPU.
"""
from __future__ import annotations

import traceback
import warnings

import torch

from lora_kit import loading
from lora_kit.training import enable_checkpointing

PASS, FAIL, NA, WORKED_AROUND = "pass", "fail", "not applicable", "worked-around"
STATUSES = (PASS, WORKED_AROUND, NA, FAIL)


class NotApplicable(Exception):
    """The probe does not apply to this device (the message says why)."""


class WorkedAround(Exception):
    """A known trap is present here and the kit's workaround avoids it (the message explains both)."""


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def bf16_matmul():
    d = device()
    a = torch.randn(128, 128, device=d)
    got = (a.bfloat16() @ a.bfloat16()).float()
    err = ((got - a @ a).abs().max() / (a @ a).abs().max()).item()
    if not err < 2e-2:
        raise AssertionError(f"bf16 matmul relative error {err:.3g} > 2e-2")
    return f"{d.type}: relative error {err:.1e}"


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    d = device()
    if d.type == "cpu" and backend_name == "EFFICIENT_ATTENTION":
        raise NotApplicable("CPU has no memory-efficient SDPA kernel (flash or math are used)")
    dt = torch.bfloat16 if d.type == "cuda" else torch.float32
    q = torch.randn(1, 4, 64, 64, device=d, dtype=dt, requires_grad=True)
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.float().sum().backward()
    return f"{d.type} {str(dt).replace('torch.', '')}: forward+backward ran"


def sdpa_flash():
    return _sdpa("FLASH_ATTENTION")


def sdpa_efficient():
    return _sdpa("EFFICIENT_ATTENTION")


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise NotApplicable(f"bitsandbytes not installed ({e})") from e
    return bnb


def _linear4bit(bnb, fix: bool = True):
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4").to(device())
    if fix:
        loading.fix_bnb_cpu_repack(layer)
    return layer


def bnb_repacks_here(bnb) -> bool:
    """Whether bitsandbytes, as shipped, repacks 4-bit weights after a no-grad forward on this device:
    ``Linear4bit`` sets ``support_avx512bf16_for_cpu`` from its CPU backend's AVX512-BF16 detection
    (``bitsandbytes.nn.modules.has_avx512bf16``), and only CPU inputs take that path."""
    return device().type == "cpu" and bool(getattr(bnb.nn.Linear4bit(64, 64, bias=False),
                                                   "support_avx512bf16_for_cpu", False))


def bnb_4bit_matmul():
    bnb = _bnb()
    layer = _linear4bit(bnb)
    x = torch.randn(8, 64, device=device(), requires_grad=True)
    ref_w = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    layer(x).pow(2).mean().backward()
    g = x.grad.clone()
    x.grad = None
    (x @ ref_w.t()).pow(2).mean().backward()
    err = ((g - x.grad).abs().max() / x.grad.abs().max()).item()
    if not err < 1e-3:
        raise AssertionError(f"4-bit input gradient differs from the dequantized reference by {err:.3g}")
    return f"NF4 forward+backward on {device().type}, input-gradient error {err:.1e}"


def bnb_grad_after_eval(fix: bool = True):
    """Train a Linear4bit+LoRA for 3 steps *after* a no-grad eval forward; the input gradient must be right.

    ``fix=True`` is the kit's way (:func:`lora_kit.loading.fix_bnb_cpu_repack` on the model);
    ``fix=False`` is bitsandbytes as shipped."""
    bnb = _bnb()
    from peft import LoraConfig, get_peft_model
    wrapper = torch.nn.Sequential(_linear4bit(bnb, fix=fix))
    model = get_peft_model(wrapper, LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    layer = model.base_model.model[0]
    if fix:
        loading.fix_bnb_cpu_repack(model)
    ref_w = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state).float()
    x = torch.randn(8, 64, device=device())
    model.eval()
    with torch.no_grad():
        model(x)  # the eval pass that triggers the repack on AVX512-BF16 CPUs
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            xi = x.clone().requires_grad_(True)
            model(xi).pow(2).mean().backward()
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            w = ref_w + layer.scaling["default"] * (b @ a).detach()
            xr = x.clone().requires_grad_(True)
            (xr @ w.t()).pow(2).mean().backward()
            err = ((xi.grad - xr.grad).abs().max() / xr.grad.abs().max()).item()
            if not err < 1e-3:
                raise AssertionError(f"gradient to the 4-bit layer input is cut after a no-grad forward (step {step}, "
                                     f"error {err:.2f}); apply lora_kit.loading.fix_bnb_cpu_repack(model)")
            opt.step()
            opt.zero_grad(set_to_none=True)
    return "input gradient correct for 3 steps after an eval pass" + (" (with fix_bnb_cpu_repack)" if fix else "")


def bnb_grad_after_eval_raw():
    """bitsandbytes as shipped: on AVX512-BF16 CPUs the trap is present (``worked-around`` when the
    kit's fix, tried right here, avoids it); elsewhere it cannot occur (``pass``)."""
    bnb = _bnb()
    repacks = bnb_repacks_here(bnb)
    try:
        detail = bnb_grad_after_eval(fix=False)
    except AssertionError as trap:
        if not repacks:
            raise  # not the known trap: a real failure
        kit = bnb_grad_after_eval(fix=True)  # raises (a failure) if the kit's workaround does not hold either
        raise WorkedAround(
            "trap present: this CPU has AVX512-BF16, so bitsandbytes repacks 4-bit weights after a no-grad "
            f"forward and cuts the gradient to the layer input ({str(trap).split(';')[0]}). lora_kit turns the "
            f"repack off on every 4-bit model it builds (fix_bnb_cpu_repack): {kit}. Only code that builds "
            "its own 4-bit model without that call is exposed.") from None
    if repacks:
        return detail + "; the repack path is on here (AVX512-BF16) yet gradients stay correct"
    if device().type == "cpu":
        return detail + "; this CPU has no AVX512-BF16, so the repack trap cannot occur here"
    return detail + f"; the repack trap is CPU-only (inputs on {device().type})"


def _bnb_optimizer(name: str):
    bnb = _bnb()
    p = torch.nn.Parameter(torch.randn(64, 128, device=device()))  # >= 4096 elements: 8-bit states are used
    opt = getattr(bnb.optim, name)([p], lr=1e-2)
    before = p.detach().clone()
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    if torch.equal(before, p.detach()):
        raise AssertionError(f"{name}.step() did not change the parameter")
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in opt.state[p].values() if isinstance(v, torch.Tensor)})
    return f"{name} step on {device().type}; state dtypes {dtypes}"


def bnb_8bit_optimizer():
    detail = _bnb_optimizer("AdamW8bit")
    if "uint8" not in detail:
        raise AssertionError(f"no 8-bit state was created: {detail}")
    return detail


def bnb_paged_optimizer():
    detail = _bnb_optimizer("PagedAdamW8bit")
    if device().type == "cpu":
        detail += " (paging to host memory only matters on CUDA)"
    return detail


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(device())


def gradient_checkpointing():
    model = _tiny_llama()
    x = torch.randint(0, 128, (2, 32), device=device())
    model(input_ids=x, labels=x).loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    enable_checkpointing(model)
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    err = max((a - p.grad).abs().max().item() for a, p in zip(ref, model.parameters()))
    if not err < 1e-5:
        raise AssertionError(f"checkpointed gradients differ by {err:.3g}")
    return f"non-reentrant; gradients equal to the plain backward (max diff {err:.1e})"


def lora_step():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(_tiny_llama(), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    x = torch.randint(0, 128, (2, 32), device=device())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    before = [p.detach().clone() for p in b]
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    if not torch.isfinite(loss) or all(torch.equal(p0, p) for p0, p in zip(before, b)):
        raise AssertionError("LoRA step left the adapter unchanged or the loss is not finite")
    return f"peft LoRA + AdamW on {device().type}: loss {loss.item():.3f}, adapter updated"


PROBES = [
    ("bf16 matmul", bf16_matmul),
    ("SDPA flash", sdpa_flash),
    ("SDPA memory-efficient", sdpa_efficient),
    ("bnb 4-bit matmul fwd+bwd", bnb_4bit_matmul),
    ("bnb 4-bit grad after eval (raw)", bnb_grad_after_eval_raw),
    ("bnb 4-bit grad after eval (kit)", bnb_grad_after_eval),
    ("bnb 8-bit optimizer step", bnb_8bit_optimizer),
    ("bnb paged optimizer step", bnb_paged_optimizer),
    ("gradient checkpointing", gradient_checkpointing),
    ("LoRA training step", lora_step),
]


def run_probe(name: str, fn) -> dict:
    """Run one probe; never raises (a crash is the probe's 'fail' with the error text)."""
    try:
        return {"name": name, "status": PASS, "detail": fn(), "error": None}
    except WorkedAround as e:
        return {"name": name, "status": WORKED_AROUND, "detail": str(e), "error": None}
    except NotApplicable as e:
        return {"name": name, "status": NA, "detail": str(e), "error": None}
    except Exception as e:  # noqa: BLE001 - any failure is the probe's result
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"name": name, "status": FAIL, "detail": None, "error": last[:500]}


def run_all() -> list[dict]:
    return [run_probe(n, f) for n, f in PROBES]
