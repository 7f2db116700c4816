"""Hand back a job that runs the planned step: the config for the user's tool, the launcher config, the script.

:func:`write_job` writes, into one folder, for ``tool`` = ``"trl"`` | ``"axolotl"`` | ``"llamafactory"``:

- the tool's config (``sft.yaml`` for ``trl sft``, ``axolotl.yaml``, ``llamafactory.yaml``) with the planned
  micro-batch, gradient accumulation, sequence length, checkpointing (non-reentrant, as planned), optimizer,
  precision, attention kernel, LoRA rank / alpha / targets and 4-bit settings;
- for ZeRO sharding a DeepSpeed JSON beside it (``ds_zero<N>.json``, referenced from the config); for FSDP the
  tool's FSDP settings;
- ``accelerate.yaml``: the accelerate config the kit writes (:mod:`lora_kit.run.accelerate_config`) with the GPU
  count (TRL and axolotl launch through ``accelerate launch``; LLaMA-Factory through ``llamafactory-cli``, told the
  GPU count by ``NPROC_PER_NODE``);
- ``launch.sh``: sets the CUDA allocator to ``expandable_segments:True`` through ``PYTORCH_CUDA_ALLOC_CONF``, the
  variable every torch reads on CUDA (:mod:`lora_kit.run.alloc_conf`), unless the user set it or
  ``PYTORCH_ALLOC_CONF``, then launches.

What the tool cannot express is said, never hidden: :func:`write_job` reads the written config back with
:func:`lora_kit.plan.config_import.settings_from_config` and returns the step the job runs and every field where
it differs from the planned one (``changed``) -- e.g. TRL's and LLaMA-Factory's collators always pad (with a
mask), axolotl cannot keep fp32 master weights for full fine-tuning, and each tool runs its own loop.
"""
from __future__ import annotations

import json
from pathlib import Path

from lora_kit.plan.config_import import settings_from_config
from lora_kit.results import write_text_atomic
from lora_kit.run.accelerate_config import write_accelerate_config
from lora_kit.run.alloc_conf import DEFAULT as ALLOC, NEW, OLD
from lora_kit.settings import as_step
from lora_kit.training import TRAINER_OPTIM

TOOLS = ("trl", "axolotl", "llamafactory")
CONFIG_NAME = {"trl": "sft.yaml", "axolotl": "axolotl.yaml", "llamafactory": "llamafactory.yaml"}


def hub_id(model: str) -> str:
    """The id the tool downloads: the catalog entry's hub id for a catalog name, else ``model`` as given."""
    from lora_kit.memory.specs import catalog
    entry = catalog().get(str(model).lower())
    return entry["hub_id"] if entry else str(model)


def deepspeed_config(step) -> dict | None:
    """A DeepSpeed JSON for a ZeRO step ("auto" values are filled by the HF Trainer from its own arguments)."""
    if not step.sharding.startswith("zero"):
        return None
    stage = int(step.sharding[-1])
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if step.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto"}


def _targets(step):
    return "all-linear" if step.lora_targets == "all-linear" else list(step.lora_targets)


def trl_config(model: str, step, dataset: str | None = None) -> dict:
    """``trl sft --config`` fields (ScriptArguments, SFTConfig, ModelConfig) that run ``step``."""
    lora = step.method != "full"
    # full + autocast: fp32 master weights under 16-bit autocast; otherwise the weights in dtype
    weights = "float32" if step.method == "full" and step.autocast else step.dtype
    half = "float16" if step.dtype == "float16" else "bfloat16"
    cfg = {"model_name_or_path": hub_id(model), "dtype": weights, "attn_implementation": step.attn_implementation}
    if dataset:
        cfg["dataset_name"] = dataset
    cfg.update({"output_dir": "output", "max_length": step.seq_len, "per_device_train_batch_size": step.batch_size,
                "gradient_accumulation_steps": step.grad_accum, "gradient_checkpointing": step.gradient_checkpointing,
                "gradient_checkpointing_kwargs": {"use_reentrant": False}, "optim": TRAINER_OPTIM[step.optimizer],
                "bf16": bool(step.autocast and half == "bfloat16"), "fp16": bool(step.autocast and half == "float16"),
                "packing": step.padding == "packed", "use_peft": lora})
    if step.padding == "max_length":
        cfg["pad_to_multiple_of"] = step.seq_len  # every batch padded to max_length
    # padding="packed": TRL packs examples into rows of up to max_length ('bfd', its default strategy), which turns
    # padding_free on: the micro-batch's rows flattened into one, position_ids restarting per example (TRL 1.16
    # refuses padding_free without packing when max_length is set)
    if lora:
        cfg.update({"lora_r": step.lora_rank, "lora_alpha": step.lora_alpha, "lora_dropout": step.lora_dropout,
                    "lora_target_modules": _targets(step)})
    if step.method == "qlora":
        cfg.update({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": step.double_quant})
    if step.liger_kernel:
        cfg["use_liger_kernel"] = True
    _trainer_sharding(cfg, step)
    return cfg


def _trainer_sharding(cfg: dict, step) -> None:
    """TrainingArguments' sharding fields (TRL and LLaMA-Factory pass them to the Trainer)."""
    if step.sharding.startswith("zero"):
        cfg["deepspeed"] = f"ds_{step.sharding}.json"
    elif step.sharding == "fsdp":
        cfg["fsdp"] = "full_shard auto_wrap" + (" offload" if step.cpu_offload else "")


def axolotl_config(model: str, step, dataset: str | None = None) -> dict:
    """An axolotl YAML that runs ``step``."""
    cfg = {"base_model": hub_id(model), "load_in_4bit": step.method == "qlora", "load_in_8bit": False}
    if dataset:
        cfg["datasets"] = [{"path": dataset, "type": "alpaca"}]
    cfg["output_dir"] = "./output"
    if step.method != "full":
        cfg.update({"adapter": step.method, "lora_r": step.lora_rank, "lora_alpha": step.lora_alpha,
                    "lora_dropout": step.lora_dropout})
        if step.lora_targets == "all-linear":
            cfg["lora_target_linear"] = True
        else:
            cfg["lora_target_modules"] = list(step.lora_targets)
        if step.method == "qlora":
            cfg["bnb_config_kwargs"] = {"bnb_4bit_use_double_quant": step.double_quant}
    # bf16 / fp16: weights in that dtype plus autocast; bfloat16 / float16: the weights, no autocast
    amp = step.autocast and step.method != "full"
    if step.dtype == "bfloat16":
        cfg["bf16" if amp else "bfloat16"] = True
    elif step.dtype == "float16":
        cfg["fp16" if amp else "float16"] = True
    elif step.autocast:
        cfg["bf16"] = True  # fp32 weights under autocast cannot be asked for: the weights load in bf16 too
    cfg.update({"sequence_len": step.seq_len, "sample_packing": step.padding == "packed",
                "pad_to_sequence_len": step.padding in ("max_length", "packed"), "micro_batch_size": step.batch_size,
                "gradient_accumulation_steps": step.grad_accum, "gradient_checkpointing": step.gradient_checkpointing,
                "gradient_checkpointing_kwargs": {"use_reentrant": False}, "optimizer": TRAINER_OPTIM[step.optimizer]})
    cfg[{"sdpa": "sdp_attention", "eager": "eager_attention", "flash_attention_2": "flash_attention"}[
        step.attn_implementation]] = True
    if step.liger_kernel:  # the plugin with the kernels the Trainer's use_liger_kernel applies
        from lora_kit.plan.config_import import AXOLOTL_LIGER_DEFAULTS
        cfg["plugins"] = ["axolotl.integrations.liger.LigerPlugin"]
        cfg.update(dict.fromkeys(AXOLOTL_LIGER_DEFAULTS, True))
    if step.sharding.startswith("zero"):
        cfg["deepspeed"] = f"ds_{step.sharding}.json"
    elif step.sharding == "fsdp":
        cfg["fsdp_version"] = 2
        cfg["fsdp_config"] = {"offload_params": bool(step.cpu_offload), "reshard_after_forward": True,
                              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "FULL_STATE_DICT"}
    return cfg


def llamafactory_config(model: str, step, dataset: str | None = None) -> dict:
    """A LLaMA-Factory YAML (``llamafactory-cli train``) that runs ``step``."""
    cfg = {"model_name_or_path": hub_id(model), "stage": "sft", "do_train": True,
           "finetuning_type": "full" if step.method == "full" else "lora"}
    if step.method != "full":
        cfg.update({"lora_rank": step.lora_rank, "lora_alpha": step.lora_alpha, "lora_dropout": step.lora_dropout,
                    "lora_target": "all" if step.lora_targets == "all-linear" else ",".join(step.lora_targets)})
    if step.method == "qlora":
        cfg.update({"quantization_bit": 4, "quantization_method": "bnb", "double_quantization": step.double_quant})
    if dataset:
        cfg["dataset"] = dataset
    cfg.update({"cutoff_len": step.seq_len, "output_dir": "output", "per_device_train_batch_size": step.batch_size,
                "gradient_accumulation_steps": step.grad_accum,
                "disable_gradient_checkpointing": not step.gradient_checkpointing, "use_reentrant_gc": False,
                "optim": TRAINER_OPTIM[step.optimizer],
                "flash_attn": {"sdpa": "sdpa", "eager": "disabled", "flash_attention_2": "fa2"}[step.attn_implementation]})
    if step.padding == "packed":
        cfg["neat_packing"] = True  # packed without attention across examples (FlashAttention-2's varlen path)
    if step.liger_kernel:
        cfg["enable_liger_kernel"] = True
    # bf16: weights in bf16, trainable ones up-cast to fp32, autocast; pure_bf16: bf16 weights, no autocast
    if step.dtype == "float16":
        cfg["fp16"] = True
    elif step.dtype == "bfloat16":
        cfg["bf16" if step.autocast else "pure_bf16"] = True
    _trainer_sharding(cfg, step)
    return cfg


EXPORTERS = {"trl": trl_config, "axolotl": axolotl_config, "llamafactory": llamafactory_config}


def export_config(tool: str, model: str, step=None, dataset: str | None = None, **overrides) -> dict:
    """The config of ``tool`` (:data:`TOOLS`) that runs ``step`` (a Step; default :data:`PLANNING`) on ``model``."""
    if tool not in EXPORTERS:
        raise ValueError(f"tool={tool!r} is not valid; choose one of {', '.join(TOOLS)}.")
    return EXPORTERS[tool](model, as_step(step, **overrides), dataset)


def launch_script(tool: str, step) -> str:
    """``launch.sh``: the allocator setting through both variables, then the tool's launcher."""
    cfg = CONFIG_NAME[tool]
    head = ["#!/usr/bin/env bash", f"# written by lora_kit: runs the planned step with {tool} on {step.num_gpus} GPU(s)",
            "set -euo pipefail", 'cd "$(dirname "$0")"',
            "# the allocator setting the plan assumes, unless you set one (every torch reads this variable on CUDA)",
            f'if [ -z "${{{OLD}+x}}${{{NEW}+x}}" ]; then export {OLD}="{ALLOC}"; fi']
    if tool == "trl":
        run = ['SFT="$(python -c \'import trl.scripts.sft as m; print(m.__file__)\')"',
               f'accelerate launch --config_file accelerate.yaml "$SFT" --config {cfg} "$@"']
    elif tool == "axolotl":
        run = [f'accelerate launch --config_file accelerate.yaml -m axolotl.cli.train {cfg} "$@"']
    else:
        run = [f"export NPROC_PER_NODE={step.num_gpus}" + (" FORCE_TORCHRUN=1" if step.num_gpus > 1 else ""),
               f'llamafactory-cli train {cfg} "$@"']
    return "\n".join(head + run) + "\n"


def write_job(model, step=None, tool: str = "trl", out_dir="job", dataset: str | None = None,
              layer_class: str | None = None, **overrides) -> dict:
    """Write the job that runs ``step`` on ``model`` with ``tool`` into ``out_dir`` (see the module docstring).

    Returns ``{"files": {name: path}, "step": the step the written config runs (read back), "changed": {field:
    (planned, written)}, "report": the read-back ConfigReport}``; ``changed`` is empty when the tool runs exactly the
    planned step."""
    import yaml
    planned = as_step(step, **overrides)
    cfg = export_config(tool, model, planned, dataset)
    out = Path(out_dir)
    files = {}
    head = (f"# {tool} config written by lora_kit for {model}: the planned step, one GPU's share "
            f"(launch with launch.sh)\n")
    files["config"] = write_text_atomic(out / CONFIG_NAME[tool], head + yaml.safe_dump(cfg, sort_keys=False))
    ds = deepspeed_config(planned)
    if ds:
        files["deepspeed"] = write_text_atomic(out / f"ds_{planned.sharding}.json", json.dumps(ds, indent=2) + "\n")
    mixed = ("float16" if planned.dtype == "float16" else "bfloat16") if planned.autocast else "float32"
    files["accelerate"] = write_accelerate_config(
        out / "accelerate.yaml", sharding="ddp" if planned.sharding == "none" else planned.sharding,
        num_gpus=planned.num_gpus, cpu_offload=planned.cpu_offload, dtype=mixed, grad_accum=planned.grad_accum,
        gradient_checkpointing=planned.gradient_checkpointing, layer_class=layer_class)
    files["launch"] = write_text_atomic(out / "launch.sh", launch_script(tool, planned))
    files["launch"].chmod(0o755)
    back, report = settings_from_config(files["config"], model=model, num_gpus=planned.num_gpus)
    changed = {k: (getattr(planned, k), getattr(back, k)) for k in planned.to_dict()
               if getattr(planned, k) != getattr(back, k)}
    return {"files": files, "step": back, "changed": changed, "report": report}


