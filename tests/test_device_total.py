"""One basis for the device total (lora_kit.memory.device): CUDA context + torch's reserved (closed form) + memory
outside the allocator (+ NCCL per rank), paged optimizer states shown apart and never in the verdict."""
import json
from pathlib import Path

import numpy as np
import pytest

from lora_kit.memory import device
from lora_kit.memory.device import (CUDA_CONTEXT_BYTES, NCCL_RANK_BYTES, OUTSIDE_BYTES, device_kwargs, device_parts,
                                    device_total, reserved_bytes)
from lora_kit.memory.estimate import estimate
from lora_kit.memory.specs import model_spec
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.headline import PAPER_STEP
from lora_kit.plan.planner import fit_verdict
from lora_kit.settings import as_step

H200 = json.loads((Path(__file__).parents[1] / "benchmarks" / "reference" / "cuda_h200.json").read_text())["rows"]
STEPS = [r for r in H200 if "settings" in r]


def test_parts_add_up_and_every_kind_of_integer_stays_exact():
    kw = dict(largest=1_050_673_152, method="qlora", embedding_bytes=1_050_673_152, num_gpus=2)
    p = device_parts(12_641_234_432, **kw)
    assert p["total"] == p["context"] + p["reserved"] + p["outside"]
    assert p["outside"] == OUTSIDE_BYTES["qlora"] + NCCL_RANK_BYTES[2] and p["context"] == CUDA_CONTEXT_BYTES
    assert p["reserved"] > 12_641_234_432 and (p["reserved"] - 12_641_234_432) % (2 * 2 ** 20) == 0
    arr = device_total(np.array([12_641_234_432, 10 ** 9]), **kw)
    obj = device_total(np.array([12_641_234_432, 10 ** 9], dtype=object), **kw)
    assert arr.dtype == np.int64 and obj.dtype == object and list(arr) == list(obj)
    assert int(arr[0]) == device_total(12_641_234_432, **kw)
    huge = 2 ** 70  # past int64: Python ints, exact
    n, d = device.FRAGMENTATION["default"]["peak"]
    assert device_total(huge, num_gpus=1) == huge + CUDA_CONTEXT_BYTES + max(OUTSIDE_BYTES.values()) + \
        -(-(-(-(n * huge) // d)) // (2 * 2 ** 20)) * (2 * 2 ** 20)
    assert not hasattr(device, "RESERVE_FRACTION")  # the fixed 8 % is gone


def test_outside_and_nccl_per_rank():
    assert device.outside_bytes("lora", 1) == OUTSIDE_BYTES["lora"] > device.outside_bytes("qlora", 1)
    n = device.outside_bytes("lora", np.array([1, 2, 4]))
    assert list(n - OUTSIDE_BYTES["lora"]) == [0, NCCL_RANK_BYTES[2], NCCL_RANK_BYTES[3]]


def test_outside_term_is_what_each_shared_h200_row_shows_beside_context_and_reserved():
    """The term was fitted on these rows: nvidia-smi's peak - used before - context - max_memory_reserved."""
    ctx = int(get_gpu("H200")["context_bytes"])
    for r in STEPS:
        seen = r["peak_nvml"] - r["nvml_used_before_context"] - ctx - r["peak_reserved"]
        assert seen == device.outside_bytes(r["settings"]["method"], 1), r["case"]


def test_closed_form_on_the_shared_h200_rows_from_the_measured_peak():
    """From torch's measured peak allocated: reserved and the device total against what the process added."""
    ctx = int(get_gpu("H200")["context_bytes"])
    for r in STEPS:
        st = r["settings"]
        kw = device_kwargs(model_spec(r["model"]), as_step(None, method=st["method"], seq_len=st["seq"],
                                                         batch_size=st["batch"]))
        added = r["peak_nvml"] - r["nvml_used_before_context"]
        total = device_total(r["peak_allocated"], context=ctx, **kw)
        assert 0.97 <= total / added <= 1.10, (r["case"], total / added)
        assert reserved_bytes(r["peak_allocated"], **{k: kw[k] for k in ("largest", "layer", "method",
                                                                          "embedding_bytes")}) \
            >= r["peak_allocated"]


def test_qlora_keeps_one_16_bit_block_only_when_embeddings_are_untied():
    untied, tied = model_spec("llama-3.1-8b"), model_spec("llama-3.2-1b")
    qlora, lora = as_step(None, method="qlora"), as_step(None, method="lora")
    assert device_kwargs(untied, qlora)["embedding_bytes"] == untied.vocab_size * untied.hidden_size * 2
    assert device_kwargs(tied, qlora)["embedding_bytes"] == 0
    assert device_kwargs(untied, lora)["embedding_bytes"] == 0
    assert device_kwargs(untied, lora, np.array([512, 2048]))["largest"].tolist() == \
        [512 * untied.vocab_size * 4, 2048 * untied.vocab_size * 4]
    assert device_kwargs(untied, lora.replace(loop="sft"), 8192)["largest"] == 4096 * 32768 * 4  # TRL's head tile


def test_layer_term_is_one_mlp_activation_in_the_dtype_the_layers_run():
    """QLoRA readied by prepare_model_for_kbit_training runs its layers in fp32 (4 bytes), also under autocast;
    without it, and LoRA in bf16, 2 bytes (4 where LoRA adapts the down projection); fp32 weights without autocast
    4."""
    spec = model_spec("mistral-7b")
    one = 4096 * spec.intermediate_size
    assert device_kwargs(spec, as_step(None, method="qlora", autocast=True), 4096)["layer"] == one * 4
    assert device_kwargs(spec, as_step(None, method="qlora", qlora_prepare="none"), 4096)["layer"] == one * 2
    # LoRA: peft's fp32 adapter on the down projection saves an fp32 copy of its input (a real CPU step's saved
    # tensors show it), a layer's largest block; adapters elsewhere only: the bf16 activation
    assert device_kwargs(spec, as_step(None, method="lora"), 4096)["layer"] == one * 4
    assert device_kwargs(spec, as_step(None, method="lora", lora_targets=["q_proj", "v_proj"]), 4096)["layer"] == one * 2
    assert device_kwargs(spec, as_step(None, method="full", dtype="float32"), 4096)["layer"] == one * 4
    assert device_kwargs(spec, as_step(None, method="full", dtype="float32", autocast=True), 4096)["layer"] == one * 2
    peak = 20 * 2 ** 30
    assert reserved_bytes(peak, layer=one * 4) - reserved_bytes(peak) == 4 * one * 4  # LAYER = 4 blocks


def test_paged_states_are_resident_when_room_but_never_in_the_verdict():
    """The QLoRA paper's 65B on a 48 GB card fits on the device total; with its paged 32-bit states all resident it
    would not: they live in CUDA managed memory, which the driver pages out, so the verdict leaves them out."""
    e = estimate("llama-65b", PAPER_STEP)
    paged = estimate("llama-65b", PAPER_STEP, optimizer="adamw").breakdown[
        "optimizer_states"] - e.breakdown["optimizer_states"]
    spec = model_spec("llama-65b")
    total = device_total(e.peak_allocated_bytes, **device_kwargs(spec, PAPER_STEP))
    assert fit_verdict(total, "L40S", 0.0)["fits"]
    assert not fit_verdict(total + paged, "L40S", 0.0)["fits"]
    from lora_kit.memory.static import trainable_tensors
    from lora_kit.memory.specs import check_targets
    targets = check_targets(spec, "qlora", 64, "all-linear", "sdpa")
    from lora_kit.memory.moe import expert_lora
    tensors, _ = trainable_tensors(spec, PAPER_STEP, targets, expert_lora(spec, targets), np.asarray([64]))
    resident = int(np.sum(device.paged_resident_bytes("paged_adamw_32bit", tensors)))
    assert 0.999 * paged <= resident <= paged  # the twin also drops bitsandbytes' small per-optimizer buffers
    assert device.paged_resident_bytes("adamw", tensors) == 0


@pytest.mark.parametrize("optimizer", ["paged_adamw_32bit", "paged_adamw_8bit"])
def test_paged_resident_is_what_the_real_paged_optimizer_keeps_in_managed_memory(optimizer):
    """``paged_resident``: the state1 / state2 bitsandbytes' real paged optimizer holds for tensors of >= 100,000
    elements after a step, on a bf16 full fine-tune (32-bit states are fp32 whatever the weight's dtype: an unpaged
    AdamW twin in bf16 would give half) and on 2 ranks with sharded states."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from lora_kit.memory.breakdown import paged_state_tensors
    from lora_kit.memory.estimate import paged_resident
    from lora_kit.training import optimizer_for
    cfg = LlamaConfig(hidden_size=384, intermediate_size=512, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    opt = optimizer_for([p for p in model.parameters() if p.requires_grad], optimizer)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    real = sum(t.untyped_storage().nbytes() for t in paged_state_tensors(opt))
    assert real > 0
    planned = paged_resident(cfg, method="full", dtype="bfloat16", optimizer=optimizer)
    assert planned - real in range(0, 512 * 2 * len(list(paged_state_tensors(opt))))  # each rounded up to 512 B
    assert paged_resident(cfg, method="full", dtype="bfloat16", optimizer=optimizer, num_gpus=2,
                          sharding="fsdp") == -(-planned // 2)
    assert paged_resident(cfg, method="full", dtype="bfloat16", optimizer="adamw") == 0


def test_cuda_allocated_adds_the_two_cublas_workspaces_by_compute_capability_and_torch():
    """torch's parseChosenWorkspaceSize: 32 MiB on compute capability 9, on 10 and 12 from torch 2.11, else
    ':4096:2:16:8'; two of them (the forward's thread and autograd's)."""
    mib = 2 ** 20
    assert device.cublas_workspace_bytes(9.0, "2.9") == 32 * mib
    assert device.cublas_workspace_bytes(8.0, "2.13") == device.cublas_workspace_bytes(8.9) == 8 * mib + 128 * 1024
    assert device.cublas_workspace_bytes(10.0, "2.10") == 8 * mib + 128 * 1024
    assert device.cublas_workspace_bytes(10.0, "2.11") == device.cublas_workspace_bytes(12.1, (2, 13)) == 32 * mib
    assert device.cublas_workspace_bytes(None) == device.cublas_workspace_bytes(float("nan")) == 32 * mib
    assert device.cuda_allocated_bytes(10 ** 9, 9.0) == 10 ** 9 + 64 * mib
    # the machine's CUBLAS_WORKSPACE_CONFIG replaces the default (":4096:8", deterministic runs: 8 x 4 MiB)
    assert device.cublas_workspace_bytes(9.0, config=":4096:8") == 32 * mib
    assert device.cublas_workspace_bytes(8.0, config=":16:8") == 128 * 1024
    assert device.cuda_allocated_bytes(0, 8.0, config=":4096:2:16:8") == 2 * (8 * mib + 128 * 1024)
    arr = device.cuda_allocated_bytes(np.array([1, 2 ** 70], dtype=object), 8.0)
    assert list(arr) == [1 + 2 * (8 * mib + 128 * 1024), 2 ** 70 + 2 * (8 * mib + 128 * 1024)]


def test_cuda_allocated_is_what_torch_counted_on_every_shared_h200_row():
    """max_memory_allocated - the step's tensors (estimate's peak, from shipped fits, with each row's step as
    benchmarks/cuda_h200.py recorded it) is the two workspaces, within the few MB the formula leaves out (AdamW's
    host-side step scalars, bitsandbytes' load buffers): within 0.05 % on every shared row, where the step's tensors
    alone are 0.1-0.6 % short."""
    res = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "cuda_h200.json").read_text())["rows"]
    measured = {r["case"]: r for r in STEPS}
    assert {r["case"] for r in res} == set(measured)
    cc = float(get_gpu("H200")["compute_capability"])
    for r in res:
        m, peak = measured[r["case"]], estimate(r["model"], **r["settings"]).peak_allocated_bytes
        cuda = device.cuda_allocated_bytes(peak, cc, m["versions"]["torch"])
        assert abs(cuda / m["peak_allocated"] - 1) < 5e-4, (r["case"], cuda / m["peak_allocated"])
        assert peak / m["peak_allocated"] < 0.9995, r["case"]


def test_cuda_math_fallback_on_the_shared_qlora_row_is_placed_where_the_measurement_puts_it():
    """On the H200 (torch 2.11) the QLoRA row's SDPA gets fp32 q/k/v with grouped K/V heads: CUDA runs the math
    kernel. Its bound is over a GiB at attention, but placed on the simulated step it adds nothing to the peak
    (the loss at a 128k vocabulary is higher), as the measurement says: torch's peak is the step's tensors plus
    the two cuBLAS workspaces to within 5 MB (the test above). The bf16 weights bitsandbytes' 4-bit matmul
    dequantises inside itself (up to 4096 x 14336 here) are placed there too, and add nothing either."""
    from lora_kit.memory.cuda_kernels import (kernel_extra, math_fallback_bytes, math_kernel_extra, sdpa_backend,
                                              sdpa_call)
    from lora_kit.memory.simulate import simulate
    from lora_kit.settings import as_step
    res = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "cuda_h200.json").read_text())["rows"]
    row = next(r for r in res if r["case"] == "l8b-qlora-ckpt-s2048")
    st, spec = as_step(None, **row["settings"]), model_spec(row["model"])
    assert sdpa_backend(sdpa_call(spec, st), "2.11", 9.0).backend == "math"
    assert math_fallback_bytes(spec, st, torch_version_="2.11").peak_extra > 2 ** 30
    sim = simulate(row["model"], st, trace=True)
    assert math_kernel_extra(row["model"], st, sim=sim, torch_version_="2.11", compute_capability=9.0) == 0
    assert max(sim.temporaries.values()) >= 4096 * 14336 * 2
    assert kernel_extra(row["model"], st, sim=sim, torch_version_="2.11", compute_capability=9.0) == 0


def test_each_allocator_setting_has_its_own_closed_form():
    """expandable_segments:True maps pages on demand: no layer term, less reserved on a long row; a setting the
    allocator does not have is refused by name."""
    spec = model_spec("mistral-7b")
    kw = device_kwargs(spec, as_step(None, method="qlora", autocast=True, seq_len=4096, batch_size=4))
    kw.pop("num_gpus")
    peak = 20 * 2 ** 30
    default, expandable = (reserved_bytes(peak, allocator=a, **kw) for a in ("default", "expandable"))
    assert peak < expandable < default
    assert device_parts(peak, num_gpus=1, allocator="expandable", **kw)["allocator"] == "expandable"
    with pytest.raises(ValueError, match="allocator='expandible'.*default, expandable"):
        reserved_bytes(peak, allocator="expandible")


def test_lora_down_projection_adapter_saves_an_fp32_copy_of_its_input():
    """What ``device_kwargs``' LoRA ``layer`` stands for, on a real bf16 step with peft: the saved tensors of a
    layer's MLP hold an fp32 ``tokens x intermediate`` copy (the down projection's adapter input)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    saved = {}
    for targets in ("all-linear", ["q_proj", "v_proj"]):
        model = get_peft_model(LlamaForCausalLM(cfg).to(torch.bfloat16), LoraConfig(r=8, target_modules=targets))
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append((t.numel(), t.dtype)) or t, lambda t: t):
            model(input_ids=torch.randint(0, 100, (2, 16)), labels=torch.randint(0, 100, (2, 16)))
        saved[str(targets)] = shapes
    tokens_inter = 2 * 16 * 352
    assert (tokens_inter, torch.float32) in saved["all-linear"]
    assert (tokens_inter, torch.float32) not in saved["['q_proj', 'v_proj']"]
    spec = model_spec(cfg)
    assert device_kwargs(spec, as_step(None, method="lora"), 32)["layer"] == tokens_inter * 4
    assert device_kwargs(spec, as_step(None, method="lora", lora_targets=["q_proj", "v_proj"]), 32)["layer"] == \
        tokens_inter * 2
