"""The run card says which prompt format the smoke run resolved and why, shows the first trained row exactly as
the tokenizer received it, and reports every metric the evaluation measured, each with its interval -- on run
folders made by the real smoke run and evaluation (the embedded model on chat messages, a few steps)."""
from __future__ import annotations

import json
import shutil

import pytest

import lora_kit as lk
from lora_kit.data import load_examples
from lora_kit.evaluation import compare as C
from lora_kit.loading import EMBEDDED_DIR, load_tokenizer
from lora_kit.prompting import PromptFormat, format_label
from lora_kit.ui.run_card import build_report

from test_your_model_your_data import _jsonl, _messages_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(model, data, run_dir, evaluate: bool = True):
    s = lk.Settings(model=str(model), dataset=str(data), heldout_fraction=0.25, max_steps=2, batch_size=4, seq_len=64,
                    eval_examples=4, control_examples=6, max_new_tokens=4, run_dir=str(run_dir))
    assert lk.smoke_run(s, progress=False, simulate=False, cpu_threads=1).ok
    if evaluate:
        lk.evaluate(s, progress=False)
    build_report(run_dir)
    return (json.loads((run_dir / "smoke" / "smoke.json").read_text()), (run_dir / "report.md").read_text(),
            load_examples(run_dir / "data" / "trained.jsonl"))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_card")  # the embedded model has a chat template; messages data
    smoke, md, trained = _run("tiny", _jsonl(root / "chat.jsonl", _messages_rows()), root / "run")
    return {"run": root / "run", "smoke": smoke, "md": md, "trained": trained}


def test_card_names_the_chat_template_and_shows_the_row_as_rendered(chat_run):
    data, md, first = chat_run["smoke"]["data"], chat_run["md"], chat_run["trained"][0]
    fmt = PromptFormat(load_tokenizer("tiny"), "chat")
    ex = data["rendered_example"]
    assert data["prompt_format"] == "chat" and data["prompt_format_reason"] == (
        "prompt_format='auto', the data is chat messages and the model has a chat template")
    # the one renderer training uses, on line 1 of data/trained.jsonl: the text, its length, its trained tokens
    assert ex["text"] == fmt.rendered(first) and ex["text"].startswith("<s>Be brief.")  # the template writes BOS
    enc = fmt.encode(first)
    assert ex["tokens"] == enc["length"] and ex["trained_tokens"] == sum(t != -100 for t in enc["labels"])
    assert ex["trained"] == [f"{first['response']}</s>"] and ex["bos"] is None
    smoke = md.split("## Smoke run")[1].split("## Evaluation")[0]
    assert f"- **prompt format**: {format_label('chat')}, because {data['prompt_format_reason']}" in smoke
    assert f"```text\n{ex['text']}\n```" in smoke and f"```text\n{first['response']}</s>\n```" in smoke
    assert "line 1 of `data/trained.jsonl`" in smoke and f"{ex['tokens']:,} tokens" in smoke
    assert "not as rendered" in smoke  # trained.jsonl / per_example.csv hold the rows as read


def test_card_gives_every_metric_with_its_interval(chat_run):
    run, md = chat_run["run"], chat_run["md"]
    ev = json.loads((run / "eval" / "eval.json").read_text())
    section = md.split("## Evaluation: base vs adapter")[1].split("\n## ")[0]
    assert ev["summary_sentence"] in section and ev["control"]["summary_sentence"] in section
    for split, label in (("heldout", "held-out"), ("control", "control")):
        comp = ev["comparisons"]["adapter"][split]
        said = (ev["summary_sentence"] if split == "heldout" else ev["control"]["summary_sentence"]).lower()
        for m, spec in C.METRICS.items():  # each metric in the sentence, and its row with the paired interval
            row = f"| {label} ({comp['n']}) | {spec.label} | "
            assert spec.label.lower() in said and row in section, (m, split)
            assert C.diff_text(m, comp[m]) in section.split(row)[1].split("\n")[0], (m, split)
    # an eval.json written before the sentence named every metric: the card makes it again from the records
    old = dict(ev, summary_sentence="No clear difference in exact match: 0.0 points (95 % CI 0.0 to 0.0) on 4 "
                                    "held-out examples.")
    (run / "eval" / "eval.json").write_text(json.dumps(old))
    build_report(run)
    again = (run / "report.md").read_text()
    assert "No clear difference in exact match: 0.0 points" not in again and ev["summary_sentence"] in again
    (run / "eval" / "eval.json").write_text(json.dumps(ev))


def test_plain_format_says_the_model_has_no_chat_template(tmp_path):
    """Messages data on a model without a chat template (the embedded one without its template): plain, the
    reason said, the row as the plain format renders it (the conversation flattened, then "Answer: "), the BOS
    the tokenizer adds named."""
    model = shutil.copytree(EMBEDDED_DIR, tmp_path / "no_template")
    (model / "chat_template.jinja").unlink()
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    smoke, md, trained = _run(model, _jsonl(tmp_path / "chat.jsonl", _messages_rows()), tmp_path / "run",
                              evaluate=False)
    data, ex = smoke["data"], smoke["data"]["rendered_example"]
    assert data["prompt_format"] == "plain" and data["prompt_format_reason"] == (
        "prompt_format='auto' and the model has no chat template")
    assert ex["text"] == f"{trained[0]['prompt']}\nAnswer: {trained[0]['response']}</s>" and ex["bos"] == "<s>"
    smoke_md = md.split("## Smoke run")[1].split("## ")[0]
    assert f"- **prompt format**: {format_label('plain')}, because prompt_format='auto' and the model has no chat " \
           "template" in smoke_md and "the tokenizer adds `<s>` in front of it" in smoke_md
    assert f"```text\n{ex['text']}\n```" in smoke_md
