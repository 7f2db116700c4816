"""An invalid ``OMP_NUM_THREADS`` is refused before anything runs, and said (issue 38, item 11): libgomp would only
warn into the kernel's log and run with its own thread count (3.5x the time in the probe)."""
from __future__ import annotations

import pytest

from lora_kit.settings import Settings
from lora_kit.ui.cli import main
from lora_kit.ui.pipeline import check_thread_env, run_pipeline


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", "two", "4,x"])
def test_invalid_thread_count_is_refused(value, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        run_pipeline(Settings(), tmp_path / "run")
    assert main(["run", "--runs-dir", str(tmp_path / "runs"), "--name", "x"]) == 2
    assert f"OMP_NUM_THREADS={value!r}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", ["1", "16", " 2 ", "4,2", ""])
def test_valid_thread_counts_pass(value):
    check_thread_env({"OMP_NUM_THREADS": value})
