"""The one settings definition: validation, params files, notebook parameters cells, CLI flags."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from lora_kit.settings import Settings, field_help, field_names, from_dict, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_has_help():
    helps = field_help()
    missing = [n for n in field_names() if not helps.get(n)]
    assert missing == [], f"fields without a trailing '# comment': {missing}"


@pytest.mark.parametrize("path", sorted((ROOT / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_params_files_are_valid_settings(path):
    raw = yaml.safe_load(path.read_text())
    assert set(raw) <= set(field_names()), f"unknown keys {set(raw) - set(field_names())}"
    s = load_settings(path)
    for k, v in raw.items():
        assert getattr(s, k) == v


def _parameters_cell(nb_path):
    nb = json.loads(nb_path.read_text())
    cells = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{nb_path.name}: expected exactly one cell tagged 'parameters'"
    return "".join(cells[0]["source"])


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_parameters_match_settings(nb_path):
    """Each parameters cell holds only literal assignments of Settings fields, one comment each,
    with the same defaults as Settings (papermill injects overrides after it)."""
    src = _parameters_cell(nb_path)
    defaults = Settings().to_dict()
    tree = ast.parse(src)
    names = []
    for node in tree.body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, f"{nb_path.name}: only assignments"
        name = node.targets[0].id
        names.append(name)
        assert name in defaults, f"{nb_path.name}: {name} is not a Settings field"
        value = ast.literal_eval(node.value)  # literal values only: nothing computed
        assert value == defaults[name], f"{nb_path.name}: {name}={value!r} but Settings has {defaults[name]!r}"
    for line in src.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            assert "#" in line, f"{nb_path.name}: parameter line without a comment: {line!r}"
    assert "run_dir" in names and "model" in names


def test_notebooks_are_stripped():
    for nb_path in NOTEBOOKS:
        nb = json.loads(nb_path.read_text())
        for c in nb["cells"]:
            if c["cell_type"] == "code":
                assert c.get("outputs") == [] and c.get("execution_count") is None, nb_path.name
        assert "widgets" not in nb.get("metadata", {}), f"{nb_path.name} keeps widget state"


def test_from_dict_rejects_unknown_and_wrong_types():
    with pytest.raises(ValueError, match=r"'seq_length' \(did you mean 'seq_len'\?\); valid settings are"):
        from_dict({"seq_length": 128})
    with pytest.raises(ValueError, match=r"'zzz' \(no close name\)"):
        from_dict({"zzz": 1})
    with pytest.raises(ValueError, match="seq_len"):
        from_dict({"seq_len": "long"})
    with pytest.raises(ValueError, match="gradient_checkpointing must be true or false"):
        from_dict({"gradient_checkpointing": "maybe"})


@pytest.mark.parametrize("bad,match", [
    ({"method": "prefix"}, "method"),
    ({"seq_len": 0}, "seq_len must be a positive integer"),
    ({"batch_size": -2}, "batch_size"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"sharding": "fsdp"}, "needs num_gpus > 1"),
    ({"margin": 1.5}, "margin"),
    ({"lora_targets": []}, "lora_targets"),
])
def test_validation_messages_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        Settings(**bad)


def test_cli_strings_are_coerced():
    s = from_dict({"seq_len": "128", "gradient_checkpointing": "true", "lora_targets": "q_proj,v_proj",
                   "margin": "0.2", "gpus": "['T4','L4']"})
    assert (s.seq_len, s.gradient_checkpointing, s.lora_targets, s.margin, s.gpus) == \
        (128, True, ["q_proj", "v_proj"], 0.2, ["T4", "L4"])


def test_cli_exposes_every_setting():
    from lora_kit.ui.cli import build_parser
    p = build_parser()
    run = p._subparsers._group_actions[0].choices["run"]
    dests = {a.dest for a in run._actions}
    assert {"s_" + n for n in field_names()} <= dests


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_papermill_reads_every_parameter(nb_path):
    """papermill's own parser (used for --help-notebook and unknown-parameter checks) sees each line."""
    import nbformat
    from papermill.translators import PythonTranslator
    nb = nbformat.read(nb_path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    parsed = PythonTranslator.inspect(cell)
    assigned = [n.targets[0].id for n in ast.parse(cell.source).body]
    assert [p.name for p in parsed] == assigned
    assert all(p.help for p in parsed)
