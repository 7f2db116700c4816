"""A real ``lora-kit run`` of the real notebook 03 (the smoke run on the embedded model), stopped
with SIGTERM -- what ``timeout``, Docker, Slurm and Kubernetes send -- while it trains. The kernel
is interrupted and shut down, both records say "interrupted", the steps so far are kept, the card
is built and says so, and no kernel is left running in the run folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lora_kit.results import read_record

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_sigterm_during_the_real_smoke_notebook(tmp_path):
    run = tmp_path / "x"
    p = subprocess.Popen([sys.executable, "-m", "lora_kit.ui.cli", "run", "--runs-dir", str(tmp_path), "--name", "x",
                          "--only", "03", "-p", "max_steps", "400", "-p", "batch_size", "4", "-p", "seq_len", "48"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    t_end = time.monotonic() + 240
    while len((read_record(run / "smoke" / "smoke.json") or {}).get("steps", [])) < 2:
        assert time.monotonic() < t_end and p.poll() is None, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert err.strip().splitlines() == [f"lora-kit run: interrupted (SIGTERM); results so far and the run card are "
                                        f"in {run}"]
    pipe = read_record(run / "pipeline.json")
    assert pipe["status"] == "interrupted at 03_smoke_run.ipynb" and pipe["ending"].startswith("SIGTERM during 03")
    smoke = read_record(run / "smoke" / "smoke.json")
    assert smoke["run"]["id"] == pipe["run"]["id"], "the kernel's smoke run belongs to the pipeline's run"
    assert smoke["status"] == "interrupted at train" and len(smoke["steps"]) >= 2
    assert not (run / "smoke" / "adapter").exists()
    card = (run / "report.md").read_text()
    assert "Status: **interrupted at train**" in card and "03_smoke_run.ipynb | interrupted" in card
    assert (run / "03_smoke_run.ipynb").exists() and (run / "03_smoke_run.html").exists()
    alive = [d.name for d in os.scandir("/proc") if d.name.isdigit() and _cwd(d.path) == str(run)]
    assert not alive, f"kernel processes left in the run folder: {alive}"


def _cwd(proc: str) -> str | None:
    try:
        return os.readlink(f"{proc}/cwd")
    except OSError:
        return None
