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


def test_cli_run_refuses_pickled_weights_before_running(tmp_path, capsys):
    """A model folder holding only ``pytorch_model.bin`` is refused before notebook 00 starts (the smoke run would
    refuse it minutes later), naming the files and the fix; nothing is unpickled."""
    from transformers import LlamaConfig
    d = tmp_path / "bin-only"
    d.mkdir()
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=300).save_pretrained(d)
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    runs = tmp_path / "runs"
    assert main(["run", "-p", "model", str(d), "--runs-dir", str(runs), "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert "holds no *.safetensors weights" in err and "pytorch_model.bin" in err and "convert" in err
    assert not runs.exists()  # nothing ran


@pytest.fixture()
def own_code_model(tmp_path, monkeypatch):
    """A model folder whose config.json names its own code (auto_map); the code leaves a mark when it runs."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    from transformers import LlamaConfig
    d = tmp_path / "own-code"
    d.mkdir()
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=300).to_dict()
    cfg.update(model_type="mykit_llama", architectures=["MyForCausalLM"],
               auto_map={"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyForCausalLM"})
    import json
    (d / "config.json").write_text(json.dumps(cfg))
    mark = tmp_path / "code-ran"
    (d / "configuration_my.py").write_text(
        f"import pathlib\npathlib.Path({str(mark)!r}).write_text('ran')\nfrom transformers import LlamaConfig\n"
        "class MyConfig(LlamaConfig):\n    model_type = 'mykit_llama'\n")
    (d / "modeling_my.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_my import MyConfig\n"
        "class MyForCausalLM(LlamaForCausalLM):\n    config_class = MyConfig\n")
    return d, mark


def test_a_model_of_its_own_code_needs_trust_and_then_plans(own_code_model, capsys):
    """Without trust_remote_code: one short message naming the setting (not transformers' list of every model type)
    and its code never runs; with it, the planner builds the model from its folder and estimate is simulate's."""
    from lora_kit.memory import specs
    d, mark = own_code_model
    with pytest.raises(ValueError, match="its own code .*auto_map.*trust_remote_code=True") as e:
        lk.estimate(str(d), method="lora", seq_len=64)
    assert len(str(e.value)) < 400 and not mark.exists()
    assert main(["estimate", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert "trust_remote_code" in err and len(err) < 500 and not mark.exists()
    try:
        assert main(["estimate", "--model", str(d), "--trust-remote-code", "true", "--seq-len", "64"]) == 0
        assert mark.exists()  # the trusted code ran
        spec = specs.model_spec(str(d))
        assert spec.model_type == "mykit_llama" and "q_proj" in [lin.name for lin in spec.linears]
        e = lk.estimate(str(d), method="lora", seq_len=64)
        assert e.peak_allocated_bytes == pytest.approx(lk.simulate(str(d), method="lora", seq_len=64).peak_allocated_bytes,
                                                       rel=0.01)  # the fitted closed form of simulate
    finally:
        specs._TRUSTED_CODE.clear()
        specs._cached_spec.cache_clear()


def test_a_mistyped_flag_gets_one_line_with_the_closest_flag(tmp_path, capsys):
    """argparse prints the command's whole usage and names the flag only; the kit prints one line with the closest
    flag the command has (as ``-p`` keys get "did you mean"), and nothing runs."""
    runs = tmp_path / "runs"
    assert main(["run", "--lora-rnak", "8", "--runs-dir", str(runs), "--name", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean --lora-rank for --lora-rnak?" in err and "usage:" not in err
    assert not runs.exists()
    assert main(["estimate", "--model", "tiny", "--sq-len=64"]) == 2
    assert "did you mean --seq-len" in capsys.readouterr().err
