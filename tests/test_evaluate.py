"""evaluate(): base vs adapters on a tiny random Llama with a quickly trained LoRA (real peft, no mocks).

Toy task (the ``toy_adapters`` fixture, tests/conftest.py, trained once per session): "Is <word> ok?"
-> "yes". A random base answers garbage; 60 LoRA steps (~5 s) make the adapter answer "yes" on
held-out words. The control set's references are the *base* model's own
greedy answers to other prompts, so the base scores 100 % there and any change the adapter makes
shows up as a regression -- the behaviour-change path is exercised for real.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from lora_kit.evaluation import compare as C
from lora_kit.evaluation.adapters import check_adapter
from lora_kit.generation import generate
from lora_kit.evaluation.evaluate import evaluate, load_result
from conftest import torch_threads

N_RESAMPLES = 500


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(toy_adapters):
    """The toy task and its two adapters, trained once per session (``toy_adapters`` in conftest)."""
    return toy_adapters


@pytest.fixture(scope="module")
def result(random_llama_dir, toy_adapters, tmp_path_factory):
    """One evaluate() run with both adapters, shared by the tests that only read its result.
    progress=True: the bar notebook 04 shows when interactive (the pipeline runs it headless)."""
    t = toy_adapters
    with torch_threads(1):
        return evaluate(str(random_llama_dir), {"lora": t["good"], "weak": t["weak"]}, heldout=t["heldout"],
                        heldout_split=None, control=t["control"], train_examples=t["train"],
                        run_dir=tmp_path_factory.mktemp("toy_eval") / "run", max_new_tokens=8, batch_size=16,
                        n_resamples=N_RESAMPLES, progress=True)


def test_adapter_gain_with_interval_and_honest_sentence(result):
    comp = result.summary["comparisons"]["lora"]["heldout"]
    em = comp["exact_match"]
    assert em["n"] == 24 and em["lo"] > 0.5 and em["lo"] <= em["diff"] <= em["hi"]
    assert comp["better"] > 12 and comp["better"] + comp["worse"] + comp["same"] == 24
    said = result.summary["sentences"]["lora"]["heldout"]
    assert said.startswith("On 24 held-out examples: the adapter is better in exact match")
    assert f"({C.diff_text('exact_match', em)}" in said and "reference loss" in said  # every metric measured
    assert "On 24 held-out examples" in result.summary_sentence
    assert result.summary_sentence.startswith("lora: ") and "weak: " in result.summary_sentence
    m = result.summary["metrics"]["heldout"]
    assert m["lora"]["ref_loss"]["mean"] < m["base"]["ref_loss"]["mean"]
    assert m["lora"]["perplexity"] < m["base"]["perplexity"]
    assert result.summary["heldout"]["is_heldout"] and result.summary["heldout"]["hygiene"]["checked"]


def test_base_rows_are_the_plain_base_model(result, random_llama_dir):
    """disable_adapter() must give exactly what the base alone generates (same decoding and seed)."""
    from lora_kit.loading import load_model, load_tokenizer
    d = str(random_llama_dir)
    ho = result.per_example[result.per_example["split"] == "heldout"]
    alone = generate(load_model(d), load_tokenizer(d), ho["prompt"].tolist(), max_new_tokens=8, batch_size=16)
    assert ho["pred:base"].tolist() == alone
    assert all("\n" not in p for p in result.per_example["pred:base"])  # stop rule: text before a newline
    dec = result.summary["decoding"]
    assert dec["do_sample"] is False and dec["max_new_tokens"] == 8 and dec["padding"] == "left"


def test_control_set_shows_behaviour_change(result, setup):
    ctl = result.summary["comparisons"]["lora"]["control"]
    assert result.summary["metrics"]["control"]["base"]["exact_match"]["mean"] == 1.0  # refs = base answers
    assert ctl["n"] == len(setup["control"]) and ctl["changed"] == ctl["worse"] > 0
    tasks = result.summary["control_tasks"]["lora"]
    assert set(tasks) == {"say", "echo"} and sum(t["n"] for t in tasks.values()) == ctl["n"]
    top = result.summary["top_changes"]["lora"]
    assert top and all(r["pred:base"] != r["pred:lora"] for r in top)
    assert [r["delta_exact_match:lora"] for r in top] == sorted(r["delta_exact_match:lora"] for r in top)
    assert result.summary["sentences"]["lora"]["control"].startswith("Control set: ")


def test_results_written_atomically_as_json_and_csv(result):
    js = json.loads(Path(result.paths["json"]).read_text())
    assert result.summary_sentence == js["summary_sentence"] + " " + js["control"]["summary_sentence"]
    assert js["control"]["changed_fraction"] == max(c["control"]["changed"] / c["control"]["n"]
                                                    for c in js["comparisons"].values())
    assert js["comparisons"]["lora"]["heldout"]["exact_match"]["diff"] == \
        pytest.approx(result.summary["comparisons"]["lora"]["heldout"]["exact_match"]["diff"])
    assert set(js["versions"]) >= {"torch", "transformers", "peft"}
    csv = pd.read_csv(result.paths["csv"], keep_default_na=False)
    assert len(csv) == len(result.per_example) and {"pred:base", "pred:lora", "pred:weak"} <= set(csv.columns)
    assert not [p for p in Path(result.paths["json"]).parent.iterdir() if p.name.endswith(".tmp")]
    again = load_result(Path(result.paths["json"]).parents[1])
    assert again.summary_sentence == result.summary_sentence
    pd.testing.assert_frame_equal(again.per_example, result.per_example, check_dtype=False)
    assert set(again.figures()) == {"metric_bars", "diff_histogram", "control_changes"}


def test_overlap_refused_unless_allowed_and_smoke_adapter_found(setup, random_llama_dir, tmp_path):
    d = str(random_llama_dir)
    leaky = setup["heldout"][:4] + setup["train"][:2]
    kw = dict(heldout=leaky, heldout_split=None, control=None, train_examples=setup["train"],
              max_new_tokens=4, n_resamples=N_RESAMPLES, progress=False)
    with pytest.raises(ValueError, match="allow_overlap=True"):
        evaluate(d, setup["good"], **kw)
    shutil.copytree(setup["good"], tmp_path / "smoke" / "adapter")
    r = evaluate(d, None, run_dir=tmp_path, allow_overlap=True, **kw)  # adapters=None -> <run_dir>/smoke/adapter
    assert r.adapters == ["adapter"] and r.summary["heldout"]["is_heldout"] is False
    assert r.summary["heldout"]["hygiene"]["overlapping"] == 2
    assert "OVERLAP the training data" in r.summary_sentence
    assert (tmp_path / "eval" / "eval.json").is_file()


def test_bad_input_is_a_clear_error(setup, random_llama_dir, tmp_path):
    d = str(random_llama_dir)
    kw = dict(heldout_split=None, control=None, progress=False, n_resamples=N_RESAMPLES)
    with pytest.raises(ValueError, match="heldout set is empty"):
        evaluate(d, setup["good"], heldout=[], **kw)
    with pytest.raises(ValueError, match="no reference answer"):
        evaluate(d, setup["good"], heldout=[{"prompt": "Is abc ok?", "response": " "}], **kw)
    with pytest.raises(ValueError, match="no reference answer"):
        evaluate(d, setup["good"], heldout=[{"prompt": "Is abc ok?"}], **kw)
    with pytest.raises(ValueError, match="context is 256 tokens"):
        evaluate(d, setup["good"], heldout=[{"prompt": "x" * 300, "response": "yes"}], **kw)
    with pytest.raises(ValueError, match="names the base model"):
        evaluate(d, {"base": setup["good"]}, heldout=setup["heldout"], **kw)
    with pytest.raises(ValueError, match="could not be fetched from the hub"):  # HF_HUB_OFFLINE=1 in tests
        evaluate(d, "no-such-org/no-such-adapter", heldout=setup["heldout"], **kw)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        evaluate(d, setup["good"], heldout=setup["heldout"], do_sample=True, temperature=0.0, **kw)
    with pytest.raises(ValueError, match="method="):
        evaluate(d, setup["good"], heldout=setup["heldout"], method="full", **kw)


def test_adapter_for_another_base_is_refused(setup, random_llama_dir, tmp_path):
    from conftest import build_char_tokenizer, build_random_llama
    from lora_kit.loading import load_model
    other = tmp_path / "other"
    build_char_tokenizer(other)
    build_random_llama(other, hidden=128, ffn=256)
    with pytest.raises(ValueError, match="does not fit base"):
        evaluate(str(other), setup["good"], heldout=setup["heldout"], heldout_split=None, control=None, progress=False)
    # same shapes, other recorded base: refused by name unless the caller says it is the same model
    renamed = tmp_path / "renamed"
    shutil.copytree(setup["good"], renamed)
    cfg = json.loads((renamed / "adapter_config.json").read_text())
    (renamed / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "org/another-model"}))
    base = load_model(str(random_llama_dir))
    with pytest.raises(ValueError, match="was trained on 'org/another-model'"):
        check_adapter(str(renamed), base, str(random_llama_dir), str(random_llama_dir))
    assert check_adapter(str(renamed), base, str(random_llama_dir), str(random_llama_dir), check_base_name=False)
    (renamed / "adapter_model.safetensors").rename(renamed / "adapter_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        check_adapter(str(renamed), base, str(random_llama_dir), str(random_llama_dir))


def test_adapter_missing_a_tensor_is_refused_not_half_loaded(setup, random_llama_dir, tmp_path):
    """peft only warns about a LoRA weight the file lacks (it stays at its init); evaluation refuses it."""
    from safetensors.torch import load_file, save_file
    cut = tmp_path / "cut"
    shutil.copytree(setup["good"], cut)
    tensors = load_file(cut / "adapter_model.safetensors")
    dropped = sorted(k for k in tensors if ".lora_B." in k)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, cut / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=rf"adapter 'adapter' at .* loaded only in part: \['{dropped}'\] were not "
                                         r"in the file, \[\] found no place"):
        evaluate(str(random_llama_dir), str(cut), heldout=setup["heldout"], heldout_split=None, control=None,
                 progress=False)


def test_qlora_base_4bit(setup, random_llama_dir):
    """The adapter on a 4-bit NF4 base (bitsandbytes CPU backend): runs and still beats the base."""
    pytest.importorskip("bitsandbytes")
    r = evaluate(str(random_llama_dir), setup["good"], heldout=setup["heldout"][:8], heldout_split=None,
                 control=None, method="qlora", max_new_tokens=4, n_resamples=N_RESAMPLES, progress=False)
    m = r.summary["metrics"]["heldout"]
    assert r.summary["method"] == "qlora" and m["adapter"]["ref_loss"]["mean"] < m["base"]["ref_loss"]["mean"]


def test_figures_and_table_from_a_real_run(result):
    figs = result.figures()
    assert set(figs) == {"metric_bars", "diff_histogram", "control_changes"}
    assert {t.name for t in figs["metric_bars"].data} == {"base", "lora", "weak"}
    table = result.examples_table("lora", split="control")
    assert table["delta_exact_match:lora"].is_monotonic_increasing  # worst regressions first


def test_sampling_uses_the_same_seed_for_every_system(setup, random_llama_dir):
    """do_sample=True: the seed is reset before each system, so a rerun reproduces every output."""
    kw = dict(heldout=setup["heldout"][:8], heldout_split=None, control=None, do_sample=True, temperature=1.0,
              max_new_tokens=4, seed=7, n_resamples=N_RESAMPLES, progress=False)
    ra = evaluate(str(random_llama_dir), setup["weak"], **kw)
    assert "Overlap with the training data was not checked" in ra.summary_sentence  # no train_examples given
    a, b = ra.per_example, evaluate(str(random_llama_dir), setup["weak"], **kw).per_example
    assert a["pred:base"].tolist() == b["pred:base"].tolist() and a["pred:adapter"].tolist() == b["pred:adapter"].tolist()
    assert a["pred:base"].nunique() > 1  # it really sampled (a random base at T=1)
