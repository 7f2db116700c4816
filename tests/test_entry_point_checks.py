"""Entry points check before they work (issue 38, items 5 and 7): a run folder that cannot be written is refused
before the model is loaded, with advice that fits; ``evaluate`` on a run whose smoke run died without an adapter
refuses instead of quietly evaluating the base model alone."""
from __future__ import annotations

import json

import pytest

import lora_kit as lk
import lora_kit.evaluation.evaluate as ev
from lora_kit.results import check_output_dir


@pytest.fixture()
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the run folder was checked")
    monkeypatch.setattr(ev, "load_model", refuse)
    monkeypatch.setattr(ev, "load_tokenizer", refuse)


def test_evaluate_refuses_a_file_as_run_dir_before_loading(tmp_path, no_model):
    f = tmp_path / "a-file"
    f.write_text("x")
    for run_dir in (f, f / "below"):
        with pytest.raises(ValueError, match="is a file, not a folder"):
            lk.evaluate("tiny", run_dir=run_dir, adapters={})


def test_smoke_run_refuses_a_file_as_run_dir(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        lk.smoke_run(run_dir=str(f / "run"))


def test_unwritable_folder_is_found_by_trying(tmp_path, monkeypatch):
    """Permission bits say nothing for root or a read-only mount: the check creates a file."""
    import lora_kit.results as res

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(res.tempfile, "mkstemp", read_only)
    with pytest.raises(ValueError, match="not writable .*Read-only file system"):
        check_output_dir(tmp_path / "run")


def test_evaluate_refuses_a_dead_smoke_run_without_adapter(tmp_path, no_model):
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    (smoke / "smoke.json").write_text(json.dumps({"status": "running", "current_phase": "train",
                                                  "process": {"pid": 2 ** 22 + 7, "host": None}}))
    with pytest.raises(ValueError, match="without saving an adapter"):
        lk.evaluate("tiny", run_dir=tmp_path)
