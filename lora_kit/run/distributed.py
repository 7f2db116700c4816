"""More than one process: the few torch.distributed pieces the smoke run needs.

Launch with ``torchrun --nproc_per_node N -m lora_kit.run.smoke --params run.yaml`` (or accelerate's
launcher). Backend: NCCL on CUDA, gloo on CPU -- slow, but it runs the real DDP / FSDP2 code path, so
a 2-process CPU run proves the script before a multi-GPU rental. (``accelerate launch --cpu
--num_processes 2`` starts only one process on this stack; use torchrun on CPU.)

Which engine runs: ``sharding`` "fsdp" or "zero3" -> PyTorch FSDP2 (``fully_shard``), wrapped as
accelerate's FSDP2 wraps (:func:`lora_kit.fsdp.apply_fsdp2`: every decoder layer, the
embedding, the tail, the root) on a 1-D device mesh over the launched group; every other value -> DDP
(ZeRO-1/2 are DeepSpeed's; the smoke run does not run DeepSpeed).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from lora_kit.run.alloc_conf import apply_default


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def init_if_launched() -> bool:
    """Join the process group when started by torchrun (WORLD_SIZE > 1); True if this call created it. Sets the
    kit's CUDA allocator default first (:func:`lora_kit.run.alloc_conf.apply_default`), before CUDA starts."""
    apply_default()
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return True


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if dist.is_initialized() else 0)
    return torch.device("cpu")


SHARDED = ("fsdp", "zero3")  # sharding values the smoke run runs on FSDP2 (DeepSpeed ZeRO-3 is not run)


def runs_sharded(s) -> bool:
    """True when this launch trains ``s`` (Settings) on FSDP2: several processes and sharding fsdp / zero3."""
    return world_size() > 1 and s.sharding in SHARDED


def engine(s) -> str:
    """What this launch runs, in words: "none", "ddp (2 ranks)", "fsdp (FSDP2, 2 ranks)"."""
    n = world_size()
    if n <= 1:
        return "none"
    return f"{s.sharding} (FSDP2, {n} ranks)" if runs_sharded(s) else f"ddp ({n} ranks)"


def check_sharded(s) -> None:
    """Refuse, saying what to change, what the FSDP2 smoke run does not run."""
    if s.method == "qlora":
        raise ValueError(f"sharding={s.sharding!r} with method='qlora' is not run by the smoke run: its FSDP2 "
                         "(fully_shard) does not shard bitsandbytes' 4-bit parameters (their quantisation state is "
                         "not a tensor FSDP2 carries); use sharding='ddp' (or method='lora') for the multi-process "
                         "smoke run. The plan's sharded QLoRA figures are estimate's (qlora_prepare 'none').")
    if s.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"sharding={s.sharding!r} runs FSDP2 with torch optimizers; optimizer={s.optimizer!r} on "
                         "sharded (DTensor) parameters is not run: use optimizer='adamw' or 'sgd', or sharding='ddp'.")
    if s.cpu_offload:
        raise ValueError(f"sharding={s.sharding!r} with cpu_offload=True is not run by the smoke run (FSDP2's "
                         "CPUOffloadPolicy needs a GPU); set cpu_offload=False for the smoke run.")


def shard_fsdp2(model, s):
    """Shard ``model`` in place with FSDP2 over every launched process, as accelerate's FSDP2 does
    (:func:`lora_kit.fsdp.apply_fsdp2`, ``policy="accelerate"``); build the optimizer after this.
    Returns (model, {"policy", "layer_class", "mesh", "reshard_after_forward"})."""
    from torch.distributed.device_mesh import init_device_mesh

    from lora_kit.fsdp import layer_class, shard_for_training
    check_sharded(s)
    wrapped = layer_class(model)  # before sharding: fully_shard renames the class (FSDP<name>)
    shard_for_training(model, init_device_mesh(device().type, (world_size(),)), s.step)
    info = {"policy": "accelerate (fully_shard per decoder layer, embedding, tail [final norm, lm_head], root)",
            "layer_class": wrapped, "mesh": [world_size()], "reshard_after_forward": True}
    if s.sharding == "zero3":
        info["note"] = ("DeepSpeed ZeRO-3 was not run: FSDP2 stood in (parameters, gradients and optimizer states "
                        "sharded alike; DeepSpeed's buffers differ); the accelerate config written launches DeepSpeed")
    return model, info


def full_trainable_state(model) -> dict | None:
    """Every trainable parameter gathered whole (``DTensor.full_tensor``, a collective: every rank calls this,
    in the same parameter order); ``{name: CPU tensor}`` on rank 0, None on the others. Frozen base weights
    are not gathered."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if rank() == 0:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out if rank() == 0 else None


def in_fresh_process(fn, **kwargs):
    """``fn(**kwargs)`` in a spawned process of its own, outside this process group (``simulate``'s fake
    FSDP2 world cannot start in a process that has joined a real one). ``fn`` and its result must pickle."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from lora_kit.noise import quiet  # the spawned process starts with no filters: the same silence as here
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=quiet) as pool:
        return pool.submit(fn, **kwargs).result()


def wrap_ddp(model):
    """DistributedDataParallel when more than one process runs, else the model unchanged."""
    if world_size() <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    ids = [device().index] if torch.cuda.is_available() else None
    return DDP(model, device_ids=ids)


def gather(obj) -> list:
    """``obj`` from every rank (a list indexed by rank); ``[obj]`` in a single process."""
    if world_size() <= 1 or not dist.is_initialized():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1 and dist.is_initialized():
        dist.barrier()


def shutdown(created: bool) -> None:
    if created and dist.is_initialized():
        dist.destroy_process_group()
