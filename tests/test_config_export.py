"""Hand back a job that runs the planned step: TRL, axolotl and LLaMA-Factory configs read back to the same step."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from lora_kit.plan.config_import import settings_from_config
from lora_kit.run.config_export import TOOLS, export_config, write_job
from lora_kit.settings import PLANNING

STEPS = {
    "qlora": PLANNING.replace(method="qlora", autocast=True, optimizer="paged_adamw_8bit", seq_len=4096, batch_size=2,
                              grad_accum=8, lora_rank=32, lora_alpha=64, lora_dropout=0.05, padding="longest",
                              double_quant=False),
    "lora_zero3_offload": PLANNING.replace(method="lora", autocast=True, lora_targets=("q_proj", "v_proj"),
                                           padding="longest", num_gpus=4, sharding="zero3", cpu_offload=True,
                                           optimizer="adamw_8bit"),
    "full_fsdp_pure_bf16": PLANNING.replace(method="full", padding="longest", num_gpus=2, sharding="fsdp",
                                            gradient_checkpointing=False, attn_implementation="eager"),
    "lora_fp16_ddp": PLANNING.replace(dtype="float16", autocast=True, padding="longest", num_gpus=2, sharding="ddp",
                                      seq_len=1024, batch_size=8),
    "lora_liger": PLANNING.replace(autocast=True, padding="longest", liger_kernel=True),
    "lora_fa2_packed": PLANNING.replace(autocast=True, attn_implementation="flash_attention_2", padding="packed",
                                        batch_size=4),
}
LOOP = {"trl": "sft", "axolotl": "trainer", "llamafactory": "trainer"}


def _allocator_after(launch: str, env: dict) -> tuple:
    """Run launch.sh's allocator line in bash with ``env``: what the two variables hold after it."""
    line = next(ln for ln in launch.splitlines() if "ALLOC_CONF" in ln and not ln.startswith("#"))
    base = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    out = subprocess.run(["bash", "-c", line + '; printf "%s|%s" "${PYTORCH_CUDA_ALLOC_CONF-unset}" '
                          '"${PYTORCH_ALLOC_CONF-unset}"'], env={**base, **env}, capture_output=True, text=True,
                         check=True).stdout
    return tuple(out.split("|"))


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("name", sorted(STEPS))
def test_written_config_reads_back_to_the_same_step(tool, name, tmp_path):
    step = STEPS[name].replace(loop=LOOP[tool])
    job = write_job("llama-3.1-8b", step, tool=tool, out_dir=tmp_path)
    assert job["changed"] == {}, job["changed"]
    assert job["step"] == step and job["report"].model == "llama-3.1-8b"
    # packed rows in axolotl / LLaMA-Factory: their varlen path gathers q/k/v into copies, which the read-back says
    caveat = {"axolotl": ["sample_packing"], "llamafactory": ["neat_packing"]}.get(tool, [])
    assert [n["key"] for n in job["report"].not_modelled] == (caveat if step.padding == "packed" else [])
    back, _ = settings_from_config(job["files"]["config"], num_gpus=step.num_gpus)  # the file alone, as a user reads it
    assert back == step
    launch = job["files"]["launch"].read_text()
    assert job["files"]["launch"].stat().st_mode & 0o100
    assert _allocator_after(launch, {}) == ("expandable_segments:True", "unset")
    # a variable the user set, even empty or the newer name alone, is theirs
    assert _allocator_after(launch, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == ("unset", "max_split_size_mb:64")
    assert _allocator_after(launch, {"PYTORCH_CUDA_ALLOC_CONF": ""}) == ("", "unset")
    acc = yaml.safe_load(job["files"]["accelerate"].read_text())
    assert acc["num_processes"] == step.num_gpus
    if step.sharding.startswith("zero"):
        ds = json.loads(job["files"]["deepspeed"].read_text())
        assert ds["zero_optimization"]["stage"] == int(step.sharding[-1])
        assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_what_a_tool_cannot_express_is_said(tmp_path):
    step = PLANNING.replace(method="full", autocast=True, padding="longest", loop="trainer")
    job = write_job("qwen2.5-0.5b", step, tool="axolotl", out_dir=tmp_path / "ax")
    assert job["changed"] == {"autocast": (True, False)}  # axolotl loads bf16 weights: no fp32 master copy
    job = write_job("qwen2.5-0.5b", PLANNING, tool="trl", out_dir=tmp_path / "trl")
    assert job["changed"] == {"padding": ("none", "longest"), "loop": ("kit", "sft")}


def test_trl_config_is_what_trl_sft_parses():
    cfg = export_config("trl", "llama-3.1-8b", STEPS["qlora"])
    assert cfg["model_name_or_path"] == "meta-llama/Llama-3.1-8B" and cfg["optim"] == "paged_adamw_8bit"
    assert cfg["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    with pytest.raises(ValueError, match="tool='unsloth' is not valid"):
        export_config("unsloth", "llama-3.1-8b")
