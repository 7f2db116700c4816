"""The run card: ``runs/<name>/report.md`` and ``report.json`` — the request a user sends when
renting a GPU, built from the results the notebooks wrote (missing parts are marked, never guessed).

Sources in the run directory: ``settings.json`` (pipeline), ``stack.json`` (00), ``plan.json`` (01),
``sweeps.json`` (02), ``smoke/smoke.json`` (03, written by ``smoke_run``), ``eval/eval.json`` (04).

When ``pipeline.json`` names a run, the card shows only results that carry that run's id (a file
left by another run is listed as excluded, never shown as this run's) and only figures written
while this run's notebooks executed; it says which notebooks ran in this run and which did not.
A record still saying "running" from a process that is gone is shown as "died".
"""
from __future__ import annotations

import time
from pathlib import Path

from lora_kit.data import LONG_SHARE_WARN, long_examples_line
from lora_kit.results import read_record, same_run, settled, write_json_atomic, write_text_atomic

GiB = 1024 ** 3


def _gib(b) -> str:
    """Bytes in GiB, or MiB below 1 GiB (the tiny model's peaks are a few MiB)."""
    if b is None:
        return "—"
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / 2**20:.1f} MiB"


def _pct(x) -> str:
    return "—" if x is None else f"{x:+.1f} %"


PARTS = {"settings": "settings.json", "stack": "stack.json", "plan": "plan.json", "sweeps": "sweeps.json",
         "smoke": "smoke/smoke.json", "eval": "eval/eval.json"}


def collect(run_dir: str | Path) -> dict:
    """Everything the run card needs, from the files of this run (None where a part did not run in it)."""
    d = Path(run_dir)
    pipe = settled(read_record(d / "pipeline.json"))
    ident = (pipe or {}).get("run")
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
    if stack:
        failed = [p.get("name") for p in stack.get("probes", []) if p.get("status") == "fail"]
        if failed:
            out.append(f"Fix the failing stack probes before renting: {', '.join(map(str, failed))}.")
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
             f"**{pipe.get('status')}**" + (f" in {pipe['seconds']:.0f} s" if pipe.get("seconds") else "")]
    if pipe.get("ending"):
        lines.append(f"Ending: {pipe['ending']}.")
    lines.append("")
    rows = {n: "did not run" for n in pipe.get("not_run") or []}
    for e in pipe.get("notebooks") or []:
        detail = f"{e.get('status')}" + (f" ({e['seconds']:.0f} s)" if e.get("seconds") is not None else "")
        rows[e.get("notebook")] = detail + (f": {str(e['error'])[:200]}" if e.get("error") else "")
    lines += ["| notebook | in this run |", "|---|---|"] + [f"| {n} | {d} |" for n, d in sorted(rows.items())]
    for line in pipe.get("not_written") or []:
        lines.append(f"\n_Disk full: {line}_")
    for why in (card.get("excluded") or {}).values():
        lines.append(f"\n_Excluded: {why}._")
    return lines + [""]


def render_markdown(card: dict) -> str:
    s = card["settings"] or {}
    lines = [f"# Run card: {s.get('model', '?')} · {s.get('method', '?')}", ""]
    lines += run_lines(card)
    # --- the request --------------------------------------------------------------------------
    lines += ["## The request", ""]
    plan = card["plan"]
    if plan and plan.get("rows"):
        lines.append(f"Planned for **{plan.get('model')}** at seq_len {plan.get('seq_len')}, micro-batch "
                     f"{plan.get('batch_size')}; fitting options, cheapest first. Times are estimates at an "
                     f"assumed utilisation ({plan.get('time_model', 'see 01')}).")
        lines.append("")
        rows = [r for r in plan["rows"] if r.get("fits")]
        rows = sorted(rows, key=lambda r: (r.get("epoch_cost") is None, r.get("epoch_cost") or 0))[:8]

        def num(r, k, fmt):
            v = r.get(k)
            return "—" if v is None or v != v else fmt.format(v)
        fmt = [{"method": r.get("method"), "gpu": r.get("gpu"), "batch": r.get("batch_size"),
                "memory": num(r, "device_total_gib", "{:.1f} GiB"), "headroom": num(r, "headroom_gib", "{:.1f} GiB"),
                "tps": num(r, "tokens_per_second", "{:,.0f}"), "time": num(r, "epoch_hours", "{:.2f} h"),
                "cost": num(r, "epoch_cost", "{:.2f}") + (" (example price)" if r.get("price_source") == "example" else "")}
               for r in rows]
        lines.append(_md_table(fmt, [("method", "method"), ("gpu", "GPU"), ("batch", "micro-batch"),
                                     ("memory", "memory / GPU"), ("headroom", "headroom"), ("tps", "tokens/s (est.)"),
                                     ("time", "time / epoch"), ("cost", "cost / epoch")]) if fmt else "No listed GPU fits.")
        if plan.get("recommendation"):
            lines += ["", f"**Recommendation:** {plan['recommendation']}"]
    else:
        lines.append("_No plan in this run (notebook 01 did not run)._")
    lines.append("")
    # --- settings ----------------------------------------------------------------------------
    lines += ["## Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in s.items()]
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
        parts = [{"part": r["part"], **{k: _gib(r.get(k)) for k in ("measured", "estimate", "simulate")}}
                 for r in (smoke or {}).get("memory_parts") or []]
        if parts:  # smoke.json's parts: the estimate's vocabulary, measured by part on CPU only
            lines += ["", "Part by part:", "", _md_table(parts, [("part", "part"), ("measured", "measured"),
                                                                  ("estimate", "estimated"), ("simulate", "simulated")])]
    else:
        lines.append("_No measured peak (the smoke run did not run or did not reach training)._")
    lines.append("")
    # --- stack -------------------------------------------------------------------------------
    lines += ["## Software stack", ""]
    st = card["stack"]
    if st:
        vers = st.get("versions", {})
        lines.append(", ".join(f"{k} {v}" for k, v in vers.items()))
        hw = st.get("hardware", {})
        if hw:
            lines += ["", ", ".join(f"{k}: {v}" for k, v in hw.items())]
        probes = st.get("probes", [])
        if probes:
            lines += ["", _md_table(probes, [("name", "probe"), ("status", "status"), ("detail", "detail")])]
    else:
        lines.append("_No stack check in this run._")
    lines.append("")
    # --- smoke -------------------------------------------------------------------------------
    lines += ["## Smoke run", ""]
    if smoke:
        lines.append(f"Status: **{smoke.get('status')}**")
        steps = smoke.get("steps") or []
        if steps:
            secs = sorted(x["seconds"] for x in steps[1:] or steps)
            lines.append(f"- {len(steps)} optimizer steps; median step {secs[len(secs) // 2]:.3f} s; "
                         f"loss {steps[0].get('loss', float('nan')):.3f} → {steps[-1].get('loss', float('nan')):.3f}")
        for k, v in (smoke.get("throughput") or {}).items():
            if isinstance(v, (int, float, str)):
                lines.append(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}")
        ck = smoke.get("checkpoint") or {}
        if ck:
            lines.append(f"- adapter on disk: {ck.get('bytes', 0) / 2**20:.2f} MiB ({', '.join(sorted(ck.get('files', {})))})")
        if (smoke.get("data") or {}).get("long_examples"):
            lines.append("- " + long_examples_line(smoke["data"]))
        ver = smoke.get("verify") or {}
        if ver:
            lines.append("- verify: " + ", ".join(f"{k}={v}" for k, v in ver.items() if not isinstance(v, (dict, list))))
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
    if ev:
        if ev.get("summary_sentence"):
            lines.append(ev["summary_sentence"])
        ctrl = ev.get("control") or {}
        if ctrl.get("summary_sentence"):
            lines += ["", ctrl["summary_sentence"]]
    else:
        lines.append("_No evaluation in this run._")
    figs = card.get("figures") or {}
    if figs.get("files"):
        lines += ["", "## Figures", ""]
        for f in figs["files"]:
            lines.append(f"![{Path(f).stem}](figures/{Path(f).name})" if f.endswith(".png")
                         else f"- [{Path(f).stem}](figures/{Path(f).name}) (interactive HTML)")
        if figs.get("png_error"):
            lines += ["", f"_PNG export skipped ({figs['png_error']}); the HTML figures are the record._"]
    lines += ["", "## What to check next", ""] + [f"- {x}" for x in next_checks(card)]
    return "\n".join(lines) + "\n"


def _figures(d: Path, pipe: dict | None) -> dict:
    """PNG figures when a browser can render them (one batch), else the HTML files; with a pipeline
    record, only figures written while one of this run's notebooks executed."""
    from lora_kit.ui.notebook import export_pngs
    if not (d / "figures").is_dir():
        return {}
    res = export_pngs(d)
    pngs = res.get("png") or []
    files = pngs or sorted(str(p) for p in (d / "figures").glob("*.html"))
    if pipe:
        windows = [(e.get("started_unix", 0), e.get("ended_unix") or time.time())
                   for e in pipe.get("notebooks") or []]

        def stem_time(f):  # the figure's HTML/JSON was written by the notebook; its PNG later, by the card
            src = [Path(f).with_suffix(x) for x in (".html", ".json")]
            return min((p.stat().st_mtime for p in src if p.exists()), default=0)
        files = [f for f in files if any(a - 1 <= stem_time(f) <= b + 1 for a, b in windows)]
    return {"files": [str(Path(f).relative_to(d)) for f in files], "png_error": res.get("error")}


def build_report(run_dir: str | Path) -> dict:
    """Write ``report.md`` and ``report.json`` into ``run_dir``; returns their paths."""
    d = Path(run_dir)
    card = collect(d)
    card["figures"] = _figures(d, card["pipeline"])
    card["next_checks"] = next_checks(card)
    write_json_atomic(d / "report.json", card)
    write_text_atomic(d / "report.md", render_markdown(card))
    return {"md": str(d / "report.md"), "json": str(d / "report.json")}
