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
