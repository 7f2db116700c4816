"""Dataset-aware planning: token-length statistics, longest examples, the micro-batch-1 warning, bad input."""
import json

import numpy as np
import pytest

from conftest import build_char_tokenizer
from lora_kit.plan.dataset_fit import dataset_lengths
from lora_kit.prompting import encode_example


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


ROWS = [{"prompt": "a" * n, "response": "b" * (n // 2 + 1)} for n in range(1, 101)]


def test_statistics_match_encode_example(tok):
    st = dataset_lengths(ROWS, tok, seq_len=64)
    want = np.array([encode_example(tok, r["prompt"], r["response"])["length"] for r in ROWS])
    assert (st.lengths == want).all()
    assert st.max == want.max() and st.p50 == np.percentile(want, 50) and st.p99 == np.percentile(want, 99)
    assert st.longest[0]["length"] == want.max() and st.longest[0]["index"] == 99
    assert [x["length"] for x in st.longest] == sorted(want, reverse=True)[:5]
    assert st.n_over_seq_len == int((want > 64).sum()) and st.n_over_seq_len > 0
    assert 0 < st.padding_fraction < 1
    assert any("truncated" in w for w in st.warnings) and "p95" in st.summary()


def test_reads_jsonl_csv_and_custom_fields(tok, tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"q": r["prompt"], "a": r["response"]}) for r in ROWS[:10]))
    st = dataset_lengths(jl, tok, prompt_field="q", response_field="a")
    assert st.n_examples == 10 and st.seq_len is None and st.warnings == []
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,response\nhello,world\nhi,there\n")
    assert dataset_lengths(csv, tok).n_examples == 2


def test_bad_input_says_what_to_change(tok, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        dataset_lengths([], tok)
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        dataset_lengths(empty, tok)
    with pytest.raises(ValueError, match="does not exist"):
        dataset_lengths(tmp_path / "missing.jsonl", tok)
    broken = tmp_path / "b.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        dataset_lengths(broken, tok)
    with pytest.raises(ValueError, match=r"no field 'prompt'.*fields that exist: \['question', 'response'\]. Set prompt_field"):
        dataset_lengths([{"question": "x", "response": "y"}], tok)
    with pytest.raises(ValueError, match="seq_len"):
        dataset_lengths(ROWS, tok, seq_len=0)


def test_longest_example_that_does_not_fit_at_micro_batch_1(tok):
    rows = ROWS[:20] + [{"prompt": "x" * 60_000, "response": "y"}]
    kw = dict(model="llama-3.1-8b", gpu="T4", method="qlora", dtype="bfloat16")
    st = dataset_lengths(rows, tok, **kw)
    assert st.longest_fits is False
    assert any("gradient accumulation cannot help" in w.lower() for w in st.warnings)
    changes = {s["change"].split("=")[0].split(" ")[0]: s for s in st.suggestions}
    assert {"truncate", "pack/chunk"} <= set(changes)  # the planner's ladder, in dataset terms
    fit_len = int(changes["truncate"]["change"].split("=")[1])
    from lora_kit.memory.estimate import estimate
    from lora_kit.plan.planner import fit_verdict
    ok = estimate("llama-3.1-8b", method="qlora", dtype="bfloat16", seq_len=fit_len, batch_size=1)
    over = estimate("llama-3.1-8b", method="qlora", dtype="bfloat16", seq_len=fit_len + 1, batch_size=1)
    assert fit_verdict(ok.device_total_bytes, "T4")["fits"] and not fit_verdict(over.device_total_bytes, "T4")["fits"]
    short = dataset_lengths(ROWS[:20], tok, **kw)
    assert short.longest_fits is True and short.suggestions == []
