"""The executed notebooks in a run folder: papermill executes into ``<stem>.running.ipynb`` (each save whole), the
notebook appears under its own name only once it ran to its end, and one that failed or was interrupted is kept,
its first cell saying that it did not finish and why. The kernel's own output reaches kernels.log in whole lines."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import nbformat

from lora_kit.results import read_record
from lora_kit.ui.pipeline import UNFINISHED_TAG, keep_unfinished, notebook_saves, running_notebook
from test_integrity import ENV, nb_dir, processes_in, wait_for  # noqa: F401 - nb_dir is a fixture

# test_integrity's stand-in notebooks: 00 writes stack.json, 01 touches started_01 and sleeps SLEEP_01 seconds


def test_a_notebook_appears_only_when_it_ends_and_an_interrupted_one_is_marked(tmp_path, nb_dir):  # noqa: F811
    """Also: the kernel's own messages (here Python's startup warning about a bad -W option, written to the
    kernel's stderr before any cell runs) reach kernels.log in whole lines."""
    run = tmp_path / "x"
    env = {**ENV, "SLEEP_01": "60", "PYTHONWARNINGS": "not-an-action"}
    p = subprocess.Popen([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(tmp_path), "--name", "x",
                          "--only", "00", "01", "--notebooks", str(nb_dir)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run / "started_01").exists())  # papermill saved 01 when the cell started
        # while 01 runs: its saves are whole notebooks under the running name, the final name is not there yet
        assert not (run / "01_choose_method.ipynb").exists()
        nbformat.validate(nbformat.reads((run / "01_choose_method.running.ipynb").read_text(), as_version=4))
        assert (run / "00_stack_check.ipynb").is_file() and not (run / "00_stack_check.running.ipynb").exists()
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 143
    assert read_record(run / "pipeline.json")["status"] == "interrupted at 01_choose_method.ipynb"
    kept = nbformat.read(run / "01_choose_method.ipynb", as_version=4)
    first = kept.cells[0]
    assert first.metadata.get("tags") == [UNFINISHED_TAG]
    assert first.source.startswith("**This notebook did not finish: interrupted (SIGTERM).**")
    assert [c.execution_count for c in kept.cells if c.cell_type == "code"][:2] == [1, 2], "what ran is kept"
    assert "did not finish" in (run / "01_choose_method.html").read_text()
    assert not list(run.glob("*.running.ipynb"))
    done = nbformat.read(run / "00_stack_check.ipynb", as_version=4)
    assert UNFINISHED_TAG not in json.dumps([c.metadata for c in done.cells])
    assert done.metadata.papermill.output_path == str(run / "00_stack_check.ipynb"), "its record names where it is"
    assert "Invalid -W option ignored: invalid action: 'not-an-action'\n" in (run / "kernels.log").read_text()


def test_a_failed_notebook_is_kept_marked_and_an_unreadable_one_by_its_name(tmp_path):
    dst = tmp_path / "01_choose_method.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 / 0")])
    running = running_notebook(dst)
    nbformat.write(nb, running)
    assert keep_unfinished(running, dst, "failed: ZeroDivisionError: division by zero") == dst
    cells = nbformat.read(dst, as_version=4).cells
    assert cells[0].source.startswith("**This notebook did not finish: failed: ZeroDivisionError: division by zero.**")
    assert cells[1].source == "1 / 0" and not running.exists()
    running.write_text('{"cells": [')  # a save cut short (what atomic saves prevent; a notebook from elsewhere)
    kept = keep_unfinished(running, tmp_path / "02_memory_sweeps.ipynb", "failed")
    assert kept == tmp_path / "02_memory_sweeps.unfinished.ipynb" and kept.read_text() == '{"cells": ['
    assert keep_unfinished(running, dst, "failed") is None  # nothing was executed


def test_papermill_saves_of_a_notebook_go_whole_to_its_running_name(tmp_path):
    from papermill.iorw import papermill_io
    out = tmp_path / "run"
    out.mkdir()
    dst = out / "01_choose_method.ipynb"
    before = list(papermill_io._handlers)
    with notebook_saves(dst):
        assert type(papermill_io.get_handler(str(dst))).__name__ == "AtomicSaves"
        papermill_io.write('{"cells": []}', str(dst))
        assert type(papermill_io.get_handler(str(tmp_path / "elsewhere.ipynb"))).__name__ == "LocalHandler"
    assert papermill_io._handlers == before
    assert [p.name for p in out.iterdir()] == ["01_choose_method.running.ipynb"]  # no temp file, no dst yet
    assert (out / "01_choose_method.running.ipynb").read_text() == '{"cells": []}'


def test_a_killed_runs_notebook_is_its_last_whole_save_and_the_card_names_it(tmp_path, nb_dir):  # noqa: F811
    from lora_kit.ui.run_card import build_report
    run = tmp_path / "x"
    p = subprocess.Popen([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(tmp_path), "--name", "x",
                          "--only", "00", "01", "--notebooks", str(nb_dir)], env={**ENV, "SLEEP_01": "60"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (run / "started_01").exists())
    finally:
        p.kill()
        p.wait(timeout=30)
    wait_for(lambda: not processes_in(run), timeout=30)  # the kernel sees its parent gone and exits
    running = run / "01_choose_method.running.ipynb"
    nbformat.validate(nbformat.read(running, as_version=4))  # whole: every save replaced the file at once
    assert not (run / "01_choose_method.ipynb").exists()
    build_report(run)
    md = (run / "report.md").read_text()
    assert "| 01_choose_method.ipynb | died; executed so far: 01_choose_method.running.ipynb |" in md, md
