"""lora_kit.data: every source gives the same rows; bad input says what to change."""
from __future__ import annotations

import csv
import json

import pytest

from lora_kit.data import load_examples, mix_examples
from lora_kit.evaluation.hygiene import normalize


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_embedded_sources_load_with_task_names():
    train = load_examples("tiny:dates", split="train")
    assert len(train) >= 100 and {r["task"] for r in train} == {"dates"}
    control = load_examples("tiny:control")
    assert 200 <= len(control) <= 400 and len({r["task"] for r in control}) >= 6
    assert len(load_examples("tiny:base_mix", limit=7)) == 7


def test_dates_splits_do_not_overlap_exactly_or_after_normalizing():
    splits = {s: load_examples("tiny:dates", split=s) for s in ("train", "validation", "test")}
    for key in ("prompt", "response"):
        seen = {}
        for split, rows in splits.items():
            for r in rows:
                k = normalize(r[key])
                assert seen.setdefault(k, split) == split, f"{r[key]!r} is in {seen[k]} and {split}"


def test_control_rows_are_correct_answers_of_base_tasks():
    from lora_kit.embedded.tasks import MONTHS
    for r in load_examples("tiny:control"):
        body = r["prompt"].split(": ", 1)[1]
        expected = {"reverse": body[::-1], "uppercase": body.upper(), "hyphenate": "-".join(body),
                    "count": str(len(body)), "sort_digits": "".join(sorted(body)),
                    "next_number": str(int(body) + 1) if body.isdigit() else None,
                    "month_number": f"{MONTHS.index(body) + 1:02d}" if body in MONTHS else None,
                    "month_after": MONTHS[(MONTHS.index(body) + 1) % 12] if body in MONTHS else None}[r["task"]]
        assert r["response"] == expected, r


def test_jsonl_csv_and_custom_fields_agree(tmp_path):
    rows = [{"q": "a?", "a": "1", "extra": 0}, {"q": "b?", "a": "2", "extra": 1}]
    j = _jsonl(tmp_path / "d.jsonl", rows)
    c = tmp_path / "d.csv"
    with open(c, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["q", "a", "extra"])
        w.writeheader()
        w.writerows(rows)
    from_jsonl = load_examples(j, prompt_field="q", response_field="a")
    from_csv = load_examples(str(c), prompt_field="q", response_field="a")
    assert [(r["prompt"], r["response"]) for r in from_jsonl] == [("a?", "1"), ("b?", "2")]
    assert [(r["prompt"], r["response"]) for r in from_csv] == [("a?", "1"), ("b?", "2")]
    assert from_jsonl[0]["task"] == str(j)


@pytest.mark.parametrize("content, match", [
    ("", "is empty"),
    ('{"prompt": "a", "answer": "b"}\n', r"no field 'response'.*fields that exist: \['answer', 'prompt'\]"),
    ('{"prompt": "a", "response": "b"}\n{"prompt": " ", "response": "c"}\n{"prompt": "d", "response": ""}\n',
     r"2 row\(s\) have an empty.*lines 2, 3 of the file"),
    ('{"prompt": "a", "response": "b"}\n\n\n{"prompt": " ", "response": "c"}\n', r"empty.*\(line 4 of the file\)"),
    ('{"prompt": "a", "response": "b"}\nnot json\n', "line 2 is not valid JSON"),
])
def test_bad_jsonl_says_what_to_change(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_examples(p)


def test_csv_problems_name_the_line_a_user_sees(tmp_path):
    """CSV rows are named by the file line they end on (the header is line 1, blank lines count as lines), not by
    their place among the data rows (the trial's "rows 3" was line 6 after two blank lines)."""
    p = tmp_path / "mine.csv"
    p.write_text("prompt,response\na?,1\n\n\nb?,2\n,\nc?,3\n")
    with pytest.raises(ValueError, match=r"1 row\(s\) have an empty.*\(line 6 of the file\)"):
        load_examples(p)
    q = tmp_path / "quoted.csv"
    q.write_text('prompt,response\n"two\nlines",1\n"",2\n')  # a quoted field over two lines
    with pytest.raises(ValueError, match=r"\(line 4 of the file\)"):
        load_examples(q)
    arr = tmp_path / "arr.json"  # a JSON array: its items
    arr.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": " ", "response": "c"}], indent=2))
    with pytest.raises(ValueError, match=r"\(item 2 of the array\)"):
        load_examples(arr)
    from lora_kit.data import row_refs
    assert row_refs([{}, {}, {}], [2, 3]) == "rows 2, 3, 1-based"  # rows of no file: their places


CHAT = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]


@pytest.mark.parametrize("data_format", ["auto", "messages"])
def test_a_field_the_file_lacks_is_named_with_the_closest_one(tmp_path, data_format):
    """A named field absent from the file: one error naming it, the file, the fields it has and the closest one;
    a format is advised only when the rows have its fields."""
    conv = _jsonl(tmp_path / "conv.jsonl", [{"conv": CHAT}] * 3)
    with pytest.raises(ValueError) as e:
        load_examples(conv, messages_field="convo", data_format=data_format)
    msg = str(e.value)
    assert f"'{conv}' has no field 'convo' (messages_field; did you mean 'conv'?)" in msg
    assert "fields that exist: ['conv']. Set messages_field='conv'." in msg and "data_format='prompt" not in msg
    assert load_examples(conv, messages_field="conv", data_format=data_format)[0]["response"] == "Paris."


def test_a_named_field_is_never_replaced_by_the_usual_one(tmp_path):
    ms = _jsonl(tmp_path / "ms.jsonl", [{"messages": CHAT}] * 3)
    for fmt in ("auto", "messages"):
        with pytest.raises(ValueError, match=r"no field 'msgs' \(messages_field; did you mean 'messages'\?\).*"
                                             r"Set messages_field='messages'\."):
            load_examples(ms, messages_field="msgs", data_format=fmt)
    assert len(load_examples(ms)) == 3  # the default name is no choice of the user's
    assert len(load_examples(ms, messages_field="msgs", usual_names=True)) == 3  # held-out / control files


def test_csv_prompt_field_typo_and_format_advice(tmp_path):
    p = tmp_path / "qa.csv"
    p.write_text("question,answer\nWhat is 2+2?,4\nWhat is 3+3?,6\n")
    with pytest.raises(ValueError) as e:
        load_examples(p, prompt_field="questoin", response_field="answer")
    assert str(e.value) == (f"dataset '{p}' has no field 'questoin' (prompt_field; did you mean 'question'?) for "
                            "data_format='prompt_response'; fields that exist: ['answer', 'question']. "
                            "Set prompt_field='question'.")
    assert load_examples(p, prompt_field="question", response_field="answer")[1]["response"] == "6"
    ms = _jsonl(tmp_path / "ms.jsonl", [{"messages": CHAT}])
    with pytest.raises(ValueError, match=r"Set prompt_field/response_field to the file's field names, "
                                         r"or data_format='messages' \(the rows look like that format\)"):
        load_examples(ms, data_format="prompt_response")
    with pytest.raises(ValueError, match=r"or data_format='messages' with messages_field='conv' \(that field holds"):
        load_examples(_jsonl(tmp_path / "conv.jsonl", [{"conv": CHAT}]))
    part = _jsonl(tmp_path / "part.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "c"}])
    with pytest.raises(ValueError, match=r"no field 'response' in 1 of 2 rows \(line 2 of the file\).*add it"):
        load_examples(part)


def test_bad_sources_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="choose one of train, validation, test"):
        load_examples("tiny:dates", split="dev")
    with pytest.raises(ValueError, match="unknown embedded dataset"):
        load_examples("tiny:nope")
    (tmp_path / "x.xlsx").write_text("x")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_examples(tmp_path / "x.xlsx")
    (tmp_path / "x.parquet").write_text("x")
    with pytest.raises(ValueError, match="x.parquet cannot be read as Parquet"):
        load_examples(tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        load_examples("tiny:control", limit=0)


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "p", "response": "r"}]),
                              "test": datasets.Dataset.from_list([{"prompt": "p2", "response": "r2"}])})
    d.save_to_disk(str(tmp_path / "ds"))
    assert load_examples(tmp_path / "ds", split="train")[0]["response"] == "r"
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\]; set dataset_split"):
        load_examples(tmp_path / "ds")
    datasets.DatasetDict({"only": d["test"]}).save_to_disk(str(tmp_path / "one"))
    assert load_examples(tmp_path / "one")[0]["response"] == "r2"  # a single split needs no name


def test_mix_examples_share_and_determinism():
    task = [{"prompt": f"t{i}", "response": "x", "task": "new"} for i in range(30)]
    base = [{"prompt": f"b{i}", "response": "y", "task": "old"} for i in range(100)]
    mixed = mix_examples(task, base, share=0.25, seed=3)
    assert len(mixed) == 40 and sum(r["task"] == "old" for r in mixed) == 10
    assert {r["prompt"] for r in task} <= {r["prompt"] for r in mixed}
    assert mixed == mix_examples(task, base, share=0.25, seed=3)
    assert mixed != mix_examples(task, base, share=0.25, seed=4)
    assert mix_examples(task, base, share=0.0) == task
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\)"):
        mix_examples(task, base, share=1.0)
    with pytest.raises(ValueError, match="base_examples is empty"):
        mix_examples(task, [], share=0.5)
