"""The run card reads records, not file times or stale statuses (issue 38, items 8 and 9).

- a run killed outright (SIGKILL): its card says "died", and no row under that header still says "running";
- a run folder copied with a plain ``cp -r`` (new file times) keeps every figure on its rebuilt card: figures
  belong to a run by ``figures.json``, never by modification time.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import plotly.graph_objects as go
import pytest

from lora_kit.results import entered_run, new_run, process_info, settled, write_json_atomic
from lora_kit.ui import notebook
from lora_kit.ui.run_card import build_report


@pytest.fixture
def dead_process() -> dict:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return process_info(p.pid) | {"proc_start": "1"}


def test_a_killed_runs_card_shows_no_running_row(tmp_path, dead_process, monkeypatch):
    monkeypatch.setattr(notebook, "chromium_path", lambda: None)
    ident = new_run("lora-kit run", tmp_path)
    write_json_atomic(tmp_path / "pipeline.json", {
        "run": ident, "kind": "lora_kit.pipeline", "status": "running", "current": "01_choose_method.ipynb",
        "requested": ["00_stack_check.ipynb", "01_choose_method.ipynb"], "not_run": [],
        "notebooks": [{"notebook": "00_stack_check.ipynb", "status": "ok", "seconds": 1.0},
                      {"notebook": "01_choose_method.ipynb", "status": "running"}],
        "process": dead_process, "updated": "2026-01-01T00:00:00Z"})
    write_json_atomic(tmp_path / "smoke" / "smoke.json", {
        "run": ident, "status": "running", "current": "train", "process": dead_process,
        "phases": {"load": {"status": "done"}, "train": {"status": "running"}}})
    md = Path(build_report(tmp_path)["md"]).read_text()
    assert "**died at 01_choose_method.ipynb**" in md
    assert "| 01_choose_method.ipynb | died |" in md
    assert "running" not in md.split("## The request")[0], md[:1500]
    smoke = settled({"status": "running", "current": "train", "process": dead_process,
                     "phases": {"train": {"status": "running"}}})
    assert smoke["phases"]["train"]["status"] == "died" and smoke["status"] == "died at train"


def test_a_copied_run_folder_keeps_its_figures(tmp_path, monkeypatch):
    """Figures saved by this run's notebook stay on the card of a ``cp -r`` copy (file times all new); a figure
    saved outside the run stays off it."""
    monkeypatch.setattr(notebook, "chromium_path", lambda: None)
    run = tmp_path / "x"
    ident = new_run("lora-kit run", run)
    t0 = time.time()
    with entered_run(ident):
        monkeypatch.setenv("LORA_KIT_NOTEBOOK", "04_evaluate.ipynb")
        notebook.save_figure(go.Figure(go.Bar(x=["a"], y=[1])), "eval_paired_diff", run)
    monkeypatch.delenv("LORA_KIT_NOTEBOOK")
    notebook.save_figure(go.Figure(go.Bar(x=["b"], y=[2])), "not_this_run", run)
    write_json_atomic(run / "pipeline.json", {
        "run": ident, "kind": "lora_kit.pipeline", "status": "partial", "not_run": [],
        "notebooks": [{"notebook": "04_evaluate.ipynb", "status": "ok", "seconds": 1.0,
                       "started_unix": t0 - 1, "ended_unix": time.time()}]})
    time.sleep(2.1)  # the copy's file times lie outside the notebook's window
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    for d in (copy, run):
        md = Path(build_report(d)["md"]).read_text()
        assert "figures/eval_paired_diff.html" in md, (d, md[md.find("## Figures"):])
        assert "not_this_run" not in md


def test_card_and_adapter_carry_no_absolute_local_path(tmp_path, random_llama_dir, monkeypatch):
    """report.md, report.json and adapter_config.json are sent when renting a GPU: paths relative to the run
    folder, a model by its name (issue 38, item 10)."""
    from lora_kit.run.smoke import smoke_run
    monkeypatch.setattr(notebook, "chromium_path", lambda: None)
    run = tmp_path / "runs" / "x"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "response": "a{i}"}}\n' for i in range(12)))
    r = smoke_run(model=str(random_llama_dir), run_dir=str(run), dataset=str(data), control_prompts=["hi"],
                  progress=False, simulate=False, max_steps=1, batch_size=2, seq_len=16, lora_rank=2, lora_alpha=4,
                  max_new_tokens=1, measure_steps=1)
    assert r.ok, r.status
    notebook.save_figure(go.Figure(go.Bar(x=["a"], y=[1])), "f", run)
    build_report(run)
    local = [str(tmp_path), str(random_llama_dir), str(Path.home()), str(Path(notebook.__file__).parents[2])]
    for name in ("report.md", "report.json", "smoke/adapter/adapter_config.json"):
        text = (run / name).read_text()
        assert not [p for p in local if p in text], (name, [p for p in local if p in text])
    import json
    assert json.loads((run / "smoke/adapter/adapter_config.json").read_text())["base_model_name_or_path"] == \
        random_llama_dir.name
    card = json.loads((run / "report.json").read_text())
    assert card["smoke"]["checkpoint"]["dir"] == "smoke/adapter" and card["settings"]["run_dir"] == "."
    assert card["settings"]["dataset"] == "../../data.jsonl"
