"""lora_kit: plan a LoRA / QLoRA fine-tuning run before renting a GPU, prove it, judge it.

Public API (imported lazily so ``import lora_kit`` stays fast)::

    estimate, simulate, measure_step        memory: analytic, simulated, measured
    sweep, max_fit, compare_methods         planning over GPUs and settings
    smoke_run, stack                        a short real run; the software/hardware check
    evaluate                                base vs adapter on held-out and control data
    Settings, load_settings                 the one settings definition
    DEFAULT_MODEL                           "tiny": the embedded model shipped in the package
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
DEFAULT_MODEL = "tiny"

_LAZY = {
    "Settings": "lora_kit.settings",
    "load_settings": "lora_kit.settings",
    "estimate": "lora_kit.estimate",
    "Estimate": "lora_kit.estimate",
    "simulate": "lora_kit.simulate",
    "measure_step": "lora_kit.measure",
    "model_spec": "lora_kit.specs",
    "sweep": "lora_kit.planner",
    "max_fit": "lora_kit.planner",
    "compare_methods": "lora_kit.planner",
    "gpu_table": "lora_kit.gpus",
    "dataset_lengths": "lora_kit.dataset_stats",
    "smoke_run": "lora_kit.smoke",
    "stack": "lora_kit.stack",
    "evaluate": "lora_kit.evaluate",
    "load_model": "lora_kit.loading",
    "load_tokenizer": "lora_kit.loading",
}

__all__ = sorted(_LAZY) + ["DEFAULT_MODEL", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name])
        if _LAZY[name] == f"lora_kit.{name}":  # a module exposed by name, e.g. lora_kit.stack
            return getattr(mod, name, mod)
        return getattr(mod, name)
    if not name.startswith("_"):  # submodules by name: lk.figures, lk.results, lk.widgets, ...
        try:
            return importlib.import_module(f"lora_kit.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"lora_kit.{name}":
                raise
    raise AttributeError(f"module 'lora_kit' has no attribute {name!r}")


def __dir__():
    return __all__
