"""Results that nothing can lose or mix up: atomic writes, run identity, recorded endings.

- **Atomic writes.** :func:`write_text_atomic` / :func:`write_json_atomic` write a temp file in
  the same folder and rename it: a reader sees the old file or the new one, never half of one.
  A full disk raises :class:`NotWritten` (an ``OSError``) naming the file that was not written;
  the previous version stays intact.
- **Logs that grow during a run** (``progress.log``, ``pipeline.log``, ``kernels.log``, ``smoke.log``) are
  appended in whole records (:func:`append_line`: one write of whole lines under a lock; a record that does
  not fit is cut off again), so a reader or a crash never sees half a record; :class:`AppendLog` counts what
  could not be written, for the run's record. Summaries (JSON) are rewritten whole, as above.
- **Run identity.** Every run (``lora-kit run``, ``smoke_run``, ``evaluate``) has an id and a
  start time (:func:`run_identity`). ``lora-kit run`` puts its identity in the environment
  (:func:`entered_run`), so the notebook kernels it starts inherit it: every JSON result written
  inside that run's folder carries ``"run": {"id", "started", ...}`` and a reader (the run card)
  can tell this run's results from leftovers of another.
- **Every ending recorded.** Records that say ``"running"`` also hold the writer's ``process``
  (pid, host, process start time) and ``updated`` (last write); :func:`settled` turns "running"
  with a dead process into "died". :func:`interrupts` turns SIGTERM (what ``timeout``, Docker,
  Slurm and Kubernetes send) into :class:`Interrupted`, a ``KeyboardInterrupt``, so a run
  records "interrupted" the same way for Ctrl-C and SIGTERM.
- **Confinement.** :func:`check_run_name` (one plain path component) and :func:`check_output_dir`
  (never inside the package, never the notebooks folder itself, never the file system root, a home
  folder, a checkout's root or ``.git``, a virtual environment; the path and the reason when it
  cannot be made); :func:`check_movable_run`: only a folder holding a run record, outside git's tracked
  files, is ever moved aside.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RUN_ENV = "LORA_KIT_RUN"  # JSON identity of the active run, inherited by notebook kernels
PACKAGE_DIR = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# atomic writes
# ----------------------------------------------------------------------------------------------
class NotWritten(OSError):
    """A result file could not be written (disk full, read-only, ...); the previous file is intact."""

    def __init__(self, path: Path, exc: OSError):
        self.path = Path(path)
        self.reason = reason = ("no space left on device" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                                else exc.strerror or str(exc))
        super().__init__(exc.errno, f"{self.path} was not written: {reason}; the previous version of the file "
                                    "(if any) is kept. Free space or choose another runs folder.")


def _default(o: Any):
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return repr(o)


def _clean(o: Any):
    if isinstance(o, float) and not math.isfinite(o):
        return None  # JSON has no NaN/inf; null is honest
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (temp file in the same folder + rename).

    A dict written inside the folder of the active ``lora-kit run`` (see :func:`entered_run`)
    without a ``"run"`` key gets that run's identity, so notebook results say which run made them.
    """
    if isinstance(data, dict) and "run" not in data:
        ident = active_run(Path(path).parent)
        if ident is not None:
            data = {"run": ident, **data}
    return write_text_atomic(path, json.dumps(_clean(data), indent=2, default=_default) + "\n")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the new one, never half."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise NotWritten(path, exc) from exc
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return path


def _unlink_quietly(tmp) -> None:
    if tmp and os.path.exists(tmp):
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# ----------------------------------------------------------------------------------------------
# logs that grow during a run: whole records, appended
# ----------------------------------------------------------------------------------------------
def append_line(path: str | Path, text: str) -> Path:
    """Append ``text`` to the log ``path`` as one whole record: its line(s), newline-terminated, written with one
    ``os.write`` (unbuffered: nothing waits in a buffer) under an exclusive ``flock``, so writers in several
    processes never interleave. A record is whole or absent: one that cannot be written completely (full disk) is
    cut off again and raises :class:`NotWritten`, the earlier records intact; a tail left without its newline by a
    writer killed mid-write is cut off before this record, so no record is glued to half of another. Readers take
    only newline-terminated lines (:func:`read_log`)."""
    import fcntl
    path = Path(path)
    data = (text if text.endswith("\n") else text + "\n").encode("utf-8", errors="replace")
    fd = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # read: where the last whole record ends
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        end = _whole_end(fd, os.fstat(fd).st_size)
        if end != os.fstat(fd).st_size:
            os.ftruncate(fd, end)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise
    except OSError as exc:
        raise NotWritten(path, exc) from exc
    finally:
        if fd is not None:
            os.close(fd)
    return path


def _whole_end(fd: int, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the last newline of the open file ``fd`` of ``size`` bytes (0 when it has none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - chunk)
        block = os.pread(fd, pos - start, start)
        i = block.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def read_log(path: str | Path) -> list[str]:
    """The whole records (newline-terminated lines) of a log; [] when it is absent."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    return data[:data.rfind(b"\n") + 1].decode("utf-8", errors="replace").splitlines()


class AppendLog:
    """A log that grows during a run, written record by record with :func:`append_line`. A record that cannot be
    written (full disk) never stops the run: it is counted, and :meth:`failure` says what was lost, for the run's
    own record (``pipeline.json``'s ``not_written``, a notebook's output). ``fresh``: start the log empty (an
    atomic replace), as a log of one run does."""

    def __init__(self, path: str | Path, fresh: bool = False):
        self.path, self.lost, self.error = Path(path), 0, None
        if fresh:
            try:
                write_text_atomic(self.path, "")
            except NotWritten as exc:
                self.error = exc

    def write(self, text: str) -> bool:
        """Append one record; False (and counted) when it was not written."""
        try:
            append_line(self.path, text)
            return True
        except NotWritten as exc:
            self.lost += 1
            self.error = self.error or exc
            return False

    def failure(self) -> str | None:
        """What was not written, in one line, or None."""
        if self.error is None:
            return None
        what = f"{self.lost} record(s)" if self.lost else "its fresh start"
        return f"{self.path}: {what} not written ({self.error.reason}); the records before are whole"


class LineLog(logging.Handler):
    """A ``logging`` handler writing each log record whole into an :class:`AppendLog` (``.log``): never half a
    record, never a traceback printed over the run's output when the disk is full (see :meth:`AppendLog.failure`)."""

    def __init__(self, path: str | Path, fresh: bool = False, level: int = logging.NOTSET):
        super().__init__(level)
        self.log = AppendLog(path, fresh=fresh)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - a record that cannot be formatted: logging's own report
            self.handleError(record)
            return
        self.log.write(text)


def relay_lines(fd: int, log: AppendLog, name: str = "lora-kit log relay") -> threading.Thread:
    """Start a thread that reads the pipe ``fd`` (a child process's stdout/stderr) until its end and appends what
    arrives to ``log`` in whole lines (a last line without its newline is completed when the pipe ends);
    it closes ``fd``. Returns the thread (daemon): join it once the child is gone."""

    def pump():
        rest = b""
        try:
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except InterruptedError:  # pragma: no cover - retried by Python itself since 3.5
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                rest += chunk
                cut = rest.rfind(b"\n") + 1 or (len(rest) if len(rest) >= 1 << 20 else 0)  # a 1 MiB line: as is
                if cut:
                    log.write(rest[:cut].decode("utf-8", errors="replace"))
                    rest = rest[cut:]
            if rest:
                log.write(rest.decode("utf-8", errors="replace"))
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    thread = threading.Thread(target=pump, daemon=True, name=name)
    thread.start()
    return thread


RESERVE = ".lora-kit-reserve"  # disk held back by a run so that it can still record its ending on a full disk
RESERVE_BYTES = 1 << 20


def reserve_space(folder: str | Path, nbytes: int = RESERVE_BYTES) -> Path | None:
    """Hold ``nbytes`` of disk in ``folder`` (a hidden file of zeros, fsynced so the blocks are taken). When the
    disk fills up, :func:`release_space` gives them back for the run's last records (its status, its card).
    None when even the reserve cannot be written (the disk is full already)."""
    path = Path(folder) / RESERVE
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * nbytes)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        _unlink_quietly(path)
        return None
    return path


def release_space(folder: str | Path) -> bool:
    """Give back the disk :func:`reserve_space` held in ``folder``; True when there was a reserve."""
    try:
        (Path(folder) / RESERVE).unlink()
        return True
    except OSError:
        return False


def disk_full(exc: BaseException | None) -> bool:
    """True when ``exc`` (or what caused it) is a full disk or an exceeded quota."""
    while exc is not None:
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc) \
                or "no space left" in str(getattr(exc, "evalue", "")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# what a writer killed outright leaves behind: temp files of atomic writes, an adapter save's temp folders, a
# PNG being rendered, a run's disk reserve, a writability probe
LEFTOVERS = (".*.tmp", ".*.saving-*", ".*.replaced-*", ".*.partial.png", RESERVE, ".lora-kit-probe-*")


def clean_leftovers(folder: str | Path) -> list[str]:
    """Remove :data:`LEFTOVERS` anywhere under ``folder``; returns them relative to ``folder``. Only for a folder
    whose lock (:func:`run_lock`) is held: then no live writer owns them."""
    import shutil
    d = Path(folder)
    if not d.is_dir():
        return []
    found = sorted({p for pattern in LEFTOVERS for p in d.rglob(pattern)})
    removed = []
    for p in found:
        if not any(q in found for q in p.parents):  # inside a removed folder already
            with contextlib.suppress(OSError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(str(p.relative_to(d)))
    return removed


class RunLocked(ValueError):
    """Another live process is writing into this run folder."""


@contextlib.contextmanager
def run_lock(run_dir: str | Path):
    """Hold the run folder ``run_dir`` for this process: an exclusive ``flock`` on ``.<name>.lock`` beside it (the
    folder itself may be moved aside or not exist yet). A second run into the same folder gets :class:`RunLocked`
    at once, naming the holder; the lock ends with the process, however it ends (SIGKILL included). The file is
    removed when the run ends (a killed run leaves it, and the next run takes it over): it is deleted while held,
    and a run that locked a file since deleted takes the new one, so two runs never hold the folder at once."""
    import fcntl
    p = Path(run_dir).expanduser().resolve()
    p.parent.mkdir(parents=True, exist_ok=True)
    lock = p.parent / f".{p.name}.lock"
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise NotWritten(lock, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunLocked(f"{str(p)!r} is in use by another run ({holder}); wait for it to end, stop it, or choose "
                            "another --name / run_dir.") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # its holder removed it as we locked it
            same = False
        if same:
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # who holds it, for the message above; a full disk only loses that
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {now_iso()}\n".encode(), 0)
        yield p
    finally:
        with contextlib.suppress(OSError):  # removed while still held: a run waiting on this file retries
            lock.unlink()
        os.close(fd)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def read_record(path: str | Path) -> dict | None:
    """A JSON record, or None when it is absent or unreadable (a reader never crashes on a result)."""
    try:
        rec = read_json(path)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


MODEL_KEYS = ("model", "plan_model", "base_model")  # a local model folder is named by its own name in a card


def portable(obj: Any, run_dir: str | Path) -> Any:
    """``obj`` (JSON-like) with no absolute local path, for files meant to be sent (the run card): a model
    (:data:`MODEL_KEYS`) by its folder's name, any other string that is a path relative to ``run_dir`` (the
    package's own files: ``lora_kit/...``); paths inside a longer text
    (an error message) lose the run folder, the package and the home folder's prefix."""
    d = Path(run_dir).resolve()
    if isinstance(obj, dict):
        return {k: Path(v.rstrip("/")).name if k in MODEL_KEYS and isinstance(v, str) and os.path.isabs(v)
                else portable(v, d) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v, d) for v in obj]
    if not isinstance(obj, str) or "/" not in obj:
        return obj
    if os.path.isabs(obj) and not any(c.isspace() for c in obj):
        p = Path(os.path.normpath(obj))
        if p == PACKAGE_DIR or PACKAGE_DIR in p.parents:
            return "lora_kit/" + p.relative_to(PACKAGE_DIR).as_posix() if p != PACKAGE_DIR else "lora_kit"
        return os.path.relpath(p, d) + ("/" if obj.endswith("/") and p != d else "")
    return portable_text(obj, d)


def portable_text(text: str, run_dir: str | Path) -> str:
    """``text`` with the run folder's, the package's and the home folder's absolute prefixes taken out."""
    d = str(Path(run_dir).resolve())
    end = r"(?![\w.+-])"
    text = re.sub(re.escape(d) + "/", "", text)
    text = re.sub(re.escape(d) + end, ".", text)
    text = re.sub(re.escape(str(PACKAGE_DIR)) + end, "lora_kit", text)
    home = str(Path.home())
    if home not in ("/", ""):
        text = re.sub(re.escape(home) + r"(?=/)", "~", text)

    def rel(m):  # any other absolute path on this machine: relative to the run folder
        path = m.group(0)
        first = path.split("/")[1]
        return os.path.relpath(path, d) if first and Path("/", first).exists() else path
    return re.sub(r"(?<![\w.~:/])/[^\s'\"`,;()\[\]]+", rel, text)


# ----------------------------------------------------------------------------------------------
# run identity
# ----------------------------------------------------------------------------------------------
def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def new_run(kind: str, run_dir: str | Path | None = None) -> dict:
    """A fresh identity: ``{"id", "started", "kind", "dir"}``; ids sort by start time."""
    return {"id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3),
            "started": now_iso(), "kind": kind,
            "dir": str(Path(run_dir).resolve()) if run_dir is not None else None}


def active_run(path: str | Path | None) -> dict | None:
    """The identity of the ``lora-kit run`` whose folder holds ``path`` (from the environment), or None."""
    raw = os.environ.get(RUN_ENV)
    if not raw or path is None:
        return None
    try:
        ident = json.loads(raw)
        root = Path(ident["dir"])
    except (ValueError, KeyError, TypeError):
        return None
    p = Path(path).resolve()
    return ident if p == root or root in p.parents else None


def run_identity(kind: str, run_dir: str | Path | None) -> dict:
    """This run's identity: the enclosing ``lora-kit run``'s when ``run_dir`` lies in its folder
    (a smoke run inside the pipeline belongs to the pipeline's run), else a new one."""
    return active_run(run_dir) or new_run(kind, run_dir)


@contextlib.contextmanager
def entered_run(identity: dict):
    """Make ``identity`` the active run for this process and the kernels it starts."""
    before = os.environ.get(RUN_ENV)
    os.environ[RUN_ENV] = json.dumps(identity)
    try:
        yield identity
    finally:
        if before is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = before


def same_run(record: dict | None, identity: dict | None) -> bool:
    """True when ``record`` carries the id of ``identity``."""
    return bool(record and identity and (record.get("run") or {}).get("id") == identity.get("id"))


# ----------------------------------------------------------------------------------------------
# processes: alive, dead, settled
# ----------------------------------------------------------------------------------------------
def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_info(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "proc_start": _proc_start(pid)}


def process_alive(proc: dict | None) -> bool | None:
    """True/False for a process recorded on this host; None when it cannot be told (other host)."""
    if not proc or not isinstance(proc.get("pid"), int):
        return None
    if proc.get("host") not in (None, socket.gethostname()):
        return None
    try:
        os.kill(proc["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    started = proc.get("proc_start")
    now = _proc_start(proc["pid"])
    if started and now and started != now:
        return False  # the pid was reused by another process
    if now is not None:
        with contextlib.suppress(OSError):  # a zombie is dead for our purpose
            if Path(f"/proc/{proc['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    return True


def touch(record: dict) -> dict:
    """Stamp the writer (pid, host) and the time of this write on ``record`` (in place)."""
    record["process"] = record.get("process") if (record.get("process") or {}).get("pid") == os.getpid() \
        else process_info()
    record["updated"] = now_iso()
    return record


def settled(record: dict | None) -> dict | None:
    """``record`` as a reader should see it: "running" whose process is gone becomes "died"."""
    if not record or record.get("status") != "running":
        return record
    if process_alive(record.get("process")) is not False:
        return record
    proc = record["process"]
    where = record.get("current") or record.get("current_phase")
    out = {**record, "status": "died" + (f" at {where}" if where else ""),
           "ending": f"process {proc['pid']} on {proc.get('host')} is gone without recording an ending "
                     f"(last update {record.get('updated', '?')}): killed (SIGKILL, out of memory) or crashed"}
    # nothing of a dead run is still running: its notebook entries and phases died with it
    if isinstance(record.get("notebooks"), list):
        out["notebooks"] = [{**e, "status": "died"} if isinstance(e, dict) and e.get("status") == "running" else e
                            for e in record["notebooks"]]
    if isinstance(record.get("phases"), dict):
        out["phases"] = {k: {**v, "status": "died"} if isinstance(v, dict) and v.get("status") == "running" else v
                         for k, v in record["phases"].items()}
    return out


# ----------------------------------------------------------------------------------------------
# signals
# ----------------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (SIGINT = Ctrl-C, or SIGTERM); ``.signal`` names it."""

    def __init__(self, signame: str = "SIGINT"):
        super().__init__(signame)
        self.signal = signame


def signal_name(exc: BaseException) -> str:
    return getattr(exc, "signal", "SIGINT")


@contextlib.contextmanager
def interrupts(sigint: bool = True):
    """Inside: SIGTERM (and SIGINT unless ``sigint=False``) raise :class:`Interrupted` once; a second
    signal during the clean-up that follows is ignored. Outside the main thread: does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [signal.SIGTERM] + ([signal.SIGINT] if sigint else [])
    before = {s: signal.getsignal(s) for s in sigs}
    fired = []

    def handler(signum, _frame):
        if fired:
            return
        fired.append(signum)
        raise Interrupted(signal.Signals(signum).name)
    for s in sigs:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


# ----------------------------------------------------------------------------------------------
# confinement
# ----------------------------------------------------------------------------------------------
_NAME = re.compile(r"^[^\W_][\w.+-]*$")


def check_run_name(name: str) -> str:
    """A run name is one plain path component: letters, digits, ``._+-``, not starting with a dot."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", "..") or len(name) > 128:
        raise ValueError(f"run name {name!r} is not a plain folder name; use letters, digits and . _ + - "
                         "(e.g. --name qlora-a100), not a path: the run goes under --runs-dir.")
    return name


def _git_root(p: Path) -> Path | None:
    return next((d for d in (p, *p.parents) if (d / ".git").exists()), None)


def protected_reason(path: str | Path) -> str | None:
    """Why ``path`` can never be a run folder (written, or moved aside): the file system root, a home folder, a git
    checkout's root or its ``.git``, a Python virtual environment; None when it can."""
    p = Path(path).expanduser().resolve()
    homes = {Path.home().resolve(), *(d.resolve() for d in (Path("/home"), Path("/root")) if d.exists())}
    if p == Path(p.anchor):
        return "the file system root"
    if p in homes or p.parent == Path("/home"):
        return "a home folder"
    if ".git" in p.parts:
        return "a git repository's .git folder"
    if (p / ".git").exists():
        return "the root of a git checkout"
    if any((d / "pyvenv.cfg").is_file() for d in (p, *p.parents)):
        return "a Python virtual environment"
    return None


def tracked_by_git(path: str | Path) -> bool:
    """True when ``path`` is, or holds, a file git tracks (its checkout's own files: never moved or replaced)."""
    p = Path(path).expanduser().resolve()
    root = _git_root(p)
    if root is None:
        return False
    import subprocess
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", str(p.relative_to(root)) or "."],
                             capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell: treat it as the checkout's
    return out.returncode != 0 or bool(out.stdout)


def check_movable_run(path: str | Path, record: dict | None) -> None:
    """ValueError unless ``path`` may be moved aside: it holds a lora_kit run record (``record``, with its ``run``
    identity) and is neither protected (:func:`protected_reason`) nor part of a git checkout's tracked files."""
    p = Path(path).expanduser().resolve()
    why = protected_reason(p)
    if why is None and not (record and isinstance(record.get("run"), dict) and record["run"].get("id")):
        why = "not a lora_kit run (it holds no run record, pipeline.json)"
    if why is None and tracked_by_git(p):
        why = "part of a git checkout's tracked files"
    if why:
        raise ValueError(f"{str(p)!r} is {why}: it is never moved aside or replaced. Choose another --name / "
                         "--runs-dir (default: runs/).")


def check_output_dir(path: str | Path, *notebook_dirs, create: bool = True) -> Path:
    """``path`` resolved; ValueError naming the path and the reason when it is inside the package or inside
    a notebooks folder (the kit's or one of ``notebook_dirs``: executed copies would replace the sources),
    or cannot be created / written. Only ``notebooks/runs/`` (git-ignored) is allowed there: it is where
    a notebook opened in JupyterLab puts its default relative ``run_dir = "runs/default"``."""
    p = Path(path).expanduser().resolve()
    why = protected_reason(p)
    if why:
        raise ValueError(f"output folder {str(p)!r} is {why}; runs must not write there. Choose another --name / "
                         "--runs-dir (default: runs/).")
    if p == PACKAGE_DIR or PACKAGE_DIR in p.parents:
        raise ValueError(f"output folder {str(p)!r} is inside the lora_kit package {str(PACKAGE_DIR)!r}; runs must "
                         "not write there. Choose another --runs-dir / run_dir (default: runs/).")
    for d in (PACKAGE_DIR.parent / "notebooks", *notebook_dirs):
        d = Path(d).resolve()
        if (p == d or d in p.parents) and d / "runs" not in p.parents:
            raise ValueError(f"output folder {str(p)!r} is inside the notebooks folder {str(d)!r}; runs must not "
                             "write there (executed notebooks would replace the sources). Choose another --name / "
                             "--runs-dir (default: runs/).")
    if create:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create output folder {str(p)!r}: {exc.strerror or exc}; choose another "
                             "--runs-dir / run_dir.") from None
    _check_writable(p)
    return p


def _check_writable(p: Path) -> None:
    """ValueError unless a file can be created in ``p`` (or, before it exists, in its nearest existing parent):
    tried with a real file, since permission bits say nothing for root or a read-only mount."""
    d = next(a for a in (p, *p.parents) if a.exists())
    if not d.is_dir():
        raise ValueError(f"cannot create output folder {str(p)!r}: {str(d)!r} is a file, not a folder; choose "
                         "another --runs-dir / run_dir.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".lora-kit-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"output folder {str(p)!r} is not writable ({exc.strerror or exc}); choose another "
                         "--runs-dir / run_dir.") from None
