"""The QLoRA paper's headline in the kit (issue 16 item 3): LLaMA-65B at the paper's setting fits a 48 GB GPU,
Llama-3.1-70B does not, the parts that differ add up to the gap, and what qlora.py's bf16 casts change."""
from __future__ import annotations

from lora_kit.memory.estimate import estimate
from lora_kit.memory.specs import model_spec
from lora_kit.plan.headline import FIG6_65B, PAPER_STEP, headline, headline_table, qlora_py_bytes


def test_65b_fits_48gb_only_with_the_paged_optimizer_and_70b_does_not():
    h = headline(margin=0.10)
    by = {r["case"]: r for r in h["rows"]}
    r65, no_paging, r70 = h["rows"][0], h["rows"][1], h["rows"][3]
    assert r65["fits_no_margin"] and not no_paging["fits_no_margin"]  # paging the 32-bit states is what fits it
    assert not r70["fits_no_margin"] and not r70["fits_10%_margin"]
    assert no_paging["breakdown"]["optimizer_states"] == h["paged_optimizer_bytes"] > 0
    # the parts that differ between the two models add up to the whole gap (both peaks in backward)
    d65, d70 = h["differences"]
    parts = ("4-bit linear weights", "embedding + lm_head (fp32)", "quantization constants", "LoRA adapters (fp32)",
             "gradients at the peak", "optimizer states not paged", "activations at the peak")
    assert r65["phase"] == r70["phase"] == "backward"
    assert sum(d70[p] - d65[p] for p in parts) == r70["peak_allocated_bytes"] - r65["peak_allocated_bytes"]
    assert d70["embedding + lm_head (fp32)"] - d65["embedding + lm_head (fp32)"] > 0.7 * (
        r70["peak_allocated_bytes"] - r65["peak_allocated_bytes"])  # the 128k vocabulary is most of it
    # qlora.py's casts of embed_tokens / lm_head back to bf16: arithmetic on the estimate, 2 bytes per value
    for name in ("llama-65b", "llama-3.1-70b"):
        spec = model_spec(name)
        assert qlora_py_bytes(name) == 2 * spec.vocab_size * spec.hidden_size * 2
    cast70 = next(r for c, r in by.items() if c == "Llama-3.1-70B as qlora.py casts it, lower rank")
    assert cast70["arithmetic"] and cast70["fits_no_margin"]
    assert cast70["peak_allocated_bytes"] == estimate("llama-3.1-70b", PAPER_STEP, **{"lora_rank": 16}
                                                      ).peak_allocated_bytes - qlora_py_bytes("llama-3.1-70b")
    # the paper's Fig. 6 total beside ours: same arithmetic as printed in the notebook and README
    p = h["paper"]["device_total_bytes"]
    assert p["paper"] == FIG6_65B["total_bytes"] and abs(p["pct"] - 100 * (p["ours"] / p["paper"] - 1)) < 1e-9
    assert list(headline_table(h)["case"]) == [r["case"] for r in h["rows"]]


def test_the_paper_check_is_the_tutorials_and_labelled_on_a_card(tmp_path):
    """The check is the same for every run: notebook 01 runs it for the embedded tutorial only, and a card that
    shows its figure says it is the kit's own check against the paper, not a figure of the run."""
    import plotly.graph_objects as go
    from lora_kit.plan.headline import FIGURE, FIGURE_NOTE
    from lora_kit.settings import Settings
    from lora_kit.ui.notebook import save_figure
    from lora_kit.ui.run_card import build_report
    assert Settings().tutorial_plan() and Settings(model="embedded").tutorial_plan()
    assert not any(Settings(**kw).tutorial_plan() for kw in (
        {"model": str(tmp_path)}, {"plan_model": "llama-3.1-70b"}, {"plan_model": "same"}))
    for name in (FIGURE, "other"):  # the figure's file name is what marks it
        save_figure(go.Figure(go.Bar(x=["a", "b"], y=[1, 2])), name, tmp_path)
    build_report(tmp_path)
    figures = (tmp_path / "report.md").read_text().split("## Figures")[1].split("\n## ")[0].strip().splitlines()
    at = next(i for i, line in enumerate(figures) if f"[{FIGURE}]" in line)
    assert figures[at + 1] == f"_{FIGURE_NOTE}_" and figures.count(f"_{FIGURE_NOTE}_") == 1
