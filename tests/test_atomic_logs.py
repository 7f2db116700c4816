"""Logs that grow during a run (progress.log, pipeline.log, kernels.log, smoke.log) hold whole records only: one
write of whole lines under a lock, a record that does not fit cut off again, a half record left by a killed writer
never glued to the next one, and what could not be written said in the run's record. The full-disk case is in
test_full_disk.py (a real tmpfs)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from lora_kit.results import AppendLog, LineLog, append_line, read_log, relay_lines


def test_half_a_record_left_by_a_killed_writer_is_cut_not_glued(tmp_path):
    log = tmp_path / "progress.log"
    log.write_bytes(b"smoke steps: 1/4\nsmoke steps: 2/")  # a writer killed in the middle of its write
    assert read_log(log) == ["smoke steps: 1/4"], "a reader takes only whole lines"
    append_line(log, "smoke steps: 3/4")
    assert log.read_bytes() == b"smoke steps: 1/4\nsmoke steps: 3/4\n"


WRITER = """
import sys
from lora_kit.results import append_line
for i in range(20):
    append_line(sys.argv[1], sys.argv[2] * 100_000 + f" {i}")
"""


def test_records_of_several_processes_never_interleave(tmp_path):
    """Four processes append 100 kB records (more than a pipe's or a page's atomic size) to one log at once."""
    log = tmp_path / "kernels.log"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(log), c]) for c in "abcd"]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    lines = read_log(log)
    assert len(lines) == 80 and log.read_bytes().endswith(b"\n")
    for line in lines:
        body, n = line.split(" ")
        assert body == body[0] * 100_000 and 0 <= int(n) < 20


def test_kernel_output_reaches_its_log_in_whole_lines(tmp_path):
    """A child's stdout and stderr through a pipe (as ``lora-kit run`` starts notebook kernels): written in pieces,
    logged in whole lines; a last line without its newline is completed when the child ends."""
    read_end, write_end = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", "import os, time\n"
                              "os.write(2, b'libgomp: Invalid value'); time.sleep(0.2)\n"
                              "os.write(1, b' for OMP_NUM_THREADS\\nsecond line\\nno newline at exit')"],
                             stdout=write_end, stderr=write_end)
    os.close(write_end)
    log = AppendLog(tmp_path / "kernels.log")
    thread = relay_lines(read_end, log)
    assert child.wait(timeout=60) == 0
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert (tmp_path / "kernels.log").read_text() == ("libgomp: Invalid value for OMP_NUM_THREADS\nsecond line\n"
                                                     "no newline at exit\n")
    assert log.failure() is None


def test_a_log_record_is_whole_and_what_is_lost_is_recorded(tmp_path):
    """pipeline.log's handler: a record with a traceback is one record; records the disk (here: a folder that is
    gone) does not take are counted, and the run's record lists them."""
    from lora_kit.ui.pipeline import _log_failures
    handler = LineLog(tmp_path / "pipeline.log")
    logger = logging.getLogger("lora_kit.test_atomic_logs")
    logger.addHandler(handler)
    try:
        try:
            raise RuntimeError("kernel gone")
        except RuntimeError:
            logger.exception("cell 3 failed")
    finally:
        logger.removeHandler(handler)
    text = (tmp_path / "pipeline.log").read_text()
    assert text.startswith("cell 3 failed\nTraceback") and text.endswith("RuntimeError: kernel gone\n")
    lost = AppendLog(tmp_path / "gone" / "progress.log")
    assert lost.write("a line") is False and lost.write("another") is False
    record: dict = {}
    _log_failures(record, [handler.log, lost])
    assert record["not_written"] == [f"{tmp_path / 'gone' / 'progress.log'}: 2 record(s) not written (No such file "
                                     "or directory); the records before are whole"]


def test_smoke_log_records_are_whole_and_a_lost_one_is_in_smoke_json(tmp_path, random_llama_dir):
    import json
    from lora_kit.run.smoke import smoke_run
    (tmp_path / "smoke" / "smoke.log").mkdir(parents=True)  # the log cannot be written: its records are lost, said
    smoke_run(model=str(random_llama_dir), run_dir=str(tmp_path), examples=[{"prompt": "a", "response": "b"}] * 8,
              control_prompts=["hi"], progress=False, simulate=False, max_steps=1, batch_size=2, seq_len=16,
              lora_rank=2, lora_alpha=4, max_new_tokens=1, measure_steps=1)
    rec = json.loads((tmp_path / "smoke" / "smoke.json").read_text())
    assert rec["status"] == "complete"
    assert rec["not_written"][0].startswith(f"{tmp_path / 'smoke' / 'smoke.log'}: ") and "not written" in rec["not_written"][0]
