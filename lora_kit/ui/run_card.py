"""The run card: ``runs/<name>/report.md`` and ``report.json`` — the request a user sends when
renting a GPU, built from the results the notebooks wrote (missing parts are marked, never guessed).

Sources in the run directory: ``settings.json`` (pipeline), ``stack.json`` (00), ``plan.json`` (01),
``sweeps.json`` (02), ``smoke/smoke.json`` (03, written by ``smoke_run``), ``eval/eval.json`` (04).

When ``pipeline.json`` names a run, the card shows only results that carry that run's id (a file
left by another run is listed as excluded, never shown as this run's) and only figures that
``figures.json`` says this run wrote; it says which notebooks ran in this run and which did not.
A record still saying "running" from a process that is gone is shown as "died".
"""
from __future__ import annotations

from pathlib import Path

from lora_kit.data import LONG_SHARE_WARN, long_examples_line
from lora_kit.plan import time_constants
from lora_kit.plan.gpus import compute_capability, get_gpu
from lora_kit.plan.planner import epoch_columns, epoch_from_data, hours_text, money_text, reprice
from lora_kit.plan.records import PLAN_BATCH, plan_row
from lora_kit.plan.timing import calibrate
from lora_kit.results import (portable, portable_text, read_record, same_run, settled, write_json_atomic,
                              write_text_atomic)
from lora_kit.run.batches import ran_seq_len
from lora_kit.run.loop import throughput
from lora_kit.settings import as_step, method_label
from lora_kit.ui.notebook import RUNNING_SUFFIX
from lora_kit.ui.tables import method_markdown

GiB = 1024 ** 3


def _gib(b) -> str:
    """Bytes in GiB, MiB below 1 GiB (the tiny model's peaks are a few MiB), KiB below 1 MiB (a 2-layer
    test model's communication per step)."""
    if b is None:
        return "—"
    if abs(b) >= GiB:
        return f"{b / GiB:.2f} GiB"
    return f"{b / 2**20:.1f} MiB" if abs(b) >= 2**20 else f"{b / 2**10:.1f} KiB"


def _pct(x) -> str:
    return "—" if x is None else f"{x:+.1f} %"


PARTS = {"settings": "settings.json", "stack": "stack.json", "plan": "plan.json", "sweeps": "sweeps.json",
         "smoke": "smoke/smoke.json", "eval": "eval/eval.json"}


def collect(run_dir: str | Path) -> dict:
    """Everything the run card needs, from the files of this run (None where a part did not run in it)."""
    d = Path(run_dir)
    pipe = settled(read_record(d / "pipeline.json"))
    ident = (pipe or {}).get("run")
    for e in (pipe or {}).get("notebooks") or []:  # a run killed outright left its notebook's last whole save
        running = Path(str(e.get("notebook"))).stem + RUNNING_SUFFIX
        if e.get("status") != "ok" and not e.get("kept_as") and (d / running).is_file():
            e["kept_as"] = running
    card = {"run": ident, "pipeline": pipe, "excluded": {}}
    for part, rel in PARTS.items():
        rec = settled(read_record(d / rel))
        if rec is not None and ident is not None and not same_run(rec, ident):
            other = rec.get("run") or {}
            card["excluded"][part] = (f"{rel} is not from this run (it carries run id {other.get('id', 'none')}, "
                                      f"started {other.get('started', '?')}); not shown")
            rec = None
        card[part] = rec
    if card["settings"] is not None:
        card["settings"] = {k: v for k, v in card["settings"].items() if k != "run"}
    elif pipe:
        card["settings"] = pipe.get("settings")
    elif card["smoke"] and isinstance(card["smoke"].get("settings"), dict):  # a smoke run in a folder of its own
        card["settings"] = dict(card["smoke"]["settings"])                    # (e.g. under torchrun)
    return card


def memory_rows(smoke: dict | None) -> list[dict]:
    """Measured peak (second step) beside estimate and simulate, as printable rows."""
    if not smoke:
        return []
    measured = (smoke.get("peaks") or {}).get("design_step_peak_bytes")
    rows = [{"source": "measured", "peak": _gib(measured), "error": "—", "note": ""}] if measured else []
    for name, v in (smoke.get("memory_model") or {}).items():
        if isinstance(v, dict):
            err = v.get("error_vs_measured")
            rows.append({"source": name, "peak": _gib(v.get("peak_allocated_bytes")),
                         "error": "—" if err is None else f"{err * 100:+.1f} %", "note": v.get("error") or ""})
        elif isinstance(v, (int, float)):
            rows.append({"source": name, "peak": _gib(v), "error": "—", "note": "per GPU"})
    return rows


def next_checks(card: dict) -> list[str]:
    """Plain-language things to check next, derived from what was measured."""
    out = []
    smoke, ev, plan, stack = card["smoke"], card["eval"], card["plan"], card["stack"]
    blocking = ((stack or {}).get("verdict") or {}).get("blocking") or []
    if blocking:  # the stack check's verdict for this plan: only failures the plan needs block it
        out.append("Fix before renting: the stack check blocks this plan -- " + "; ".join(
            f"{b.get('probe')} ({b.get('status')}: {' '.join(str(b.get('error') or 'no message').split())}); "
            f"{b.get('change')}"
            for b in blocking) + ".")
    if smoke is None:
        out.append("Run the smoke run (03) with the planned settings before renting for longer.")
    elif smoke.get("status") != "complete":
        out.append(f"The smoke run stopped ({smoke.get('status')}): see smoke/smoke.json and the suggested changes.")
    lx = ((smoke or {}).get("data") or {}).get("long_examples") or {}
    if lx.get("share", 0) > LONG_SHARE_WARN:
        out.append(f"{lx['share']:.0%} of the training rows are longer than seq_len={lx['seq_len']} (longest "
                   f"{lx['longest_tokens']} tokens; long_examples={lx['policy']!r}): raise seq_len if memory allows "
                   "(see 02), or shorten or drop those rows, so the fine-tune sees whole answers.")
    if ev is None:
        out.append("Evaluate base vs adapter (04) on held-out examples: training loss is not quality.")
    else:
        ctrl = ev.get("control") or {}
        changed = ctrl.get("changed_fraction")
        if changed is not None and changed > 0.1:
            out.append(f"{changed:.0%} of control outputs changed: mix base-task data into training "
                       "(`base_mix`) or lower the learning rate, then re-check the control set.")
    if plan and not any(r.get("fits") for r in plan.get("rows", [])):
        out.append("No listed GPU fits the planned settings: see 02 for the largest seq_len / batch that fits.")
    mg = (plan or {}).get("multi_gpu") or {}
    if mg.get("num_gpus"):
        rd = str((card.get("settings") or {}).get("run_dir") or "").rstrip("/")
        if rd in ("", ".") and card.get("name"):  # a portable card: the run folder under the default runs/
            rd = f"runs/{card['name']}"
        own = f" -p run_dir {rd}-{mg['num_gpus']}ranks" if rd else ""  # the CLI refuses a lora-kit run's folder
        out.append(f"Several GPUs: on the {mg['num_gpus']} rented GPUs launch the smoke run with "
                   f"`torchrun --standalone --nproc_per_node {mg['num_gpus']} -m lora_kit.run.smoke --params run.yaml"
                   f"{own}` (a folder of its own: it carries its own run id) and compare each rank's peak and the step time with *Several GPUs* (its communication time is "
                   "an assumption).")
    out.append("On the rented GPU, run `lora-kit check` first, then the smoke run with the same params file; "
               "compare its measured peak and step time with this card before starting the long run.")
    return out


def _md_table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(h for _, h in cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(str(r.get(k, "—")) for k, _ in cols) + " |\n" for r in rows)


def run_lines(card: dict) -> list[str]:
    """Which run this card is, how it ended, which notebooks ran in it and which did not."""
    pipe = card["pipeline"] or {}
    if not pipe:
        return []
    run = card.get("run") or {}
    lines = [f"Run `{run.get('id', '?')}`, started {run.get('started', '?')}. Pipeline status: "
             f"**{pipe.get('status')}**" + (f" in {pipe['seconds']:.0f} s" if pipe.get("seconds") else "")
             + (f" (the last invocation alone: it resumed the run, after {len(pipe['resumed'])} earlier)"
                if pipe.get("resumed") and pipe.get("seconds") else "")]
    if pipe.get("ending"):
        lines.append(f"Ending: {pipe['ending']}.")
    lines.append("")
    rows = {n: "did not run" for n in pipe.get("not_run") or []}
    for e in pipe.get("notebooks") or []:
        detail = f"{e.get('status')}" + (f" ({e['seconds']:.0f} s)" if e.get("seconds") is not None else "")
        rows[e.get("notebook")] = detail + (f": {str(e['error'])[:200]}" if e.get("error") else "") + (
            f"; executed so far: {e['kept_as']}" if e.get("kept_as") else "")
    lines += ["| notebook | in this run |", "|---|---|"] + [f"| {n} | {d} |" for n, d in sorted(rows.items())]
    for line in pipe.get("not_written") or []:
        lines.append(f"\n_Disk full: {line}_")
    for why in (card.get("excluded") or {}).values():
        lines.append(f"\n_Excluded: {why}._")
    return lines + [""]


def title_lines(card: dict) -> list[str]:
    """The card's title names what is requested (the planned model) and, when it differs, the model the
    smoke run and evaluation used, so the header and the request never disagree."""
    s, plan = card["settings"] or {}, card["plan"] or {}
    run = f"{s.get('model', '?')} · {method_label(s.get('method', '?'))}"
    planned = plan.get("model")
    if not planned or planned == s.get("model"):
        return [f"# Run card: fine-tuning {run}", ""]
    return [f"# Run card: fine-tuning {planned} (planned) · smoke run and evaluation on {run}", "",
            f"The request below plans **{planned}**. The smoke run and the evaluation ran **{s.get('model')}** "
            f"({method_label(s.get('method'))}, seq_len {s.get('seq_len')}, micro-batch {s.get('batch_size')}; "
            "every value under *Settings*) to prove the pipeline, not to measure the planned model."
            + (f" The embedded tutorial plans {planned}, since its tiny model fits any GPU; set `plan_model` to "
               "plan another model." if not s.get("plan_model") else ""), ""]


def _param(v) -> str:
    """A setting as a params file (YAML) writes it: true/false, [a, b], plain strings and numbers."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_param(x) for x in v) + "]"
    return str(v)


def _on(v) -> str:
    return "on" if v else "off"


def assumption_lines(plan: dict, epoch_time_: dict | None = None) -> list[str]:
    """What the plan's numbers assume, in words: plan.json's ``assumptions``, ``epoch`` and ``attention_note``;
    with the card's :func:`epoch_time` made from other data (the smoke run read the user's dataset after the plan),
    the epoch line says the table's epoch is the plan's placeholder and where the user's is."""
    a, ep = plan.get("assumptions") or {}, plan.get("epoch") or {}
    out = [f"- model: **{plan.get('model')}**; sequence length: {plan.get('seq_len', a.get('seq_len')):,} tokens per "
           f"example; micro-batch per GPU: {plan.get('batch_size')}"]
    if a:
        prep = "; prepare_model_for_kbit_training's fp32 up-casts" if as_step(a).replace(method="qlora").kbit_prepared \
            else "; no fp32 up-casts, bf16 adapters"
        out += [f"- base weights: {a.get('dtype')} for full and LoRA, 4-bit NF4 for QLoRA (double quantization "
                f"{_on(a.get('double_quant'))}{prep}); autocast {_on(a.get('autocast'))}",
                f"- gradient checkpointing {_on(a.get('gradient_checkpointing'))}; attention {a.get('attn_implementation')}; "
                f"optimizer {a.get('optimizer')}; padding mask {a.get('padding')}",
                f"- LoRA / QLoRA: rank {a.get('lora_rank')}, targets {a.get('lora_targets')} (full fine-tuning trains "
                "every parameter)",
                f"- GPUs per run: {a.get('num_gpus')}, sharding {a.get('sharding')}, CPU offload {_on(a.get('cpu_offload'))}"]
    else:
        out.append("- the other step settings were not recorded in this plan.json (written by an older notebook 01)")
    if plan.get("margin") is not None:
        out.append(f"- fits: the estimate uses at most {1 - plan['margin']:.0%} of the GPU's memory "
                   f"(a {plan['margin']:.0%} safety margin)")
    if ep:
        mine = _data_epoch(plan, epoch_time_)
        if mine:
            out.append(f"- one epoch: {_epoch_size(mine)} ({mine.get('note', '')}); the plan was made before the smoke "
                       f"run read your data, with a placeholder of {_epoch_size(ep)}: its times, costs and "
                       "recommendation are recomputed here for your data")
        else:
            out.append(f"- one epoch: {_epoch_size(ep)} ({ep.get('note', '')})")
    if plan.get("time_model"):
        out.append(f"- time: {plan['time_model']}")
    if plan.get("attention_note"):
        out.append(f"- attention on CUDA: {plan['attention_note']}")
    return out


def _epoch_size(ep: dict) -> str:
    """"N examples = T tokens" (padded rows: T counts the padding); the user's padded rows: "N examples (T tokens
    of text, before padding)"; packed: "T tokens"."""
    tokens = f"{ep.get('tokens', 0):,} tokens"
    if not ep.get("examples") or ep.get("packed"):
        return tokens
    if ep.get("source") == "yours":
        return f"{ep['examples']:,} examples ({tokens} of text, before padding)"
    return f"{ep['examples']:,} examples = {tokens}"


def longest_line(sweeps: dict | None) -> str | None:
    """sweeps.json's longest seq_len at micro-batch 1 on the planned GPU, per setting, in one line."""
    longest = (sweeps or {}).get("max_seq_len_batch1")
    if not longest:
        return None
    context = sweeps.get("context")
    capped = (set(longest.values()) if isinstance(longest, dict) else {longest}) == {context}

    def value(v):
        return f"{v:,}" + (" (the model's context)" if v == context and not capped else "")
    per = ("; ".join(f"{k.replace('qlora', 'QLoRA').replace('lora', 'LoRA')}: {value(v)}" for k, v in longest.items())
           if isinstance(longest, dict) else value(longest))
    tail = (f" Every value is the model's context ({context:,} positions, max_position_embeddings), where the search "
            "stops: memory allows more." if capped else "")
    return (f"Longest seq_len (tokens) that fits {sweeps.get('gpu')} at micro-batch 1 ({sweeps.get('plan_model')}, "
            f"notebook 02): {per}.{tail}")


def _data_epoch(plan: dict, epoch_time_: dict | None) -> dict | None:
    """The user's epoch (the smoke run's data statistics, in :func:`epoch_time`) where the plan used its
    placeholder and the two differ; None where the plan's epoch stands."""
    ep, mine = plan.get("epoch") or {}, (epoch_time_ or {}).get("epoch") or {}
    if ep.get("source") == "yours" or not mine or not (mine.get("examples") or mine.get("tokens")):
        return None
    return mine if (mine.get("examples"), mine.get("tokens")) != (ep.get("examples"), ep.get("tokens")) else None


def request_rows(plan: dict, epoch_time_: dict | None = None) -> tuple:
    """plan.json's method x GPU rows and recommendation, their times and costs recomputed for the user's epoch
    when the plan used a placeholder (:func:`_data_epoch`)."""
    mine = _data_epoch(plan, epoch_time_)
    if not mine:
        return plan["rows"], plan.get("recommendation")
    a = plan.get("assumptions") or {}
    step = {k: v for k, v in {"seq_len": plan.get("seq_len") or a.get("seq_len"), "num_gpus": a.get("num_gpus"),
                              "grad_accum": (epoch_time_ or {}).get("grad_accum")}.items() if v}
    df = reprice(plan["rows"], mine, as_step(None, **step),
                 error_factor=plan.get("time_error_factor") or time_constants.ERROR_FACTOR_UNCALIBRATED)
    return df, df.attrs["recommendation"]


def planned_apart_lines(settings: dict | None, plan: dict) -> list[str]:
    """One line, or none: the step fields the plan sizes differently from this run's settings because the run left
    them at the embedded model's CPU defaults (``Settings.plan_step``), each with both values."""
    from lora_kit.settings import EMBEDDED_CHANGES
    a, s = plan.get("assumptions") or {}, settings or {}
    apart = [f"{k} {a[k]!r} (this run: {s[k]!r})" for k in EMBEDDED_CHANGES
             if k in a and k in s and s[k] == EMBEDDED_CHANGES[k][0] and a[k] != s[k]]
    if not apart:
        return []
    return [f"- planned for a GPU, not as this run: {', '.join(apart)}. This run left them at the embedded model's "
            "CPU defaults, which the plan replaces with GPU planning defaults; a value other than the CPU default is "
            "planned as you set it"]


def request_lines(plan: dict | None, sweeps: dict | None = None, epoch_time_: dict | None = None,
                  settings: dict | None = None) -> list[str]:
    """The request: what the plan assumes, every option that fits (cheapest first), the recommendation; times and
    costs for the user's dataset once the smoke run has read it."""
    lines = ["## The request", ""]
    if not (plan and plan.get("rows")):
        return lines + ["_No plan in this run (notebook 01 did not run)._", ""]
    lines += ["Every method x GPU option that fits, cheapest first. The numbers assume:", ""]
    lines += assumption_lines(plan, epoch_time_) + planned_apart_lines(settings, plan)
    rows, recommendation = request_rows(plan, epoch_time_)
    lines += ["", method_markdown(rows, fits_only=True, cheapest_first=True)]
    if recommendation:
        lines += ["", f"**Recommendation:** {recommendation}"]
    if longest_line(sweeps):
        lines += ["", longest_line(sweeps)]
    return lines + [""]


def _smoke_device(smoke: dict | None) -> str:
    """The device the smoke run trained on (``smoke.json``'s ``launch``: "cuda:0", "cpu"), or ""."""
    return str(((smoke or {}).get("launch") or {}).get("device", ""))


def _smoke_calibration(smoke: dict, plan: dict, row: dict) -> dict | None:
    """The smoke run's measured step as a calibration of the plan's GPU, when it ran the planned model on CUDA on
    that GPU: ``{"scale", "error_factor", "source"}``; None otherwise (a CPU or tiny-model smoke run)."""
    ss = smoke.get("settings") or {}
    steps = [x for x in (smoke.get("steps") or [])[1:] if x.get("seconds")]
    if not steps or not _smoke_device(smoke).startswith("cuda"):
        return None
    if ss.get("model") != plan.get("model") or not ss.get("gpu"):
        return None
    try:
        gpu = get_gpu(ss["gpu"])
        if gpu["name"] != row["gpu"]:
            return None
        median = sorted(steps, key=lambda x: x["seconds"])[len(steps) // 2]
        # the tokens that step ran: its width with padding "longest", its packed row with "packed"
        st = as_step(ss)
        ran = {**ss, "seq_len": ran_seq_len(st.padding, st.seq_len, st.batch_size, median.get("seq_len"))}
        tm = calibrate(median["seconds"], ran, gpu)
    except ValueError:
        return None
    return {"scale": tm.scale, "error_factor": tm.error_factor, "source": tm.source}


def epoch_time(card: dict) -> dict | None:
    """Time and cost of one epoch of the user's data for the planned row (``method`` on ``gpu`` of the settings,
    else the recommended row), with the interval from the time model's measured error: before calibration, or
    the smaller one after the smoke run calibrated the model on that GPU. The epoch is the plan's when the user
    gave it, else the smoke run's data statistics, else the plan's placeholder (said so)."""
    plan, smoke, s = card.get("plan") or {}, card.get("smoke") or {}, card.get("settings") or {}
    row = plan_row(plan.get("rows") or [], s.get("gpu"), s.get("method"))
    if not row or not row.get("fits") or not row.get("step_seconds"):
        return None
    ep = plan.get("epoch") or {}
    data = smoke.get("data") or {}
    if ep.get("source") != "yours" and data.get("usable") and data.get("mean_length"):
        ep = epoch_from_data(data)
    elif ep.get("source") != "yours" and ep.get("examples"):
        ep = {**ep, "note": f"{ep.get('note', '')}; a placeholder until the smoke run has read your dataset "
                            "(or pass epoch= to compare_methods)"}
    if not (ep.get("examples") or ep.get("tokens")):
        return None
    a = plan.get("assumptions") or {}
    n_gpus, grad_accum = int(a.get("num_gpus") or 1), int(s.get("grad_accum") or 1)
    cal = _smoke_calibration(smoke, plan, row)
    planned = plan.get("time_error_factor") or time_constants.ERROR_FACTOR_UNCALIBRATED  # older plan.json: none
    factor = min(cal["error_factor"], planned) if cal else planned
    step_s = row["step_seconds"] * (cal["scale"] if cal else 1.0)
    # the planner's own epoch arithmetic (the request's table uses it too), at the calibrated step time
    e = epoch_columns({**row, "step_seconds": step_s}, ep, 1.0, plan.get("seq_len") or a.get("seq_len"), n_gpus,
                      grad_accum, factor)
    priced = row.get("price_per_hour") is not None
    return {"method": row["method"], "gpu": row["gpu"], "batch_size": row["batch_size"], "num_gpus": n_gpus,
            "grad_accum": grad_accum, "steps": e["steps_per_epoch"], "step_seconds": step_s,
            "hours": e["epoch_hours"], "hours_low": e["epoch_hours_low"], "hours_high": e["epoch_hours_high"],
            **{k: e[f"epoch_{k}"] if priced else None for k in ("cost", "cost_low", "cost_high")},
            "price_source": row.get("price_source"), "error_factor": factor, "calibration": cal, "epoch": ep}


def epoch_time_lines(et: dict | None) -> list[str]:
    """The epoch's time and cost with their interval, in words."""
    if not et:
        return []
    ep = et["epoch"]
    size = (f"{ep['examples']:,} rows" if ep.get("examples") else f"{ep['tokens']:,} tokens") + f" ({ep.get('note', '')})"
    why = (f"after calibrating on the smoke run's measured step on this GPU ({et['calibration']['source']})"
           if et.get("calibration") else "before calibration: a smoke run of this model on the rented GPU narrows it")
    cost = (f"; cost **{money_text(et['cost'])}** ({money_text(et['cost_low'])} to {money_text(et['cost_high'])}, "
            f"{'your' if et.get('price_source') == 'yours' else 'EXAMPLE'} price)" if et.get("cost") is not None else "")
    return ["### Time and cost per epoch", "",
            f"{method_label(et['method'])} on {et['num_gpus']} x {et['gpu']}, micro-batch {et['batch_size']}: one epoch "
            f"is {size}, {et['steps']:,} steps of {et['step_seconds']:.3g} s: **{hours_text(et['hours'])}** "
            f"({hours_text(et['hours_low'])} to {hours_text(et['hours_high'])}){cost}. The interval is the time "
            f"model's measured error, x{et['error_factor']:.2f}, {why}.", ""]


def _probe_rows(probes: list[dict]) -> list[dict]:
    """A probe's row shows its error when it has one (a failure's message), else its detail."""
    return [{"name": p.get("name"), "status": p.get("status"),
             "detail": str(p.get("error") or p.get("detail") or "").replace("\n", " ")} for p in probes]


def _hardware_line(hw: dict) -> str:
    gpus = hw.get("gpus") or []
    gpu = ("; ".join(f"{g.get('name')} ({(g.get('memory_bytes') or 0) / GiB:.1f} GiB, compute capability "
                     f"{g.get('compute_capability')})" for g in gpus) if gpus else "no GPU")
    return f"CPU {hw.get('cpu_architecture', '?')} ({hw.get('cpu_count', '?')} cores), {hw.get('os', '?')}; {gpu}"


def _row_step(plan: dict, row: dict) -> dict:
    """The step fields of the plan's ``row``: plan.json's ``assumptions`` with the row's method and micro-batch."""
    return {**(plan.get("assumptions") or {}), "method": row["method"],
            "batch_size": int(row.get("batch_size") or plan.get("batch_size") or 1)}


def _paged_resident(plan: dict, row: dict) -> int:
    """Bytes a paged optimizer keeps in CUDA managed memory for the plan's ``row`` (0 for other optimizers:
    :func:`lora_kit.memory.estimate.paged_resident`); 0 where it cannot be estimated here."""
    step = _row_step(plan, row)
    if not str(step.get("optimizer") or "").startswith("paged_") or not plan.get("model"):
        return 0
    from lora_kit.memory.estimate import paged_resident
    try:
        return paged_resident(plan["model"], **step)
    except (ValueError, OSError, TypeError):  # a model or setting this process cannot plan
        return 0


def _reserved_expandable(plan: dict, row: dict, peak: int | None) -> int | None:
    """torch's reserved for the plan's ``row`` with ``expandable_segments:True`` (what the kit's GPU path sets), in
    the closed form of ``lora_kit.memory.device`` from the row's peak; None where the step cannot be read here."""
    if peak is None or not plan.get("model"):
        return None
    from lora_kit.memory.device import device_kwargs, reserved_bytes
    from lora_kit.memory.specs import model_spec
    from lora_kit.settings import as_step
    try:
        kw = device_kwargs(model_spec(plan["model"]), as_step(None, **_row_step(plan, row)))
    except (ValueError, OSError, TypeError):  # a model or setting this process cannot plan
        return None
    kw.pop("num_gpus")
    return int(reserved_bytes(peak, allocator="expandable", **kw))


def nvidia_smi_view(card: dict) -> dict | None:
    """What nvidia-smi will show for the planned row (``method`` on ``gpu`` of the settings, else the recommended
    row), on the basis of ``lora_kit.memory.device``: the plan's device total (what the training process adds to the
    card, the figure "fits" compares with CUDA's total) = the GPU's CUDA context + torch's reserved memory + memory
    outside the allocator (kernel workspaces; NCCL on a multi-GPU rank), each labelled; then the paged optimizer
    states resident while there is room (CUDA managed memory the driver pages out when the card runs short: shown,
    never counted in *fits*); then the driver's share (nvidia-smi's total minus CUDA's), which nvidia-smi counts as
    used before any process starts. Each is added once, here, and only the device total enters the verdict."""
    from lora_kit.memory.device import cuda_allocated_bytes, outside_bytes
    plan, s = card.get("plan") or {}, card.get("settings") or {}
    row = plan_row(plan.get("rows") or [], s.get("gpu"), s.get("method"))
    if not row or row.get("device_total_gib") is None:
        return None
    try:
        g = get_gpu(row["gpu"])
    except ValueError:  # a GPU added with add_gpu in the planning session is not in this process's catalog
        return None
    total = int(row["device_total_gib"] * GiB)
    share = g.get("driver_share_bytes")
    share = int(share) if isinstance(share, (int, float)) and share == share else None
    gpus = int((plan.get("assumptions") or {}).get("num_gpus") or 1)
    context, outside = int(g["context_bytes"]), int(outside_bytes(row["method"], gpus))
    paged = _paged_resident(plan, row)
    process = total + paged
    peak = int(row["peak_gib"] * GiB) if row.get("peak_gib") is not None else None
    expandable = _reserved_expandable(plan, row, peak)
    return {"method": row["method"], "gpu": g["name"], "device_total_bytes": total, "batch_size": row.get("batch_size"),
            "seq_len": plan.get("seq_len"), "largest_batch": plan.get("batch_size") == PLAN_BATCH,
            "reserved_expandable_bytes": expandable,
            "device_total_expandable_bytes": None if expandable is None else context + expandable + outside,
            "peak_allocated_bytes": peak,
            "cuda_allocated_bytes": cuda_allocated_bytes(peak, compute_capability(g)) if peak is not None else None,
            "context_bytes": context, "context_basis": g["context_basis"], "outside_bytes": outside,
            "reserved_bytes": total - context - outside, "paged_resident_bytes": paged,
            "process_bytes": process,
            "cuda_capacity_bytes": int(g["cuda_capacity_bytes"]), "capacity_basis": g["cuda_capacity_basis"],
            "driver_share_bytes": share, "nvidia_smi_total_bytes": int(g["capacity_bytes"]) if share else None,
            "nvidia_smi_used_bytes": process + share if share is not None else None}


def _micro_batch(view: dict) -> str:
    """", at micro-batch B x seq_len S (the plan's row)", or "" where the row does not say."""
    b, sl = view.get("batch_size"), view.get("seq_len")
    if not isinstance(b, (int, float)) or b != b:
        return ""
    return f", at micro-batch {int(b)}" + (f" x seq_len {int(sl):,}" if isinstance(sl, (int, float)) else "") + \
        (" (the plan's: the largest that fits)" if view.get("largest_batch") else "")


def nvidia_smi_lines(view: dict | None) -> list[str]:
    """:func:`nvidia_smi_view` in words, each figure labelled with what it is."""
    if not view:
        return []
    basis = ("CUDA's total (the catalog's reading)" if not str(view["capacity_basis"]).startswith("fallback")
             else "the vendor's GB x 1e9, a fallback: the catalog has no CUDA reading for this GPU")
    out = ["### What nvidia-smi will show", "",
           f"{method_label(view['method'])} on {view['gpu']}{_micro_batch(view)}: the plan's device total is "
           f"**{_gib(view['device_total_bytes'])}** per GPU (what the training process adds to the card: CUDA "
           f"context, torch's reserved memory, memory outside its allocator); *fits* compares it with "
           f"{_gib(view['cuda_capacity_bytes'])} less the safety margin, {basis}.", "",
           "| part | GiB | what it is |", "|---|---:|---|",
           f"| CUDA context | {view['context_bytes'] / GiB:.2f} | " + (
               "measured on this GPU |" if str(view["context_basis"]).startswith("measured")
               else "a stated default (no reading for this GPU) |"),
           f"| torch's reserved | {view['reserved_bytes'] / GiB:.2f} | the peak allocated plus the caching allocator's "
           "fragmentation (closed form fitted on allocator replays, PyTorch's default setting) |",
           f"| outside the allocator | {view['outside_bytes'] / GiB:.2f} | kernel workspaces (and NCCL on a "
           "multi-GPU rank) |",
           f"| **device total** | **{view['device_total_bytes'] / GiB:.2f}** | what *fits* counts |"]
    if view.get("reserved_expandable_bytes") is not None:
        out.append(f"| torch's reserved with expandable segments | {view['reserved_expandable_bytes'] / GiB:.2f} | "
                   "`expandable_segments:True`, what the kit's GPU path sets (closed form fitted on replays of that "
                   f"setting); device total with it {view['device_total_expandable_bytes'] / GiB:.2f}; *fits* "
                   "counts the default setting's, which a trainer of your own may run |")
    if view.get("paged_resident_bytes"):
        out.append(f"| paged optimizer states, resident when room | {view['paged_resident_bytes'] / GiB:.2f} | CUDA "
                   "managed memory: on the card while it fits, paged to the host when it does not; not counted in "
                   "*fits* |")
    out.append("")
    if view.get("cuda_allocated_bytes") is not None:
        out += [f"`torch.cuda.max_memory_allocated()` will read about **{_gib(view['cuda_allocated_bytes'])}**: the "
                f"plan's peak of {_gib(view['peak_allocated_bytes'])} (the step's tensors) plus two cuBLAS workspaces "
                "(the forward's thread and autograd's), which torch's allocator holds from the first matmul on.", ""]
    if view.get("driver_share_bytes") is not None:
        out.append(f"nvidia-smi counts the driver's share as used before any process starts, so it will show about "
                   f"**{_gib(view['nvidia_smi_used_bytes'])}** used of its {_gib(view['nvidia_smi_total_bytes'])} "
                   f"total: the device total" + (" + the paged states resident" if view.get("paged_resident_bytes")
                                                 else "") +
                   f" + the driver's share of {_gib(view['driver_share_bytes'])} (nvidia-smi's "
                   "total minus CUDA's). The share is not part of the device total and is not counted in *fits*.")
    else:
        out.append("nvidia-smi will show the device total plus the driver's share, which the catalog cannot give for "
                   "this GPU (it needs both nvidia-smi's and CUDA's total); on the machine, nvidia-smi's total minus "
                   "the total of `torch.cuda.mem_get_info()` is that share.")
    return out + [""]


def allocator_lines(smoke: dict | None) -> list[str]:
    """The CUDA caching allocator setting the smoke run started with (smoke.json's ``allocator``), who set it,
    and the one thing to do about it."""
    a = (smoke or {}).get("allocator")
    if not isinstance(a, dict):
        return []
    on = a.get("expandable_segments")
    who = {"lora_kit": "set by lora_kit", "environment": "set in your environment"}.get(a.get("set_by"),
                                                                                       "set by an unknown source")
    var = f"`{a['variable']}={a.get('value', '')}`" if a.get("variable") else "no allocator variable set"
    if _smoke_device(smoke).startswith("cpu"):
        return [f"- CUDA allocator: expandable segments {'on' if on else 'off'} ({var}, {who}); this smoke run ran "
                "on a CPU, where the setting has no effect. On the rented GPU the kit's GPU path turns expandable "
                "segments on unless the variable is set; what nvidia-smi will show (above) gives torch's reserve "
                "under both settings, and *fits* counts the default's."]
    out = [f"- CUDA allocator: expandable segments **{'on' if on else 'off'}** ({var}, {who}). Keep this setting "
           "on the rented GPU, set before CUDA starts: the smoke run's memory was measured with it"
           + ("." if on else "; the kit's own GPU path turns expandable segments on unless the variable is set, "
                             "which keeps reserved memory closer to allocated.")]
    if a.get("cuda_started_before"):
        out.append("- CUDA had started before the setting was made, so its allocator may not have read it.")
    for name in a.get("ignored") or []:
        out.append(f"- `{name}` is set, but this torch's CUDA allocator does not read it (torch 2.9-2.10 ignore "
                   "`PYTORCH_ALLOC_CONF`'s expandable segments on CUDA, pytorch issue 183387): set "
                   "`PYTORCH_CUDA_ALLOC_CONF` instead.")
    return out


def smoke_lines(smoke: dict) -> list[str]:
    """The smoke run's step time, throughput, checkpoint and verification, rounded and in words."""
    lines = [f"Status: **{smoke.get('status')}**"]
    steps = smoke.get("steps") or []
    if steps:
        secs = sorted(x["seconds"] for x in steps[1:] or steps)
        lines.append(f"- {len(steps)} optimizer steps; median step {secs[len(secs) // 2]:.3f} s; "
                     f"loss {steps[0].get('loss', float('nan')):.3f} → {steps[-1].get('loss', float('nan')):.3f}")
    tp = smoke.get("throughput") or {}
    if tp.get("mean_step_seconds") is not None:
        # the plan's tokens/s counts every row slot (micro-batch x seq_len per step); older smoke.json: from its steps
        padded = tp.get("mean_padded_tokens_per_s") or (throughput(steps)["mean_padded_tokens_per_s"] if steps
                                                        else None)
        lines.append(f"- mean step {tp['mean_step_seconds']:.3f} s, {tp.get('mean_tokens_per_s', 0):,.0f} tokens/s "
                     "(the rows' own tokens, padding excluded"
                     + (f"; {padded:,.0f} counting padding, as the request's tokens/s counts them" if padded else "")
                     + ")" + (f" ({tp['note']})" if tp.get("note") else ""))
    ck = smoke.get("checkpoint") or {}
    if ck:
        lines.append(f"- adapter on disk: {ck.get('bytes', 0) / 2**20:.2f} MiB ({', '.join(sorted(ck.get('files', {})))})")
    if (smoke.get("data") or {}).get("long_examples"):
        lines.append("- " + long_examples_line(smoke["data"]))
    ver = smoke.get("verify") or {}
    if ver:
        files = ver.get("files") or {}
        lines.append(f"- verify: **{'passed' if ver.get('passed') else 'FAILED'}**. The reloaded adapter "
                     f"{'reproduces' if ver.get('reload_equal') else 'does NOT reproduce'} the trained logits (largest "
                     f"difference {ver.get('reload_max_abs_diff', float('nan')):.2g}, tolerance "
                     f"{ver.get('tolerance', float('nan')):.0e}); the adapter "
                     f"{'changes' if ver.get('adapter_changes_outputs') else 'does NOT change'} the base model's logits "
                     f"(largest change {ver.get('adapter_vs_base_max_abs_diff', float('nan')):.3g})"
                     + (f"; {files['n_tensors']} LoRA tensors, no missing or unexpected keys" if files.get("n_tensors")
                        else "") + ".")
    return lines


SHOWN_CHARS = 1200  # a rendered example longer than this is shown by its start and end, the middle left out


def _middle_cut(text: str, keep: int = SHOWN_CHARS) -> str:
    """``text``, or its first and last ``keep // 2`` characters with what was left out said between them."""
    if len(text) <= keep:
        return text
    half = keep // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half:,} characters left out ...]\n{text[-half:]}"


def _fenced(text: str) -> list[str]:
    """``text`` as a fenced code block whose fence no backtick run in the text can close."""
    run = max((len(r) for r in "".join(c if c == "`" else " " for c in text).split()), default=0)
    fence = "`" * max(3, run + 1)
    return [fence + "text", text, fence]


def prompt_lines(smoke: dict, ev: dict | None = None) -> list[str]:
    """The prompt format the smoke run resolved (and why), what it trained, and its first trained row exactly
    as the tokenizer received it (smoke.json's ``data.rendered_example``, :meth:`lora_kit.prompting.PromptFormat.
    as_seen`); the evaluation's format beside it when the two differ."""
    from lora_kit.prompting import format_label
    data = smoke.get("data") or {}
    kind = data.get("prompt_format")
    if not kind:
        return []
    why = f", because {data['prompt_format_reason']}" if data.get("prompt_format_reason") else ""
    lines = [f"- **prompt format**: {format_label(kind)}{why}; trained tokens: train_on={data.get('train_on')!r}"
             + "".join(f"; {n}" for n in data.get("format_notes") or [])]
    ev_kind = ((ev or {}).get("decoding") or {}).get("prompt_format")
    if ev_kind and ev_kind != kind:
        lines.append(f"- the evaluation prompted in **{format_label(ev_kind)}**, not the format the smoke run trained "
                     "in: its figures judge prompts the adapter was not trained on")
    ex = data.get("rendered_example")
    if not ex:
        return lines
    cut = f", cut to seq_len={ex['truncated_to']:,} in training" if ex.get("truncated_to") else ""
    bos = f"; the tokenizer adds `{ex['bos']}` in front of it" if ex.get("bos") else ""
    trained = "\n[...]\n".join(_middle_cut(t, SHOWN_CHARS // 2) for t in ex.get("trained") or [])
    lines += ["", f"The first trained row (line 1 of `data/trained.jsonl`) as the tokenizer received it: "
              f"{ex.get('tokens', 0):,} tokens{cut}, {ex.get('trained_tokens', 0):,} of them trained{bos}"
              + (f"; {len(ex['text']):,} characters, the middle left out" if len(ex["text"]) > SHOWN_CHARS else "")
              + ":", ""] + _fenced(_middle_cut(ex["text"])) + [
              "", "The trained tokens (what the loss sees), decoded:", ""] + _fenced(trained) + [
              "", "`data/trained.jsonl`, `data/heldout.jsonl` and `eval/per_example.csv` keep each row as read (a "
              "conversation as `role: text` lines), not as rendered; the model saw the format above."]
    return lines


def loop_view(plan: dict | None, gpu: str | None = None) -> dict | None:
    """The loop users run next: per method, the plan's step at the micro-batch of that method's row in the plan
    (on ``gpu``, the run's planned GPU, else its recommended row: :func:`lora_kit.plan.records.plan_row`), under
    transformers' Trainer and TRL's SFTTrainer with their defaults (``estimate(loop=...)``: fused AdamW, clipping,
    SFT's fused LM head), beside lora_kit's step. A method whose figures cannot be made says why. Made from the
    plan as the run wrote it (a local model by its path), before the card drops local paths."""
    if not (plan and plan.get("rows") and plan.get("assumptions")):
        return None
    from lora_kit.memory.estimate import estimate, has_fit
    from lora_kit.memory.loops import sft_cpu_tiles
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.specs import model_spec
    from lora_kit.plan.records import plan_row
    from lora_kit.settings import LOOPS, as_step
    a = plan["assumptions"]
    rows, batches = [], []
    for method in dict.fromkeys(r["method"] for r in plan["rows"] if r.get("method")):
        try:
            row = plan_row(plan["rows"], gpu, method)
        except ValueError:  # a GPU the catalog does not know: the method's recommended row
            row = plan_row(plan["rows"], None, method)
        batch = row.get("batch_size", plan.get("batch_size"))  # a row without one: the plan's single micro-batch
        where = method_label(method) + (f" on {row['gpu']}" if row.get("gpu") else "") + f", micro-batch {batch}"
        where += "" if row.get("fits", True) else " (does not fit that GPU)"
        try:
            step = as_step(a).for_method(method).replace(batch_size=int(batch))  # LoRA fields: full's defaults
            # a loop without a kept fit (a model of your own): one simulated step, not a fit of the whole family
            peak = {loop: (estimate if has_fit(plan["model"], step, loop=loop) else simulate)(
                plan["model"], step, loop=loop).peak_allocated_bytes for loop in LOOPS}
        except (TypeError, ValueError) as exc:
            rows.append({"where": where, "error": str(exc)})
            continue
        batches.append(int(batch))
        rows.append({"where": where, **{f"{loop}_bytes": int(v) for loop, v in peak.items()}})
    tiles = int(sft_cpu_tiles(max(batches), a["seq_len"], model_spec(plan["model"]).vocab_size)) if batches else None
    return {"model": plan["model"], "rows": rows, "sft_cpu_tiles_bytes": tiles} if rows else None


def loop_lines(view: dict | None) -> list[str]:
    """:func:`loop_view` in words."""
    if not view:
        return []
    out = [f"- {r['where']}: no estimate ({r['error']})" if "error" in r else
           f"- {r['where']}: your Trainer run will peak at **{_gib(r['trainer_bytes'])}**, TRL's SFTTrainer at "
           f"**{_gib(r['sft_bytes'])}** (lora_kit's step: {_gib(r['kit_bytes'])})" for r in view["rows"]]
    lines = ["## The loop you run next", "", f"Peak allocated per GPU (estimate; a simulated step where no fit of "
             f"that loop is kept) of the planned step ({view['model']}, "
             "same settings, each method at its micro-batch in the request) in the loop you will train with, at its "
             "defaults:", "", *out, ""]
    if view.get("sft_cpu_tiles_bytes") is not None:
        lines += [f"SFTTrainer's figure is its CPU path; on CUDA its Triton head scores the vocabulary in place, up "
                  f"to {_gib(view['sft_cpu_tiles_bytes'])} less. Set gradient checkpointing and autocast as your "
                  "config has them (SFTConfig turns both on by default).", ""]
    return lines


def _gb(b) -> str:
    """Bytes moved, in decimal units (divided by the interconnect's GB/s on the same line)."""
    if b is None:
        return "—"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b} B"


def _secs(x) -> str:
    return "—" if x is None else f"{x:.3g} s"


def _per_gpu(v):
    """smoke.json's ``estimate_<sharding>_per_gpu``: bytes, or a dict with them, or an error string (None)."""
    if isinstance(v, dict):
        v = v.get("peak_allocated_bytes")
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _planned_lines(mg: dict) -> list[str]:
    """plan.json's ``multi_gpu`` (:func:`lora_kit.plan.multi_gpu.multi_gpu_plan`) in words."""
    if mg.get("error"):
        return [f"_The multi-GPU plan could not be made: {mg['error']}_", ""]
    m, c, i, t, ck = (mg.get(k) or {} for k in ("memory", "communication", "interconnect", "time", "checkpoint"))
    sh, n = mg.get("planned_as") or mg.get("sharding"), mg.get("num_gpus")
    as_ddp = " (sharding 'none' runs as DDP)" if mg.get("sharding") == "none" else ""
    cap = (f"{_gib(m['cuda_capacity_bytes'])} CUDA-visible" if m.get("cuda_capacity_bytes")  # what fits is judged on,
           else _gib(m.get("capacity_bytes")))                                               # where the plan records it
    lines = [f"Planned: **{n} x {mg.get('gpu')}**, {method_label(mg.get('method', '?'))}, sharding **{sh}**{as_ddp}, "
             f"{mg.get('model')}, seq_len {mg.get('seq_len', 0):,}, micro-batch {mg.get('batch_size')} per GPU"
             + (", CPU offload on" if mg.get("cpu_offload") else "") + ".", "",
             f"- {m.get('not_pooled', 'Memory is not pooled: each GPU must hold its own per-GPU peak.')}",
             f"- Per GPU ({sh}): peak allocated **{_gib(m.get('per_gpu_peak_bytes'))}**, device total "
             f"**{_gib(m.get('per_gpu_device_total_bytes'))}** (CUDA context + torch's reserved + outside the "
             f"allocator, NCCL included), of "
             f"{cap}: {'fits' if m.get('fits') else 'does NOT fit'} with the {mg.get('margin', 0):.0%} margin."]
    saved, pct = m.get("saving_vs_ddp_bytes") or 0, m.get("saving_vs_ddp_pct") or 0.0
    if sh != "ddp":
        lines.append(f"- DDP would need {_gib(m.get('ddp_per_gpu_peak_bytes'))} per GPU (device total "
                     f"{_gib(m.get('ddp_per_gpu_device_total_bytes'))}): " + (
                         f"{sh} saves **{_gib(saved)} per GPU ({pct:.1f} %)**." if saved >= 0 else
                         f"{sh} needs **{_gib(-saved)} MORE per GPU ({-pct:.1f} %)**: on this model the gathered "
                         "layers and communication buffers outweigh what sharding saves."))
    moved = (f"all-reduce {_gb(c.get('all_reduce_bytes'))}" if c.get("all_reduce_bytes") else
             f"all-gather {_gb(c.get('all_gather_bytes'))}, reduce-scatter {_gb(c.get('reduce_scatter_bytes'))}")
    lines.append(f"- Communication per step, computed from the model ({c.get('source')}): {moved} of buffers; "
                 f"each rank sends (and receives) **{_gb(c.get('per_rank_traffic_bytes'))}**. {c.get('how', '')}.")
    bw = i.get("gbs_per_direction")
    lines.append(f"- Interconnect assumed: {i.get('name') or '?'}, "
                 + (f"{bw:g} GB/s per direction (the catalog's datasheet figure)." if bw else "no bandwidth in the "
                    "catalog (add interconnect_gbs)."))
    if t.get("step_seconds_not_overlapped") is not None:
        epoch = (f"; an epoch ({t['steps_per_epoch']:,} steps) {t['epoch_hours_overlapped']:.3g} h overlapped, "
                 f"{t['epoch_hours_not_overlapped']:.3g} h not" if t.get("epoch_hours_not_overlapped") else "")
        lines.append(f"- Step time, **an assumption until a multi-GPU run measures it**: compute "
                     f"{_secs(t.get('compute_step_seconds'))} + communication {_secs(t.get('comm_seconds'))} = "
                     f"**{_secs(t['step_seconds_not_overlapped'])}** not overlapped, "
                     f"{_secs(t.get('step_seconds_overlapped'))} if communication hides behind compute{epoch} "
                     f"({t.get('assumption', '')}).")
    else:
        lines.append("- Step time with communication: not computed "
                     f"({t.get('assumption', 'no interconnect bandwidth')}).")
    if ck:
        lines.append(f"- Checkpoint: {ck.get('what')}, **{_gib(ck.get('bytes'))}** ({ck.get('dtype')}) at "
                     f"`{ck.get('file')}`, written by {ck.get('written_by')}.")
        sh_ck = ck.get("sharded") or {}
        if sh_ck:
            lines.append(f"  Resumable training state (fsdp, sharded state dict): `{sh_ck.get('where')}`, per rank "
                         "about "
                         f"{_gib(sh_ck.get('model_bytes_per_rank'))} of model state and "
                         f"{_gib(sh_ck.get('optimizer_bytes_per_rank'))} of optimizer state ({sh_ck.get('note')}).")
    return lines + [""]


def _measured_ranks(smoke: dict, plan_model: str | None) -> list[str]:
    """The smoke run's per-rank measured peaks beside the estimate for the same model and sharding."""
    world = (smoke.get("launch") or {}).get("world_size") or 1
    ranks = [r for r in (smoke.get("peaks") or {}).get("per_rank") or [] if isinstance(r, dict)]
    if world <= 1 and len(ranks) <= 1:
        return []
    st, launch = smoke.get("settings") or {}, smoke.get("launch") or {}
    ran = str(launch.get("sharding") or st.get("sharding") or "none")  # smoke.json names the engine that ran
    sh = "fsdp" if launch.get("fsdp") else "ddp"  # launch.fsdp is there when FSDP2 sharded the run, else DDP ran
    mm = smoke.get("memory_model") or {}
    est_keys = [k for k in mm if k.startswith("estimate_") and k.endswith("_per_gpu")]
    est = _per_gpu(mm.get(f"estimate_{sh}_per_gpu"))
    sim = mm.get("simulate") if isinstance(mm.get("simulate"), dict) else {}
    sim = _per_gpu(sim) if sim.get("num_gpus") == world and sim.get("sharding", "none") != "none" else None
    rows = []
    for r in ranks:
        peak = r.get("design_step_peak_bytes")
        err = (f"{(est - peak) / peak * 100:+.1f} %" if est is not None and isinstance(peak, (int, float)) and peak
               else "—")
        rows.append({"rank": r.get("rank", "?"), "peak": _gib(peak), "max": _gib(r.get("max_peak_bytes")),
                     **{k: _gib(_per_gpu(mm.get(k))) for k in est_keys}, "sim": _gib(sim), "err": err})
    cols = ([("rank", "rank"), ("peak", "measured peak (step 1)"), ("max", "max over measured steps")]
            + [(k, f"estimate per GPU ({k[len('estimate_'):-len('_per_gpu')]})") for k in est_keys]
            + ([("sim", "simulate (FSDP2, rank 0)")] if sim is not None else [])
            + [("err", f"estimate ({sh}) vs measured")])
    lines = [f"Measured in the smoke run: {world} processes ({launch.get('device', '?')}), "
             f"{st.get('model', '?')}, sharding {ran}, micro-batch {st.get('batch_size', '?')} per process:", ""]
    lines.append(_md_table(rows, cols) if rows else "_smoke.json has no per-rank peaks._")
    ck = smoke.get("checkpoint") or {}
    if (ck.get("gathered_from_ranks") or 1) > 1:
        lines += ["", f"Its adapter: {_gib(ck.get('bytes'))} on disk in `{ck.get('dir')}`, gathered from "
                  f"{ck['gathered_from_ranks']} ranks and written by rank {ck.get('written_by_rank', 0)} alone."]
    if plan_model and st.get("model") and st.get("model") != plan_model:
        lines += ["", f"The smoke run trained {st.get('model')}, not the planned {plan_model}: compare its ranks with "
                  "the estimate for its own model (columns above), and the planned figures above with a smoke run of "
                  "the planned model on the rented GPUs."]
    return lines + [""]


def multi_gpu_lines(card: dict) -> list[str]:
    """"## Several GPUs": the plan's multi-GPU record and the smoke run's per-rank peaks; nothing for one GPU."""
    plan, smoke = card.get("plan") or {}, card.get("smoke") or {}
    mg = plan.get("multi_gpu")
    planned_n = max((plan.get("assumptions") or {}).get("num_gpus") or 1,
                    (card.get("settings") or {}).get("num_gpus") or 1)
    measured = _measured_ranks(smoke, plan.get("model")) if smoke else []
    if not mg and planned_n <= 1 and not measured:
        return []
    lines = ["## Several GPUs", ""]
    if mg:
        lines += _planned_lines(mg)
    elif planned_n > 1 and not card.get("pipeline") and not card.get("plan") and measured:
        lines += [f"_The run is for {planned_n} GPUs; this folder holds a smoke run of its own (no plan.json): the "
                  "planned multi-GPU figures are on the card of the `lora-kit run` whose notebook 01 planned it._", ""]
    elif planned_n > 1:
        lines += [f"_The run is for {planned_n} GPUs but plan.json has no multi-GPU section (notebook 01 did not "
                  "run with num_gpus > 1 in this run)._", ""]
    return lines + measured


def eval_rows(ev: dict) -> list[dict]:
    """Every metric eval.json holds, per adapter and split: each system's mean with its interval, the paired
    difference with its interval and its verdict (:mod:`lora_kit.evaluation.compare`'s words); perplexity (no
    interval) after the reference loss."""
    from lora_kit.evaluation.compare import BASE, METRICS, diff_text, mean_text, verdict
    rows = []
    for a, comps in (ev.get("comparisons") or {}).items():
        for split, comp in comps.items():
            means = (ev.get("metrics") or {}).get(split) or {}
            where = f"{'held-out' if split == 'heldout' else split} ({comp.get('n')})"

            def shown(system: str, m: str) -> str:
                x = (means.get(system) or {}).get(m) or {}
                if x.get("lo") is None:
                    return mean_text(m, x.get("mean"))
                return f"{mean_text(m, x['mean'])} ({mean_text(m, x['lo'], False)} to {mean_text(m, x['hi'], False)})"

            for m, spec in METRICS.items():
                if m in comp:
                    rows.append({"adapter": a, "set": where, "metric": spec.label, "base": shown(BASE, m),
                                 "system": shown(a, m), "diff": diff_text(m, comp[m]), "verdict": verdict(m, comp[m])})
            ppl = [(means.get(s) or {}).get("perplexity") for s in (BASE, a)]
            if all(isinstance(x, (int, float)) for x in ppl):
                rows.append({"adapter": a, "set": where, "metric": "perplexity (exp of the token-weighted loss)",
                             "base": f"{ppl[0]:,.1f}", "system": f"{ppl[1]:,.1f}", "diff": "—", "verdict": "—"})
    return rows


def eval_lines(ev: dict) -> list[str]:
    """The evaluation: the held-out and control sentences made from eval.json's records
    (:func:`lora_kit.evaluation.evaluate.summary_sentences`: every metric it measured), then every metric with
    its interval (:func:`eval_rows`)."""
    from lora_kit.evaluation.evaluate import summary_sentences
    try:
        heldout, control = summary_sentences(ev)
    except (KeyError, TypeError, StopIteration):  # a record without the parts the sentences are made from
        heldout, control = ev.get("summary_sentence"), (ev.get("control") or {}).get("summary_sentence")
    lines = [x for x in (heldout,) if x]
    if control:
        lines += ["", control]
    rows = eval_rows(ev)
    if rows:
        several = len({r["adapter"] for r in rows}) > 1
        conf = round(100 * ((ev.get("statistics") or {}).get("confidence") or 0.95))
        cols = ([("adapter", "adapter")] if several else []) + [
            ("set", "set (examples)"), ("metric", "metric"), ("base", "base (interval)"),
            ("system", "adapter (interval)"), ("diff", "adapter − base (paired)"),
            ("verdict", "verdict")]
        lines += ["", f"Every metric the evaluation measured ({conf} % intervals: "
                  f"{(ev.get('statistics') or {}).get('interval', 'bootstrap')}; exact match in %, chrF 0-100, "
                  "reference loss in nats per reference token, lower is better):", "", _md_table(rows, cols).rstrip()]
    return lines


def render_markdown(card: dict) -> str:
    s = card["settings"] or {}
    lines = title_lines(card)
    lines += run_lines(card)
    lines += request_lines(card["plan"], card["sweeps"], card.get("epoch_time"), s)
    lines += epoch_time_lines(card.get("epoch_time"))
    lines += loop_lines(card["loops"] if "loops" in card else loop_view(card["plan"], s.get("gpu")))
    # --- settings ----------------------------------------------------------------------------
    lines += ["## Settings", "", "The run's settings (the names and values of a params file). The card names no "
              "path of your machine: a local model is shown by its folder's name and other local paths relative to "
              "the run folder, so set `model`, `dataset` and the other paths to where your copies are on the rented "
              "machine before using them as a params file.", "",
              "| setting | value |", "|---|---|"]
    lines += [f"| {k} | `{_param(v)}` |" if v != "" else f"| {k} | — |" for k, v in s.items()]
    lines.append("")
    # --- memory ------------------------------------------------------------------------------
    lines += ["## Memory: estimated, simulated, measured", ""]
    smoke = card["smoke"]
    rows = memory_rows(smoke)
    if rows:
        lines.append(_md_table(rows, [("source", "source"), ("peak", "peak allocated"),
                                      ("error", "error vs measured"), ("note", "note")]))
        where = ((smoke or {}).get("measurement") or {}).get("method", "")
        lines += ["", f"Measured with: {where}; peak of the second training step (per GPU)."]
        parts = [{"part": str(r["part"]).replace("_", " "), **{k: _gib(r.get(k)) for k in ("measured", "estimate", "simulate")}}
                 for r in (smoke or {}).get("memory_parts") or []]
        if parts:  # smoke.json's parts: the estimate's vocabulary, measured by part on CPU only
            lines += ["", "Part by part:", "", _md_table(parts, [("part", "part"), ("measured", "measured"),
                                                                  ("estimate", "estimated"), ("simulate", "simulated")])]
    else:
        lines.append("_No measured peak (the smoke run did not run or did not reach training)._")
    lines.append("")
    lines += nvidia_smi_lines(card.get("nvidia_smi"))
    lines += multi_gpu_lines(card)
    # --- stack -------------------------------------------------------------------------------
    lines += ["## Software stack", ""]
    st = card["stack"]
    if st:
        vers = st.get("versions", {})
        lines.append(", ".join(f"{k} {v if v is not None else '—'}" for k, v in vers.items()))
        hw = st.get("hardware", {})
        if hw:
            lines += ["", _hardware_line(hw)]
        probes = st.get("probes", [])
        if probes:
            lines += ["", _md_table(_probe_rows(probes), [("name", "probe"), ("status", "status"),
                                                          ("detail", "detail or error")])]
    else:
        lines.append("_No stack check in this run._")
    lines.append("")
    # --- smoke -------------------------------------------------------------------------------
    lines += ["## Smoke run", ""]
    if smoke:
        lines += smoke_lines(smoke) + allocator_lines(smoke) + prompt_lines(smoke, card["eval"])
        sugg = ((smoke.get("oom") or {}).get("suggestions") or {})
        if isinstance(sugg, dict) and sugg.get("ranked"):
            lines += ["", f"Out of memory in {smoke['oom'].get('phase')}. Changes that would fit "
                      "(the planner's ladder, least loss of quality first):"]
            lines += [f"1. {x.get('change')}" for x in sugg["ranked"]]
    else:
        lines.append("_No smoke run in this run._")
    lines.append("")
    # --- evaluation --------------------------------------------------------------------------
    lines += ["## Evaluation: base vs adapter", ""]
    ev = card["eval"]
    lines += eval_lines(ev) if ev else ["_No evaluation in this run._"]
    figs = card.get("figures") or {}
    if figs.get("files"):
        lines += ["", "## Figures", ""]
        from lora_kit.plan.headline import FIGURE, FIGURE_NOTE
        for f in figs["files"]:
            lines.append(f"![{Path(f).stem}](figures/{Path(f).name})" if f.endswith(".png")
                         else f"- [{Path(f).stem}](figures/{Path(f).name}) (interactive HTML)")
            if Path(f).stem == FIGURE:  # the tutorial's, or one a run of an older kit recorded
                lines.append(f"_{FIGURE_NOTE}_")
        if figs.get("png_error"):
            lines += ["", f"_PNG export skipped ({figs['png_error']}); the HTML figures are the record._"]
    lines += ["", "## What to check next", ""] + [f"- {x}" for x in next_checks(card)]
    return "\n".join(lines) + "\n"


def _figures(d: Path, pipe: dict | None) -> dict:
    """PNG figures when a browser can render them (one batch), else the HTML files; with a pipeline
    record, only figures that ``figures.json`` says this run wrote (:func:`lora_kit.ui.notebook.save_figure`
    records each one; file times are not evidence: a plain ``cp -r`` changes them)."""
    from lora_kit.ui.notebook import export_pngs, figure_index
    if not (d / "figures").is_dir():
        return {}
    res = export_pngs(d)
    pngs = res.get("png") or []
    have = {Path(p).stem for p in pngs}  # a figure whose PNG failed keeps its HTML
    files = pngs + sorted(str(p) for p in (d / "figures").glob("*.html") if p.stem not in have)
    if pipe:
        run_id = (pipe.get("run") or {}).get("id")
        index = figure_index(d)
        files = [f for f in files if run_id and (index.get(Path(f).stem) or {}).get("run") == run_id]
    return {"files": [str(Path(f).relative_to(d)) for f in files], "png_error": res.get("error")}


def build_report(run_dir: str | Path) -> dict:
    """Write ``report.md`` and ``report.json`` into ``run_dir``; returns their paths."""
    d = Path(run_dir)
    card = collect(d)
    card["name"] = d.resolve().name
    card["figures"] = _figures(d, card["pipeline"])
    # what reads the model (a local folder by its path) is made first; then the card loses its local paths
    card["epoch_time"] = epoch_time(card)
    card["nvidia_smi"] = nvidia_smi_view(card)
    card["loops"] = loop_view(card["plan"], (card["settings"] or {}).get("gpu"))
    card = portable(card, d)  # the card is sent when renting a GPU: no absolute local path (relative to run_dir)
    card["next_checks"] = next_checks(card)
    write_json_atomic(d / "report.json", card)
    write_text_atomic(d / "report.md", portable_text(render_markdown(card), d))
    return {"md": str(d / "report.md"), "json": str(d / "report.json")}
