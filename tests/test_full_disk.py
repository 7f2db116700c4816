"""A full disk (issue 38, items 4 and 5): every file the kit writes is whole or absent, the run records how it
ended, and the command line says so in one line.

Two ways to fill a disk: a real tmpfs of a few MiB in a private mount namespace (``unshare -rm``, no root
needed; skipped where the machine forbids it), and, for a single writer, ``open`` monkeypatched so that a file
takes 8,192 bytes and then raises ENOSPC, as a full disk does.
"""
from __future__ import annotations

import builtins
import errno
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest

from lora_kit.results import NotWritten, read_record
from lora_kit.ui import notebook
from test_integrity import ENV, _in_small_tmpfs, nb_dir  # noqa: F401 - nb_dir is a fixture

REPO = Path(__file__).resolve().parents[1]


def disk_fills_after(monkeypatch, room: int = 8192) -> None:
    """Every file opened for writing takes ``room`` bytes, then raises ENOSPC (what is before stays)."""
    real_open, real_fdopen = builtins.open, os.fdopen

    def wrap(f, mode):
        if not any(c in str(mode) for c in "wax+"):
            return f
        written = [0]
        write = f.write

        def limited(data):
            n = len(data.encode() if isinstance(data, str) else data)
            if written[0] + n > room:
                write(data[:max(room - written[0], 0)])
                f.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            written[0] += n
            return write(data)
        f.write = limited
        return f

    monkeypatch.setattr(builtins, "open", lambda file, mode="r", *a, **k: wrap(real_open(file, mode, *a, **k), mode))
    monkeypatch.setattr(io, "open", builtins.open)
    monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: wrap(real_fdopen(fd, mode, *a, **k), mode))


def test_a_figure_is_whole_or_the_previous_one_on_a_full_disk(tmp_path, monkeypatch):
    before = notebook.save_figure(go.Figure(go.Bar(x=["a"], y=[1])), "eval_paired_diff", tmp_path)
    old = {k: Path(p).read_bytes() for k, p in before.items()}
    big = go.Figure(go.Scatter(x=list(range(20000)), y=list(range(20000))))
    disk_fills_after(monkeypatch)
    with pytest.raises(NotWritten, match="eval_paired_diff.html was not written: no space left on device"):
        notebook.save_figure(big, "eval_paired_diff", tmp_path)
    monkeypatch.undo()
    assert {k: Path(p).read_bytes() for k, p in before.items()} == old, "the previous figure is intact"
    assert not [p for p in (tmp_path / "figures").iterdir() if p.name.startswith(".")], "no temp file left"


def _tmpfs_run(tmp_path, size: str, script: str):
    mount, keep = tmp_path / "small", tmp_path / "keep"
    mount.mkdir()
    cmd = _in_small_tmpfs(mount, size, f"{script}; rc=$?; cp -r {shlex.quote(str(mount))}/. {keep}; exit $rc")
    if cmd is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces: `unshare -rm`)")
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240, cwd=REPO), mount, keep


def test_pipeline_records_its_ending_when_the_disk_fills_up(tmp_path, nb_dir):  # noqa: F811
    """02 fills the disk: pipeline.json says "failed at 02 (disk full)" -- never "running", which a reader would
    take for a killed run -- and the card is built from the run's reserve."""
    mount = tmp_path / "small"
    run = shlex.join([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(mount), "--name", "x",
                      "--only", "00", "02", "--notebooks", str(nb_dir)])
    r, _, keep = _tmpfs_run(tmp_path, "12m", f"FILL_DISK=1 {run}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    rec = read_record(keep / "x" / "pipeline.json")
    assert rec["status"] == "failed at 02_memory_sweeps.ipynb (disk full)", rec["status"]
    assert "disk filled up" in rec["disk_full"]
    md = (keep / "x" / "report.md").read_text()
    assert "failed at 02_memory_sweeps.ipynb (disk full)" in md and "killed (SIGKILL" not in md
    assert not list(keep.rglob(".*.tmp")) and not list(keep.rglob(".lora-kit-reserve"))


def test_smoke_cli_on_a_full_disk_says_one_line(tmp_path):
    mount = tmp_path / "small"
    cmd = shlex.join([sys.executable, "-m", "lora_kit.run.smoke", "-p", "run_dir", str(mount / "run"),
                      "-p", "max_steps", "1", "--no-simulate"])
    r, _, keep = _tmpfs_run(tmp_path, "1m", f"head -c 2000000 /dev/zero > {shlex.quote(str(mount))}/filler 2>/dev/null; {cmd}")
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "Traceback" not in r.stderr and "smoke.json was not written: no space left on device" in r.stderr


def test_smoke_run_raises_not_written_naming_the_adapter(tmp_path, random_llama_dir, monkeypatch):
    """A full disk while the adapter is saved: NotWritten names the adapter folder (not a raw OSError from a
    library), and no half adapter is left."""
    from lora_kit.run import adapter_io
    from lora_kit.run.smoke import smoke_run

    def full(model, path, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    real = adapter_io.save_adapter

    def save(model, out_dir, **kw):
        monkeypatch.setattr(type(model), "save_pretrained", lambda self, path, **k: full(self, path, **k))
        return real(model, out_dir, **kw)
    monkeypatch.setattr(adapter_io, "save_adapter", save)
    with pytest.raises(NotWritten, match=r"smoke/adapter was not written: no space left on device"):
        smoke_run(model=str(random_llama_dir), run_dir=str(tmp_path), examples=[{"prompt": "a", "response": "b"}] * 8,
                  control_prompts=["hi"], progress=False, simulate=False, max_steps=1, batch_size=2, seq_len=16,
                  lora_rank=2, lora_alpha=4, max_new_tokens=1, measure_steps=1)
    rec = read_record(tmp_path / "smoke" / "smoke.json")
    assert rec["status"] == "failed at save" and not (tmp_path / "smoke" / "adapter").exists()
    assert not [p for p in (tmp_path / "smoke").iterdir() if p.name.startswith(".")]


PROGRESS_ON_A_FULL_DISK = """
import os, sys
from pathlib import Path
from lora_kit.progress import bar
from lora_kit.results import entered_run, new_run
run = Path(sys.argv[1])
run.mkdir()
with entered_run(new_run("test", run)):
    b = bar(10, "smoke steps", enabled=False, run_dir=run, every_s=0)
    b.update(1)  # one whole line
    fd = os.open(run / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\\0" * 4096)
    except OSError:
        os.close(fd)
    b.set_postfix(note="x" * 50_000)  # a line the disk has no room for
    b.update(1)
    b.close()
print("the loop ran on")
"""


def test_a_log_line_is_whole_or_absent_on_a_full_disk(tmp_path):
    """progress.log on a real full disk: the line that does not fit leaves no half of it (the pipeline's reader
    and a later line would take it for a record), the loop is not stopped, and the loss is said."""
    mount = tmp_path / "small"
    cmd = shlex.join([sys.executable, "-c", PROGRESS_ON_A_FULL_DISK, str(mount / "run")])
    r, _, keep = _tmpfs_run(tmp_path, "1m", cmd)
    assert r.returncode == 0 and "the loop ran on" in r.stdout, r.stderr
    log = (keep / "run" / "progress.log").read_bytes()
    assert log.endswith(b"\n") and b"xxx" not in log, log[-200:]
    assert [line.split(",")[0] for line in log.decode().splitlines()] == ["smoke steps: 1/10 steps (10%)"]
    assert "progress line not written" in r.stderr and "no space left on device" in r.stderr, r.stderr
