"""Bad input gives a clear error (or documented handling) before any time is spent training."""
from __future__ import annotations

import json
import shutil

import pytest

from lora_kit.run import adapter_io
from lora_kit.run.smoke import smoke_run
from lora_kit.run.batches import collate, verified_slice

ROWS = [{"prompt": f"Q{i}", "response": f"A{i}"} for i in range(8)]


@pytest.fixture(scope="module")
def tok(random_llama_dir):
    from lora_kit.loading import load_tokenizer
    return load_tokenizer(str(random_llama_dir), padding_side="right")


def test_model_folder_without_weights(random_llama_dir, tmp_path):
    d = tmp_path / "no_weights"
    d.mkdir()
    for f in random_llama_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, d / f.name)
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights.*pytorch_model\.bin.*convert"):
        smoke_run(model=str(d), run_dir=str(tmp_path / "run"), examples=ROWS, progress=False, max_steps=1)
    rec = json.loads((tmp_path / "run" / "smoke" / "smoke.json").read_text())
    assert rec["status"] == "failed at load" and "safetensors" in rec["error"]


def test_seq_len_longer_than_context(random_llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"seq_len=512 is longer than the model's context.*at most 256"):
        smoke_run(model=str(random_llama_dir), run_dir=str(tmp_path), examples=ROWS, seq_len=512,
                  progress=False, max_steps=1)


def test_empty_rows_are_an_error_naming_them(tok):
    rows = ROWS + [{"prompt": "Q", "response": "  "}, {"prompt": None, "response": "A"}]
    with pytest.raises(ValueError, match=r"2 row\(s\) have an empty 'prompt' or 'response' \(rows 9, 10, 1-based\)"):
        verified_slice(tok, rows, seq_len=32, n_examples=4)


def test_missing_column_and_empty_dataset(tok):
    with pytest.raises(ValueError, match="no 'response' column.*response_field"):
        verified_slice(tok, [{"prompt": "a", "answer": "b"}], seq_len=32, n_examples=1)
    with pytest.raises(ValueError, match="dataset is empty"):
        verified_slice(tok, [], seq_len=32, n_examples=1)


def test_long_examples_truncated_and_reported_longest_lead(tok):
    rows = ROWS + [{"prompt": "P" * 10, "response": "R" * 40}, {"prompt": "P" * 40, "response": "R"}]
    order, rep = verified_slice(tok, rows, seq_len=32, n_examples=20, n_first=1, seed=1)
    assert rep["truncated"] == 1 and rep["skipped_response_cut_away"] == 1  # the second loses its response
    assert rep["skipped_response_cut_away_rows"] == [9]
    assert order[0]["row"] == 8 and order[0]["truncated"] and len(order[0]["input_ids"]) == 32
    assert rep["longest_lengths"][0] == order[0]["full_length"] > 32
    assert len(order) == 20  # small dataset: repeated to fill the steps
    batch = collate(order[:3], 32, tok.pad_token_id)
    assert batch["input_ids"].shape == (3, 32)
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


def test_whole_response_cut_away_everywhere(tok):
    with pytest.raises(ValueError, match="raise seq_len"):
        verified_slice(tok, [{"prompt": "P" * 40, "response": "R"}], seq_len=16, n_examples=1)


def _adapter(model_dir, out, **cfg):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    m = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **cfg))
    return adapter_io.save_adapter(m, out)


def test_adapter_saved_for_another_base(random_llama_dir, tmp_path):
    from conftest import build_random_llama
    from transformers import AutoModelForCausalLM
    wider = tmp_path / "wider"
    build_random_llama(wider, hidden=128, ffn=256)
    files = _adapter(wider, tmp_path / "adapter")
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]  # peft's README removed
    base = AutoModelForCausalLM.from_pretrained(str(random_llama_dir))
    with pytest.raises(ValueError, match="was saved for base .*wider.*load it into that base model"):
        adapter_io.load_adapter(base, tmp_path / "adapter")


def test_adapter_folder_checks(random_llama_dir, tmp_path):
    _adapter(random_llama_dir, tmp_path / "a")
    assert adapter_io.check_adapter_files(tmp_path / "a")["n_tensors"] == 2 * 2 * 2  # 2 layers x q,v x A,B
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="non-adapter files"):
        adapter_io.check_adapter_files(tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").unlink()
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        adapter_io.check_adapter_files(tmp_path / "a")


def test_bad_cpu_threads_and_measure_steps(tmp_path):
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        smoke_run(run_dir=str(tmp_path), cpu_threads=0)
    with pytest.raises(ValueError, match="measure_steps must be >= 1"):
        smoke_run(run_dir=str(tmp_path), measure_steps=0)
