"""``lora-kit estimate --params`` takes a run's own params file: the shipped params/*.yaml and the settings.json
``lora-kit run`` writes. It plans the model, step fields, gpu and margin in it, and lists the run's other settings
(data, evaluation, output) as ignored, in one line; a name that is no setting at all is still refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lora_kit.settings import STEP_FIELDS, Settings
from lora_kit.ui.cli import ESTIMATE_FIELDS, main

PARAMS = sorted((Path(__file__).parents[1] / "params").glob("*.yaml"))


@pytest.mark.parametrize("path", PARAMS, ids=lambda p: p.name)
def test_shipped_params_files_are_estimated_with_what_they_do_not_use_listed(path, capsys):
    given = yaml.safe_load(path.read_text())
    assert main(["estimate", "--params", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ignored_params"] == [k for k in given if k not in ESTIMATE_FIELDS]
    assert {k: out["settings"][k] for k in given if k in STEP_FIELDS} == {k: v for k, v in given.items()
                                                                         if k in STEP_FIELDS}
    assert out["settings"]["model"] == given["model"] and out["peak_allocated_bytes"] > 0
    # the verdict's device total is PyTorch's default allocator setting; expandable segments' is shown beside it
    assert out["allocator"] == "default"
    assert out["peak_allocated_bytes"] < out["device_total_expandable_bytes"] <= out["device_total_bytes"]
    assert main(["estimate", "--params", str(path)]) == 0
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("ignored from")]
    assert len(lines) == 1 and all(k in lines[0] for k in out["ignored_params"])
    assert "torch's reserve, default allocator" in text and "with expandable segments" in text


def _settings_json_estimate(path, capsys):
    written = json.loads(Path(path).read_text())
    assert main(["estimate", "--params", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["assumed"] == [] or set(out["assumed"]) <= {"gpu", "margin"}  # every step field is in the file
    step = {k: out["settings"][k] for k in STEP_FIELDS}
    assert step == {k: written[k] for k in STEP_FIELDS}  # the run's step, as it ran (embedded defaults included)
    assert {"dataset", "run_dir", "max_steps", "gpus", "interactive"} <= set(out["ignored_params"])
    assert not set(out["ignored_params"]) & set(ESTIMATE_FIELDS)
    return out


def test_a_settings_json_of_the_run_form_is_estimated(tmp_path, capsys):
    """The file lora-kit run writes: ``Settings.to_dict()`` written inside the run, so stamped with its identity
    (lora_kit.ui.pipeline, lora_kit.results.write_json_atomic)."""
    from lora_kit.results import entered_run, run_identity, write_json_atomic
    path = tmp_path / "settings.json"
    with entered_run(run_identity("lora-kit run", tmp_path)):
        write_json_atomic(path, Settings(run_dir=str(tmp_path), interactive=False).to_dict())
    assert "run" in json.loads(path.read_text())
    _settings_json_estimate(path, capsys)


@pytest.mark.slow
def test_the_settings_json_lora_kit_run_wrote_is_estimated(main_job, capsys):
    _settings_json_estimate(main_job["run"] / "settings.json", capsys)


def test_a_name_that_is_no_setting_is_still_refused(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text("model: llama-3.1-8b\nsequence_len: 512\ndataset: my.jsonl\n")
    assert main(["estimate", "--params", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'sequence_len'" in err and "did you mean" in err


def test_a_params_file_naming_a_training_config_plans_from_it(tmp_path, capsys):
    """A run's params file with ``from_config`` is planned from that config: its model and step replace the
    file's, as in notebooks 01/02."""
    config = Path(__file__).parent / "configs" / "trl_qlora_llama-3.1-8b.yaml"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "seq_len": 64, "from_config": str(config), "dataset": "my.jsonl",
                                    "gpu": "L4"}))
    assert main(["estimate", "--params", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["from_config"]["format"] == "trl" and out["settings"]["method"] == "qlora" and out["gpu"] == "L4"
    assert out["model"] == "llama-3.1-8b"  # the config's model, as notebooks 01/02 plan it (not the run's "tiny")
    assert sorted(out["ignored_params"]) == ["dataset", "model", "seq_len"]
    assert out["settings"]["seq_len"] == yaml.safe_load(config.read_text())["max_length"]
