"""Figures and notebook HTML exports render offline: plotly.js once per run folder, no CDN script."""
import nbformat
import plotly.graph_objects as go
import plotly.io as pio

from lora_kit.ui import notebook
from lora_kit.ui.pipeline import export_html


def _fig():
    return go.Figure(go.Bar(x=["a", "b"], y=[1, 2]), layout_title_text="bars")


def test_offline_problems_finds_cdn_and_missing_scripts(tmp_path):
    page = tmp_path / "page.html"
    page.write_text('<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>'
                    '<script src="//cdn.example/require.js"></script><script src="gone.js"></script>'
                    '<link rel="stylesheet" href="https://fonts.example/x.css"><script>var x = 1;</script>')
    problems = notebook.offline_problems(page)
    assert len(problems) == 4 and sum("internet" in p for p in problems) == 3 and "gone.js" in problems[2]


def test_saved_figures_share_one_plotlyjs_and_fetch_nothing(tmp_path):
    a = notebook.save_figure(_fig(), "a", tmp_path)
    b = notebook.save_figure(_fig(), "b", tmp_path)
    shipped = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.js"))
    assert shipped == [notebook.PLOTLY_JS]  # once per run folder, beside figures/
    for html in (a["html"], b["html"]):
        text = open(html).read()
        assert notebook.offline_problems(html) == [] and f'src="../{notebook.PLOTLY_JS}"' in text
        assert len(text) < 50_000  # the figure only, not plotly.js (~4.8 MB)
    # written once: a later figure leaves the shipped file alone
    js = tmp_path / notebook.PLOTLY_JS
    before = js.stat().st_mtime_ns
    notebook.save_figure(_fig(), "c", tmp_path)
    assert js.stat().st_mtime_ns == before


def test_notebook_export_renders_offline(tmp_path):
    """An executed notebook's outputs as the notebooks' renderer makes them, exported as the pipeline does."""
    renderer = notebook._offline_renderer()
    fig = _fig().to_dict()
    data = {**pio.renderers["plotly_mimetype"].to_mimebundle(fig), **pio.renderers[renderer].to_mimebundle(fig)}
    assert "<script src=" not in data["text/html"] and "mathjax" not in data["text/html"].lower()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# a figure, $x^2$"),
                nbformat.v4.new_code_cell("fig", outputs=[nbformat.v4.new_output("display_data", data=data)])]
    path = tmp_path / "run" / "01.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    html = export_html(path)
    text = html.read_text()
    assert notebook.offline_problems(html) == []
    assert f'<script src="{notebook.PLOTLY_JS}"></script>' in text and "Plotly.newPlot" in text
    assert (path.parent / notebook.PLOTLY_JS).is_file()
    for cdn in ("require.js", "require.min.js", "MathJax.js", "html-manager", "mermaid"):
        assert cdn not in text, cdn
    assert len(text) < 1_000_000  # nbconvert's CSS and the figure; plotly.js is shared, not embedded
