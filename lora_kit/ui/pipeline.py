"""The main job: run the notebooks in order with papermill into ``runs/<name>/``.

Each notebook is executed headless with the same validated settings (``interactive=False``),
written next to its HTML export; the run card is built at the end. A failing notebook stops the
run with a clear message; everything produced so far (executed notebooks, HTML, JSON results,
``pipeline.json`` marked ``failed``) is kept.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from lora_kit.results import read_json, write_json_atomic
from lora_kit.settings import Settings

PIPELINE = (
    "00_stack_check.ipynb",
    "01_choose_method.ipynb",
    "02_memory_sweeps.ipynb",
    "03_smoke_run.ipynb",
    "04_evaluate.ipynb",
)


class PipelineError(RuntimeError):
    """A notebook failed; ``.notebook`` names it and the outputs so far are kept."""

    def __init__(self, message: str, notebook: str):
        super().__init__(message)
        self.notebook = notebook


def notebooks_dir() -> Path:
    """The notebooks folder: the repository's ``notebooks/`` (editable install) or package data."""
    package = Path(__file__).resolve().parents[1]
    for cand in (package.parent / "notebooks", package / "notebooks"):
        if (cand / PIPELINE[0]).is_file():
            return cand
    raise FileNotFoundError("notebooks not found; run from a lora_kit checkout or pass --notebooks DIR.")


def export_html(nb_path: Path) -> Path | None:
    """HTML export next to the executed notebook (figures embedded); None if export fails."""
    try:
        import nbformat
        from nbconvert import HTMLExporter
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(nb_path, as_version=4))
        out = nb_path.with_suffix(".html")
        out.write_text(body)
        return out
    except Exception as exc:  # an export problem must not lose the run
        print(f"  (HTML export of {nb_path.name} failed: {exc})", file=sys.stderr)
        return None


def _failure_text(exc: Exception) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}".strip()


def run_pipeline(settings: Settings, out_dir: str | Path, notebooks: str | Path | None = None,
                 only: list[str] | None = None, log=print) -> dict:
    """Execute the notebooks into ``out_dir``; returns the pipeline record (also ``pipeline.json``)."""
    import logging

    import papermill as pm
    # Every notebook receives all settings (one definition); papermill warns about those a notebook
    # does not declare in its parameters cell -- expected here, so keep its log to errors.
    logging.getLogger("papermill").setLevel(logging.ERROR)

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    nb_dir = Path(notebooks) if notebooks else notebooks_dir()
    names = [n for n in PIPELINE if not only or any(n.startswith(o) or n == o for o in only)]
    if not names:
        raise ValueError(f"--only {only} matches no notebook; notebooks are: {', '.join(PIPELINE)}.")
    settings = settings.replace(run_dir=str(out), interactive=False)
    params = settings.to_dict()
    write_json_atomic(out / "settings.json", params)
    record = {"status": "running", "run_dir": str(out), "notebooks": [], "settings": params}
    write_json_atomic(out / "pipeline.json", record)
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        src = nb_dir / name
        dst = out / name
        log(f"[{i}/{len(names)}] {name} ...")
        t0 = time.perf_counter()
        entry = {"notebook": name, "status": "running"}
        record["notebooks"].append(entry)
        try:
            pm.execute_notebook(str(src), str(dst), parameters=params, kernel_name="python3",
                                cwd=str(out), progress_bar=False, log_output=False)
        except Exception as exc:
            entry.update(status="failed", seconds=round(time.perf_counter() - t0, 2), error=_failure_text(exc))
            record.update(status=f"failed at {name}", seconds=round(time.perf_counter() - t_all, 2))
            if dst.exists():
                export_html(dst)
            write_json_atomic(out / "pipeline.json", record)
            _build_report_safely(out, log)
            raise PipelineError(f"{name} failed: {entry['error']}\n  executed notebook kept at {dst}\n"
                                f"  all outputs so far are in {out}", name) from exc
        entry.update(status="ok", seconds=round(time.perf_counter() - t0, 2))
        html = export_html(dst)
        entry["html"] = html.name if html else None
        write_json_atomic(out / "pipeline.json", record)
        log(f"      ok in {entry['seconds']:.1f} s")
    record.update(status="complete", seconds=round(time.perf_counter() - t_all, 2))
    write_json_atomic(out / "pipeline.json", record)
    _build_report_safely(out, log)
    return read_json(out / "pipeline.json")


def _build_report_safely(out: Path, log) -> None:
    try:
        from lora_kit.ui.run_card import build_report
        paths = build_report(out)
        log(f"run card: {paths['md']}")
    except Exception as exc:  # the report must never hide the run's own outcome
        log(f"(run card could not be built: {type(exc).__name__}: {exc})")
