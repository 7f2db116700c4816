"""One run owns its folder (issue 38, items 6 and 8).

- ``smoke_run`` into the folder of a complete smoke run refuses unless ``overwrite=True``, which moves the old
  run's ``smoke/`` and ``data/`` aside whole;
- what a killed writer leaves (``.smoke.json.*.tmp``, ``.adapter.saving-*``) is removed by the next run;
- two runs started into one name at once: one runs, the other is refused by a lock, naming it;
- a ``lora-kit run`` killed outright leaves no kernel sockets or connection file once the next run started.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lora_kit.results import read_record
from test_integrity import ENV, nb_dir, wait_for  # noqa: F401 - nb_dir is a fixture

ROWS = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(8)]


def _smoke(run_dir, model, **kw):
    from lora_kit.run.smoke import smoke_run
    return smoke_run(model=str(model), run_dir=str(run_dir), examples=ROWS, control_prompts=["hi"], progress=False,
                     simulate=False, max_steps=1, batch_size=2, seq_len=16, lora_rank=2, lora_alpha=4,
                     max_new_tokens=1, measure_steps=1, **kw)


def test_smoke_run_refuses_a_complete_run_unless_asked_and_cleans_leftovers(tmp_path, random_llama_dir):
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    (smoke / ".smoke.json.k1lled.tmp").write_text('{"half": ')  # a kill between write and rename
    (smoke / ".adapter.saving-k1lled").mkdir()                   # a kill during the adapter save
    first = _smoke(tmp_path, random_llama_dir)
    assert first.ok
    assert not [p.name for p in smoke.iterdir() if p.name.startswith(".")], "leftovers of a killed run removed"
    kept = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="holds a complete smoke run .*overwrite=True"):
        _smoke(tmp_path, random_llama_dir)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == kept, "nothing touched"
    second = _smoke(tmp_path, random_llama_dir, overwrite=True)
    assert second.ok and second.record["run"]["id"] != first.record["run"]["id"]
    aside = tmp_path / f"replaced-{first.record['run']['id']}"
    assert read_record(aside / "smoke" / "smoke.json")["run"]["id"] == first.record["run"]["id"]
    assert (aside / "smoke" / "adapter" / "adapter_model.safetensors").is_file()


def _cli(runs, *args, nb, env=None):
    return subprocess.Popen([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(runs), *args,
                             "--notebooks", str(nb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **(env or {})})


def test_two_runs_into_one_name_one_is_refused_by_the_lock(tmp_path, nb_dir):  # noqa: F811
    ps = [_cli(tmp_path, "--name", "x", "--only", "00", nb=nb_dir, env={"SLEEP_00": "4"}) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in ps]
    rcs = sorted(p.returncode for p in ps)
    assert rcs == [0, 2], outs
    err = next(e for p, (_, e) in zip(ps, outs) if p.returncode == 2)
    assert "is in use by another run (pid" in err and "already holds" not in err, err
    assert read_record(tmp_path / "x" / "pipeline.json")["status"] == "partial"


def test_a_killed_runs_kernel_files_are_removed_by_the_next_run(tmp_path, nb_dir):  # noqa: F811
    tmp, runtime = tmp_path / "tmp", tmp_path / "runtime"
    tmp.mkdir()
    runtime.mkdir()
    env = {"TMPDIR": str(tmp), "JUPYTER_RUNTIME_DIR": str(runtime)}
    p = _cli(tmp_path, "--name", "a", "--only", "00", "01", nb=nb_dir, env={**env, "SLEEP_01": "60"})
    try:
        wait_for(lambda: (tmp_path / "a" / "started_01").exists() or p.poll() is not None, timeout=400)
    except AssertionError:
        p.kill()
        raise AssertionError(f"the run never reached 01: {p.communicate()}") from None
    if p.poll() is not None:
        out, err = p.communicate()
        raise AssertionError(f"the run ended before 01 was killed: {err[-3000:]}")
    p.kill()
    p.wait(timeout=30)
    time.sleep(4)  # the kernel sees its parent gone and exits, without removing its sockets
    q = _cli(tmp_path, "--name", "b", "--only", "00", nb=nb_dir, env=env)
    _, err = q.communicate(timeout=240)
    assert q.returncode == 0, err
    left = sorted(str(x.relative_to(tmp_path)) for d in (tmp, runtime) for x in d.rglob("*")
                  if "kernel" in x.name or "ipc" in x.name or "lora-kit" in x.name)
    assert left == [], left


def test_kernel_sockets_fit_however_long_the_temp_folder(tmp_path, monkeypatch):
    """ZeroMQ's IPC sockets live in the kernel's folder; a Unix socket's path holds at most 107 bytes, so a temp
    folder too deep for one (pytest-xdist's, a user's TMPDIR) sends the folder to /tmp."""
    import shutil
    import tempfile

    from lora_kit.ui.pipeline import SOCKET_PATH_MAX, _kernel_dir
    deep = tmp_path / ("x" * 60) / ("y" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    d = _kernel_dir()
    try:
        assert d is not None and not str(d).startswith(str(deep))
        assert len(os.fsencode(d / "ipc")) + 4 <= SOCKET_PATH_MAX
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_lock_file_is_removed_when_the_run_ends(tmp_path):
    """The lock beside the run folder does not pile up (one per run name ever used); while held, a second taker is
    refused naming the holder, and a lock file a killed run left is taken over."""
    from lora_kit.results import RunLocked, run_lock
    lock = tmp_path / ".x.lock"
    with run_lock(tmp_path / "x"):
        assert lock.is_file() and f"pid {os.getpid()}" in lock.read_text()
        with pytest.raises(RunLocked, match="in use by another run"):
            with run_lock(tmp_path / "x"):
                pass
        assert lock.is_file()  # the refused taker leaves the holder's file alone
    assert not lock.exists()
    lock.write_text("pid 1 on a machine that was killed\n")  # a killed run's leftover, no flock on it
    with run_lock(tmp_path / "x"):
        assert f"pid {os.getpid()}" in lock.read_text()
    assert not lock.exists()
