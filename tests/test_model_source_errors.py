"""A model the kit cannot read says which file and why, in every entry point (issue 38, items 3 and 12): a malformed
``config.json`` is named with the parse error (never a bare JSONDecodeError); a path-like name that does not exist
says so (never the hub's "Repo id must be in the form ...")."""
from __future__ import annotations

import pytest

import lora_kit as lk
from lora_kit.loading import resolve_model
from lora_kit.ui.cli import main


@pytest.fixture()
def bad_model(tmp_path):
    d = tmp_path / "broken-model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", hidden_size: 64}')
    return d


MISSING = ["./no/such/model", "/no/such/model", "models/llama/7b", "~/no-such-model-folder"]


def test_api_names_the_malformed_file(bad_model):
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON .*line 1 column"):
        lk.estimate(str(bad_model))
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON"):
        resolve_model(str(bad_model))  # what smoke_run, evaluate and the tokenizer load through


def test_cli_estimate_names_the_malformed_file(bad_model, capsys):
    assert main(["estimate", "--model", str(bad_model)]) == 2
    err = capsys.readouterr().err
    assert str(bad_model / "config.json") in err and "line 1 column" in err


def test_cli_run_refuses_before_running(bad_model, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["run", "-p", "model", str(bad_model), "--runs-dir", str(runs), "--name", "x"]) == 2
    assert str(bad_model / "config.json") in capsys.readouterr().err
    assert not runs.exists()  # nothing ran


@pytest.mark.parametrize("name", MISSING)
def test_missing_path_says_so_everywhere(name, tmp_path, capsys):
    with pytest.raises(ValueError, match="does not exist"):
        lk.estimate(name)
    assert main(["estimate", "--model", name]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "-p", "model", name, "--runs-dir", str(tmp_path / "runs"), "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Repo id" not in err
    assert not (tmp_path / "runs").exists()
