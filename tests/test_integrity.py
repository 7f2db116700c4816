"""Run integrity of ``lora-kit run``, in subprocesses: one run, one record.

A real ``lora-kit run`` (real papermill, real kernels) on small stand-in notebooks that call the
real ``lora_kit.results`` writers, so each case takes seconds: reruns refused / overwritten /
resumed, SIGTERM, SIGINT and SIGKILL during a notebook and between notebooks, a kernel that dies,
path escapes, bad input, a full disk. Each test asserts the recorded state and that no earlier
file was lost. The real notebooks under signals are in tests/test_integrity_run.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from lora_kit.results import (
    check_output_dir,
    check_run_name,
    new_run,
    process_info,
    read_record,
    settled,
    write_json_atomic,
)
from lora_kit.ui.cli import main
from lora_kit.ui.pipeline import PIPELINE, kernel_death

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

WRITE = "import lora_kit.results as r, time, os\n"
NOTEBOOKS = {
    "00_stack_check.ipynb": WRITE + "r.write_json_atomic(f'{run_dir}/stack.json', {'probes': [], 'seed': seed})\n"
                                    "time.sleep(float(os.environ.get('SLEEP_00', 0)))",
    "01_choose_method.ipynb": WRITE + "open(f'{run_dir}/started_01', 'w').close()\n"
                                      "time.sleep(float(os.environ.get('SLEEP_01', 0)))\n"
                                      "assert not os.environ.get('FAIL_01'), 'asked to fail'\n"
                                      "r.write_json_atomic(f'{run_dir}/plan.json', {'rows': []})",
    "02_memory_sweeps.ipynb": WRITE + "r.write_json_atomic(f'{run_dir}/sweeps.json', {'n': 1})\n"
                                      "if os.environ.get('FILL_DISK'):  # leave the disk full for the pipeline\n"
                                      "    with open(f'{run_dir}/filler', 'wb') as f:\n"
                                      "        try:\n"
                                      "            while True: f.write(b'0' * 4096); f.flush()\n"
                                      "        except OSError: pass",
    "03_smoke_run.ipynb": WRITE + "os.kill(os.getpid(), 9)",  # a kernel that dies (as the OOM killer does it)
    "04_evaluate.ipynb": WRITE + "r.write_json_atomic(f'{run_dir}/stack.json', {'big': 'x' * 3_000_000})",
}


@pytest.fixture(scope="module")
def nb_dir(tmp_path_factory):
    """Stand-in notebooks: a parameters cell (run_dir, seed) and one code cell each."""
    d = tmp_path_factory.mktemp("notebooks")
    for name, code in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                       "language_info": {"name": "python"}}
        params = nbformat.v4.new_code_cell('run_dir = "runs/default"\nseed = 0')
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, nbformat.v4.new_code_cell(code)]
        nbformat.write(nb, d / name)
    return d


def run_cli(runs, *args, nb=None, env=None, **kw):
    cmd = [sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(runs), *map(str, args)]
    if nb is not None:
        cmd += ["--notebooks", str(nb)]
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=240, **kw)


def start_cli(runs, *args, nb=None, env=None):
    cmd = [sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(runs), *map(str, args)]
    if nb is not None:
        cmd += ["--notebooks", str(nb)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **(env or {})})


def wait_for(cond, timeout=120.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def processes_in(folder: Path) -> list[int]:
    """Live processes whose working directory is ``folder`` (a run's kernels work there)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if Path(os.readlink(p / "cwd")) == folder.resolve():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------
# run identity: reruns refused, overwritten (moved aside) or resumed (proven parts kept)
# ----------------------------------------------------------------------------------------------
def test_rerun_is_refused_then_overwrite_moves_the_old_run_aside(tmp_path, nb_dir):
    r = run_cli(tmp_path, "--name", "x", "--only", "00", nb=nb_dir)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "x"
    first = read_record(run / "pipeline.json")
    assert first["status"] == "partial" and first["not_run"] == list(PIPELINE[1:])  # never "complete"
    stack = read_record(run / "stack.json")
    assert stack["run"]["id"] == first["run"]["id"] and stack["run"]["started"]  # the kernel's file carries the id
    before = snapshot(run)

    r = run_cli(tmp_path, "--name", "x", "--only", "00", "-p", "seed", "1", nb=nb_dir)
    assert r.returncode == 2 and "already holds a run (partial" in r.stderr and "--overwrite" in r.stderr
    assert snapshot(run) == before, "a refused rerun must not touch the old run"

    r = run_cli(tmp_path, "--name", "x", "--only", "00", "-p", "seed", "1", "--overwrite", nb=nb_dir)
    assert r.returncode == 0, r.stderr
    aside = tmp_path / f"x.replaced-{first['run']['id']}"
    assert snapshot(aside) == before, "the old run is moved aside whole, never merged"
    second = read_record(run / "pipeline.json")
    assert second["run"]["id"] != first["run"]["id"]
    assert read_record(run / "stack.json")["seed"] == 1
    card = (run / "report.md").read_text()
    assert second["run"]["id"] in card and first["run"]["id"] not in card


def test_card_excludes_results_of_another_run(tmp_path, nb_dir, monkeypatch):
    r = run_cli(tmp_path, "--name", "x", "--only", "00", nb=nb_dir)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "x"
    # a result left by another run (e.g. copied in, or written by a run that died) is never shown as this run's
    stale = {"run": new_run("smoke_run", run), "status": "complete", "steps": [{"loss": 1.0, "seconds": 1.0}]}
    write_json_atomic(run / "smoke" / "smoke.json", stale)
    import plotly.graph_objects as go

    from lora_kit.ui import notebook
    from lora_kit.ui.notebook import save_figure
    from lora_kit.ui.run_card import build_report
    monkeypatch.setattr(notebook, "chromium_path", lambda: None)  # HTML figures only: no browser start
    old = save_figure(go.Figure(go.Bar(x=["a"], y=[1])), "from_before", run)  # a figure older than this run
    for f in old.values():
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    md = Path(build_report(run)["md"]).read_text()
    assert "_No smoke run in this run._" in md and "smoke/smoke.json is not from this run" in md
    assert "from_before" not in md, "figures not written while this run's notebooks executed are not shown"
    assert "03_smoke_run.ipynb | did not run" in md


def test_resume_keeps_only_what_is_proven_and_needs_the_same_settings(tmp_path, nb_dir):
    r = run_cli(tmp_path, "--name", "x", "--only", "00", "01", nb=nb_dir, env={"FAIL_01": "1"})
    assert r.returncode == 1 and "01_choose_method.ipynb failed" in r.stderr and "asked to fail" in r.stderr
    run = tmp_path / "x"
    first = read_record(run / "pipeline.json")
    assert first["status"] == "failed at 01_choose_method.ipynb"
    kept_stack = (run / "00_stack_check.ipynb").read_bytes(), (run / "stack.json").read_bytes()

    r = run_cli(tmp_path, "--name", "x", "--only", "00", "01", "--resume", "-p", "seed", "3", nb=nb_dir)
    assert r.returncode == 2 and "settings differ" in r.stderr and "seed" in r.stderr

    r = run_cli(tmp_path, "--name", "x", "--only", "00", "01", "--resume", nb=nb_dir)
    assert r.returncode == 0, r.stderr
    rec = read_record(run / "pipeline.json")
    assert rec["run"]["id"] == first["run"]["id"] and rec["status"] == "partial"
    assert [(e["notebook"], e["status"]) for e in rec["notebooks"]] == [
        ("00_stack_check.ipynb", "ok"), ("01_choose_method.ipynb", "ok")]
    assert ((run / "00_stack_check.ipynb").read_bytes(), (run / "stack.json").read_bytes()) == kept_stack
    aside = Path(rec["resumed"][0]["moved_aside"])
    assert (aside / "01_choose_method.ipynb").exists(), "the failed notebook's output is moved aside, not kept"
    assert read_record(run / "plan.json")["run"]["id"] == rec["run"]["id"]


# ----------------------------------------------------------------------------------------------
# every ending recorded
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_a_notebook_records_interrupted_and_builds_the_card(tmp_path, nb_dir, sig, rc):
    run = tmp_path / "x"
    p = start_cli(tmp_path, "--name", "x", "--only", "00", "01", "02", nb=nb_dir, env={"SLEEP_01": "60"})
    wait_for(lambda: (run / "started_01").exists())
    stack = (run / "stack.json").read_bytes()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == rc
    assert err.strip().splitlines() == [f"lora-kit run: interrupted ({sig.name}); results so far and the run card "
                                        f"are in {run}"], err
    rec = read_record(run / "pipeline.json")
    assert rec["status"] == "interrupted at 01_choose_method.ipynb"
    assert rec["ending"].startswith(f"{sig.name} during 01_choose_method.ipynb")
    assert [e["status"] for e in rec["notebooks"]] == ["ok", "interrupted"]
    assert rec["not_run"] == ["02_memory_sweeps.ipynb"]
    assert (run / "stack.json").read_bytes() == stack, "results of finished notebooks are kept"
    assert "interrupted at 01_choose_method.ipynb" in (run / "report.md").read_text()
    wait_for(lambda: not processes_in(run), timeout=15)  # the kernel was stopped, not orphaned


def test_signal_between_notebooks(tmp_path, nb_dir):
    """SIGTERM as soon as 00 is recorded ok: lands while 01's kernel is being started."""
    run = tmp_path / "x"
    p = start_cli(tmp_path, "--name", "x", "--only", "00", "01", nb=nb_dir, env={"SLEEP_01": "60"})
    wait_for(lambda: [e.get("status") for e in (read_record(run / "pipeline.json") or {}).get("notebooks", [])]
             [:1] == ["ok"], timeout=120)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and len(err.strip().splitlines()) == 1, err
    rec = read_record(run / "pipeline.json")
    assert rec["status"].startswith("interrupted") and rec["notebooks"][0]["status"] == "ok"
    assert rec["status"] != "complete" and (run / "report.md").exists()
    wait_for(lambda: not processes_in(run), timeout=15)


def test_sigkill_leaves_running_with_a_pid_that_readers_turn_into_died(tmp_path, nb_dir):
    run = tmp_path / "x"
    p = start_cli(tmp_path, "--name", "x", "--only", "00", "01", nb=nb_dir, env={"SLEEP_01": "60"})
    wait_for(lambda: (run / "started_01").exists())
    p.kill()
    p.wait(timeout=30)
    raw = read_record(run / "pipeline.json")
    assert raw["status"] == "running" and raw["process"]["pid"] == p.pid and raw["updated"]
    seen = settled(raw)
    assert seen["status"] == "died at 01_choose_method.ipynb" and f"process {p.pid}" in seen["ending"]
    wait_for(lambda: not processes_in(run), timeout=20)  # the kernel notices its parent is gone and exits
    r = run_cli(tmp_path, "--name", "x", "--only", "00", "01", nb=nb_dir)
    assert r.returncode == 2 and "already holds a run (died at 01_choose_method.ipynb" in r.stderr
    r = run_cli(tmp_path, "--name", "x", "--only", "00", "01", "--resume", nb=nb_dir)
    assert r.returncode == 0, r.stderr
    rec = read_record(run / "pipeline.json")
    assert [e["status"] for e in rec["notebooks"]] == ["ok", "ok"] and rec["run"]["id"] == raw["run"]["id"]


def test_dead_kernel_is_reported_as_such(tmp_path, nb_dir):
    r = run_cli(tmp_path, "--name", "x", "--only", "03", nb=nb_dir)
    assert r.returncode == 1
    rec = read_record(tmp_path / "x" / "pipeline.json")
    assert rec["status"] == "kernel died at 03_smoke_run.ipynb"
    err = rec["notebooks"][0]["error"]
    assert "the kernel died (killed by SIGKILL)" in err and err in r.stderr
    assert "Traceback" not in r.stderr
    assert "kernel died at 03_smoke_run.ipynb" in (tmp_path / "x" / "report.md").read_text()


def test_kernel_death_names_host_memory_when_likely():
    assert kernel_death(-9, 0, 1).startswith("the kernel died (killed by SIGKILL): likely out of host memory")
    assert "likely out of host memory" in kernel_death(-9, None, None)  # OOM killer unobservable: SIGKILL is its mark
    assert kernel_death(-9, 2, 2) == "the kernel died (killed by SIGKILL)"  # counter readable and unchanged
    assert kernel_death(1, 0, 0) == "the kernel died (exited with code 1)"


def test_settled_tells_a_live_writer_from_a_dead_one():
    me = {"status": "running", "process": process_info(), "current": "train"}
    assert settled(me) is me
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rec = {"status": "running", "process": {**process_info(dead.pid), "pid": dead.pid}, "current": "train"}
    assert settled(rec)["status"] == "died at train"
    reused = {"status": "running", "process": {**process_info(), "proc_start": "1"}}  # our pid, another start time
    assert settled(reused)["status"] == "died"
    elsewhere = {"status": "running", "process": {"pid": 1, "host": "another-host"}}
    assert settled(elsewhere)["status"] == "running"  # cannot be told from here: left as recorded


# ----------------------------------------------------------------------------------------------
# confinement and bad input: one message naming what to change, nothing written
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../escape", "/tmp/abs-escape", "..", ".", "a/b", ".hidden", "", "x\\y"])
def test_run_name_is_one_plain_component(tmp_path, name, nb_dir, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    assert main(["run", "--runs-dir", str(runs), "--name", name, "--only", "00", "--notebooks", str(nb_dir)]) == 2
    assert "is not a plain folder name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["runs"]
    assert not Path("/tmp/abs-escape").exists()
    with pytest.raises(ValueError, match="not a plain folder name"):
        check_run_name(name)


def test_nothing_is_written_into_notebooks_or_the_package(capsys):
    notebooks = REPO / "notebooks"
    # the tracked notebooks and the folder's entries (notebooks/runs aside: an interactive session or
    # nbval in another test worker may write its own run there meanwhile)
    before = {p: p.stat().st_mtime_ns for p in notebooks.iterdir() if p.name != "runs"}
    for runs, name in ((notebooks, "x"), (REPO / "lora_kit", "x"), (REPO / "lora_kit" / "embedded", "x"),
                       (REPO, "notebooks")):  # the last: runs/<name> is the notebooks folder itself
        assert main(["run", "--runs-dir", str(runs), "--name", name, "--only", "01"]) == 2
        assert "runs must not write there" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in notebooks.iterdir() if p.name != "runs"} == before
    with pytest.raises(ValueError, match="inside"):
        check_output_dir(REPO / "lora_kit" / "x", create=False)


def test_bad_output_paths_say_which_path_and_why(tmp_path, nb_dir, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    assert main(["run", "--runs-dir", str(a_file), "--name", "x", "--only", "00", "--notebooks", str(nb_dir)]) == 2
    assert f"cannot create output folder '{a_file}/x'" in capsys.readouterr().err
    assert a_file.read_text() == "not a folder"


@pytest.mark.parametrize("args,msg", [
    (["--only", "99"], "--only 99 matches no notebook"),
    (["--only", "01", "99"], "--only 99 matches no notebook"),
    (["--notebooks", "/no/such/folder"], "--notebooks '/no/such/folder' is not a folder"),
    (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
])
def test_bad_run_arguments_create_nothing(tmp_path, args, msg, capsys):
    assert main(["run", "--runs-dir", str(tmp_path), "--name", "x", *args]) == 2
    assert msg in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "bad input must not leave a folder behind"


def test_notebooks_folder_missing_a_notebook(tmp_path, nb_dir, capsys):
    partial = tmp_path / "nbs"
    partial.mkdir()
    shutil.copy(nb_dir / "00_stack_check.ipynb", partial)
    assert main(["run", "--runs-dir", str(tmp_path / "runs"), "--name", "x", "--only", "00", "01",
                 "--notebooks", str(partial)]) == 2
    assert "lacks 01_choose_method.ipynb" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------------------------
# disk full: the previous files stay intact and the record says what was not written
# ----------------------------------------------------------------------------------------------
def _in_small_tmpfs(mount: Path, size: str, script: str) -> list[str] | None:
    """A command running shell ``script`` with a ``size`` tmpfs on ``mount``, in a private mount namespace
    (as root, or in an unprivileged user namespace); None when this machine allows neither."""
    import shlex
    if shutil.which("unshare") is None:
        return None
    mount_cmd = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount))}"
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        if subprocess.run([*prefix, "sh", "-c", mount_cmd], capture_output=True).returncode == 0:
            return [*prefix, "sh", "-c", f"{mount_cmd} && {script}"]
    return None


def test_disk_full_keeps_previous_files_and_says_what_was_not_written(tmp_path, nb_dir):
    """00 writes stack.json; 04 tries to rewrite it with 3 MB on a 2 MB disk."""
    import shlex
    mount, keep = tmp_path / "small", tmp_path / "keep"
    mount.mkdir()
    run = shlex.join([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(mount), "--name", "x",
                      "--only", "00", "04", "--notebooks", str(nb_dir)])
    cmd = _in_small_tmpfs(mount, "2m", f"{run}; rc=$?; cp -r {shlex.quote(str(mount / 'x'))} {keep}; exit $rc")
    if cmd is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces: `unshare -rm`)")
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "04_evaluate.ipynb failed" in r.stderr and "stack.json was not written: no space left on device" in r.stderr
    rec = read_record(keep / "pipeline.json")
    assert rec["status"] == "failed at 04_evaluate.ipynb (disk full)"
    stack = read_record(keep / "stack.json")
    assert stack["probes"] == [] and "big" not in stack, "the previous stack.json is intact"
    assert not list(keep.rglob(".*.tmp")), "no temp file left behind"


# ----------------------------------------------------------------------------------------------
# bad input files: the file, the line and what to change -- no traceback, nothing run
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,msg", [
    (b"seq_len: 64\nmodel: \xff\xfe\n", "is not UTF-8 text (line 2)"),
    (b"seq_len: 64\nmodel: [tiny\nmethod: lora\n", "is not valid YAML at line"),
    (b"model: !!python/object/apply:os.system ['true']\n", "is not valid YAML at line 1"),
])
def test_bad_params_file_names_the_file_and_line(tmp_path, content, msg, capsys):
    params = tmp_path / "p.yaml"
    params.write_bytes(content)
    assert main(["run", "--runs-dir", str(tmp_path / "runs"), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert msg in err and str(params) in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_non_utf8_data_names_the_file_and_line(tmp_path, suffix, capsys):
    from lora_kit.run.smoke import main as smoke_main
    data = tmp_path / f"d{suffix}"
    data.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "c"}\n' if suffix == ".jsonl"
                     else b"prompt,response\na,b\n\xff,c\n")
    run = tmp_path / "run"
    bad = "2" if suffix == ".jsonl" else "3"
    assert smoke_main(["-p", "run_dir", str(run), "-p", "dataset", str(data), "-p", "max_steps", "1",
                       "--no-simulate"]) == 2
    assert f"{data}: line {bad} is not UTF-8 text" in capsys.readouterr().err
    assert read_record(run / "smoke" / "smoke.json")["status"] == "failed at load"


def test_disk_full_under_the_pipeline_itself(tmp_path, nb_dir):
    """02 leaves the disk full: papermill's save of 02 and the HTML export fail; it says what was not written,
    exits 1, records the failure and every earlier file is intact."""
    import shlex
    mount, keep = tmp_path / "small", tmp_path / "keep"
    mount.mkdir()
    run = shlex.join([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(mount), "--name", "x",
                      "--only", "00", "02", "--notebooks", str(nb_dir)])
    cmd = _in_small_tmpfs(mount, "12m", f"FILL_DISK=1 {run}; rc=$?; cp -r {shlex.quote(str(mount / 'x'))} {keep}; "
                                       "exit $rc")
    if cmd is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces: `unshare -rm`)")
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert ("02_memory_sweeps.ipynb failed: NotWritten: [Errno 28] " in r.stderr
            and "02_memory_sweeps.running.ipynb was not written: no space left on device" in r.stderr)
    assert "HTML export of 02_memory_sweeps.unfinished.ipynb failed" in r.stderr
    # papermill's saves are whole: the last one that fitted is kept, named unfinished (no room to mark it inside)
    nbformat.validate(nbformat.read(keep / "02_memory_sweeps.unfinished.ipynb", as_version=4))
    assert not (keep / "02_memory_sweeps.ipynb").exists()
    assert read_record(keep / "stack.json")["probes"] == [] and read_record(keep / "sweeps.json")["n"] == 1
    rec = read_record(keep / "pipeline.json")  # written from the run's reserve (tests/test_full_disk.py)
    assert rec["notebooks"][0]["status"] == "ok" and rec["status"] == "failed at 02_memory_sweeps.ipynb (disk full)"
    assert "</html>" in (keep / "00_stack_check.html").read_text()
    assert not (keep / "02_memory_sweeps.html").exists(), "no truncated export"
    assert not list(keep.rglob(".*.tmp")), "no temp file left behind"
