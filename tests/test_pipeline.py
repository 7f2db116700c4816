"""The main job end to end: ``lora-kit run`` executes every notebook with papermill on the
embedded default, exports HTML, writes results and the run card; a failing notebook stops the run,
keeps what was produced and exits non-zero. Plus the CLI's other commands."""
from __future__ import annotations

import json
import os
import re

import pytest

from lora_kit.ui.cli import main
from lora_kit.ui.pipeline import PIPELINE


def test_cli_estimate_prints_breakdown_and_fit(capsys):
    assert main(["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--seq-len", "2048",
                 "--dtype", "bfloat16", "--gpu", "L4"]) == 0
    out = capsys.readouterr().out
    assert "peak allocated" in out and "device total" in out and "weights" in out
    assert "L4:" in out and "fit" in out


def test_cli_estimate_json_matches_library(capsys):
    import lora_kit as lk
    assert main(["estimate", "--model", "qwen2.5-0.5b", "--seq-len", "512", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    est = lk.estimate(model="qwen2.5-0.5b", seq_len=512)  # the planning defaults, as the CLI assumes
    assert got["peak_allocated_bytes"] == est.peak_allocated_bytes and got["settings"] == est.settings
    assert "seq_len" not in got["assumed"] and "batch_size" in got["assumed"]


@pytest.mark.parametrize("argv,msg", [
    (["estimate", "--model", "llama-3.1-8b", "--seq-len", "-5"], "seq_len must be a positive integer"),
    (["estimate", "--model", "no-such-model-xyz"], "no-such-model-xyz"),
    (["run", "-p", "sequence_length", "128"], "valid settings are"),
    (["run", "--sharding", "fsdp"], "needs num_gpus > 1"),
    # a user trial: a mistyped target trained only q_proj and completed with exit code 0
    (["run", "--only", "03", "-p", "lora_targets", "q_proj,v_projj"], "did you mean 'v_proj' for 'v_projj'?"),
    (["run", "--model", "llama-3.1-8b"], "`hf download meta-llama/Llama-3.1-8B "),  # a catalog name: its hub id
    (["run", "--gpu", "H100"], "Unknown GPU 'H100'. Did you mean 'H100-PCIe' or 'H100-SXM'?"),
    (["run", "--gpus", "[L4,H200,A10]"], "Unknown GPU 'A10'. Did you mean 'A10G'"),  # brackets read as a list
])
def test_cli_bad_input_says_what_to_change(argv, msg, capsys, tmp_path):
    assert main(argv + (["--runs-dir", str(tmp_path)] if argv[0] == "run" else [])) == 2
    assert msg in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing may run before settings are valid"


def test_a_dataset_the_run_cannot_read_is_refused_before_anything_runs(tmp_path, capsys):
    """Notebook 00 would stop on it after the stack probes; the CLI reads every file first (no tokenizer)."""
    data = tmp_path / "mine.csv"
    data.write_text("question,answer\nq1,a1\nq2,a2\n")
    runs = tmp_path / "runs"
    assert main(["run", "--runs-dir", str(runs), "--name", "x", "-p", "dataset", str(data)]) == 2
    err = capsys.readouterr().err
    assert "has no field 'prompt'" in err and "Set prompt_field/response_field" in err and str(data) in err
    assert not runs.exists()


def test_long_examples_error_is_refused_before_anything_runs(tmp_path, capsys):
    """long_examples='error' with a training row longer than seq_len: refused before 00, naming the file's lines,
    with the smoke run's message (notebook 03 would stop on it minutes later)."""
    import lora_kit as lk
    from lora_kit.data_check import check_long_examples
    from test_your_model_your_data import _long_rows_csv
    data = tmp_path / "mine.csv"
    _long_rows_csv(data)
    runs = tmp_path / "runs"
    argv = ["run", "--runs-dir", str(runs), "--name", "x", "--dataset", str(data), "--seq-len", "48"]
    assert main(argv + ["-p", "long_examples", "error", "-p", "heldout_fraction", "0.2", "-p", "seed", "3"]) == 2
    err = capsys.readouterr().err
    with pytest.raises(ValueError) as same:
        check_long_examples(lk.Settings(dataset=str(data), seq_len=48, long_examples="error", heldout_fraction=0.2,
                                        seed=3))
    assert f"lora-kit run: data: {same.value}\n" in err and "longer than seq_len=48 (lines " in err
    assert "1-based" not in err and not runs.exists()


def test_failing_notebook_stops_run_and_keeps_outputs(tmp_path, capsys):
    rc = main(["run", "--runs-dir", str(tmp_path), "--name", "bad", "--only", "01",
               "-p", "plan_model", "no-such-model-xyz"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "01_choose_method.ipynb failed" in err and "no-such-model-xyz" in err
    run = tmp_path / "bad"
    rec = json.loads((run / "pipeline.json").read_text())
    assert rec["status"] == "failed at 01_choose_method.ipynb"
    assert rec["notebooks"][0]["status"] == "failed" and "no-such-model-xyz" in rec["notebooks"][0]["error"]
    assert (run / "01_choose_method.ipynb").exists() and (run / "01_choose_method.html").exists()
    assert (run / "report.md").exists()  # the run card marks what is missing instead of vanishing


@pytest.mark.slow
def test_main_job_on_embedded_default(main_job):
    """The README's main job: every notebook on the tiny model on CPU, results and run card. The one
    full execution of the notebooks in the suite (``main_job`` in conftest): each notebook's own
    assert cell runs here, headless; nbval re-runs only 02, for its interactive widget cell."""
    assert main_job["rc"] == 0
    run = main_job["run"]
    rec = json.loads((run / "pipeline.json").read_text())
    assert rec["status"] == "complete" and [n["notebook"] for n in rec["notebooks"]] == list(PIPELINE)
    for name in PIPELINE:
        code = [c for c in json.loads((run / name).read_text())["cells"] if c["cell_type"] == "code"]
        # every cell ran, the notebook's own assert cell included (nbval no longer runs 00, 01, 03, 04)
        assert code and all(c["execution_count"] for c in code), f"{name}: a cell was not executed"
        assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"], name
        html = (run / name.replace(".ipynb", ".html")).read_text()
        assert "Traceback" not in html
        # what a person reads: papermill's injected cell holds only what the run changed; no library noise
        injected = next(c for c in code if "injected-parameters" in c["metadata"].get("tags", []))
        assert len("".join(injected["source"]).splitlines()) <= 4, name
        stderr = "".join("".join(o["text"]) for c in code for o in c["outputs"] if o.get("name") == "stderr")
        for noisy in ("FutureWarning", "Paged optimizers", "gemm_4bit_forward", "use_cache=True", "Caching is",
                      "Could not find a config file"):
            assert noisy not in stderr, (name, noisy, stderr[:2000])
        assert not [o for c in code for o in c["outputs"] if "PosixPath(" in str(o.get("data", {}))], name
    assert "plotly" in (run / "01_choose_method.html").read_text()  # figures visible in the export
    # the main job is the tutorial: 04 asserted its claim instead of only reporting it (ui.notebook.tutorial_claims)
    cells = json.loads((run / "04_evaluate.ipynb").read_text())["cells"]
    printed = "".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c["outputs"])
    assert "nb.tutorial_claims(S)" in "".join("".join(c["source"]) for c in cells)
    assert printed and "Reported, not asserted" not in printed
    # offline: one plotly.js for the whole run folder, and no page fetches a script from the internet
    from lora_kit.ui.notebook import PLOTLY_JS, offline_problems
    assert [p.relative_to(run).as_posix() for p in run.rglob("*.js")] == [PLOTLY_JS]
    assert {p.name: offline_problems(p) for p in run.rglob("*.html") if offline_problems(p)} == {}
    for part in ("stack.json", "plan.json", "sweeps.json", "smoke/smoke.json", "eval/eval.json",
                 "eval/per_example.csv", "smoke/adapter/adapter_model.safetensors"):
        assert (run / part).exists(), part
    smoke = json.loads((run / "smoke" / "smoke.json").read_text())
    assert smoke["status"] == "complete" and smoke["verify"]["passed"]
    kernels_log = run / "kernels.log"  # the kernels' own messages (IPC transport: no TCP warning)
    assert not kernels_log.exists() or "without encryption" not in kernels_log.read_text()
    lines = (run / "progress.log").read_text()  # headless progress, printed by lora-kit run as it came
    assert re.search(r"^smoke steps: (\d+)/\1 steps \(100%\)", lines, re.M) and "evaluate" in lines, lines
    ev = json.loads((run / "eval" / "eval.json").read_text())
    assert ev["comparisons"]["adapter"]["heldout"]["exact_match"]["lo"] > 0
    card = (run / "report.md").read_text()
    for section in ("## The request", "## The loop you run next", "## Memory: estimated, simulated, measured",
                    "## Software stack",
                    "## Smoke run", "## Evaluation: base vs adapter", "## What to check next"):
        assert section in card
    assert "measured" in card and "held-out" in card
    assert "- **prompt format**: plain" in card and "line 1 of `data/trained.jsonl`" in card
    from lora_kit.plan.headline import FIGURE, FIGURE_NOTE  # the kit's check against the QLoRA paper: the tutorial's
    assert FIGURE in json.loads((run / "figures.json").read_text())["figures"] and f"_{FIGURE_NOTE}_" in card
    report = json.loads((run / "report.json").read_text())
    assert report["smoke"]["status"] == "complete" and report["plan"]["rows"]


def _fig_run_dir(tmp_path):
    import plotly.graph_objects as go
    from lora_kit.ui.notebook import save_figure
    save_figure(go.Figure(go.Bar(x=["a", "b"], y=[1, 2])), "bars", tmp_path)
    return tmp_path


def test_run_card_without_browser_keeps_html_figures(tmp_path, monkeypatch):
    """Static export is optional: no Chromium -> the run card links the HTML figures and says why."""
    from lora_kit.ui import notebook
    from lora_kit.ui.run_card import build_report
    monkeypatch.setattr(notebook, "chromium_path", lambda: None)
    d = _fig_run_dir(tmp_path)
    paths = build_report(d)
    md = open(paths["md"]).read()
    assert "figures/bars.html" in md and "no Chromium" in md
    assert not (d / "figures" / "bars.png").exists()
    assert "_No smoke run in this run._" in md  # missing parts are marked, never guessed


def test_run_card_png_figures_with_browser(tmp_path, monkeypatch):
    """PNGs through a real Chromium, which writes its config and caches in the run folder while it runs (then
    removed), not in the user's home (~/.config/chromium, ~/.cache)."""
    from lora_kit.ui import notebook
    from lora_kit.ui.run_card import build_report
    if notebook.chromium_path() is None:
        pytest.skip("no Chromium binary: PNG export cannot run here (covered by the no-browser test)")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for k in notebook.BROWSER_HOME_VARS:
        monkeypatch.delenv(k, raising=False)
    d = _fig_run_dir(tmp_path)
    md = open(build_report(d)["md"]).read()
    assert not any(home.iterdir()) and not (d / ".browser").exists()
    assert not any(k in os.environ for k in notebook.BROWSER_HOME_VARS)
    png = d / "figures" / "bars.png"
    assert png.is_file(), md[md.find("_PNG export"):][:400]  # the card says why it kept HTML
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![bars](figures/bars.png)" in md


def test_cli_estimate_names_the_parts_at_the_phase_of_the_peak(capsys):
    """70B full fine-tuning peaks in the optimizer step: what is left beside the states is the step's
    temporaries (AdamW foreach), not activations; LoRA fields are not listed for full fine-tuning."""
    assert main(["estimate", "--model", "llama-3.1-70b", "--method", "full"]) == 0
    out = capsys.readouterr().out
    assert "parts at the peak (optimizer phase):" in out and "optimizer-step temporaries" in out
    assert "  activations" not in out and "lora_rank" not in out and "double_quant" not in out
    assert main(["estimate", "--model", "llama-3.1-8b", "--method", "qlora", "--seq-len", "8192",
                 "--gradient-checkpointing", "false"]) == 0
    out = capsys.readouterr().out
    assert "(backward phase)" in out and "activations + backward temporaries" in out and "double_quant" in out
