"""A user's own model and data through the whole journey (issue 12, item 8).

(a) The embedded model copied to a tmp folder as "my model", training data in a CSV with other
    column names, a separate held-out JSONL and the user's own control file, all named in a params
    file, through ``lora-kit run``: all five notebooks green; the run card shows the held-out result
    with its interval. One run, shared by the tests of this module.
(b) Random-weight small models of three real architectures (Qwen2, Mistral, Gemma-2), saved locally
    with a chat template, trained on ``messages`` data: smoke run and evaluation complete in the chat
    format. Plumbing only: random weights learn nothing worth measuring.
(c) Every shipped params file validates, and its data files, when they are shipped examples, load.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lora_kit.data import load_examples
from lora_kit.loading import EMBEDDED_DIR

from conftest import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------------------------
# (a) my model, my data, through lora-kit run
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def my_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mine")
    shutil.copytree(EMBEDDED_DIR, root / "my_model")
    with open(root / "train.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["question", "answer"])
        w.writeheader()
        w.writerows({"question": r["prompt"], "answer": r["response"]}
                    for r in load_examples("tiny:dates", split="train")[:600])
    _jsonl(root / "heldout.jsonl", ({"question": r["prompt"], "answer": r["response"]}
                                    for r in load_examples("tiny:dates", split="test")[:40]))
    _jsonl(root / "control.jsonl", ({"question": r["prompt"], "answer": r["response"], "task": r["task"]}
                                    for r in load_examples("tiny:control")[::8]))
    params = {"model": str(root / "my_model"), "dataset": str(root / "train.csv"),
              "heldout_dataset": str(root / "heldout.jsonl"), "control_dataset": str(root / "control.jsonl"),
              "prompt_field": "question", "response_field": "answer", "max_steps": 80, "learning_rate": 0.006,
              "eval_examples": 40, "control_examples": 24}
    (root / "mine.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(root / "runs"),
                           "--name", "mine", "--params", str(root / "mine.yaml")],
                          capture_output=True, text=True, env=env, timeout=900)
    return {"root": root, "proc": proc, "out": root / "runs" / "mine", "params": params}


@pytest.mark.slow
def test_my_model_my_data_all_notebooks_green(my_run):
    proc, out = my_run["proc"], my_run["out"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pipe = json.loads((out / "pipeline.json").read_text())
    assert [e["status"] for e in pipe["notebooks"]] == ["ok"] * 5, pipe["notebooks"]


@pytest.mark.slow
def test_my_run_used_my_files_and_held_out_what_it_did_not_train_on(my_run):
    out, p = my_run["out"], my_run["params"]
    smoke = json.loads((out / "smoke" / "smoke.json").read_text())
    data = smoke["data"]
    assert data["source"] == p["dataset"] and data["heldout"] == p["heldout_dataset"] and data["rows"] == 600
    assert data["prompt_format"] == "plain" and data["long_examples"]["count"] == 0
    assert smoke["generations"]["source"] == p["control_dataset"]
    ev = json.loads((out / "eval" / "eval.json").read_text())
    assert ev["heldout"]["n"] == 40 and ev["control"]["n"] == 24 and ev["control"]["source"] == p["control_dataset"]
    hyg = ev["heldout"]["hygiene"]
    trained = load_examples(out / "data" / "trained.jsonl")
    assert hyg["checked"] and hyg["clean"] and hyg["n_train"] == len(trained) <= 600
    assert load_examples(out / "data" / "heldout.jsonl") == load_examples(
        p["heldout_dataset"], prompt_field="question", response_field="answer")


@pytest.mark.slow
def test_my_model_is_the_planned_model_with_no_plan_setting(my_run):
    """No plan_model in the params: notebooks 01/02 and the card plan the model the user trains."""
    out, mine = my_run["out"], my_run["params"]["model"]
    assert json.loads((out / "plan.json").read_text())["model"] == mine
    assert json.loads((out / "sweeps.json").read_text())["plan_model"] == mine
    card = (out / "report.md").read_text()  # the card names a local model by its folder (no local paths)
    assert f"# Run card: fine-tuning {Path(mine).name}" in card and "(planned)" not in card.splitlines()[0]
    from lora_kit.plan.headline import FIGURE  # the kit's own check against the QLoRA paper is the tutorial's alone
    assert FIGURE not in json.loads((out / "figures.json").read_text())["figures"] and FIGURE not in card


@pytest.mark.slow
def test_my_run_card_shows_the_heldout_gain_with_its_interval(my_run):
    out = my_run["out"]
    ev = json.loads((out / "eval" / "eval.json").read_text())
    diff = ev["comparisons"]["adapter"]["heldout"]["exact_match"]
    card = (out / "report.md").read_text()
    assert ev["summary_sentence"] in card and "95 % CI" in ev["summary_sentence"]
    assert diff["lo"] <= diff["diff"] <= diff["hi"]
    assert diff["lo"] > 0, f"80 steps of the dates task lift held-out exact match: {diff}"


# ----------------------------------------------------------------------------------------------
# (b) three real architectures, random weights, chat template, messages data (plumbing only)
# ----------------------------------------------------------------------------------------------
def _build(arch: str, out: Path) -> Path:
    import torch
    import transformers as tf
    tok = build_char_tokenizer(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg, cls = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM)}[arch]
    extra = {"head_dim": 16} if arch == "gemma2" else {}
    torch.manual_seed(0)
    cls(cfg(**common, **extra)).save_pretrained(out, safe_serialization=True)
    return out


def _messages_rows(n: int = 24) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"add {a} {a + 3}"},
                          {"role": "assistant", "content": str(2 * a + 3)}]} for a in range(n)]


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2"])
def test_real_architectures_chat_template_messages_data(arch, tmp_path):
    import lora_kit as lk
    from lora_kit.loading import load_tokenizer
    from lora_kit.prompting import IGNORE_INDEX, PromptFormat
    model = _build(arch, tmp_path / arch)
    data = _jsonl(tmp_path / "chat.jsonl", _messages_rows())
    s = lk.Settings(model=str(model), dataset=str(data), heldout_fraction=0.25, max_steps=2, batch_size=4,
                    attn_implementation="eager" if arch == "gemma2" else "sdpa",  # Gemma-2 has no SDPA path
                    seq_len=64, eval_examples=4, control_examples=6, max_new_tokens=4, run_dir=str(tmp_path / "run"))
    r = lk.smoke_run(s, progress=False, simulate=False, cpu_threads=1)
    assert r.ok, r.status
    assert r["data"]["prompt_format"] == "chat" and r["data"]["rows"] == 18  # 24 rows, a quarter held out
    assert r["generations"]["source"] == "generic:control" and r["generations"]["prompt_format"] == "chat"
    ev = lk.evaluate(s, progress=False)
    assert ev.summary["decoding"]["prompt_format"] == "chat" and ev.summary["heldout"]["is_heldout"]
    assert ev.summary["heldout"]["n"] == 4 and ev.summary["control"]["source"] == "generic:control"
    # labels: only the assistant's answer (and its end of turn) is trained
    tok = load_tokenizer(str(model))
    ex = load_examples(data)[0]
    enc = PromptFormat(tok, "chat").encode(ex)
    answer = [t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab != IGNORE_INDEX]
    assert tok.decode(answer, skip_special_tokens=True) == "3"
    text = tok.decode(enc["input_ids"], skip_special_tokens=True)
    assert text.startswith("<|system|>Be") and text.endswith("<|assistant|>3"), text  # (this tokenizer drops spaces)


# ----------------------------------------------------------------------------------------------
# formats and prompt formats: one path, clear errors
# ----------------------------------------------------------------------------------------------
def test_three_data_formats_give_the_same_examples(tmp_path):
    pr = _jsonl(tmp_path / "pr.jsonl", [{"q": "Say hi\n\nto Bob", "a": "hi Bob"}])
    al = _jsonl(tmp_path / "al.jsonl", [{"instruction": "Say hi", "input": "to Bob", "output": "hi Bob"}])
    ms = _jsonl(tmp_path / "ms.jsonl", [{"messages": [{"role": "user", "content": "Say hi\n\nto Bob"},
                                                      {"role": "assistant", "content": "hi Bob"}]}])
    a = load_examples(pr, prompt_field="q", response_field="a")[0]
    b = load_examples(al)[0]
    c = load_examples(ms)[0]
    assert (a["prompt"], a["response"]) == (b["prompt"], b["response"]) == (c["prompt"], c["response"])
    assert "context" in c and "context" not in b


def test_format_that_does_not_match_the_data_names_the_setting(tmp_path):
    al = _jsonl(tmp_path / "al.jsonl", [{"instruction": "Say hi", "output": "hi"}])
    with pytest.raises(ValueError, match=r"no field 'messages'.*data_format='alpaca'"):
        load_examples(al, data_format="messages")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="line 1 of the file: .*ending with the assistant's answer"):
        load_examples(bad)
    from lora_kit.loading import load_tokenizer
    from lora_kit.prompting import resolve_prompt_format
    tok = build_char_tokenizer(tmp_path / "tok")  # no chat template
    with pytest.raises(ValueError, match="prompt_format='chat'.*no chat template"):
        resolve_prompt_format("chat", tok, True)
    assert resolve_prompt_format("auto", tok, True) == "plain"
    assert resolve_prompt_format("auto", load_tokenizer("tiny"), False) == "plain"
    import lora_kit as lk
    with pytest.raises(ValueError, match="prompt_format"):
        lk.Settings(prompt_format="Q: [prompt]")
    with pytest.raises(ValueError, match="long_examples"):
        lk.Settings(long_examples="cut")
    with pytest.raises(ValueError, match="heldout_fraction"):
        lk.Settings(heldout_fraction=1.0)


def test_user_template_and_plain_mask_everything_but_the_answer():
    from lora_kit.loading import load_tokenizer
    from lora_kit.prompting import IGNORE_INDEX, PromptFormat
    tok = load_tokenizer("tiny")
    for kind in ("plain", "### Q: {prompt} ### A: "):
        enc = PromptFormat(tok, kind).encode({"prompt": "month after May", "response": "June"})
        kept = [t for t, lab in zip(enc["input_ids"], enc["labels"]) if lab != IGNORE_INDEX]
        assert tok.decode(kept, skip_special_tokens=True) == "June" and kept[-1] == tok.eos_token_id


def test_long_examples_counted_and_policy_applied():
    from lora_kit.loading import load_tokenizer
    from lora_kit.data import long_examples_line
    from lora_kit.run.batches import verified_slice
    tok = load_tokenizer("tiny")
    rows = [{"prompt": f"q{i}", "response": "a"} for i in range(8)] + [{"prompt": "P" * 20, "response": "R" * 20}]
    _, rep = verified_slice(tok, rows, seq_len=32, n_examples=4)
    lx = rep["long_examples"]
    assert (lx["count"], lx["truncated"], lx["dropped"], lx["longest_row"]) == (1, 1, 0, 8)
    assert lx["share"] == pytest.approx(1 / 9) and lx["longest_tokens"] > 32
    assert "1 of 9 rows (11.1%) longer than seq_len=32" in long_examples_line(rep) and "check" in long_examples_line(rep)
    order, rep = verified_slice(tok, rows, seq_len=32, n_examples=4, long_examples="drop")
    assert rep["long_examples"]["dropped"] == 1 and all(e["row"] != 8 for e in order)
    with pytest.raises(ValueError, match=r"1 of 9 examples .* longer than seq_len=32.*long_examples='truncate' or 'drop'"):
        verified_slice(tok, rows, seq_len=32, n_examples=4, long_examples="error")


def test_heldout_split_is_deterministic_clean_and_keeps_duplicates_together():
    from lora_kit.data import normalize, split_heldout
    ex = [{"prompt": f"Q {i % 30}", "response": "x"} for i in range(60)]  # every prompt twice
    tr, ho = split_heldout(ex, 0.2, seed=1)
    assert (tr, ho) == split_heldout(ex, 0.2, seed=1) and ho != split_heldout(ex, 0.2, seed=2)[1]
    assert len(ho) == 12 and sorted(tr + ho) == list(range(60))
    assert not {normalize(ex[i]["prompt"]) for i in ho} & {normalize(ex[i]["prompt"]) for i in tr}


def test_generic_control_set_for_other_models():
    from lora_kit.data import control_source
    rows = load_examples("generic:control")
    assert 140 <= len(rows) <= 170 and len({r["prompt"] for r in rows}) == len(rows)
    assert {r["task"] for r in rows} == {"arithmetic", "capitals", "units", "spelling", "dates", "instructions"}
    assert control_source("auto", "tiny") == "tiny:control" and control_source("auto", "/my/model") == "generic:control"
    assert control_source("mine.jsonl", "/my/model") == "mine.jsonl"
    sums = [r for r in rows if " + " in r["prompt"]]
    assert all(int(r["response"]) == sum(map(int, r["prompt"].split("?")[0].split("is ")[1].split(" + ")))
               for r in sums)


# ----------------------------------------------------------------------------------------------
# (c) every params file: valid settings; shipped example data loads with its field settings
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((ROOT / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_params_file_and_its_example_data(path):
    from lora_kit.data import control_source, field_settings
    from lora_kit.settings import load_settings
    s = load_settings(path)
    for name in ("dataset", "heldout_dataset", "control_dataset"):
        src = getattr(s, name)
        if name == "control_dataset":
            src = control_source(src, s.model)
        if src and (ROOT / src).exists():  # shipped example data, relative to the repo
            fields = {} if str(src).startswith(("tiny:", "generic:")) else field_settings(s)
            assert load_examples(ROOT / src, **fields), f"{path.name}: {name} {src} is empty"
        elif src and not str(src).startswith(("tiny:", "generic:")):
            pytest.fail(f"{path.name}: {name}={src!r} is neither shipped nor embedded")


def test_run_card_says_when_many_examples_are_long():
    from lora_kit.ui.run_card import next_checks
    lx = {"policy": "truncate", "seq_len": 64, "count": 29, "share": 0.29, "longest_tokens": 300, "longest_row": 3,
          "truncated": 20, "dropped": 0, "answer_cut_away": 9}
    card = {"smoke": {"status": "complete", "data": {"rows": 100, "long_examples": lx}}, "eval": None, "plan": None,
            "stack": None}
    assert any("29% of the training rows are longer than seq_len=64" in x for x in next_checks(card))
    card["smoke"]["data"]["long_examples"] = {**lx, "count": 1, "share": 0.01}
    assert not any("longer than seq_len" in x for x in next_checks(card))


def _long_rows_csv(path):
    """A CSV (header, then a blank line after the third row) whose rows 1, 9, 17, 25, 33 are long; the file line
    of each row, by content."""
    rows = [{"prompt": f"question {i}", "response": "short"} for i in range(40)]
    for i in (0, 8, 16, 24, 32):
        rows[i] = {"prompt": f"long {i} " + "P " * 60, "response": "R " * (60 + i)}
    lines = ["prompt,response"] + [f"{r['prompt']},{r['response']}" for r in rows]
    lines.insert(4, "")  # a blank line: row n ends on file line n + 1 up to row 3, n + 2 after
    path.write_text("\n".join(lines) + "\n")
    return {ln.split(",")[0]: n for n, ln in enumerate(lines, 1) if ln}


def test_long_examples_are_named_by_their_line_in_the_users_file(tmp_path):
    """With part of the dataset held out, the training rows are not the file's rows: messages about long examples
    name the line of the user's file (the trial's "longest: 688 tokens, row 23, 1-based" was line 24's row)."""
    import lora_kit as lk
    from lora_kit.data import long_examples_line, mix_examples, row_refs, run_data
    from lora_kit.data_check import check_long_examples
    from lora_kit.loading import load_tokenizer
    from lora_kit.run.batches import verified_slice
    f = tmp_path / "mine.csv"
    line_of = _long_rows_csv(f)
    s = lk.Settings(dataset=str(f), heldout_fraction=0.2, seed=3, seq_len=48)
    d = run_data(s)
    assert len(d["train"]) < 40 and [line_of[e["prompt"]] for e in d["train"]] == d["train"].lines
    tok = load_tokenizer("tiny")
    _, rep = verified_slice(tok, d["train"], seq_len=48, n_examples=4)
    lx = rep["long_examples"]
    longest = d["train"][lx["longest_row"]]["prompt"]
    assert longest.startswith("long") and lx["longest_at"] == f"line {line_of[longest]} of the file"
    assert f"line {line_of[longest]} of the file" in long_examples_line(rep)
    long_lines = sorted(line_of[p] for p in line_of if p.startswith("long") and p in {e["prompt"] for e in d["train"]})
    with pytest.raises(ValueError) as smoke:
        verified_slice(tok, d["train"], seq_len=48, n_examples=4, long_examples="error")
    msg = str(smoke.value)
    assert f"{len(long_lines)} of {len(d['train'])} examples" in msg and "1-based" not in msg
    assert f"(lines {', '.join(map(str, long_lines))} of the file; longest: {lx['longest_tokens']} tokens, " \
           f"line {line_of[longest]} of the file)" in msg
    with pytest.raises(ValueError) as early:  # before anything runs: the same check, the same message
        check_long_examples(s.replace(long_examples="error"), tok)
    assert str(early.value) == f"dataset ({f}): {msg}"
    check_long_examples(s, tok)  # "truncate": nothing refused
    mixed = mix_examples(d["train"], [{"prompt": "b", "response": "c"}] * 9, 0.2)  # base_mix: no file line claimed
    assert row_refs(mixed, [2]) == "row 2 of the training rows (20% base-task rows mixed in)"
