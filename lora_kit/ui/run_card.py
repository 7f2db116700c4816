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
from lora_kit.settings import method_label
from lora_kit.ui.tables import method_markdown

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
            "every value under *Settings*) to prove the pipeline, not to measure the planned model.", ""]


def _param(v) -> str:
    """A setting as a params file (YAML) writes it: true/false, [a, b], plain strings and numbers."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_param(x) for x in v) + "]"
    return str(v)


def _on(v) -> str:
    return "on" if v else "off"


def assumption_lines(plan: dict) -> list[str]:
    """What the plan's numbers assume, in words: plan.json's ``assumptions`` and ``epoch``."""
    a, ep = plan.get("assumptions") or {}, plan.get("epoch") or {}
    out = [f"- model: **{plan.get('model')}**; sequence length: {plan.get('seq_len', a.get('seq_len')):,} tokens per "
           f"example; micro-batch per GPU: {plan.get('batch_size')}"]
    if a:
        out += [f"- base weights: {a.get('dtype')} for full and LoRA, 4-bit NF4 for QLoRA (double quantization "
                f"{_on(a.get('double_quant'))}); autocast {_on(a.get('autocast'))}",
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
        size = (f"{ep['examples']:,} examples = " if ep.get("examples") else "") + f"{ep.get('tokens', 0):,} tokens"
        out.append(f"- one epoch: {size} ({ep.get('note', '')})")
    if plan.get("time_model"):
        out.append(f"- time: {plan['time_model']}")
    return out


def longest_line(sweeps: dict | None) -> str | None:
    """sweeps.json's longest seq_len at micro-batch 1 on the planned GPU, per setting, in one line."""
    longest = (sweeps or {}).get("max_seq_len_batch1")
    if not longest:
        return None
    per = ("; ".join(f"{k.replace('qlora', 'QLoRA').replace('lora', 'LoRA')}: {v:,}" for k, v in longest.items())
           if isinstance(longest, dict) else f"{longest:,}")
    return (f"Longest seq_len (tokens) that fits {sweeps.get('gpu')} at micro-batch 1 ({sweeps.get('plan_model')}, "
            f"notebook 02): {per}.")


def request_lines(plan: dict | None, sweeps: dict | None = None) -> list[str]:
    """The request: what the plan assumes, every option that fits (cheapest first), the recommendation."""
    lines = ["## The request", ""]
    if not (plan and plan.get("rows")):
        return lines + ["_No plan in this run (notebook 01 did not run)._", ""]
    lines += ["Every method x GPU option that fits, cheapest first. The numbers assume:", ""]
    lines += assumption_lines(plan) + ["", method_markdown(plan["rows"], fits_only=True, cheapest_first=True)]
    if plan.get("recommendation"):
        lines += ["", f"**Recommendation:** {plan['recommendation']}"]
    if longest_line(sweeps):
        lines += ["", longest_line(sweeps)]
    return lines + [""]


def _probe_rows(probes: list[dict]) -> list[dict]:
    """A probe's row shows its error when it has one (a failure's message), else its detail."""
    return [{"name": p.get("name"), "status": p.get("status"),
             "detail": str(p.get("error") or p.get("detail") or "").replace("\n", " ")} for p in probes]


def _hardware_line(hw: dict) -> str:
    gpus = hw.get("gpus") or []
    gpu = ("; ".join(f"{g.get('name')} ({(g.get('memory_bytes') or 0) / GiB:.1f} GiB, compute capability "
                     f"{g.get('compute_capability')})" for g in gpus) if gpus else "no GPU")
    return f"CPU {hw.get('cpu_architecture', '?')} ({hw.get('cpu_count', '?')} cores), {hw.get('os', '?')}; {gpu}"


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
        lines.append(f"- mean step {tp['mean_step_seconds']:.3f} s, {tp.get('mean_tokens_per_s', 0):,.0f} tokens/s"
                     + (f" ({tp['note']})" if tp.get("note") else ""))
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


def loop_lines(plan: dict | None) -> list[str]:
    """The loop users run next: the plan's step under transformers' Trainer and TRL's SFTTrainer with their
    defaults (``estimate(loop=...)``: fused AdamW, clipping, SFT's fused LM head), beside lora_kit's step."""
    if not (plan and plan.get("rows") and plan.get("assumptions")):
        return []
    from lora_kit.memory.estimate import estimate
    from lora_kit.memory.loops import sft_cpu_tiles
    from lora_kit.memory.specs import model_spec
    from lora_kit.settings import LOOPS, LORA_FIELDS
    a = {k: v for k, v in plan["assumptions"].items() if k != "loop"}
    out = []
    for method in dict.fromkeys(r["method"] for r in plan["rows"] if r.get("method")):
        kw = {k: v for k, v in a.items() if not (method == "full" and k in LORA_FIELDS)}
        try:
            peak = {loop: estimate(plan["model"], method=method, batch_size=plan["batch_size"], loop=loop,
                                   **kw).peak_allocated_bytes for loop in LOOPS}
        except ValueError:
            continue
        out.append(f"- {method_label(method)}: your Trainer run will peak at **{_gib(peak['trainer'])}**, TRL's "
                   f"SFTTrainer at **{_gib(peak['sft'])}** (lora_kit's step: {_gib(peak['kit'])})")
    if not out:
        return []
    tiles = int(sft_cpu_tiles(plan["batch_size"], a["seq_len"], model_spec(plan["model"]).vocab_size))
    return ["## The loop you run next", "", f"Peak allocated per GPU (estimate) of the planned step ({plan['model']}, "
            "same settings) in the loop you will train with, at its defaults:", "", *out, "",
            f"SFTTrainer's figure is its CPU path; on CUDA its Triton head scores the vocabulary in place, up to "
            f"{_gib(tiles)} less. Set gradient checkpointing and autocast as your config has them (SFTConfig "
            "turns both on by default).", ""]


def render_markdown(card: dict) -> str:
    s = card["settings"] or {}
    lines = title_lines(card)
    lines += run_lines(card)
    lines += request_lines(card["plan"], card["sweeps"])
    lines += loop_lines(card["plan"])
    # --- settings ----------------------------------------------------------------------------
    lines += ["## Settings", "", "The run's settings (the names and values of a params file):", "",
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
        lines += smoke_lines(smoke)
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
    have = {Path(p).stem for p in pngs}  # a figure whose PNG failed keeps its HTML
    files = pngs + sorted(str(p) for p in (d / "figures").glob("*.html") if p.stem not in have)
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
