"""Small glue for the notebooks, so that they stay thin (parameters, calls, figures, asserts).

- :func:`setup` turns the ``parameters`` cell (plus anything papermill injected) into a validated
  :class:`~lora_kit.settings.Settings`, prepares ``run_dir`` and sets the plotly renderer so that
  figures show in JupyterLab *and* in executed notebooks / HTML exports.
- :func:`show` displays a figure and keeps a copy in ``<run_dir>/figures/`` (HTML + JSON);
  :func:`export_pngs` turns them into PNGs in one batch for the run card, when kaleido finds a
  Chromium — optional: a missing browser never fails a run, the HTML figures stay.
- Offline by construction: plotly.js is written once per run folder (``<run_dir>/plotly.min.js``,
  :func:`ship_plotlyjs`); saved figures and the notebooks' HTML exports (:func:`notebook_html`) load
  it from there, and nothing they contain fetches a script from the internet (no CDN plotly.js,
  require.js, MathJax, widget manager or mermaid). Keep ``plotly.min.js`` beside them when you
  copy a run folder.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from lora_kit.settings import TINY_ALIASES, Settings, field_names, from_dict

_RUN_DIR: Path | None = None


def setup(namespace: dict) -> Settings:
    """Settings from the notebook's globals (only names that are Settings fields are taken).

    The same in JupyterLab as under ``lora-kit run``: a relative ``run_dir`` is taken from the kit's
    checkout (:func:`runs_base`), so an interactive session writes ``runs/default/`` in the layout of
    ``lora-kit run`` (04's last cell builds its card); CPU threads are set by :func:`cpu_threads`;
    the libraries' known-harmless warnings are silenced (:mod:`lora_kit.noise`).
    """
    global _RUN_DIR
    import plotly.io as pio

    from lora_kit.noise import quiet
    quiet()
    # mimetype for JupyterLab; offline HTML (plotly.js from the run folder) for the HTML exports
    pio.renderers.default = f"plotly_mimetype+{_offline_renderer()}"
    values = {k: namespace[k] for k in field_names() if k in namespace}
    settings = from_dict(values)
    if settings.trust_remote_code:  # the planner may build the model from its own code (config.json auto_map)
        from lora_kit.memory.specs import allow_model_code
        allow_model_code(settings.model)
    _RUN_DIR = (runs_base() / Path(settings.run_dir).expanduser()).resolve()
    settings = settings.replace(run_dir=str(_RUN_DIR))
    (_RUN_DIR / "figures").mkdir(parents=True, exist_ok=True)
    cpu_threads(settings)
    return settings


# settings that do not change what the tutorial trains or how it is judged: where the run goes and what is planned
_CLAIM_FREE = ("double_quant", "qlora_prepare", "plan_model", "from_config", "gpu", "gpus", "margin", "run_dir",
               "interactive", "trust_remote_code")


def tutorial_claims(settings: Settings) -> str | None:
    """None where the tutorial's claims about its adapter apply to this run: the embedded model on its dates task
    with a LoRA method, every setting that shapes training or judging at the tutorial's value (longer training
    and more examples allowed), else why not, in one sentence: the notebooks then report the figures without
    asserting them."""
    d, s = Settings(), settings
    if not (s.model in TINY_ALIASES and s.dataset == d.dataset and s.method in ("lora", "qlora")):
        return "the tutorial's claims are about the embedded model on its dates task with a LoRA method"
    differ = []
    for k in field_names():
        mine, theirs = getattr(s, k), getattr(d, k)
        if k in _CLAIM_FREE or k in ("model", "method") or mine == theirs:
            continue
        if (k == "max_steps" and mine > theirs) or (k in ("eval_examples", "control_examples")
                                                    and (mine == 0 or mine > theirs)):
            continue
        differ.append(f"{k}={mine!r} (the tutorial's: {theirs!r})")
    return f"this run differs from the tutorial's: {', '.join(differ)}" if differ else None


def runs_base() -> Path:
    """The folder a relative ``run_dir`` is taken from: ``LORA_KIT_RUNS_BASE`` when set; the kit's checkout
    when the kernel runs in its ``notebooks/`` folder (JupyterLab's working directory there), so that
    ``runs/default`` is the folder ``lora-kit run`` writes from the checkout; else the working directory
    (``lora-kit run`` passes absolute paths)."""
    if os.environ.get("LORA_KIT_RUNS_BASE"):
        return Path(os.environ["LORA_KIT_RUNS_BASE"]).expanduser()
    here = Path.cwd().resolve()
    return here.parent if here == kit_notebooks_dir() else here


def kit_notebooks_dir() -> Path | None:
    """The kit's notebooks folder: the checkout's ``notebooks/`` (editable install) or package data; None
    for an installed package without them."""
    package = Path(__file__).resolve().parents[1]
    for cand in (package.parent / "notebooks", package / "notebooks"):
        if (cand / "00_stack_check.ipynb").is_file():
            return cand
    return None


def cpu_threads(settings: Settings) -> int | None:
    """Torch's CPU threads for this kernel, the same headless and in JupyterLab. ``OMP_NUM_THREADS`` wins
    when set. Otherwise the embedded tiny model gets one thread: its matrices are too small to share, and on
    a busy 2-core machine two OpenMP threads ran its steps 3-10x slower (they spin-wait for each other).
    Real models keep torch's default (one thread per core). Returns the count set, None when left alone."""
    if os.environ.get("OMP_NUM_THREADS") or settings.model not in TINY_ALIASES:
        return None
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    else:  # read by torch's OpenMP runtime when it loads: no torch import here (01 and 02 never need it)
        os.environ["OMP_NUM_THREADS"] = "1"
    return 1


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


PLOTLY_JS = "plotly.min.js"  # one copy per run folder, loaded by its figures and HTML exports
OFFLINE_RENDERER = "lora_kit_offline"
# nbconvert's JupyterLab template without its CDN scripts (require.js, MathJax, the widget manager,
# mermaid); plotly.js comes from the run folder, beside the exported notebook
_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}<script src="PLOTLY_JS"></script>{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
""".replace("PLOTLY_JS", PLOTLY_JS)


def ship_plotlyjs(run_dir: str | Path) -> Path:
    """``<run_dir>/plotly.min.js``: the installed plotly's bundle, written once per run folder."""
    from lora_kit.results import write_text_atomic
    path = Path(run_dir) / PLOTLY_JS
    if not path.is_file():
        from plotly.offline import get_plotlyjs
        write_text_atomic(path, get_plotlyjs())
    return path


def _offline_renderer() -> str:
    """Register (once) a renderer whose ``text/html`` is the figure alone: no plotly.js, no MathJax
    fetch. The HTML export supplies plotly.js (see :func:`notebook_html`); JupyterLab shows the
    figure through the plotly mimetype instead."""
    import plotly.io as pio
    from plotly.io.base_renderers import MimetypeRenderer

    class OfflineHtml(MimetypeRenderer):
        def to_mimebundle(self, fig_dict):
            return {"text/html": pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False,
                                             full_html=False, default_width="100%", default_height=525,
                                             validate=False)}

    if OFFLINE_RENDERER not in pio.renderers:
        pio.renderers[OFFLINE_RENDERER] = OfflineHtml()
    return OFFLINE_RENDERER


def notebook_html(nb_path: str | Path) -> str:
    """The HTML export of an executed notebook that renders offline: plotly.js from
    ``plotly.min.js`` in the notebook's folder (written there if missing), no CDN scripts."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    nb_path = Path(nb_path)
    ship_plotlyjs(nb_path.parent)
    exporter = HTMLExporter(template_name="lab",
                            extra_loaders=[DictLoader({"lora_kit_offline.html.j2": _OFFLINE_TEMPLATE})])
    exporter.template_file = "lora_kit_offline.html.j2"
    body, _ = exporter.from_notebook_node(nbformat.read(nb_path, as_version=4))
    return body


def offline_problems(html_path: str | Path) -> list[str]:
    """What would keep an HTML file from rendering offline: scripts or stylesheets loaded from
    http(s) or protocol-relative URLs, and local scripts that are not where the file points."""
    import re
    html_path = Path(html_path)
    text = html_path.read_text(encoding="utf-8", errors="replace")
    problems = []
    for tag, attr in (("script", "src"), ("link", "href")):
        for m in re.finditer(rf"<{tag}\b[^>]*?\b{attr}\s*=\s*[\"']?([^\"'\s>]+)", text, flags=re.I):
            url = m.group(1)
            if re.match(r"(https?:)?//", url, flags=re.I):
                problems.append(f"{tag} {attr}={url} (fetched from the internet)")
            elif tag == "script" and not url.startswith("data:") and not (html_path.parent / url).is_file():
                problems.append(f"script src={url} (no such file beside {html_path.name})")
    return problems


RUNNING_SUFFIX = ".running.ipynb"  # <stem>.running.ipynb: a notebook ``lora-kit run`` is executing (renamed at its end)
FIGURE_INDEX = "figures.json"  # <run_dir>/figures.json: which run (and notebook) wrote each saved figure
NOTEBOOK_ENV = "LORA_KIT_NOTEBOOK"  # the notebook a ``lora-kit run`` kernel executes (set by the pipeline)


def save_figure(fig, name: str, run_dir: str | Path | None = None) -> dict:
    """Write ``<run_dir>/figures/<name>.html`` (interactive, plotly.js from ``<run_dir>/plotly.min.js``)
    and ``<name>.json`` (for the PNG batch), each atomically (a full disk keeps the previous figure and raises
    :class:`lora_kit.results.NotWritten` naming the file), and record in ``<run_dir>/figures.json`` which run
    and notebook wrote it: the run card and ``--resume`` read that record, never file times (a plain ``cp -r``
    changes them)."""
    from lora_kit.results import write_text_atomic
    out_dir = Path(run_dir).resolve() / "figures" if run_dir else (_RUN_DIR or Path("runs/figures")) / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    ship_plotlyjs(out_dir.parent)
    paths = {"html": str(out_dir / f"{name}.html"), "json": str(out_dir / f"{name}.json")}
    write_text_atomic(paths["html"], fig.to_html(include_plotlyjs=f"../{PLOTLY_JS}", include_mathjax=False,
                                                 full_html=True))
    write_text_atomic(paths["json"], fig.to_json())
    _index_figure(out_dir.parent, name)
    return paths


def _index_figure(run_dir: Path, name: str) -> None:
    from lora_kit.results import active_run, now_iso, read_record, write_json_atomic
    index = read_record(run_dir / FIGURE_INDEX) or {}
    figures = index.get("figures") if isinstance(index.get("figures"), dict) else {}
    ident = active_run(run_dir) or {}
    figures[name] = {"run": ident.get("id"), "notebook": os.environ.get(NOTEBOOK_ENV) if ident else None,
                     "written": now_iso()}
    write_json_atomic(run_dir / FIGURE_INDEX, {"kind": "lora_kit.figures", "figures": figures})


def figure_index(run_dir: str | Path) -> dict:
    """``{name: {"run": id, "notebook": name, "written": time}}`` of the figures saved into ``run_dir``."""
    from lora_kit.results import read_record
    figures = (read_record(Path(run_dir) / FIGURE_INDEX) or {}).get("figures")
    return figures if isinstance(figures, dict) else {}


BROWSER_HOME_VARS = ("XDG_CONFIG_HOME", "XDG_CACHE_HOME")  # where Chromium puts ~/.config/chromium and its caches


def export_pngs(run_dir: str | Path, width: int = 1000, height: int = 560) -> dict:
    """PNG copies of every saved figure, in one kaleido batch (one browser start, not one per figure).

    Optional by design: without a Chromium (or kaleido), returns ``{"error": ...}`` and the HTML
    figures stay the record. Returns ``{"png": [paths]}`` on success. kaleido is called directly, not
    through ``plotly.io.write_images``, which drops kaleido's per-figure errors: on a loaded machine a
    render was seen to fail silently (no PNG, no error). Figures still missing after the batch are
    tried once more; what still fails is reported, never skipped in silence.
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
    errors: list = []
    home = Path(run_dir) / ".browser"  # Chromium writes its config and caches here, never in the user's home
    saved = {k: os.environ.get(k) for k in BROWSER_HOME_VARS}
    try:
        import kaleido
        os.environ.update({k: str(home / k.split("_")[1].lower()) for k in BROWSER_HOME_VARS})
        for _attempt in range(2):
            specs = [dict(fig=pio.from_json(p.read_text()).to_dict(), path=_partial_png(p),
                          opts=dict(format="png", width=width, height=height)) for p in todo]
            errors = [e for e in (kaleido.write_fig_from_object_sync(specs) or ()) if isinstance(e, BaseException)]
            for spec in specs:  # a PNG appears whole or not at all: kaleido writes a hidden file, renamed here
                _place_png(spec["path"], spec["path"].parent / (spec["path"].name[1:-len(".partial.png")] + ".png"))
            todo = [p for p in todo if not p.with_suffix(".png").is_file()]
            if not todo:
                break
    except Exception as exc:  # static export is optional: keep the HTML figures
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)
    if todo:
        why = f"{type(errors[0]).__name__}: {errors[0]}" if errors else "kaleido wrote no file"
        return {"error": f"no PNG for {', '.join(p.stem for p in todo)} ({why})"[:300],
                "png": sorted(str(p) for p in fig_dir.glob("*.png"))}
    return {"png": sorted(str(p) for p in fig_dir.glob("*.png"))}


def _partial_png(json_path: Path) -> Path:
    return json_path.parent / f".{json_path.stem}.partial.png"


def _place_png(partial: Path, final: Path) -> None:
    """Rename a PNG kaleido wrote whole into place; one it left truncated or empty (full disk) is removed."""
    import contextlib
    try:
        ok = partial.is_file() and partial.read_bytes().endswith(b"IEND\xaeB`\x82")  # PNG's closing chunk
        if ok:
            os.replace(partial, final)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def show(fig, name: str | None = None):
    """Display ``fig`` in the notebook and keep a copy under the run directory."""
    from IPython.display import display
    if name:
        save_figure(fig, name)
    display(fig)
    return None
