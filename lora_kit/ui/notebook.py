"""Small glue for the notebooks, so that they stay thin (parameters, calls, figures, asserts).

- :func:`setup` turns the ``parameters`` cell (plus anything papermill injected) into a validated
  :class:`~lora_kit.settings.Settings`, prepares ``run_dir`` and sets the plotly renderer so that
  figures show in JupyterLab *and* in executed notebooks / HTML exports.
- :func:`show` displays a figure and keeps a copy in ``<run_dir>/figures/`` (HTML + JSON);
  :func:`export_pngs` turns them into PNGs in one batch for the run card, when kaleido finds a
  Chromium — optional: a missing browser never fails a run, the HTML figures stay.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from lora_kit.settings import Settings, field_names, from_dict

_RUN_DIR: Path | None = None


def setup(namespace: dict) -> Settings:
    """Settings from the notebook's globals (only names that are Settings fields are taken)."""
    global _RUN_DIR
    import plotly.io as pio
    # mimetype for JupyterLab, "notebook" (embedded plotly.js) for nbconvert HTML and nbval runs.
    pio.renderers.default = "plotly_mimetype+notebook"
    values = {k: namespace[k] for k in field_names() if k in namespace}
    settings = from_dict(values)
    _RUN_DIR = Path(settings.run_dir).resolve()
    (_RUN_DIR / "figures").mkdir(parents=True, exist_ok=True)
    return settings


def chromium_path() -> str | None:
    """A Chromium/Chrome binary for static export, or None (never downloads one)."""
    for env in ("BROWSER_PATH", "CHROME_PATH"):
        if os.environ.get(env) and Path(os.environ[env]).exists():
            return os.environ[env]
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def save_figure(fig, name: str, run_dir: str | Path | None = None) -> dict:
    """Write ``<run_dir>/figures/<name>.html`` (interactive) and ``<name>.json`` (for the PNG batch)."""
    out_dir = Path(run_dir).resolve() / "figures" if run_dir else (_RUN_DIR or Path("runs/figures")) / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"html": str(out_dir / f"{name}.html"), "json": str(out_dir / f"{name}.json")}
    fig.write_html(paths["html"], include_plotlyjs="cdn", full_html=True)
    Path(paths["json"]).write_text(fig.to_json())
    return paths


def export_pngs(run_dir: str | Path, width: int = 1000, height: int = 560) -> dict:
    """PNG copies of every saved figure, in one kaleido batch (one browser start, not one per figure).

    Optional by design: without a Chromium (or kaleido), returns ``{"error": ...}`` and the HTML
    figures stay the record. Returns ``{"png": [paths]}`` on success.
    """
    import plotly.io as pio
    fig_dir = Path(run_dir) / "figures"
    todo = sorted(p for p in fig_dir.glob("*.json") if not p.with_suffix(".png").exists())
    if not todo:
        return {"png": sorted(str(p) for p in fig_dir.glob("*.png"))}
    browser = chromium_path()
    if browser is None:
        return {"error": "no Chromium found: figures kept as HTML only"}
    os.environ.setdefault("BROWSER_PATH", browser)
    try:
        figs = [pio.from_json(p.read_text()) for p in todo]
        pio.write_images(figs, [str(p.with_suffix(".png")) for p in todo], width=width, height=height)
    except Exception as exc:  # static export is optional: keep the HTML figures
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"png": sorted(str(p) for p in fig_dir.glob("*.png"))}


def show(fig, name: str | None = None):
    """Display ``fig`` in the notebook and keep a copy under the run directory."""
    from IPython.display import display
    if name:
        save_figure(fig, name)
    display(fig)
    return None
