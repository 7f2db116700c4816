"""Every adapter a run trains (notebook 03), and the record of where they are (read by 04).

:func:`train_adapters` is the smoke run (:func:`lora_kit.run.smoke.smoke_run`, its adapter in
``<run_dir>/smoke/adapter``) plus, on the embedded tasks, the base-mix comparison: the same run with
``compare_base_mix`` of base-task rows mixed into training (``base_mix``), in ``<run_dir>/mix/`` (its
own ``smoke/smoke.json``, ``smoke/adapter`` and ``data/``). The comparison is the remedy for forgetting,
measured: 04 shows how much more of the control set the mixed adapter keeps, at what held-out cost.

The smoke run's record (``<run_dir>/smoke/smoke.json``) then lists the adapters under ``"adapters"``,
``{name: folder relative to run_dir}`` (relative, so a run folder moved or copied whole still finds
them), and the comparison's outcome under ``"base_mix_comparison"``. :func:`trained_adapters` reads
that list; :func:`lora_kit.evaluation.evaluate` uses it when no adapters are given, so 04 evaluates
exactly what 03 trained and trains nothing itself.
"""
from __future__ import annotations

import inspect
from pathlib import Path

from lora_kit.data import base_mix_source
from lora_kit.results import read_record, touch, write_json_atomic

MAIN_ADAPTER = "adapter"  # the smoke run's adapter, as 04 names it
SMOKE_ADAPTER = Path("smoke") / "adapter"
MIX_DIR = "mix"  # <run_dir>/mix: the base-mix comparison's own run folder


def compares_base_mix(s) -> bool:
    """Whether a run with settings ``s`` trains the base-mix comparison: ``compare_base_mix`` is set, differs
    from ``base_mix``, and the dataset is one of the embedded tasks (whose base-task rows are what is mixed)."""
    return s.compare_base_mix > 0 and s.compare_base_mix != s.base_mix and str(s.dataset).startswith("tiny:") \
        and base_mix_source(s.model) is not None


def mix_adapter_name(share: float) -> str:
    """The comparison adapter's name in the record and in 04's figures, e.g. "adapter + 25% base mix"."""
    return f"{MAIN_ADAPTER} + {share:.0%} base mix"


def train_adapters(settings=None, *, progress: bool = True, **kwargs):
    """Train every adapter of the run: the smoke run, then the base-mix comparison when
    :func:`compares_base_mix` (only after the smoke run completed). Returns the smoke run's
    :class:`~lora_kit.run.smoke.SmokeResult`, whose record (and ``smoke.json``) now holds ``"adapters"``
    (``{name: folder relative to run_dir}``, only adapters whose run completed) and, when the comparison
    ran, ``"base_mix_comparison"`` (``{"base_mix", "run_dir", "status"}``).

    ``kwargs``: :func:`~lora_kit.run.smoke.smoke_run` arguments and Settings overrides, for the smoke run.
    The comparison runs with the same settings but ``base_mix=compare_base_mix`` and its own run folder,
    without ``simulate`` (the smoke run already compared the memory models).
    """
    from lora_kit.run.distributed import rank
    from lora_kit.run.smoke import _settings, smoke_run
    smoke_args = {k: kwargs.pop(k) for k in list(kwargs) if k in inspect.signature(smoke_run).parameters}
    s = _settings(settings, kwargs)
    result = smoke_run(s, progress=progress, **smoke_args)
    rec = result.record
    adapters = {MAIN_ADAPTER: SMOKE_ADAPTER.as_posix()} if result.ok and rec.get("checkpoint") else {}
    if result.ok and compares_base_mix(s):
        mix_dir = Path(s.run_dir) / MIX_DIR
        mixed = smoke_run(s.replace(base_mix=s.compare_base_mix, run_dir=str(mix_dir)), simulate=False,
                          progress=progress, cpu_threads=smoke_args.get("cpu_threads"))
        rec["base_mix_comparison"] = {"base_mix": s.compare_base_mix, "run_dir": MIX_DIR, "status": mixed.status}
        if mixed.ok and mixed.record.get("checkpoint"):
            adapters[mix_adapter_name(s.compare_base_mix)] = (Path(MIX_DIR) / SMOKE_ADAPTER).as_posix()
    rec["adapters"] = adapters
    if rank() == 0:
        write_json_atomic(result.run_dir / "smoke.json", touch(rec))
    return result


def trained_adapters(run_dir) -> dict[str, str]:
    """``{name: folder}`` of the adapters the run in ``run_dir`` trained (absolute folders): the list its
    smoke run recorded (:func:`train_adapters`), else ``<run_dir>/smoke/adapter`` when a smoke run saved
    one (e.g. ``python -m lora_kit.run.smoke``), else ``{}``."""
    run_dir = Path(run_dir)
    listed = (read_record(run_dir / "smoke" / "smoke.json") or {}).get("adapters")
    if isinstance(listed, dict):
        return {str(k): str(run_dir / v) for k, v in listed.items()}
    if (run_dir / SMOKE_ADAPTER / "adapter_config.json").is_file():
        return {MAIN_ADAPTER: str(run_dir / SMOKE_ADAPTER)}
    return {}

