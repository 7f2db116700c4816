"""Run integrity of the smoke run, in subprocesses: a real ``python -m lora_kit.run.smoke`` on the
embedded tiny model (a few steps), killed with SIGKILL, SIGTERM and SIGINT while training and while
saving the adapter. Each test asserts what smoke.json records, that the adapter folder is whole or
absent (never half), and that no earlier adapter was lost; evaluate refuses an adapter whose
record is not complete."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_integrity import wait_for  # tests/ is on sys.path (rootdir conftest)

from lora_kit.evaluation.evaluate import evaluate
from lora_kit.results import read_record, settled

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "TQDM_DISABLE": "1"}
FAST = ["-p", "batch_size", "4", "-p", "seq_len", "48", "--no-simulate", "--cpu-threads", "1",
        "--measure-steps", "2"]
# the real smoke run, with the save paused after the adapter files are complete in their temporary
# folder and before the rename: the one moment a kill could leave half an adapter
PAUSED_SAVE = """
import sys, time, pathlib
from lora_kit.run import adapter_io
real = adapter_io._deterministic_config
def paused(path, *args):
    real(path, *args)
    pathlib.Path(sys.argv[1]).write_text("saving")
    time.sleep(120)
adapter_io._deterministic_config = paused
from lora_kit.run.smoke import main
sys.exit(main(sys.argv[2:]))
"""


def smoke(run_dir: Path, steps: int, *, pause_marker: Path | None = None, env=None,
          overwrite: bool = False) -> subprocess.Popen:
    args = ["-p", "run_dir", str(run_dir), "-p", "max_steps", str(steps), *FAST] + ["--overwrite"] * overwrite
    cmd = ([sys.executable, "-c", PAUSED_SAVE, str(pause_marker)] if pause_marker
           else [sys.executable, "-m", "lora_kit.run.smoke"]) + args
    # the run starts with SIGINT's default disposition, as from a terminal: a suite started as a background job of a
    # non-interactive shell (`cmd &`) ignores SIGINT and a child inherits that, so the signal never reached the run
    # (it finished its save: exit 0, not 130)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, **(env or {})}, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def record(run_dir: Path) -> dict | None:
    return read_record(run_dir / "smoke" / "smoke.json")


def training(run_dir: Path, n_steps: int = 2):
    return lambda: len((record(run_dir) or {}).get("steps", [])) >= n_steps


def files(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def complete_runs(tmp_path_factory):
    """Two complete smoke runs of the same settings, in processes with different hash seeds."""
    dirs = [tmp_path_factory.mktemp(f"complete{i}") for i in (1, 2)]
    procs = [smoke(d, 2, env={"PYTHONHASHSEED": str(i)}) for i, d in enumerate(dirs, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return dirs


def test_complete_adapter_is_deterministic_shareable_and_identified(complete_runs):
    a, b = (d / "smoke" / "adapter" for d in complete_runs)
    assert sorted(p.name for p in a.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    for p in a.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    cfg = json.loads((a / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(cfg["target_modules"]) and len(cfg["target_modules"]) > 1
    assert files(a) == files(b), "the same adapter from two processes must be the same bytes"
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".adapter")], "no temporary folder left"
    rec = record(complete_runs[0])
    assert rec["status"] == "complete" and rec["run"]["id"] and rec["run"]["started"]
    assert rec["run"]["id"] != record(complete_runs[1])["run"]["id"]
    assert rec["process"]["pid"] and rec["updated"] and "current" not in rec


def test_sigterm_while_training_records_interrupted(tmp_path):
    p = smoke(tmp_path, 400)
    wait_for(training(tmp_path))
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143
    assert err.strip().splitlines()[-1] == "smoke run interrupted (SIGTERM); what was measured is in smoke/smoke.json"
    assert "Traceback" not in err
    rec = record(tmp_path)
    assert rec["status"] == "interrupted at train" and rec["phases"]["train"]["status"] == "interrupted"
    assert rec["ending"].startswith("SIGTERM during train") and len(rec["steps"]) >= 2  # steps so far kept
    assert rec["phases"]["save"]["status"] == "pending" and not (tmp_path / "smoke" / "adapter").exists()


def test_sigkill_while_training_reads_as_died_and_evaluate_refuses_the_old_adapter(complete_runs):
    run = complete_runs[0]
    old, old_id = files(run / "smoke" / "adapter"), record(run)["run"]["id"]
    refused = smoke(run, 400)  # a complete smoke run is never replaced unasked
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "holds a complete smoke run" in err and record(run)["run"]["id"] == old_id
    p = smoke(run, 400, overwrite=True)  # a second run into the same folder, asked to replace it, killed outright
    wait_for(lambda: (record(run) or {}).get("run", {}).get("id") and training(run)()
             and record(run)["status"] == "running")
    p.kill()
    p.wait(timeout=30)
    rec = record(run)
    assert rec["status"] == "running" and rec["process"]["pid"] == p.pid and len(rec["steps"]) >= 2
    assert settled(rec)["status"] == "died at train"
    assert files(run / f"replaced-{old_id}" / "smoke" / "adapter") == old  # the earlier adapter, moved aside whole
    assert not (run / "smoke" / "adapter").exists()  # ... never passed off as this run's
    with pytest.raises(ValueError, match="died at train"):
        evaluate(run_dir=run, n_heldout=4, n_control=4, progress=False)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_kill_while_saving_never_leaves_half_an_adapter(complete_runs, tmp_path, sig):
    run = complete_runs[1] if sig == signal.SIGKILL else tmp_path / "fresh"
    adapter = run / "smoke" / "adapter"
    old = files(adapter) if adapter.exists() else None
    old_id = (record(run) or {}).get("run", {}).get("id")
    marker = tmp_path / "saving"
    p = smoke(run, 2, pause_marker=marker, overwrite=True)  # a complete run is moved aside first
    wait_for(marker.exists)
    assert record(run)["current"] == "save" and record(run)["phases"]["save"]["status"] == "running"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    rec = record(run)
    if sig == signal.SIGKILL:
        assert p.returncode == -signal.SIGKILL
        assert rec["status"] == "running" and settled(rec)["status"] == "died at save"
        assert files(run / f"replaced-{old_id}" / "smoke" / "adapter") == old, "the previous adapter stays whole"
        assert not adapter.exists(), "no adapter rather than half of one"
        with pytest.raises(ValueError, match="died at save"):
            evaluate(run_dir=run, n_heldout=4, n_control=4, progress=False)
    else:
        assert p.returncode == 130 and "Traceback" not in err
        assert rec["status"] == "interrupted at save" and rec["ending"].startswith("SIGINT during save")
        assert not adapter.exists(), "no adapter rather than half of one"
        assert not [x for x in adapter.parent.iterdir() if x.name.startswith(".adapter")], "temporary folder removed"
