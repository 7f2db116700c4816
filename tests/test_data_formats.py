"""Every data format people bring loads, becomes the same examples, and trains (one real step of the
embedded model on the encoded batch); held-out files are detected on their own."""
from __future__ import annotations

import csv
import json

import pytest

from lora_kit.data import load_examples, run_data
from lora_kit.settings import Settings

U, A = "What is two plus two?", "Four."
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": U}, {"role": "assistant", "content": A}]


def _jsonl(path, rows, bom=False):
    path.write_text(("\ufeff" if bom else "") + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _files(tmp_path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = {
        "prompt_response": _jsonl(tmp_path / "pr.jsonl", [{"prompt": U, "response": A}] * 3),
        "alpaca": _jsonl(tmp_path / "al.jsonl", [{"instruction": U, "input": "", "output": A}] * 3),
        "messages": _jsonl(tmp_path / "ms.jsonl", [{"messages": MSGS}] * 3),
        "sharegpt": _jsonl(tmp_path / "sg.jsonl", [{"conversations": [
            {"from": "system", "value": "Be brief."}, {"from": "human", "value": U}, {"from": "gpt", "value": A}]}] * 3),
        "trl_prompt_completion": _jsonl(tmp_path / "pc.jsonl", [{"prompt": U, "completion": A}] * 3),
        "trl_conversational_prompt_completion": _jsonl(tmp_path / "cpc.jsonl", [
            {"prompt": MSGS[:2], "completion": MSGS[2:]}] * 3),
        "trl_text": _jsonl(tmp_path / "tx.jsonl", [{"text": f"{U} {A}"}] * 3),
        "jsonl_with_bom": _jsonl(tmp_path / "bom.jsonl", [{"prompt": U, "response": A}] * 3, bom=True),
    }
    (tmp_path / "arr.json").write_text(json.dumps([{"prompt": U, "response": A}] * 3, indent=2), encoding="utf-8")
    out["json_array"] = tmp_path / "arr.json"
    with open(tmp_path / "bom.csv", "w", encoding="utf-8-sig", newline="") as f:  # Excel's "CSV UTF-8"
        w = csv.DictWriter(f, ["prompt", "response"])
        w.writeheader()
        w.writerows([{"prompt": U, "response": A}] * 3)
    out["csv_with_bom"] = tmp_path / "bom.csv"
    pq.write_table(pa.Table.from_pylist([{"messages": MSGS}] * 3), tmp_path / "ms.parquet")
    out["parquet_messages"] = tmp_path / "ms.parquet"
    return out


KINDS = ["prompt_response", "alpaca", "messages", "sharegpt", "trl_prompt_completion",
         "trl_conversational_prompt_completion", "trl_text", "jsonl_with_bom", "json_array", "csv_with_bom",
         "parquet_messages", "datasetdict_split"]


@pytest.fixture(scope="module")
def tiny():
    import torch
    from peft import LoraConfig, get_peft_model
    from lora_kit.loading import load_tokenizer, load_model
    tok = load_tokenizer("tiny")
    torch.manual_seed(0)
    model = get_peft_model(load_model("tiny", dtype="float32"), LoraConfig(r=4, target_modules="all-linear"))
    return tok, model


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_loads_and_trains(kind, tmp_path, tiny):
    import torch
    from lora_kit.prompting import PromptFormat
    from lora_kit.run.batches import collate, verified_slice
    if kind == "datasetdict_split":
        datasets = pytest.importorskip("datasets")
        d = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "no", "response": "no"}]),
                                  "sft": datasets.Dataset.from_list([{"prompt": U, "response": A}] * 3)})
        d.save_to_disk(str(tmp_path / "dd"))
        s = Settings(dataset=str(tmp_path / "dd"), heldout_dataset=str(_files(tmp_path)["messages"]),
                     prompt_field="prompt", response_field="response", data_format="auto",
                     messages_field="messages", heldout_fraction=0.1, seed=0)
        rows = run_data(s, dataset_split="sft")["train"]
    else:
        rows = load_examples(_files(tmp_path)[kind])
    assert len(rows) == 3
    e = rows[0]
    if kind == "trl_text":
        assert e["text"] == f"{U} {A}"
    else:
        assert (e["context"][-1]["content"] if "context" in e else e["prompt"], e["response"]) == (U, A), e
        assert ("context" in e) == (kind in ("messages", "sharegpt", "trl_conversational_prompt_completion",
                                             "parquet_messages"))
        if "context" in e:
            assert e["context"][0] == {"role": "system", "content": "Be brief."}
    tok, model = tiny
    order, rep = verified_slice(tok, rows, seq_len=64, n_examples=2, fmt=PromptFormat(tok, "plain"))
    assert rep["trained_tokens"] > 0
    batch = collate(order, 64, tok.pad_token_id)
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0
                                        for p in model.parameters() if p.requires_grad)


def test_trl_conversational_rows_are_messages_not_python_text(tmp_path):
    rows = load_examples(_files(tmp_path)["trl_conversational_prompt_completion"])
    assert "[{" not in rows[0]["prompt"] + rows[0]["response"]


def test_broken_files_name_the_file_row_and_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "a", "response": "b"}, 3]')
    with pytest.raises(ValueError, match=r"bad.json: item 2 of the array is not a JSON object"):
        load_examples(bad)
    sg = _jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": U}, {"from": "robot", "value": A}]}])
    with pytest.raises(ValueError, match=r"sg.jsonl', line 1 of the file: ShareGPT role 'robot' is not known"):
        load_examples(sg)
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": MSGS[:2], "completion": A}])
    with pytest.raises(ValueError, match=r"line 1 of the file: 'prompt' and 'completion' must both be text"):
        load_examples(pc)


def test_heldout_file_in_another_format_is_detected_on_its_own(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"q": f"{U} {i}", "a": A} for i in range(4)])
    held = _files(tmp_path)["sharegpt"]
    s = Settings(dataset=str(train), heldout_dataset=str(held), prompt_field="q", response_field="a",
                 data_format="prompt_response", messages_field="messages", heldout_fraction=0.1, seed=0)
    d = run_data(s)
    assert len(d["train"]) == 4 and d["heldout"][0]["response"] == A and "context" in d["heldout"][0]
