"""The planner panel: ipywidgets controls -> live memory breakdown and a plain-language verdict.

A view only: every change builds a :class:`lora_kit.settings.Settings` and calls
:func:`lora_kit.plan.planner.check_plan` (the same function the CLI and notebooks use); nothing is
computed here. Choices come from the one settings definition (``METHODS``, ``OPTIMIZERS``,
``SHARDINGS``, ``DTYPES``), the model catalog (``lora_kit.memory.specs.catalog``), the GPU catalog
(``lora_kit.plan.gpus.gpu_table``) and the model's own linear layers (``valid_targets``).

Drive it from code (tests, a browser test) through its public widgets::

    p = PlannerPanel()
    p.seq_len.value = 4096          # the figure and p.verdict update in place
    p.settings()                    # -> Settings with the current values
    p.plan_kwargs()                 # -> the plan shown: model and step (estimate(**p.plan_kwargs()))
    p.load_config("sft.yaml")       # start from a TRL / axolotl / LLaMA-Factory / torchtune / Trainer config

The model shown is ``settings.planning_model()`` (the model the planning notebooks size GPUs for).
:meth:`PlannerPanel.settings` writes the panel's model back to ``plan_model`` (to ``model`` when
``plan_model`` is "same"), so the training model of later steps does not change by planning for a bigger one.
    display(p.widget)

Trade-off: the breakdown figure is a ``plotly.graph_objects.FigureWidget`` (needs ``anywidget``),
updated in place so a change re-renders in milliseconds; importing it the first time costs seconds
(plotly's widget support pulls in nbformat/jsonschema).
"""
from __future__ import annotations

import html

import ipywidgets as w

from lora_kit.memory.specs import catalog, valid_targets
from lora_kit.plan.figures import PART_COLORS
from lora_kit.plan.gpus import get_gpu, known_gpus
from lora_kit.plan.config_import import settings_from_config
from lora_kit.plan.planner import check_plan, verdict_text
from lora_kit.settings import DTYPES, LORA_FIELDS, METHODS, OPTIMIZERS, PLANNING, SHARDINGS, Settings

GIB = 2 ** 30
PARTS = ("weights", "quant_constants", "adapters", "gradients", "optimizer_states", "activations")
_STYLE = {"description_width": "170px"}
_LAYOUT = w.Layout(width="440px")


def _model_options(current: str) -> list[str]:
    opts = ["tiny"] + sorted(catalog())
    return opts if current in opts else [current] + opts


class PlannerPanel:
    """Controls for one plan, a live stacked breakdown (``.figure``) and a verdict (``.verdict``)."""

    def __init__(self, settings: Settings | None = None, from_config: str | None = None):
        from lora_kit.plan.planner import GIB as _  # noqa: F401  (fail early if the planner is unavailable)
        s = settings or Settings()
        self._plan_field = "model" if s.plan_model == "same" else "plan_model"
        report = None
        if from_config:  # start from the user's training config: its model and step (ValueError names the problem)
            step, report = settings_from_config(from_config)
            s = s.replace(**step.to_dict(), **{self._plan_field: report.model})
        model = s.planning_model()
        self._base = s
        self._updating = False
        self.last_plan: dict | None = None
        self.error: str | None = None

        def dd(options, value, label):
            return w.Dropdown(options=list(options), value=value, description=label, style=_STYLE, layout=_LAYOUT)

        def num(value, lo, hi, label):
            return w.BoundedIntText(value=value, min=lo, max=hi, description=label, style=_STYLE, layout=_LAYOUT)

        self.model = dd(_model_options(model), model, "model")
        self.method = dd(METHODS, s.method, "method")
        self.dtype = dd(DTYPES, s.dtype, "weights dtype")
        self.gpu = dd(known_gpus(), get_gpu(s.gpu)["name"], "GPU")  # unknown GPU -> ValueError listing known ones
        self.margin = w.BoundedFloatText(value=round(s.margin * 100, 1), min=0, max=90, step=1,
                                         description="safety margin (%)", style=_STYLE, layout=_LAYOUT)
        self.seq_len = num(s.seq_len, 1, 1 << 20, "seq_len (tokens)")
        self.batch_size = num(s.batch_size, 1, 1 << 14, "micro-batch / GPU")
        self.lora_rank = num(s.lora_rank, 1, 4096, "LoRA rank r")
        self.lora_dropout = w.BoundedFloatText(value=s.lora_dropout, min=0, max=0.95, step=0.05,
                                               description="LoRA dropout", style=_STYLE, layout=_LAYOUT)
        self.targets = w.SelectMultiple(options=[], description="LoRA targets", rows=4,
                                        style=_STYLE, layout=_LAYOUT)
        self.checkpointing = w.Checkbox(value=s.gradient_checkpointing, description="gradient checkpointing",
                                        style=_STYLE, layout=_LAYOUT, indent=True)
        self.optimizer = dd(OPTIMIZERS, s.optimizer, "optimizer")
        self.num_gpus = num(s.num_gpus, 1, 1024, "number of GPUs")
        self.sharding = dd(SHARDINGS, s.sharding, "sharding")
        self._set_target_options(s.lora_targets)
        self.verdict = w.HTML(layout=w.Layout(width="940px"))
        # start from a training config (TRL, axolotl, LLaMA-Factory, torchtune, TrainingArguments JSON)
        self.config_path = w.Text(value=str(from_config or ""), description="start from config",
                                  placeholder="path to your TRL / axolotl / LLaMA-Factory / torchtune config",
                                  style=_STYLE, layout=w.Layout(width="760px"))
        self.load_button = w.Button(description="load config", layout=w.Layout(width="160px"))
        self.load_button.on_click(lambda _: self.load_config(self.config_path.value))
        self.config_report = w.HTML(layout=w.Layout(width="940px"))
        self._show_report(report)
        self.figure = self._make_figure()
        left = w.VBox([self.model, self.method, self.dtype, self.gpu, self.margin, self.num_gpus, self.sharding])
        right = w.VBox([self.seq_len, self.batch_size, self.lora_rank, self.lora_dropout, self.targets,
                        self.checkpointing, self.optimizer])
        self.widget = w.VBox([w.HBox([self.config_path, self.load_button]), self.config_report,
                              w.HBox([left, right], layout=w.Layout(width="960px", justify_content="space-between")),
                              self.verdict, self.figure], layout=w.Layout(width="980px"))
        self.batch_size.tooltip = "examples per GPU per step; gradient accumulation does not change peak memory"
        self.targets.tooltip = "modules that get LoRA adapters; all selected = 'all-linear'"
        self.num_gpus.tooltip = "memory is per GPU: without zero/fsdp sharding every GPU holds everything"
        self.lora_dropout.tooltip = "dropout on each adapter's input: a 1-byte mask per adapted input for backward"
        # stable CSS hooks for the real-browser test and for user styling
        self.widget.add_class("lk-panel")
        self.verdict.add_class("lk-verdict")
        self.figure.add_class("lk-figure")
        for name in ("model", "method", "dtype", "gpu", "margin", "seq_len", "batch_size", "lora_rank", "lora_dropout",
                     "targets", "checkpointing", "optimizer", "num_gpus", "sharding"):
            getattr(self, name).add_class("lk-" + name.replace("_", "-"))
        for c in self.controls():
            c.observe(self._on_change, names="value")
        self.update()

    def _show_report(self, report) -> None:
        """What the loaded config set that the plan does not model (or that does not matter), in the panel."""
        if report is None:
            self.config_report.value = ""
            return
        items = "".join(f"<li><b>{html.escape(n['key'])}={html.escape(repr(n['value']))}</b>: "
                        f"{html.escape(n['why'])}</li>" for n in report.not_modelled)
        self.config_report.value = (
            f"<div>Started from {html.escape(report.path)} ({html.escape(report.format)}): model "
            f"{html.escape(str(report.model))}."
            + (f" Not modelled:<ul>{items}</ul>" if items else " Every field that changes memory or time is "
               "planned.") + (f" Ignored: {html.escape(', '.join(report.ignored))}." if report.ignored else "")
            + "</div>")

    def load_config(self, path: str) -> None:
        """Start the panel from a training config: its model and every step field (the panel's controls and the
        fields it has no control for); an unreadable config leaves the panel as it was and says why."""
        try:
            step, report = settings_from_config(path)
            self._base = self._base.replace(**step.to_dict())
        except ValueError as e:
            self.config_report.value = f"<div style='color:#b00'><b>Cannot read the config:</b> {html.escape(str(e))}</div>"
            return
        self._updating = True
        try:
            if report.model not in self.model.options:
                self.model.options = [report.model, *self.model.options]
            self.model.value = report.model
            for name, value in (("method", step.method), ("dtype", step.dtype), ("seq_len", step.seq_len),
                                ("batch_size", step.batch_size), ("lora_rank", step.lora_rank),
                                ("lora_dropout", step.lora_dropout),
                                ("checkpointing", step.gradient_checkpointing), ("optimizer", step.optimizer),
                                ("num_gpus", step.num_gpus), ("sharding", step.sharding)):
                getattr(self, name).value = value
        finally:
            self._updating = False
        self._set_target_options(step.lora_targets)
        self._show_report(report)
        self.update()

    def controls(self) -> list:
        return [self.model, self.method, self.dtype, self.gpu, self.margin, self.seq_len, self.batch_size,
                self.lora_rank, self.lora_dropout, self.targets, self.checkpointing, self.optimizer, self.num_gpus,
                self.sharding]

    def _set_target_options(self, lora_targets) -> None:
        try:
            names = valid_targets(self.model.value)
        except ValueError:
            names = []
        chosen = names if lora_targets == "all-linear" else [t for t in lora_targets if t in names] or names
        self._updating = True
        try:
            self.targets.options = names
            self.targets.value = tuple(chosen)
        finally:
            self._updating = False

    def _make_figure(self):
        import plotly.graph_objects as go
        fig = go.FigureWidget()
        for part in PARTS:
            fig.add_bar(name=part.replace("_", " "), x=["estimate"], y=[0], marker_color=PART_COLORS[part],
                        hovertemplate=f"{part.replace('_', ' ')}: %{{y:.3f}} GiB<extra></extra>")
        # what nvidia-smi shows on top of the allocator's peak (see estimate's device_total_bytes)
        fig.add_bar(name="CUDA context + reserve", x=["estimate"], y=[0], marker_color="#BAB0AC",
                    hovertemplate="CUDA context + reserved + outside the allocator: %{y:.3f} GiB<extra></extra>")
        fig.add_hline(y=0, line_dash="dash", line_color="black", annotation_text="usable GPU memory",
                      annotation_position="top left")
        fig.update_layout(barmode="stack", width=940, height=380, margin=dict(l=60, r=20, t=50, b=40),
                          title="Peak memory per GPU, by part", yaxis_title="memory (GiB)",
                          legend=dict(orientation="h", y=-0.15))
        return fig

    def settings(self) -> Settings:
        """The current values as a validated :class:`Settings` (raises ValueError if inconsistent). With
        ``method="full"`` the LoRA controls keep their values for a switch back, and the plan leaves them out."""
        names = list(self.targets.options)
        chosen = list(self.targets.value)
        targets = "all-linear" if not names or set(chosen) == set(names) or not chosen else chosen
        full = self.method.value == "full"
        lora = {k: getattr(PLANNING, k) for k in LORA_FIELDS} if full else dict(
            lora_rank=int(self.lora_rank.value), lora_targets=targets, lora_dropout=float(self.lora_dropout.value))
        return self._base.replace(
            **{self._plan_field: self.model.value}, method=self.method.value, dtype=self.dtype.value, gpu=self.gpu.value,
            margin=float(self.margin.value) / 100, seq_len=int(self.seq_len.value),
            batch_size=int(self.batch_size.value), gradient_checkpointing=bool(self.checkpointing.value),
            optimizer=self.optimizer.value, num_gpus=int(self.num_gpus.value), sharding=self.sharding.value, **lora)

    def plan_kwargs(self) -> dict:
        """The plan on screen: ``model`` (the panel's, not necessarily ``settings().model``) and its ``step``."""
        return {"model": self.model.value, "step": self.settings().step}

    def _on_change(self, change) -> None:
        if self._updating:
            return
        if change["owner"] is self.model:
            self._set_target_options("all-linear")
        self.update()

    def update(self) -> None:
        """Recompute the plan from the widgets and refresh the verdict and the figure in place."""
        for c in (self.lora_rank, self.lora_dropout, self.targets):  # full fine-tuning has no adapters
            c.disabled = self.method.value == "full"
        try:
            s = self.settings()
            plan = check_plan(gpu=s.gpu, margin=s.margin, **self.plan_kwargs())
        except ValueError as e:
            self.error = str(e)
            self.verdict.value = f"<div style='color:#b00'><b>Cannot plan:</b> {html.escape(str(e))}</div>"
            return
        self.error, self.last_plan = None, plan
        color = "#1a7f37" if plan["fits"] else "#b00"
        self.verdict.value = (f"<div style='color:{color}; font-size:14px; line-height:1.4'>"
                              f"{html.escape(verdict_text(plan))}</div>")
        est = plan["estimate"]
        with self.figure.batch_update():
            for trace, part in zip(self.figure.data, PARTS):
                trace.y = [est.breakdown.get(part, 0) / GIB]
            self.figure.data[len(PARTS)].y = [(est.device_total_bytes - est.peak_allocated_bytes) / GIB]
            usable = plan["usable_bytes"] / GIB
            self.figure.layout.shapes[0].update(y0=usable, y1=usable)
            self.figure.layout.annotations[0].update(
                y=usable, text=f"{plan['gpu']} usable ({s.margin:.0%} margin): {usable:.1f} GiB")
            self.figure.layout.title.text = (f"{self.model.value} · {s.method} · seq_len {s.seq_len} · micro-batch "
                                             f"{s.batch_size} on {plan['gpu']}: {est.device_total_bytes / GIB:.2f} GiB "
                                             f"of {usable:.1f} GiB usable")
