"""Data checked up front: every file the run reads is loaded and formatted once, before any model is loaded;
the first problem names the file, the row and the fix."""
from __future__ import annotations

import json

import pytest

import lora_kit as lk
from lora_kit.data_check import check_data


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    import lora_kit.loading as loading

    def refuse(*a, **k):
        raise AssertionError("a model was loaded during the data check")
    monkeypatch.setattr(loading, "load_model", refuse)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _settings(tmp_path, **kw):
    good = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "response": "a"} for i in range(5)])
    return lk.Settings(**{"dataset": good, "run_dir": str(tmp_path / "run"), **kw})


def test_clean_data_one_line_per_file(tmp_path):
    held = _jsonl(tmp_path / "held.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                               {"from": "gpt", "value": "OK"}]}])
    r = check_data(_settings(tmp_path, heldout_dataset=held))
    assert [f["role"] for f in r["files"]] == ["dataset", "heldout_dataset", "control_dataset"]
    assert r["files"][1]["format"] == "sharegpt" and r["prompt_format"] == "plain"
    assert any("train.jsonl" in line and "5 rows" in line for line in r["lines"])


@pytest.mark.parametrize("which", ["dataset", "heldout_dataset", "control_dataset"])
def test_broken_row_wrong_column_unreadable_file_named(which, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", \n', encoding="utf-8")
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"question": "a", "answer": "b"}])
    latin = tmp_path / "latin.csv"
    latin.write_bytes("prompt,response\ncaf\xe9,b\n".encode("latin-1"))
    for path, msg in ((str(broken), r"broken.jsonl: line 2 is not valid JSON.*fix or remove that line"),
                      (wrong, r"wrong.jsonl' has no field 'prompt'.*fields that exist: \['answer', 'question'\]"),
                      (str(latin), r"latin.csv: line 2 is not UTF-8.*save the file as UTF-8")):
        with pytest.raises(ValueError, match=f"{which} .*{msg}"):
            check_data(_settings(tmp_path, **{which: path}))


def test_chat_template_refusal_named_by_row(tmp_path):
    from test_chat_tokens import MIXTRAL, _shipped, _tokenizer
    tok = _tokenizer("sentencepiece", _shipped(MIXTRAL), "<s>", "</s>")
    u, a = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant", "content": t})
    rows = [{"messages": [u("hi"), a("OK")]}, {"messages": [u("hi"), u("again"), a("OK")]}]
    s = _settings(tmp_path, dataset=_jsonl(tmp_path / "chat.jsonl", rows), heldout_fraction=0.5)
    with pytest.raises(ValueError, match=r"dataset \(.*chat.jsonl\), line 2 of the file: the chat template refuses "
                                         r"this conversation \(roles \['user', 'user', 'assistant'\]\).*alternate"):
        check_data(s, tokenizer=tok)


def test_base_mix_never_injects_embedded_tasks_into_another_model(tmp_path):
    s = _settings(tmp_path, model=str(tmp_path / "my-model"), base_mix=0.2)
    with pytest.raises(ValueError, match="base_mix=0.2 mixes the embedded tiny model's own tasks"):
        check_data(s, load_tokenizer=False)
    assert [f["role"] for f in check_data(_settings(tmp_path, base_mix=0.2))["files"]][-1] == "base_mix"


def test_long_examples_error_refused_with_the_smoke_runs_message(tmp_path):
    """Notebook 00's data check refuses, under long_examples='error', the training rows 03 would refuse."""
    from lora_kit.data import run_data
    from lora_kit.loading import load_tokenizer
    from lora_kit.run.batches import verified_slice
    tok = load_tokenizer("tiny")
    rows = [{"prompt": f"q{i}", "response": "a"} for i in range(9)] + [{"prompt": "P " * 40, "response": "R"}]
    s = _settings(tmp_path, dataset=_jsonl(tmp_path / "long.jsonl", rows), seq_len=32, heldout_fraction=0.1)
    assert check_data(s, tokenizer=tok)["files"][0]["rows"] == 10  # "truncate": nothing refused
    s = s.replace(long_examples="error")
    with pytest.raises(ValueError) as smoke:
        verified_slice(tok, run_data(s)["train"], seq_len=32, n_examples=4, long_examples="error")
    assert "line 10 of the file" in str(smoke.value)
    with pytest.raises(ValueError) as early:
        check_data(s, tokenizer=tok)
    assert str(early.value) == f"dataset ({s.dataset}): {smoke.value}"


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_no_usable_training_row_is_refused_before_the_smoke_run(tmp_path, policy):
    """Every training row loses its whole answer at seq_len (or is dropped): notebook 00's data check refuses it with
    the smoke run's reason, instead of 03 finding it after 00-02 ran. One row that still trains is enough."""
    from lora_kit.loading import load_tokenizer
    from lora_kit.run.batches import verified_slice
    tok = load_tokenizer("tiny")
    rows = [{"prompt": "P " * 40 + str(i), "response": "R"} for i in range(6)]
    s = _settings(tmp_path, dataset=_jsonl(tmp_path / "long.jsonl", rows), seq_len=32, long_examples=policy)
    with pytest.raises(ValueError, match="no usable example") as smoke:
        verified_slice(tok, rows, seq_len=32, n_examples=4, long_examples=policy)
    with pytest.raises(ValueError) as early:
        check_data(s, tokenizer=tok)
    msg = str(early.value)
    assert msg.startswith(f"dataset ({s.dataset}): no usable example: all 6 ") and "raise seq_len" in msg, msg
    assert ("long_examples='drop'" in msg) == ("long_examples='drop'" in str(smoke.value)), (msg, smoke.value)
    rows.append({"prompt": "q", "response": "a"})
    s = s.replace(dataset=_jsonl(tmp_path / "long.jsonl", rows))
    assert check_data(s, tokenizer=tok)["files"][0]["rows"] == 7
