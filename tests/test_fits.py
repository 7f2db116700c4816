"""Where fits live (lora_kit.memory.fits): `lora-kit fit` makes one, `estimate` finds it by key, says which libraries it
was made with when they differ from the installed ones, fits a miss on the spot, and with `LORA_KIT_FIT=never` names the
command that fits instead."""
from __future__ import annotations

import gzip
import json

import pytest

from lora_kit.memory import fits
from lora_kit.memory.estimate import estimate
from lora_kit.memory.simulate import simulate
from lora_kit.ui.cli import main

SMALL_GLM4 = dict(model_type="glm4", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
                  pad_token_id=0, bos_token_id=0, eos_token_id=0)


@pytest.fixture
def my_model(tmp_path):
    """A model folder of a family the catalog does not model (only its config: estimate needs no weights)."""
    d = tmp_path / "my-glm4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMALL_GLM4))
    return d


def test_lora_kit_fit_stores_the_fit_estimate_then_equals_simulate(my_model, tmp_path, monkeypatch, capsys):
    store = tmp_path / "fits"
    monkeypatch.setenv("LORA_KIT_FITS", str(store))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    assert main(["fit", "--model", str(my_model), "--method", "full", "--dtype", "float32", "--quiet"]) == 0
    assert "fitted in" in capsys.readouterr().out
    assert len(list(store.glob("glm4-*.json.gz"))) == 1
    fits._MEMO.clear()  # read back from the file, as a new process would
    kw = dict(method="full", dtype="float32", batch_size=3, seq_len=3072)  # a shape the fit never ran
    est = estimate(str(my_model), **kw)
    assert est.memory_model == "fitted"
    sim = simulate(str(my_model), **kw)
    assert (est.peak_allocated_bytes, est.breakdown, est.phase) == (sim.peak_allocated_bytes, sim.breakdown, sim.phase)
    # off the design's 512-token grid a few small storages round differently (under 512 bytes each)
    est, sim = estimate(str(my_model), **{**kw, "seq_len": 3000}), simulate(str(my_model), **{**kw, "seq_len": 3000})
    assert abs(est.peak_allocated_bytes - sim.peak_allocated_bytes) < 1e-4 * sim.peak_allocated_bytes


def test_a_fit_made_with_other_libraries_is_used_and_says_so(my_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path / "fits"))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    assert main(["fit", "--model", str(my_model), "--method", "full", "--quiet"]) == 0
    [path] = (tmp_path / "fits").glob("*.json.gz")
    data = json.loads(gzip.decompress(path.read_bytes()))
    data["versions"]["transformers"] = "0.0.1"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    fits._MEMO.clear()
    e = estimate(str(my_model), method="full")
    assert e.memory_model.startswith("fitted (fitted with transformers 0.0.1 (installed ")
    assert "lora-kit fit" in e.memory_model


def test_without_a_fit_and_fitting_off_estimate_names_the_command_that_fits(my_model, tmp_path, monkeypatch):
    """No hand-written fallback: with ``LORA_KIT_FIT=never`` a miss is a clear error naming the command, and the
    command it names makes the fit that then answers."""
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path / "fits"))
    monkeypatch.setenv("LORA_KIT_FIT", "never")
    with pytest.raises(fits.MissingFit, match="LORA_KIT_FIT=never") as err:
        estimate(str(my_model), method="full", dtype="float32")
    command = str(err.value).split("`")[1].split()
    assert command[:3] == ["lora-kit", "fit", "--model"] and command[4:8] == ["--method", "full", "--dtype", "float32"]
    assert main(["fit", "--model", str(my_model), *command[4:], "--quiet"]) == 0
    fits._MEMO.clear()
    assert estimate(str(my_model), method="full", dtype="float32").memory_model == "fitted"
    monkeypatch.setenv("LORA_KIT_FIT", "sometimes")
    with pytest.raises(ValueError, match="LORA_KIT_FIT='sometimes': use 'auto'"):
        estimate(str(my_model), method="full", seq_len=1024)


def test_the_key_is_the_architecture_not_the_spelling_nor_the_depth():
    from lora_kit.memory.specs import load_config, model_spec
    from lora_kit.settings import PLANNING
    by_name = fits.key(model_spec("llama-3.1-8b").config, PLANNING)
    assert by_name == fits.key(load_config("llama-3.1-8b").to_dict(), PLANNING)  # catalog entry = its full config
    deeper = {**model_spec("llama-3.1-8b").config, "num_hidden_layers": 3}
    assert fits.digest(fits.key(deeper, PLANNING)) == fits.digest(by_name)  # depth is a variable of the fit
    assert fits.digest(fits.key(model_spec("llama-3.1-8b").config, PLANNING.replace(optimizer="sgd"))) != \
        fits.digest(by_name)


def test_a_step_no_fit_describes_is_simulate_itself_row_by_row(tmp_path, monkeypatch):
    """TRL's token tiles beside a sliding window are two kinds of regime the fit does not combine: estimate then runs
    simulate for each distinct row, says so, and refuses a composed setting simulate cannot run."""
    import numpy as np

    from lora_kit.memory.estimate import estimate_arrays
    monkeypatch.setenv("LORA_KIT_FITS", str(tmp_path / "fits"))
    d = tmp_path / "my-mistral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**SMALL_GLM4, "model_type": "mistral", "num_hidden_layers": 2,
                                               "sliding_window": 256}))
    kw = dict(method="lora", loop="sft", dtype="float32", gradient_checkpointing=False)
    arr = estimate_arrays(str(d), **kw, seq_len=np.array([128, 384, 128]), batch_size=2)
    sims = [simulate(str(d), **kw, seq_len=s, batch_size=2) for s in (128, 384)]
    assert arr["peak_allocated_bytes"].tolist() == [sims[0].peak_allocated_bytes, sims[1].peak_allocated_bytes,
                                                    sims[0].peak_allocated_bytes]
    assert arr["phase"].tolist()[:2] == [s.phase for s in sims]
    assert arr["memory_model"][0].startswith("simulated (no closed form: loop 'sft' is not fitted")
    assert not list((tmp_path / "fits").glob("*.json.gz"))  # nothing stored: there was nothing to fit
    with pytest.raises(ValueError, match="simulate cannot run: plan it on one GPU"):
        estimate(str(d), **kw, sharding="zero2", num_gpus=2)
