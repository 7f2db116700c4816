"""lora_kit: plan a LoRA / QLoRA fine-tuning run before renting a GPU, prove it, judge it.

The package is laid out along the user's journey (imports point down only; ``tests/test_layout.py``
checks it)::

    settings, results, loading, data, prompting,    the ground floor: one settings/step schema,
    training, generation                            atomic results, model/data loading, the step
    memory/      specs, tracker, estimate, measure, simulate
    plan/        gpus, timing, planner, dataset_fit, figures
    run/         smoke, adapters, batches, loop, adapter_io, oom, distributed, accelerate_config
    evaluation/  evaluate, compare, metrics, hygiene, adapters, figures
    check/       stack, probes
    embedded/    tasks (the tiny model's data), story (its train/evaluate harness), shipped files
    ui/          notebook, widgets, tables, pipeline, run_card, cli

Public API (imported lazily so ``import lora_kit`` stays fast)::

    estimate, simulate, measure_step        memory: analytic, simulated, measured
    sweep, max_fit, compare_methods         planning over GPUs and settings
    epoch_from_data                         one epoch of the user's own data (the smoke run's statistics),
                                            for compare_methods(epoch=...)
    settings_from_config, write_job         the step of a TRL / axolotl / LLaMA-Factory / torchtune / Trainer
                                            config; the config, accelerate file and launch script of a plan
    smoke_run, stack                        a short real run; the software/hardware check
    train_adapters, trained_adapters        every adapter of a run (03: the smoke run's, the base-mix
                                            comparison's) and where they are (04 evaluates them)
    evaluate                                base vs adapter on held-out and control data
    Step                                    one training step: the schema (lora_kit.settings.PLANNING and
                                            EMBEDDED are its two named default sets)
    Settings, load_settings                 a run's settings: the step fields plus model, data, evaluation
    DEFAULT_MODEL                           "tiny": the embedded model shipped in the package
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
DEFAULT_MODEL = "tiny"

# public name -> module defining it
_LAZY = {
    "Settings": "lora_kit.settings",
    "Step": "lora_kit.settings",
    "load_settings": "lora_kit.settings",
    "estimate": "lora_kit.memory.estimate",
    "Estimate": "lora_kit.memory.estimate",
    "simulate": "lora_kit.memory.simulate",
    "measure_step": "lora_kit.memory.measure",
    "model_spec": "lora_kit.memory.specs",
    "sweep": "lora_kit.plan.planner",
    "max_fit": "lora_kit.plan.planner",
    "compare_methods": "lora_kit.plan.planner",
    "qlora_vs_lora": "lora_kit.plan.planner",
    "epoch_from_data": "lora_kit.plan.planner",
    "gpu_table": "lora_kit.plan.gpus",
    "dataset_lengths": "lora_kit.plan.dataset_fit",
    "settings_from_config": "lora_kit.plan.config_import",
    "run_settings": "lora_kit.plan.config_import",
    "write_job": "lora_kit.run.config_export",
    "smoke_run": "lora_kit.run.smoke",
    "train_adapters": "lora_kit.run.adapters",
    "trained_adapters": "lora_kit.run.adapters",
    "evaluate": "lora_kit.evaluation.evaluate",
    "load_model": "lora_kit.loading",
    "load_tokenizer": "lora_kit.loading",
}
# public name -> module exposed as a namespace (``lk.stack.report()``, ``lk.figures.fits_heatmap``)
_MODULES = {
    "stack": "lora_kit.check.stack",
    "figures": "lora_kit.plan.figures",
    "tables": "lora_kit.ui.tables",
    "records": "lora_kit.plan.records",
    "timing": "lora_kit.plan.timing",
    "gpus": "lora_kit.plan.gpus",
    "results": "lora_kit.results",
    "widgets": "lora_kit.ui.widgets",
    "notebook": "lora_kit.ui.notebook",
}

__all__ = sorted({**_LAZY, **_MODULES}) + ["DEFAULT_MODEL", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'lora_kit' has no attribute {name!r}")


def __dir__():
    return __all__
