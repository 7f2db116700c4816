"""Progress of the long loops (training steps, evaluation batches), visible wherever they run.

- In JupyterLab or a terminal (``enabled=True``): a tqdm bar.
- Headless inside ``lora-kit run`` (the notebooks run with ``interactive=False``): a line every
  ``every_s`` seconds and one at the end, appended whole to ``<run folder>/progress.log``
  (:func:`lora_kit.results.append_line`); the pipeline prints new lines under the notebook's own line on the
  terminal (:func:`follow`). A line the disk has no room for is skipped and said once on stderr (the notebook's
  output), never raised into the training loop.
- Otherwise: nothing.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from lora_kit.results import AppendLog, active_run

PROGRESS_LOG = "progress.log"


class _Lines:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` as periodic lines in a file."""

    def __init__(self, path: Path, total: int, desc: str, unit: str, every_s: float):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.log = AppendLog(path)  # whole lines: the pipeline's reader (:func:`follow`) never sees half of one
        self.n, self.postfix, self.detail, self.t0 = 0, "", "", time.perf_counter()
        self.last = self.t0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            self._write()

    def set_description(self, detail: str) -> None:
        self.detail = detail

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def close(self) -> None:
        if self.n:
            self._write()
        if self.log.lost > 1:
            print(f"({self.log.failure()})", file=sys.stderr)

    def _write(self) -> None:
        spent = time.perf_counter() - self.t0
        left = spent / self.n * (self.total - self.n) if self.n else 0
        units = self.unit + ("es" if self.unit.endswith(("ch", "sh", "s", "x")) else "s")
        line = (f"{self.desc}{f' ({self.detail})' if self.detail else ''}: {self.n}/{self.total} {units} "
                f"({self.n / max(self.total, 1):.0%}), "
                f"{spent:.0f} s" + (f", ~{left:.0f} s left" if self.n < self.total else "")
                + (f", {self.postfix}" if self.postfix else ""))
        if not self.log.write(line) and self.log.lost == 1:  # said once, in the notebook's output
            print(f"(progress line not written: {self.log.failure()})", file=sys.stderr)


def bar(total: int, desc: str, *, enabled: bool, run_dir=None, unit: str = "step", every_s: float = 15.0):
    """A progress bar over ``total`` ``unit``\\ s: tqdm when ``enabled``; else periodic lines when
    ``run_dir`` lies in the folder of an active ``lora-kit run``; else a silent tqdm (same methods)."""
    from tqdm.auto import tqdm
    if enabled:
        return tqdm(total=total, desc=desc, unit=unit, leave=False)
    ident = active_run(run_dir) if run_dir is not None else None
    if ident is None:
        return tqdm(total=total, disable=True)
    return _Lines(Path(ident["dir"]) / PROGRESS_LOG, total, desc, unit, every_s)


def follow(run_dir: str | Path, log, prefix: str = "      ", poll_s: float = 1.0):
    """Start printing, through ``log``, each line appended to ``<run_dir>/progress.log`` from now on;
    returns a function that stops (printing what is left)."""
    path = Path(run_dir) / PROGRESS_LOG
    start = path.stat().st_size if path.exists() else 0
    stop = threading.Event()

    def drain():
        nonlocal start
        if not path.exists():
            return
        with open(path, encoding="utf-8") as f:
            f.seek(start)
            text = f.read()
        whole = text[:text.rfind("\n") + 1]
        start += len(whole.encode("utf-8"))
        for line in whole.splitlines():
            log(prefix + line)

    def loop():
        while not stop.wait(poll_s):
            drain()

    thread = threading.Thread(target=loop, daemon=True, name="lora-kit progress")
    thread.start()

    def done():
        stop.set()
        thread.join()
        drain()
    return done
