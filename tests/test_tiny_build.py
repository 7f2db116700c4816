"""The embedded model: it loads offline, matches its build_info, and its build script still runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_kit.embedded.tasks import DATA_DIR, TINY_DIR, sha256_file
from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


def _build_module():
    return load_script("scripts/build_tiny_model.py", "build_tiny_model")


# shipped beside the built data but written by hand, not by the build script (lora_kit.data: "generic:control")
HAND_WRITTEN = {"generic_control.jsonl"}


def _check_folder(model_dir: Path, data_dir: Path, info: dict) -> None:
    """Every file build_info lists exists with its size and sha256; no unlisted shipped files."""
    for folder, table in ((model_dir, info["model_files"]), (data_dir, info["data_files"])):
        listed = set(table) | {"build_info.json", "MODEL_CARD.md"} | HAND_WRITTEN
        present = {p.name for p in folder.iterdir() if p.is_file()}
        assert present <= listed, f"unlisted files in {folder}: {present - listed}"
        for name, meta in table.items():
            p = folder / name
            assert p.stat().st_size == meta["bytes"], name
            assert sha256_file(p) == meta["sha256"], f"{name} changed since the build"
    for name, n in info["data_rows"].items():
        assert sum(1 for line in open(data_dir / name) if line.strip()) == n, name


def test_shipped_files_match_build_info_and_script_defaults():
    info = json.loads((TINY_DIR / "build_info.json").read_text())
    _check_folder(TINY_DIR, DATA_DIR, info)
    build = _build_module()
    assert info["settings"] == {**build.DEFAULTS, "tiny_test": False}, "shipped model was not built with the defaults"
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    s = info["settings"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["max_position_embeddings"]) == (
        s["hidden"], s["ffn"], s["layers"], s["heads"], s["kv_heads"], s["max_positions"])
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] % 64 == 0
    total = sum(f["bytes"] for f in info["model_files"].values()) + sum(f["bytes"] for f in info["data_files"].values())
    assert total < 10e6, f"embedded default grew to {total / 1e6:.1f} MB"
    card = (TINY_DIR / "MODEL_CARD.md").read_text()
    measured = info["measured"]
    for number in [f"{info['pretraining']['parameters']:,}", f"{measured['control_exact_match']:.3f}",
                   f"{measured['dates_test_exact_match']:.3f}", f"{total / 1e6:.2f} MB"] + [
            f"| {task} |" for task in measured["control_per_task"]]:
        assert number in card, f"MODEL_CARD.md does not state the measured {number!r}; update it from build_info.json"


def test_embedded_model_and_tokenizer_load_offline(monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lora_kit
    from lora_kit.loading import load_model, load_tokenizer, resolve_model
    from lora_kit.prompting import encode_example

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_model(lora_kit.DEFAULT_MODEL)
    assert Path(path) == TINY_DIR
    raw = AutoModelForCausalLM.from_pretrained(path)
    raw_tok = AutoTokenizer.from_pretrained(path)
    assert type(raw).__name__ == "LlamaForCausalLM"
    n_params = sum(p.numel() for p in raw.parameters())
    info = json.loads((TINY_DIR / "build_info.json").read_text())
    assert n_params == info["pretraining"]["parameters"]
    widths = {d for m in raw.modules() if isinstance(m, torch.nn.Linear) for d in m.weight.shape}
    assert all(w % 64 == 0 for w in widths), widths
    assert raw.config.max_position_embeddings >= 256 and len(raw_tok) == raw.config.vocab_size

    tok = load_tokenizer("tiny")
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.padding_side) == ("<s>", "</s>", "<pad>", "left")
    ids = tok("Date to ISO: 3 March 2021")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "Date to ISO: 3 March 2021"
    assert tok.unk_token_id not in tok("All printable ASCII: ~`{}|\\^_@!")["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "Reverse: abc"}], tokenize=False)
    ex = encode_example(tok, "Reverse: abc", "cba")
    assert tok(chat, add_special_tokens=False)["input_ids"] == ex["input_ids"][:ex["labels"].count(-100)]

    m = load_model("tiny", method="lora")
    batch = torch.tensor([ex["input_ids"]])
    with torch.no_grad():
        assert torch.equal(m(batch).logits, raw(batch).logits)


def test_build_script_end_to_end_reduced_size_is_deterministic(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build = _build_module()
    threads = torch.get_num_threads()
    try:
        infos = [build.main(["--tiny-test", "--out", str(tmp_path / name)]) for name in ("a", "b")]
    finally:
        torch.set_num_threads(threads)
    a, b = infos
    assert a["model_files"] == b["model_files"] and a["data_files"] == b["data_files"], "same seed, different build"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(a["model_files"])
    _check_folder(tmp_path / "a" / "tiny", tmp_path / "a" / "data", json.loads(
        (tmp_path / "a" / "tiny" / "build_info.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "tiny")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a" / "tiny")
    assert model.config.hidden_size == build.TINY_TEST["hidden"] and len(tok) % 64 == 0
    assert 0 <= a["measured"]["control_exact_match"] <= 1


def test_build_script_rejects_widths_not_multiple_of_64():
    build = _build_module()
    with pytest.raises(ValueError, match="multiple of 64"):
        build.parse_args(["--tiny-test", "--hidden", "100"])
