"""03 trains every adapter and records where they are; 04 evaluates what that record lists (issue 31).

The two trainings themselves run in the main job (tests/test_pipeline.py: 03 trains both, 04's assert
cell compares them); here: the condition, the record's shape and its reading, without training."""
from __future__ import annotations

import json
from types import SimpleNamespace

from lora_kit.run.adapters import compares_base_mix, mix_adapter_name, trained_adapters
from lora_kit.ui.pipeline import OWNED


def _s(**kw):
    return SimpleNamespace(**{"compare_base_mix": 0.25, "base_mix": 0.0, "dataset": "tiny:dates", "model": "tiny", **kw})


def test_comparison_condition_is_the_one_04_had():
    assert compares_base_mix(_s())
    assert not compares_base_mix(_s(compare_base_mix=0.0))  # 0 skips
    assert not compares_base_mix(_s(base_mix=0.25))  # the run is already mixed that way
    assert not compares_base_mix(_s(dataset="/data/mine.jsonl"))  # base-task rows exist for the embedded tasks only
    assert not compares_base_mix(_s(model="/models/mine"))  # and for the embedded model only
    assert mix_adapter_name(0.25) == "adapter + 25% base mix"


def _adapter(folder):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")


def test_trained_adapters_reads_what_03_recorded(tmp_path):
    assert trained_adapters(tmp_path) == {}
    _adapter(tmp_path / "smoke" / "adapter")  # a smoke run without the record's list (python -m lora_kit.run.smoke)
    assert trained_adapters(tmp_path) == {"adapter": str(tmp_path / "smoke" / "adapter")}
    listed = {"adapter": "smoke/adapter", "adapter + 25% base mix": "mix/smoke/adapter"}
    (tmp_path / "smoke" / "smoke.json").write_text(json.dumps({"status": "complete", "adapters": listed}))
    assert trained_adapters(tmp_path) == {k: str(tmp_path / v) for k, v in listed.items()}  # relative to run_dir
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    tmp_path.rename(moved)  # a run folder moved whole still finds its adapters
    assert trained_adapters(moved)["adapter + 25% base mix"] == str(moved / "mix" / "smoke" / "adapter")


def test_the_comparison_folder_belongs_to_03():
    """--resume keeps 03's folders with 03: the base-mix run is 03's now, not 04's."""
    assert "mix" in OWNED["03_smoke_run.ipynb"] and "mix" not in OWNED["04_evaluate.ipynb"]
