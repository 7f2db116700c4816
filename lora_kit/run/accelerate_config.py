"""An ``accelerate`` config file for the chosen sharding, ready for ``accelerate launch --config_file``.

none/ddp -> MULTI_GPU (DDP: every GPU holds everything, no memory saved, simplest and fastest);
zero1/2/3 -> DEEPSPEED with that ZeRO stage (shards optimizer states / + gradients / + params;
more communication per step); fsdp -> FSDP (v2, full sharding of params, grads and states, wrapped
per transformer block: ``layer_class``, resharded after forward; the state dict gathered whole when
saving, so a trained adapter is saved once in peft's format) -- what the sharded smoke run ran
(:func:`lora_kit.run.distributed.shard_fsdp2`), which its 2-process test launches from this file. ``cpu_offload`` moves optimizer states (and params for zero3 / fsdp) to host
memory: large savings, much slower steps. QLoRA with FSDP/ZeRO-3 needs
``bnb_4bit_quant_storage`` equal to the compute dtype on the real run -- noted in the file.
"""
from __future__ import annotations

from pathlib import Path

from lora_kit.results import write_text_atomic
from lora_kit.run.alloc_conf import DEFAULT, variable

MIXED = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}


def accelerate_config(sharding: str = "ddp", num_gpus: int = 2, cpu_offload: bool = False,
                      dtype: str = "bfloat16", grad_accum: int = 1, gradient_checkpointing: bool = False,
                      layer_class: str | None = None) -> dict:
    """The config as a dict (the YAML written by :func:`write_accelerate_config`)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}.")
    if dtype not in MIXED:
        raise ValueError(f"dtype={dtype!r} is not valid; choose one of {sorted(MIXED)}.")
    cfg = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0, "num_machines": 1,
           "num_processes": num_gpus, "mixed_precision": MIXED[dtype], "rdzv_backend": "static",
           "same_network": True, "use_cpu": False, "gpu_ids": "all", "main_training_function": "main",
           "downcast_bf16": "no", "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False}
    if sharding in ("none", "ddp"):
        cfg["distributed_type"] = "MULTI_GPU" if num_gpus > 1 else "NO"
    elif sharding in ("zero1", "zero2", "zero3"):
        stage = int(sharding[-1])
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "zero_stage": stage, "gradient_accumulation_steps": grad_accum, "gradient_clipping": 1.0,
            "offload_optimizer_device": "cpu" if cpu_offload else "none",
            "offload_param_device": "cpu" if cpu_offload and stage == 3 else "none",
            "zero3_init_flag": stage == 3, "zero3_save_16bit_model": stage == 3}
    elif sharding == "fsdp":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": bool(cpu_offload),
            "fsdp_reshard_after_forward": True, "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_activation_checkpointing": bool(gradient_checkpointing)}
        if layer_class:
            cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = layer_class
    else:
        raise ValueError(f"sharding={sharding!r} is not valid; choose none, ddp, zero1, zero2, zero3 or fsdp.")
    return cfg


def write_accelerate_config(path, **kwargs) -> Path:
    """Write the YAML atomically; launch with ``accelerate launch --config_file <path> your_script.py``."""
    import yaml
    cfg = accelerate_config(**kwargs)
    head = ("# accelerate config written by lora_kit; launch: accelerate launch --config_file "
            f"{Path(path).name} train.py\n# sharding={kwargs.get('sharding', 'ddp')}"
            f" cpu_offload={kwargs.get('cpu_offload', False)}\n"
            "# QLoRA + fsdp/zero3: set bnb_4bit_quant_storage to the compute dtype in BitsAndBytesConfig.\n"
            f"# CUDA allocator: launch with {variable()}={DEFAULT} unless you set it (accelerate's config has no field "
            "for it; lora_kit's smoke run sets it itself)\n")
    return write_text_atomic(path, head + yaml.safe_dump(cfg, sort_keys=True))
