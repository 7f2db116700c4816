"""The main job: run the notebooks in order with papermill into ``runs/<name>/``.

Each notebook is executed headless with the same validated settings (``interactive=False``),
written next to its HTML export; the run card is built at the end, whatever the ending.

One run, one record (``pipeline.json``):

- the run has an id and a start time; the notebooks' kernels inherit them (see
  :mod:`lora_kit.results`), so every result file says which run wrote it and the card shows only
  this run's results;
- a folder that already holds a run is refused unless ``overwrite`` (the old run is moved aside
  to ``<name>.replaced-<id>``, never merged) or ``resume`` (same settings; only notebooks whose
  results prove them complete in that run are kept, the rest is moved aside and run again);
- every ending is recorded: "complete" (all notebooks ran and passed in this run), "partial" (those
  asked for passed; ``not_run`` lists the others), "failed at <nb>", "kernel died at <nb>" (with
  "likely out of host memory" when the kernel was SIGKILLed), "interrupted at <nb>" (SIGINT or
  SIGTERM: the kernel is interrupted so its own records say so, then stopped). A process killed
  outright leaves "running" with its pid and last update, which readers turn into "died";
- nothing is written into the notebooks folder or the package; a disk that fills up keeps the
  previous files and the record says what was not written.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import ClassVar

from jupyter_client.manager import AsyncKernelManager

from lora_kit.data import SPLIT_DIR, absolute_paths
from lora_kit.progress import follow
from lora_kit.ui.notebook import (FIGURE_INDEX, NOTEBOOK_ENV, PLOTLY_JS, RUNNING_SUFFIX, figure_index,
                                  kit_notebooks_dir)
from lora_kit.results import (RESERVE_BYTES, AppendLog, LineLog, NotWritten, active_run, check_movable_run,
                              check_output_dir, clean_leftovers, disk_full, entered_run, interrupts, new_run, now_iso,
                              process_alive, read_record, relay_lines, release_space, reserve_space, run_lock,
                              same_run, settled, signal_name, touch, write_json_atomic, write_text_atomic)
from lora_kit.settings import Settings

PIPELINE = (
    "00_stack_check.ipynb",
    "01_choose_method.ipynb",
    "02_memory_sweeps.ipynb",
    "03_smoke_run.ipynb",
    "04_evaluate.ipynb",
)
# the files whose records prove a notebook complete in a run, and the folders it owns
PROOF = {"00_stack_check.ipynb": "stack.json", "01_choose_method.ipynb": "plan.json",
         "02_memory_sweeps.ipynb": "sweeps.json", "03_smoke_run.ipynb": "smoke/smoke.json",
         "04_evaluate.ipynb": "eval/eval.json"}
# mix: 03's base-mix comparison; data: the rows 03 trained on and held out (data/trained.jsonl, heldout.jsonl),
# which 04 evaluates on and the card quotes
OWNED = {"03_smoke_run.ipynb": ("smoke", "mix", SPLIT_DIR), "04_evaluate.ipynb": ("eval",)}
SETTINGS_NOT_COMPARED = ("run_dir", "interactive")  # differ between runs of the same plan


class PipelineError(RuntimeError):
    """A notebook failed; ``.notebook`` names it and the outputs so far are kept."""

    def __init__(self, message: str, notebook: str):
        super().__init__(message)
        self.notebook = notebook


class RunExists(ValueError):
    """The run folder already holds a run and neither overwrite nor resume was asked."""


def notebooks_dir() -> Path:
    """The notebooks folder: the repository's ``notebooks/`` (editable install) or package data."""
    found = kit_notebooks_dir()
    if found is not None:
        return found
    raise FileNotFoundError("notebooks not found; run from a lora_kit checkout or pass --notebooks DIR.")


def select_notebooks(only: list[str] | None) -> list[str]:
    """The notebooks ``only`` names (prefixes such as "03" or full names); ValueError for one that matches none."""
    if not only:
        return list(PIPELINE)
    unknown = [o for o in only if not any(n.startswith(str(o)) for n in PIPELINE)]
    if unknown:
        raise ValueError(f"--only {' '.join(map(str, unknown))} matches no notebook; choose from "
                         f"{', '.join(n.split('_')[0] for n in PIPELINE)} ({', '.join(PIPELINE)}).")
    return [n for n in PIPELINE if any(n.startswith(str(o)) for o in only)]


def check_notebooks(nb_dir: str | Path, names: list[str]) -> Path:
    d = Path(nb_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"--notebooks {str(nb_dir)!r} is not a folder; pass the folder holding {names[0]} "
                         "(default: the kit's notebooks/).")
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise ValueError(f"--notebooks {str(nb_dir)!r} lacks {', '.join(missing)}; pass the folder holding the "
                         "kit's notebooks.")
    return d.resolve()


def export_html(nb_path: Path) -> Path | None:
    """HTML export next to the executed notebook, written atomically; None if it fails. It renders
    offline: its figures load the run folder's one plotly.min.js (see :func:`lora_kit.ui.notebook.notebook_html`)."""
    try:
        from lora_kit.ui.notebook import notebook_html
        return write_text_atomic(nb_path.with_suffix(".html"), notebook_html(nb_path))
    except Exception as exc:  # an export problem must not lose the run
        print(f"  (HTML export of {nb_path.name} failed: {exc})", file=sys.stderr)
        return None


def injected_parameters(nb_path: Path, params: dict) -> dict:
    """What papermill injects into a notebook: the settings whose value differs from what the notebook
    takes on its own (its ``parameters`` cell, else the :class:`Settings` default). The kernel's
    ``setup`` rebuilds every other setting from those same defaults, so it validates exactly ``params``,
    and the executed notebook shows a short cell of what this run changed (not all ~45 settings)."""
    import ast

    import nbformat
    declared: dict = {}
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    try:
                        declared[node.targets[0].id] = ast.literal_eval(node.value)
                    except ValueError:  # not a literal: always injected
                        declared[node.targets[0].id] = object()
    defaults = Settings().to_dict()
    own = {**defaults, **declared}
    return {k: v for k, v in params.items() if k not in own or own[k] != v}


def _failure_text(exc: BaseException) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}".strip()


# ----------------------------------------------------------------------------------------------
# kernels: known by pid, so an interrupted run can stop them and a dead one can be explained
# ----------------------------------------------------------------------------------------------
class TrackedKernelManager(AsyncKernelManager):
    """papermill's kernel manager, remembering each kernel it starts (pid, exit code). On POSIX it talks
    to the kernel over local sockets (IPC), not TCP: nothing listens on a port, and the kernel has no
    reason to warn "Kernel is running over TCP without encryption" in every run."""
    started: ClassVar[list] = []
    files_dir: Path | None = None

    def __init__(self, **kw):
        self_dir = _kernel_dir() if os.name == "posix" else None
        if self_dir is not None:  # sockets and connection file in one folder of the temp folder, owned by this process
            kw.setdefault("transport", "ipc")
            kw.setdefault("ip", str(self_dir / "ipc"))
            kw.setdefault("connection_file", str(self_dir / "kernel.json"))
            super().__init__(**kw)
            self.files_dir = self_dir
        else:  # no temp folder short enough for a socket path: TCP on localhost, as Jupyter does by default
            super().__init__(**kw)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self.files_dir is not None:
            shutil.rmtree(self.files_dir, ignore_errors=True)

    kernel_pid: int | None = None
    returncode: int | None = None
    kernels_log: AppendLog | None = None  # kernels.log, fed by :attr:`kernels_relay`
    kernels_relay = None

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        # the kernel process's own messages (not cell outputs) go to kernels.log in the run folder (papermill
        # runs it with the run folder as working directory), not over the terminal: through a pipe, appended in
        # whole lines by this process (:func:`lora_kit.results.relay_lines`)
        ident = active_run(os.getcwd())
        if ident and "stderr" not in kw:
            read_end, write_end = os.pipe()
            try:
                kw.update(stderr=write_end, stdout=write_end)
                await super()._async_launch_kernel(kernel_cmd, **kw)
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)  # the kernel holds its own copy: the pipe ends when the kernel (and its children) do
            self.kernels_log = AppendLog(Path(ident["dir"]) / KERNELS_LOG)
            self.kernels_relay = relay_lines(read_end, self.kernels_log, name="lora-kit kernels.log")
        else:
            await super()._async_launch_kernel(kernel_cmd, **kw)
        self.kernel_pid = self.provisioner.process.pid
        TrackedKernelManager.started.append(self)

    def exit_code(self) -> int | None:
        """The kernel's exit code once it ended (negative: killed by that signal), else None."""
        proc = getattr(self.provisioner, "process", None)
        if proc is not None and proc.poll() is not None:
            self.returncode = proc.returncode
        return self.returncode

    def alive(self) -> bool:
        return self.kernel_pid is not None and self.exit_code() is None and \
            process_alive({"pid": self.kernel_pid}) is True


KERNELS_LOG = "kernels.log"
KERNEL_FILES = "lk-kernel-"  # <temp folder>/lk-kernel-<pid of lora-kit run>-<random>/: ipc sockets + kernel.json
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the terminating NUL)


def _kernel_bases() -> list[Path]:
    import tempfile
    return list(dict.fromkeys([Path(tempfile.gettempdir()), Path("/tmp")]))


def _kernel_dir() -> Path | None:
    """A fresh folder for one kernel's sockets, in the temp folder, or ``/tmp`` when the temp folder's path is too
    long for a socket (ZeroMQ names them ``<folder>/ipc-<n>``); None when neither is short enough or writable."""
    import tempfile
    clean_kernel_files()
    for base in _kernel_bases():
        try:
            d = Path(tempfile.mkdtemp(prefix=f"{KERNEL_FILES}{os.getpid()}-", dir=base))
        except OSError:
            continue
        if len(os.fsencode(d / "ipc")) + 4 <= SOCKET_PATH_MAX:
            return d
        shutil.rmtree(d, ignore_errors=True)
    return None


def clean_kernel_files() -> list[str]:
    """Remove the kernel folders (IPC sockets, connection file) of ``lora-kit run`` processes that are gone: a run
    killed outright (SIGKILL) cannot remove its own; its kernel exits when it sees its parent gone."""
    removed = []
    for d in (d for base in _kernel_bases() for d in base.glob(f"{KERNEL_FILES}*")):
        try:
            pid = int(d.name[len(KERNEL_FILES):].split("-")[0])
        except ValueError:
            continue
        if d.is_dir() and d.stat().st_uid == os.getuid() and process_alive({"pid": pid}) is False:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def oom_kills() -> int | None:
    """How many times the kernel's out-of-memory killer ran (host + this cgroup), or None if unreadable."""
    total, seen = 0, False
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                total, seen = total + int(line.split()[1]), True
    except (OSError, ValueError):
        pass
    try:
        cg = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[1]
        for line in (Path("/sys/fs/cgroup") / cg.lstrip("/") / "memory.events").read_text().splitlines():
            if line.startswith("oom_kill "):
                total, seen = total + int(line.split()[1]), True
    except (OSError, IndexError, ValueError):
        pass
    return total if seen else None


def kernel_death(exit_code: int | None, oom_before: int | None, oom_after: int | None) -> str:
    """Why a kernel died, in words: SIGKILL with the OOM killer running (or unobservable) is likely OOM."""
    if exit_code is not None and exit_code < 0:
        how = f"killed by {signal.Signals(-exit_code).name}"
    else:
        how = "exited" + (f" with code {exit_code}" if exit_code is not None else "")
    oom_ran = oom_before is not None and oom_after is not None and oom_after > oom_before
    if oom_ran or (exit_code == -signal.SIGKILL and oom_after is None):
        return (f"the kernel died ({how}): likely out of host memory -- lower batch_size / seq_len or use a "
                "machine with more RAM" + (" (the out-of-memory killer ran)" if oom_ran else ""))
    return f"the kernel died ({how})"


def _stop_kernel(km: TrackedKernelManager, out: Path, signame: str, grace: float = 5.0) -> None:
    """Pass the signal on to the kernel (so a smoke run records its own "interrupted"), then kill its
    process group."""
    pid = km.kernel_pid
    if not km.alive():
        return
    try:
        os.kill(pid, getattr(signal, signame, signal.SIGINT))
        t_end = time.monotonic() + grace
        while time.monotonic() < t_end and _running_records(out, pid):
            time.sleep(0.1)
        time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)  # the kernel leads its own session: this takes its children too
    except (ProcessLookupError, PermissionError):
        pass
    try:
        km.provisioner.process.wait(timeout=10)
    except Exception:  # noqa: BLE001 - best effort; the pid check below settles the records anyway
        pass


def _running_records(out: Path, pid: int | None = None) -> list[Path]:
    found = []
    for p in sorted(out.rglob("smoke.json")):
        rec = read_record(p)
        if rec and rec.get("status") == "running" and (pid is None or (rec.get("process") or {}).get("pid") == pid):
            found.append(p)
    return found


def _settle_children(out: Path, ending: str) -> None:
    """Records under the run that still say "running" from a process that is gone get ``ending``."""
    for p in _running_records(out):
        rec = read_record(p)
        if rec is None or process_alive(rec.get("process")) is not False:
            continue
        where = rec.get("current")
        rec.update(status="interrupted" + (f" at {where}" if where else ""), ending=ending)
        if where and (rec.get("phases") or {}).get(where, {}).get("status") == "running":
            rec["phases"][where]["status"] = "interrupted"
        try:
            write_json_atomic(p, touch(rec))
        except NotWritten:
            pass


# ----------------------------------------------------------------------------------------------
# the run folder: fresh, overwritten (old run moved aside) or resumed (proven parts kept)
# ----------------------------------------------------------------------------------------------
def _aside(out: Path, label: str) -> Path:
    dest = out.parent / f"{out.name}.{label}"
    n = 1
    while dest.exists():
        n += 1
        dest = out.parent / f"{out.name}.{label}-{n}"
    return dest


def _proven(out: Path, entry: dict, ident: dict) -> bool:
    name = entry.get("notebook")
    if entry.get("status") != "ok" or name not in PROOF or not (out / name).is_file():
        return False
    rec = read_record(out / PROOF[name])
    return same_run(rec, ident) and rec.get("status", "complete") == "complete"


def prepare_run_dir(out: Path, params: dict, overwrite: bool, resume: bool, log) -> tuple[dict, list[dict], list]:
    """(identity, kept notebook entries, resumed history) for ``out``; moves an old run aside when asked."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other; choose one.")
    left = clean_leftovers(out)  # the folder's lock is held: what a killed writer left is nobody's
    if left:
        log(f"removed what a killed run left in {out}: {', '.join(left)}")
    if not out.exists() or not any(out.iterdir()):
        return new_run("lora-kit run", out), [], []
    old_raw = read_record(out / "pipeline.json")
    old = settled(old_raw)
    what = (f"a run ({old.get('status')}, id {(old.get('run') or {}).get('id')}, started "
            f"{(old.get('run') or {}).get('started')})" if old else "files")
    if old and old.get("status") == "running":
        pid = (old.get("process") or {}).get("pid")
        raise RunExists(f"{out} holds a run that is still running (pid {pid}); wait for it, stop it, or choose "
                        "another --name.")
    if resume or overwrite:
        check_movable_run(out, old)
    if resume:
        if not old or not old.get("run"):
            raise RunExists(f"--resume: {out} holds {what} but no pipeline record to resume; use --overwrite "
                            "(moves them aside) or another --name.")
        before = {k: v for k, v in (old.get("settings") or {}).items() if k not in SETTINGS_NOT_COMPARED}
        now = {k: v for k, v in params.items() if k not in SETTINGS_NOT_COMPARED}
        diff = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if diff:
            raise RunExists(f"--resume: settings differ from the run in {out} ({', '.join(diff)}); a resumed run "
                            "keeps one set of settings. Use --overwrite or another --name to run these settings.")
        ident = old["run"]
        kept = [e for e in old.get("notebooks", []) if _proven(out, e, ident)]
        keep = {"pipeline.json", "settings.json", FIGURE_INDEX, PLOTLY_JS}
        for e in kept:
            keep |= {e["notebook"], Path(e["notebook"]).with_suffix(".html").name, PROOF[e["notebook"]].split("/")[0],
                     *OWNED.get(e["notebook"], ())}
        index = figure_index(out)  # a figure belongs to the notebook that saved it (figures.json), in this run
        kept_figures = {n for n, v in index.items() if isinstance(v, dict) and v.get("run") == ident.get("id")
                        and v.get("notebook") in {e["notebook"] for e in kept}}
        aside = _aside(out, f"aside-{time.strftime('%Y%m%dT%H%M%S')}")
        moved = []
        for p in sorted(out.iterdir()):
            if p.name == "figures" and p.is_dir():
                for f in sorted(p.iterdir()):
                    if f.name.rsplit(".", 1)[0] not in kept_figures:
                        (aside / "figures").mkdir(parents=True, exist_ok=True)
                        shutil.move(str(f), aside / "figures" / f.name)
                        moved.append(f"figures/{f.name}")
            elif p.name not in keep:
                aside.mkdir(parents=True, exist_ok=True)
                shutil.move(str(p), aside / p.name)
                moved.append(p.name)
        log(f"resuming run {ident['id']}: kept {', '.join(e['notebook'] for e in kept) or 'nothing'}"
            + (f"; moved {len(moved)} unproven file(s) to {aside}" if moved else ""))
        return ident, kept, list(old.get("resumed", [])) + [{"at": now_iso(), "kept": [e["notebook"] for e in kept],
                                                              "moved_aside": str(aside) if moved else None}]
    if overwrite:
        old_id = ((old or {}).get("run") or {}).get("id") or time.strftime("%Y%m%dT%H%M%S")
        dest = _aside(out, f"replaced-{old_id}")
        os.replace(out, dest)
        log(f"moved the previous run aside: {dest}")
        return new_run("lora-kit run", out), [], []
    try:  # files that are not a run (or not movable): --overwrite / --resume would refuse them too, so not offered
        check_movable_run(out, old)
    except ValueError as e:
        raise RunExists(f"{out} already holds {what}; {e}") from None
    raise RunExists(f"{out} already holds {what}. Pass --overwrite to move it aside and start afresh, --resume to "
                    "keep its completed notebooks, or choose another --name.")


# ----------------------------------------------------------------------------------------------
# the job
# ----------------------------------------------------------------------------------------------
def check_thread_env(environ=os.environ) -> None:
    """ValueError when ``OMP_NUM_THREADS`` is set to what OpenMP cannot read (a positive whole number, or a comma
    list of them for nested levels): libgomp only warns, in the kernel's log, and runs with its own default."""
    import re
    value = environ.get("OMP_NUM_THREADS")
    if value is None or value.strip() == "":
        return
    if not re.fullmatch(r"\s*[1-9]\d*\s*(,\s*[1-9]\d*\s*)*", value):
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive whole number; OpenMP would ignore it and pick "
                         "its own thread count. Unset it or set it to a number, e.g. OMP_NUM_THREADS=1.")


def run_pipeline(settings: Settings, out_dir: str | Path, notebooks: str | Path | None = None,
                 only: list[str] | None = None, log=print, overwrite: bool = False, resume: bool = False) -> dict:
    """Execute the notebooks into ``out_dir``; returns the pipeline record (also ``pipeline.json``).

    Raises ValueError (bad input: nothing was run), :class:`PipelineError` (a notebook failed or its
    kernel died; outputs kept, card built) or :class:`lora_kit.results.Interrupted` /
    ``KeyboardInterrupt`` (recorded as "interrupted", card built).
    """
    import papermill as pm

    check_thread_env()
    names = select_notebooks(only)
    nb_dir = check_notebooks(notebooks if notebooks else notebooks_dir(), names)
    out = check_output_dir(out_dir, nb_dir, create=False)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other; choose one.")
    with run_lock(out):  # one run per folder: a second one is refused here, before it reads or moves anything
        return _run_locked(pm, settings, out, nb_dir, names, log, overwrite, resume)


def _run_locked(pm, settings: Settings, out: Path, nb_dir: Path, names: list[str], log, overwrite: bool,
                resume: bool) -> dict:
    settings = settings.replace(run_dir=str(out), interactive=False, **absolute_paths(settings))  # kernels run in out/
    params = settings.to_dict()
    ident, kept, resumed = prepare_run_dir(out, params, overwrite, resume, log)
    check_output_dir(out, nb_dir)
    done = {e["notebook"] for e in kept}
    todo = [n for n in names if n not in done]
    record = {"run": ident, "kind": "lora_kit.pipeline", "status": "running", "run_dir": str(out),
              "requested": names, "notebooks": list(kept), "not_run": [], "settings": params}
    if resumed:
        record["resumed"] = resumed
    logs: list[AppendLog] = []  # the run's logs, whose lost records the record lists at the end (not_written)
    with entered_run(ident), _papermill_log(out, logs), _reserved(out):
        write_json_atomic(out / "settings.json", params)
        _save(out, record)
        t_all = time.perf_counter()
        with interrupts():  # SIGINT / SIGTERM -> Interrupted once; a repeat during the clean-up is ignored
            try:
                for i, name in enumerate(todo, 1):
                    log(f"[{i}/{len(todo)}] {name} ...")
                    stop_following = follow(out, log)  # the notebook's training / evaluation progress lines
                    try:
                        _run_one(pm, nb_dir, out, name, params, record, logs)
                    finally:
                        stop_following()
                    log(f"      ok in {record['notebooks'][-1]['seconds']:.1f} s")
                ran_ok = {e["notebook"] for e in record["notebooks"] if e["status"] == "ok"}
                record["not_run"] = [n for n in PIPELINE if n not in ran_ok]
                record["status"] = "complete" if not record["not_run"] else "partial"
                _finish(out, record, t_all, log, logs)
            except KeyboardInterrupt as exc:
                if record["status"] in ("complete", "partial"):  # every notebook had ended: only the card is lost
                    _save(out, record)
                    raise
                _end_interrupted(out, record, exc, todo)
                _finish(out, record, t_all, log, logs)
                raise
            except _NotebookFailed as exc:
                _finish(out, record, t_all, log, logs)
                lost = "".join(f"\n  {line}" for line in record.get("not_written", []))
                raise PipelineError(exc.message + lost, exc.name) from exc.__cause__
    return record


@contextlib.contextmanager
def _reserved(out: Path):
    """Disk held back for the run's ending (see :func:`_save`), given back when the run ends."""
    reserve_space(out)
    try:
        yield
    finally:
        release_space(out)


@contextlib.contextmanager
def _papermill_log(out: Path, logs: list):
    """papermill's and nbclient's messages go to ``pipeline.log`` in the run folder, each record whole
    (:class:`lora_kit.results.LineLog`; its :class:`~lora_kit.results.AppendLog` joins ``logs``); the terminal
    gets our one-line progress and outcome. Every notebook receives all settings (one definition), so
    papermill's warnings about parameters a notebook does not declare are expected: errors only."""
    logger = logging.getLogger("papermill")
    handler = LineLog(out / "pipeline.log")
    logs.append(handler.log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    before = logger.level, logger.propagate
    logger.setLevel(logging.ERROR)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(before[0])
        logger.propagate = before[1]


class _NotebookFailed(Exception):
    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name, self.message = name, message


def _run_one(pm, nb_dir: Path, out: Path, name: str, params: dict, record: dict, logs: list) -> None:
    dst = out / name
    t0 = time.perf_counter()
    entry = {"notebook": name, "status": "running", "started": now_iso(), "started_unix": time.time()}
    record["notebooks"].append(entry)
    record["current"] = name
    _save(out, record)
    n_kernels, oom_before = len(TrackedKernelManager.started), oom_kills()
    os.environ[NOTEBOOK_ENV] = name  # the kernel inherits it: figures.json says which notebook saved a figure
    running = running_notebook(dst)
    try:
        try:
            with notebook_saves(dst):  # papermill saves dst (its metadata names dst) into the running file
                pm.execute_notebook(str(nb_dir / name), str(dst),
                                    parameters=injected_parameters(nb_dir / name, params), kernel_name="python3",
                                    cwd=str(out), progress_bar=False, log_output=False,
                                    kernel_manager_class=TrackedKernelManager)
            os.replace(running, dst)  # the executed notebook appears whole, once it has run to its end
        finally:
            os.environ.pop(NOTEBOOK_ENV, None)
            logs += [km for km in TrackedKernelManager.started[n_kernels:] if km.kernels_log is not None]
    except KeyboardInterrupt as exc:
        kept = keep_unfinished(running, dst, f"interrupted ({signal_name(exc)})")
        if kept is not None and kept != dst:
            entry["kept_as"] = kept.name
        raise
    except Exception as exc:
        entry.update(seconds=round(time.perf_counter() - t0, 2), ended_unix=time.time())
        kms = TrackedKernelManager.started[n_kernels:]
        if type(exc).__name__ == "DeadKernelError":
            why = kernel_death(kms[-1].exit_code() if kms else None, oom_before, oom_kills())
            entry.update(status="kernel died", error=why)
            record["status"] = f"kernel died at {name}"
            _settle_children(out, f"{why} during {name}")
        else:
            entry.update(status="failed", error=_failure_text(exc))
            record["status"] = f"failed at {name}"
        full = disk_full(exc)
        if full:
            entry["error"] += " (disk full)"
            record["status"] += " (disk full)"
        record["not_run"] = [n for n in record["requested"] if n not in {e["notebook"] for e in record["notebooks"]}]
        kept = keep_unfinished(running, dst, f"{entry['status']}: {entry['error']}")
        if kept is not None:
            entry["html"] = getattr(export_html(kept), "name", None)
            if kept != dst:
                entry["kept_as"] = kept.name
        kept = ("" if kept is None else f"\n  executed notebook kept at {kept}" + (
            ", its first cell saying that it did not finish" if kept == dst else " (the name says it did not finish)"))
        raise _NotebookFailed(name, f"{name} {entry['status']}: {entry['error']}{kept}\n"
                                    f"  all outputs so far are in {out}") from exc
    entry.update(status="ok", seconds=round(time.perf_counter() - t0, 2), ended_unix=time.time())
    html = export_html(dst)
    entry["html"] = html.name if html else None
    record.pop("current", None)
    _save(out, record)


UNFINISHED_TAG = "lora-kit-unfinished"  # the first cell of an executed notebook that did not run to its end


def running_notebook(dst: Path) -> Path:
    """Where papermill writes ``dst`` while it executes: ``<stem>.running.ipynb`` beside it, renamed to ``dst``
    when the notebook has run to its end; a run killed outright leaves it under this name."""
    return dst.with_name(dst.stem + RUNNING_SUFFIX)


@contextlib.contextmanager
def notebook_saves(dst: Path):
    """Inside: each save papermill makes of ``dst`` (after every cell) goes to :func:`running_notebook` instead,
    replacing it whole (:func:`lora_kit.results.write_text_atomic`), so ``dst`` appears only when renamed at the
    end, a reader or a kill never finds half a notebook, and a full disk keeps the previous save and raises
    :class:`lora_kit.results.NotWritten`. Other files in ``dst``'s folder are written whole too."""
    from papermill.iorw import LocalHandler, papermill_io
    running = running_notebook(dst)

    class AtomicSaves(LocalHandler):
        def write(self, buf, path):
            write_text_atomic(running if Path(path) == dst else path, buf)

    entry = (str(dst.parent) + os.sep, AtomicSaves())  # papermill takes the first registered prefix a path starts with
    papermill_io.register(*entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            papermill_io._handlers.remove(entry)  # papermill has no unregister


def keep_unfinished(running: Path, dst: Path, ending: str) -> Path | None:
    """Keep the notebook papermill was executing (``running``) as ``dst``, its first cell saying that it did not
    finish and why (``ending``); where that cannot be written (full disk, an unreadable save), the file is renamed
    ``<stem>.unfinished.ipynb`` instead, the name saying it. Returns where it is; None when there was none."""
    if not running.exists():
        return None
    import nbformat
    try:
        nb = nbformat.read(running, as_version=4)
        note = nbformat.v4.new_markdown_cell(
            f"**This notebook did not finish: {ending}.** The cells below show what ran before that; the run's "
            "record is `pipeline.json`.")
        note.metadata["tags"] = [UNFINISHED_TAG]
        nb.cells.insert(0, note)
        write_text_atomic(dst, nbformat.writes(nb))
        running.unlink()
        return dst
    except Exception:  # noqa: BLE001 - the disk has no room to say it inside: the name says it
        unfinished = dst.with_name(f"{dst.stem}.unfinished.ipynb")
        try:
            os.replace(running, unfinished)
        except OSError:
            return running
        return unfinished


def _end_interrupted(out: Path, record: dict, exc: BaseException, todo: list[str]) -> None:
    sig = signal_name(exc)
    current = record.get("current")
    for km in TrackedKernelManager.started:
        _stop_kernel(km, out, sig)
    where = f"during {current}" if current else "between notebooks"
    _settle_children(out, f"the run was interrupted ({sig}) {where}; its kernel was stopped")
    where += "; its kernel was interrupted and shut down" if current else ""
    for e in record["notebooks"]:
        if e["status"] == "running":
            e.update(status="interrupted", ended_unix=time.time())
            kept = out / e.get("kept_as", e["notebook"])
            if kept.exists():
                e["html"] = getattr(export_html(kept), "name", None)
    ran = {e["notebook"] for e in record["notebooks"]}
    record["not_run"] = [n for n in todo if n not in ran]
    record["status"] = "interrupted" + (f" at {current}" if current else "")
    record["ending"] = f"{sig} {where}"


def _save(out: Path, record: dict) -> None:
    """Write pipeline.json. On a full disk the run's reserve (:func:`lora_kit.results.reserve_space`) is given
    back and the write tried once more, so the record never stays "running" for want of a few kilobytes; what
    still cannot be written is recorded in memory (``not_written``) and reported at the end."""
    try:
        write_json_atomic(out / "pipeline.json", touch(record))
    except NotWritten as exc:
        if disk_full(exc) and release_space(out):
            record["disk_full"] = ("the disk filled up during the run; its reserve of "
                                   f"{RESERVE_BYTES // 2**20} MiB was given back to record this ending and the card")
            _save(out, record)
            return
        record.setdefault("not_written", []).append(str(exc))


def _finish(out: Path, record: dict, t_all: float, log, logs: list) -> None:
    record.pop("current", None)
    _log_failures(record, logs)
    record["seconds"] = round(time.perf_counter() - t_all, 2)
    record["ended"] = now_iso()
    _save(out, record)
    _build_report_safely(out, log)


def _log_failures(record: dict, logs: list, wait_s: float = 5.0) -> None:
    """Add to ``record["not_written"]`` what the run's logs could not write: its own ``AppendLog`` s and the kernel
    managers whose ``kernels.log`` relays are waited for (``wait_s`` in all) once their kernels are gone."""
    seen, until = set(), time.monotonic() + wait_s
    for item in logs:
        if isinstance(item, TrackedKernelManager):
            if item.kernels_relay is not None:
                item.kernels_relay.join(max(0.0, until - time.monotonic()))
            item = item.kernels_log
        text = item.failure() if id(item) not in seen else None
        seen.add(id(item))
        if text:
            record.setdefault("not_written", []).append(text)


def _build_report_safely(out: Path, log) -> None:
    from lora_kit.ui.run_card import build_report
    log("building the run card (its first time for a model and step, estimate fits the Trainer's and TRL's loops "
        "on the spot: up to a few minutes on a CPU)")
    t0 = time.monotonic()
    for _ in range(2):
        try:
            paths = build_report(out)
            log(f"run card: {paths['md']} ({time.monotonic() - t0:.0f} s)")
            return
        except NotWritten as exc:  # a full disk: the run's reserve makes room for the card once
            if not (disk_full(exc) and release_space(out)):
                log(f"(run card could not be built: {exc})")
                return
        except Exception as exc:  # the report must never hide the run's own outcome
            log(f"(run card could not be built: {type(exc).__name__}: {exc})")
            return
