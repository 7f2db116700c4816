"""The run card states the device-total basis: context + torch's reserved + memory outside the allocator, labelled,
adding up to the plan's device total; a paged optimizer's states shown apart as "resident when room" (in nvidia-smi's
view, never in *fits*); the driver's share added once."""
import json

from lora_kit.memory.device import outside_bytes
from lora_kit.memory.estimate import estimate, paged_resident
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.planner import compare_methods
from lora_kit.plan.records import plan_record
from lora_kit.settings import Settings
from lora_kit.ui.run_card import build_report

STEP = dict(seq_len=2048, lora_rank=16, gradient_checkpointing=True)


def _card(d, optimizer):
    s = Settings(method="qlora", gpu="H200", dtype="bfloat16", optimizer=optimizer, run_dir=str(d))
    (d / "settings.json").write_text(json.dumps(s.to_dict()))
    table = compare_methods("llama-3.1-8b", gpus=["H200"], methods=("qlora",), optimizer=optimizer, margin=0.1,
                            **STEP)
    (d / "plan.json").write_text(json.dumps(plan_record(table, "llama-3.1-8b", margin=0.1, optimizer=optimizer,
                                                        **STEP)))
    build_report(d)
    return json.loads((d / "report.json").read_text())["nvidia_smi"], (d / "report.md").read_text()


def test_card_parts_add_up_and_paged_states_are_shown_apart(tmp_path):
    (tmp_path / "paged").mkdir()
    v, md = _card(tmp_path / "paged", "paged_adamw_8bit")
    g = get_gpu("H200")
    assert v["context_bytes"] == g["context_bytes"] and v["outside_bytes"] == outside_bytes("qlora", 1)
    assert v["context_bytes"] + v["reserved_bytes"] + v["outside_bytes"] == v["device_total_bytes"]
    s = Settings(method="qlora", gpu="H200", dtype="bfloat16", optimizer="paged_adamw_8bit").step
    own = estimate("llama-3.1-8b", step=s.replace(**STEP))
    twin = estimate("llama-3.1-8b", step=s.replace(optimizer="adamw_8bit", **STEP))
    paged = twin.breakdown["optimizer_states"] - own.breakdown["optimizer_states"]
    assert v["paged_resident_bytes"] == paged > 0
    assert v["reserved_bytes"] >= own.peak_allocated_bytes
    # nvidia-smi: device total + paged resident + driver's share, each once
    assert v["nvidia_smi_used_bytes"] == v["device_total_bytes"] + paged + v["driver_share_bytes"]
    section = md.split("### What nvidia-smi will show")[1].split("##")[0]
    for label in ("CUDA context", "torch's reserved", "outside the allocator", "**device total**",
                  "paged optimizer states, resident when room"):
        assert label in section
    assert "not counted in *fits*" in section
    # what torch.cuda.max_memory_allocated() will read: the plan's peak + two cuBLAS workspaces (32 MiB on an H200)
    assert v["cuda_allocated_bytes"] == v["peak_allocated_bytes"] + 2 * 32 * 2 ** 20
    assert "`torch.cuda.max_memory_allocated()` will read about" in section
    # the QLoRA paper's paged 32-bit AdamW: fp32 states in managed memory (they were missing from the card: its
    # unpaged twin was looked up by name and does not exist)
    (tmp_path / "paged32").mkdir()
    v32, md32 = _card(tmp_path / "paged32", "paged_adamw_32bit")
    assert v32["paged_resident_bytes"] == paged_resident("llama-3.1-8b", s.replace(optimizer="paged_adamw_32bit",
                                                                                   **STEP)) == 4 * paged > 0
    assert "paged optimizer states, resident when room" in md32
    (tmp_path / "plain").mkdir()
    v, md = _card(tmp_path / "plain", "adamw")
    assert v["paged_resident_bytes"] == 0 and "resident when room" not in md
    assert v["nvidia_smi_used_bytes"] == v["device_total_bytes"] + v["driver_share_bytes"]


def test_card_shows_reserved_with_expandable_segments_beside_the_default_setting(tmp_path):
    """The kit's GPU path sets expandable_segments:True: the card gives that setting's reserved (its own closed form
    from the plan's peak) and device total beside the default setting's, which *fits* keeps counting."""
    from lora_kit.memory.device import device_kwargs, reserved_bytes
    from lora_kit.memory.specs import model_spec
    from lora_kit.settings import as_step
    v, md = _card(tmp_path, "adamw")
    plan = json.loads((tmp_path / "plan.json").read_text())
    (row,) = [r for r in plan["rows"] if r["method"] == "qlora" and r["gpu"] == "H200"]
    step = as_step(None, **{**plan["assumptions"], "method": "qlora", "batch_size": int(row["batch_size"])})
    kw = device_kwargs(model_spec("llama-3.1-8b"), step)
    kw.pop("num_gpus")
    want = reserved_bytes(v["peak_allocated_bytes"], allocator="expandable", **kw)
    assert v["reserved_expandable_bytes"] == want < v["reserved_bytes"]
    assert v["device_total_expandable_bytes"] == v["context_bytes"] + want + v["outside_bytes"] < v["device_total_bytes"]
    section = md.split("### What nvidia-smi will show")[1].split("##")[0]
    assert "torch's reserved with expandable segments" in section and "*fits* counts the default setting's" in section
