"""The CUDA caching allocator setting the kit's GPU path runs with: ``expandable_segments:True`` unless already set.

Expandable segments map memory in pages at the end of one segment per pool instead of opening a new segment per
size, so blocks freed by one size serve the next (``lora_kit.memory.allocator`` replays both settings; torchtune
issue 1185 measured one Llama-3-8B QLoRA run at 16.39 -> 10.83 GiB reserved with it, at the same speed).

Which variable: the kit sets ``PYTORCH_CUDA_ALLOC_CONF``, the one every torch with expandable segments honours on
CUDA. torch 2.9 added ``PYTORCH_ALLOC_CONF``, but 2.9.1's CUDA allocator ignores its ``expandable_segments``
(pytorch issue 183387; fixed by 2.11, karpathy/autoresearch PR 588); 2.9-2.10 warn that the old name is
deprecated, which is harmless. Which one torch reads (:func:`names_read`): torch 2.13's
``CUDAAllocatorConfig::instance`` (``c10/cuda/CUDAAllocatorConfig.h``) reads ``PYTORCH_CUDA_ALLOC_CONF`` and only
when it is not set ``PYTORCH_ALLOC_CONF``; the kit assumes that order from 2.11 on, and the old name alone before.
A variable that is set, even empty, is the user's choice and is left alone. It must be set before CUDA starts: the
smoke run and ``lora_kit.run.distributed.init_if_launched`` call :func:`apply_default` before anything touches
CUDA, and record :func:`in_effect`.
"""
from __future__ import annotations

import os
import re

import torch

DEFAULT = "expandable_segments:True"
NEW, OLD = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"
_SET_HERE: set[str] = set()  # variables this process set (so a second call still says who set them)


def variable() -> str:
    """The variable the kit sets (and tells users to set): ``PYTORCH_CUDA_ALLOC_CONF`` on every torch."""
    return OLD


def names_read(torch_version: str | None = None) -> tuple[str, ...]:
    """The variables the CUDA allocator of the installed torch (or ``torch_version``) reads, first one first."""
    m = re.match(r"(\d+)\.(\d+)", torch_version or torch.__version__)
    return (OLD, NEW) if m and (int(m.group(1)), int(m.group(2))) >= (2, 11) else (OLD,)


def in_effect(env=None, torch_version: str | None = None) -> dict:
    """The setting torch will read from ``env`` (default ``os.environ``): the variable, its value and whether
    expandable segments are on (the last ``expandable_segments`` item wins, as torch parses them); ``ignored``
    lists a variable that is set but that this torch's CUDA allocator does not read."""
    env = os.environ if env is None else env
    name = next((n for n in names_read(torch_version) if n in env), None)
    value = env[name] if name else ""
    items = [i.split(":", 1) for i in value.replace(" ", "").split(",") if ":" in i]
    on = [v == "True" for k, v in items if k == "expandable_segments"]
    ignored = [n for n in (OLD, NEW) if n in env and n not in names_read(torch_version)]
    return {"variable": name, "value": value, "expandable_segments": bool(on and on[-1]), "ignored": ignored}


def apply_default(env=None, torch_version: str | None = None) -> dict:
    """Set ``expandable_segments:True`` through :func:`variable` unless ``PYTORCH_ALLOC_CONF`` or
    ``PYTORCH_CUDA_ALLOC_CONF`` is set already; returns :func:`in_effect` with ``set_by`` ("lora_kit" or
    "environment") and ``cuda_started_before`` (True: CUDA was running already, so a variable set now may not
    reach its allocator)."""
    env = os.environ if env is None else env
    started = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    set_now = not any(n in env for n in (NEW, OLD))
    if set_now:
        env[variable()] = DEFAULT
        if env is os.environ:
            _SET_HERE.add(variable())
    rec = in_effect(env, torch_version)
    earlier = env is os.environ and rec["variable"] in _SET_HERE and rec["value"] == DEFAULT
    return {**rec, "set_by": "lora_kit" if set_now or earlier else "environment", "cuda_started_before": started}
