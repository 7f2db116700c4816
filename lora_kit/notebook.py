"""Small glue for the notebooks, so that they stay thin (parameters, calls, figures, asserts).

- :func:`setup` turns the ``parameters`` cell (plus anything papermill injected) into a validated
  :class:`~lora_kit.settings.Settings`, prepares ``run_dir`` and sets the plotly renderer so that
  figures show in JupyterLab *and* in executed notebooks / HTML exports.
- :func:`show` displays a figure and keeps a copy in ``<run_dir>/figures/`` (HTML always; PNG when
  kaleido can find a Chromium — optional, a missing browser never fails a run).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .settings import Settings, field_names, from_dict

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


def save_figure(fig, name: str, run_dir: str | Path | None = None, png: bool = True) -> dict:
    """Write ``<run_dir>/figures/<name>.html`` (and ``.png`` if possible); returns the paths written."""
    out_dir = Path(run_dir).resolve() / "figures" if run_dir else (_RUN_DIR or Path("runs/figures")) / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"html": str(out_dir / f"{name}.html")}
    fig.write_html(paths["html"], include_plotlyjs="cdn", full_html=True)
    if png and chromium_path():
        try:
            os.environ.setdefault("BROWSER_PATH", chromium_path())
            fig.write_image(str(out_dir / f"{name}.png"), width=1000, height=560)
            paths["png"] = str(out_dir / f"{name}.png")
        except Exception as exc:  # static export is optional: keep the HTML figure
            paths["png_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return paths


def show(fig, name: str | None = None):
    """Display ``fig`` in the notebook and keep a copy under the run directory."""
    from IPython.display import display
    if name:
        save_figure(fig, name)
    display(fig)
    return None
