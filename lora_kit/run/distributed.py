"""More than one process: the few torch.distributed pieces the smoke run needs.

Launch with ``torchrun --nproc_per_node N -m lora_kit.run.smoke --params run.yaml`` (or accelerate's
launcher). Backend: NCCL on CUDA, gloo on CPU -- slow, but it runs the real DDP code path, so a
2-process CPU run proves the script before a multi-GPU rental. (``accelerate launch --cpu
--num_processes 2`` starts only one process on this stack; use torchrun on CPU.)
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def init_if_launched() -> bool:
    """Join the process group when started by torchrun (WORLD_SIZE > 1); True if this call created it."""
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
