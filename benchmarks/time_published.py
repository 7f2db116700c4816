"""The step-time model against measured GPU runs: fit its few constants on some rows, judge them on the others.

Reads ``benchmarks/reference/time_rows.json`` (built by ``benchmarks/time_rows_build.py`` from the shared
reference; committed), fits the ``FITTED`` constants of :mod:`lora_kit.plan.time_constants` on the rows whose
``role`` is "fit" (least squares on log(predicted / measured); the same constants for every GPU; efficiencies kept in (0, 1),
the dequantisation and L2 factors at least 1), and prints the
error of every in-scope row, per source, fitted and judged rows marked; out-of-scope rows are listed with their
reason. It also measures the error left after a one-row calibration on the same GPU (what the smoke run does):
each row calibrates the model, the other rows on that GPU are predicted (all of them, and those of the same
model, method and checkpointing: the smoke run measures the planned settings). It then judges each source
with that whole source left out of the fit and prints a table per source (fitted rows, judged rows, source left
out). Saves ``benchmarks/results/time_published.json`` (``docs/time-model.md`` is generated from it) and writes
the fitted constants and the two measured error factors (the planner's intervals before and after calibration)
into ``lora_kit/plan/time_constants.py``, so the shipped figures are the measured ones (``--no-write``: don't).

    .venv/bin/python benchmarks/time_published.py            # fit, then judge
    .venv/bin/python benchmarks/time_published.py --no-fit   # judge the shipped constants as they are (prints;
                                                             # --json PATH to save)

Runs on a CPU in seconds (no GPU needed: it evaluates the model, the measurements are in the rows).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from transformers import LlamaConfig

from lora_kit.memory.specs import model_spec
from lora_kit.plan import time_constants as C
from lora_kit.plan.gpus import get_gpu
from lora_kit.plan.timing import TimeModel, step_time
from lora_kit.results import write_json_atomic

ROWS = Path(__file__).parent / "reference" / "time_rows.json"
CONSTANTS = Path(__file__).parents[1] / "lora_kit" / "plan" / "time_constants.py"
OUT = Path(__file__).parent / "results" / "time_published.json"
NAMES = tuple(C.FITTED)
TARGET_MEDIAN, TARGET_FACTOR = 0.15, 1.5
# the fit's fixed starting point (so that a rerun reproduces the shipped constants): typical figures, not fitted
START = {"matmul_efficiency": 0.6, "attention_efficiency": 0.5, "bandwidth_efficiency": 0.7,
         "host_seconds_per_kernel": 2e-5, "dequant_factor": 3.0, "l2_speedup": 2.0}  # issue 35: within 15 % median and 1.5x on every judged row


# What the rows that miss by more than the median target have in common, from their parts (printed per row)
CAUSES = {
    "qwen:": "Qwen's modelling code calls flash-attn's fused rotary and RMSNorm kernels when installed (less "
    "element-wise traffic than the HF Llama code the kit counts: long sequences predicted slow), and at 1-2k tokens "
    "a pass is neither host- nor device-bound: the model's max(host, device) per pass leaves out the part of the "
    "host's time the queue does not hide (predicted fast)",
}


def load_rows(path=ROWS) -> tuple[list, list]:
    rows = json.loads(Path(path).read_text())["rows"]
    return [r for r in rows if not r["out_of_scope"]], [r for r in rows if r["out_of_scope"]]


def split_rule(path=ROWS) -> str:
    return json.loads(Path(path).read_text()).get("split_rule", "")


def predict(row: dict, tm: TimeModel) -> dict:
    model = LlamaConfig(**row["model_config"]) if row.get("model_config") else row["model"]
    if row.get("fused_qkv"):
        model = fused_qkv(model_spec(model))
    return step_time(model, get_gpu(row["gpu"]), time_model=tm, **row.get("timing", {}), **row["settings"])


def fused_qkv(spec):
    """``spec`` with q, k and v as one linear (Qwen-1's ``c_attn``): one LoRA adapter, one cast of its input,
    where a Llama block has three."""
    qkv = [lin for lin in spec.linears if lin.kind == "attn_in"]
    fused = replace(qkv[0], name="c_attn", out_features=sum(lin.out_features for lin in qkv))
    return replace(spec, linears=(fused,) + tuple(lin for lin in spec.linears if lin.kind != "attn_in"))


# fractions of a peak, each at most what the kernel is published to reach: cuBLAS large bf16 GEMMs 80-87 % of the
# datasheet peak (stas00/ml-engineering "Maximum Achievable Matmul FLOPS": A100 SXM 86.9 %, H100 SXM 80.3 %);
# FlashAttention-2 up to 73 % forward, 63 % backward on an A100 (Dao 2023, arXiv 2307.08691, section 4.1)
BOUNDED = {"matmul_efficiency": 0.87, "attention_efficiency": 0.73, "bandwidth_efficiency": 1.0}
AT_LEAST_ONE = ("dequant_factor", "l2_speedup")  # slower / faster than a bound by construction: >= 1


def _value(name: str, x: float) -> float:
    """A fitted constant from its unconstrained parameter (physical ranges kept)."""
    if name in BOUNDED:
        return BOUNDED[name] / (1 + math.exp(-x))
    return 1 + math.exp(x) if name in AT_LEAST_ONE else math.exp(x)


def _at_bound(name: str, v: float) -> bool:
    """The fit pushed ``name`` to the edge of its physical range: the rows do not pin it down."""
    if name in BOUNDED:
        return v >= 0.995 * BOUNDED[name]
    return name in AT_LEAST_ONE and v <= 1.005


def _param(name: str, v: float) -> float:
    if name in BOUNDED:
        return math.log(v / (BOUNDED[name] - v))
    return math.log(max(v - 1, 1e-3)) if name in AT_LEAST_ONE else math.log(v)


def _loss(x, rows) -> float:
    tm = TimeModel(**{k: _value(k, v) for k, v in zip(NAMES, x)})
    return sum(math.log(predict(r, tm)["step_seconds"] / r["measured"]["step_seconds"]) ** 2 for r in rows)


def nelder_mead(f, x0, step=0.3, iters=400, tol=1e-7):
    """Minimise ``f`` from ``x0`` (a plain Nelder-Mead; few dimensions, smooth enough)."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        cen = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        refl = [cen[j] + (cen[j] - pts[-1][j]) for j in range(n)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [cen[j] + 2 * (cen[j] - pts[-1][j]) for j in range(n)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [cen[j] + 0.5 * (pts[-1][j] - cen[j]) for j in range(n)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = min(range(n + 1), key=vals.__getitem__)
    return pts[i], vals[i]


RESTARTS = 4  # Nelder-Mead restarted from its own optimum until it stops improving (at most this many times)


def fit(rows, roles=("fit",)) -> TimeModel:
    """Least squares on log(predicted / measured) from :data:`START`, the simplex restarted from its optimum
    (:data:`RESTARTS`). A constant no fitted row depends on (e.g.
    ``dequant_factor`` without a QLoRA row) keeps its starting value: the simplex would otherwise carry it
    anywhere, at no cost to the fit."""
    fit_rows = [r for r in rows if r["role"] in roles]
    x0 = [_param(k, START[k]) for k in NAMES]
    base = _loss(x0, fit_rows)
    free = [i for i in range(len(NAMES))
            if abs(_loss([v + (1.0 if j == i else 0.0) for j, v in enumerate(x0)], fit_rows) - base) > 1e-12]

    def loss(v):
        full = list(x0)
        for i, vi in zip(free, v):
            full[i] = vi
        return _loss(full, fit_rows)
    xf, best = nelder_mead(loss, [x0[i] for i in free], iters=1500)
    for _ in range(RESTARTS):  # a fresh simplex around the optimum: a collapsed one stops short of it
        xr, val = nelder_mead(loss, xf, iters=1500)
        if val >= best - 1e-12:
            break
        xf, best = xr, val
    x = list(x0)
    for i, vi in zip(free, xf):
        x[i] = vi
    return TimeModel(**{k: float(f"{_value(k, v):.3g}") for k, v in zip(NAMES, x)})


def leave_one_source_out(rows) -> dict:
    """A harder judge than the fixed split: for each source, the constants fitted on every row of the other
    sources (fit and judged) predict that source's rows (a plan is made for a machine and software stack no row
    measured). A constant the other sources do not pin down lands wherever the fit leaves it (``at_a_bound``)."""
    out = {}
    for src in sorted({r["source"] for r in rows}):  # a judged-only source is never fitted, here either
        tm = fit([r for r in rows if r["source"] != src and not r.get("judged_only")], roles=("fit", "judged"))
        ratios = {r["id"]: predict(r, tm)["step_seconds"] / r["measured"]["step_seconds"]
                  for r in rows if r["source"] == src}
        out[src] = {**_stats(list(ratios.values())), "constants": {k: getattr(tm, k) for k in NAMES},
                    "at_a_bound": [k for k in NAMES if _at_bound(k, getattr(tm, k))], "ratios": ratios}
    return out


def _stats(ratios) -> dict:
    if not ratios:
        return {"n": 0}
    errs = [abs(q - 1) for q in ratios]
    return {"n": len(ratios), "median_abs_error": statistics.median(errs),
            "max_factor": max(max(q, 1 / q) for q in ratios), "min_ratio": min(ratios), "max_ratio": max(ratios)}


def calibrated_error(rows, tm: TimeModel) -> dict:
    """One-row calibration on a GPU (scale = measured / predicted), the other rows of that GPU predicted."""
    by_gpu: dict = {}
    for r in rows:
        by_gpu.setdefault(r["gpu"], []).append(r)
    ratios, pairs = [], []
    for gpu, rs in by_gpu.items():
        pred = {r["id"]: predict(r, tm)["step_seconds"] for r in rs}
        for cal in rs:
            scale = cal["measured"]["step_seconds"] / pred[cal["id"]]
            for r in rs:
                if r is not cal:
                    q = scale * pred[r["id"]] / r["measured"]["step_seconds"]
                    ratios.append(q)
                    same = all(r["settings"][k] == cal["settings"][k] for k in ("method", "gradient_checkpointing")) \
                        and r["model"] == cal["model"]
                    pairs.append({"gpu": gpu, "calibrated_on": cal["id"], "predicted": r["id"], "ratio": q,
                                  "same_model_and_method": same})
    same = [p["ratio"] for p in pairs if p["same_model_and_method"]]
    return {**_stats(ratios), "same_model_and_method": _stats(same), "pairs": pairs,
            "same_means": "the same model, method and gradient checkpointing (what a smoke run of the plan measures)"}


def run(tm: TimeModel, rows, out_rows) -> dict:
    results = []
    for r in rows:
        p = predict(r, tm)
        q = p["step_seconds"] / r["measured"]["step_seconds"]
        results.append({"id": r["id"], "source": r["source"], "url": r["url"], "role": r["role"], "gpu": r["gpu"],
                        "model": r["model"], "method": r["settings"]["method"], "seq_len": r["settings"]["seq_len"],
                        "batch_size": r["settings"]["batch_size"],
                        "checkpointing": ("reentrant" if r.get("timing", {}).get("reentrant_checkpointing") else True)
                        if r["settings"]["gradient_checkpointing"] else False,
                        "measured_seconds": r["measured"]["step_seconds"], "predicted_seconds": p["step_seconds"],
                        "ratio": q, "miss": max(q, 1 / q) > TARGET_FACTOR, "attention_kernel": p["attention_kernel"],
                        "parts_seconds": p["parts_seconds"], "mfu": p["mfu"],
                        "largest_part": max(p["parts_seconds"], key=p["parts_seconds"].get),
                        "cause": next((v for k, v in CAUSES.items() if r["id"].startswith(k)), "")
                        if abs(q - 1) > TARGET_MEDIAN else ""})
    sources = {}
    for x in results:
        sources.setdefault(x["source"], []).append(x["ratio"])
    judged = [x["ratio"] for x in results if x["role"] == "judged"]
    return {"about": __doc__.split("\n\n")[0], "command": "python benchmarks/time_published.py",
            "split_rule": split_rule(),
            "constants": {k: getattr(tm, k) for k in NAMES},
            "at_a_bound": [k for k in NAMES if _at_bound(k, getattr(tm, k))],
            "targets": {"median_abs_error": TARGET_MEDIAN, "max_factor": TARGET_FACTOR},
            "rows": results, "by_source": {k: _stats(v) for k, v in sources.items()},
            "fitted": _stats([x["ratio"] for x in results if x["role"] == "fit"]), "judged": _stats(judged),
            "calibrated": calibrated_error(rows, tm),
            "out_of_scope": [{"id": r["id"], "source": r["source"], "url": r["url"], "reason": r["out_of_scope"],
                              **_shown(r, tm)} for r in out_rows]}


def _shown(row: dict, tm: TimeModel) -> dict:
    """An out-of-scope row the kit plans as it ran (``"show": true`` in the reference: kept out for its software,
    not its method or kernels): the prediction beside the measurement, shown, never in a fit or an error figure."""
    if not row.get("show"):
        return {}
    p = predict(row, tm)["step_seconds"]
    return {"shown": {"measured_seconds": row["measured"]["step_seconds"], "predicted_seconds": p,
                      "ratio": p / row["measured"]["step_seconds"]}}


def uncalibrated_factor(res: dict) -> float:
    """The planner's interval before calibration: the worst miss over the fitted rows, the judged rows and every
    source predicted with that whole source left out of the fit."""
    return max(res["fitted"]["max_factor"], res["judged"]["max_factor"],
               *(v["max_factor"] for v in res.get("leave_one_source_out", {}).values()))


def write_constants(res: dict, path=CONSTANTS) -> None:
    """Wire the measured figures into ``lora_kit/plan/time_constants.py`` (no hand copying): each ``FITTED``
    value and the two error factors are replaced in place; comments and everything else stay."""
    text = Path(path).read_text()
    for name, v in res["constants"].items():
        text, n = re.subn(rf'(\n    "{name}": )[^,]+,', rf"\g<1>{v!r},", text, count=1)
        if n != 1:
            raise SystemExit(f"{path}: FITTED has no line for {name!r}")
    f, j, cal = res["fitted"], res["judged"], res["calibrated"]["same_model_and_method"]
    loso = max(v["max_factor"] for v in res["leave_one_source_out"].values())
    lines = {"ERROR_FACTOR_UNCALIBRATED": (round(uncalibrated_factor(res), 2), f"fitted x{f['max_factor']:.2f}, "
                                           f"judged x{j['max_factor']:.2f}, one source left out x{loso:.2f}"),
             "ERROR_FACTOR_CALIBRATED": (round(cal["max_factor"], 2), "worst pair of the same model, method, "
                                         f"checkpointing (median {100 * cal['median_abs_error']:.1f} %)")}
    for name, (v, why) in lines.items():
        text, n = re.subn(rf"\n{name} = .*", f"\n{name} = {v!r}  # {why}", text, count=1)
        if n != 1:
            raise SystemExit(f"{path}: no line {name} = ...")
    Path(path).write_text(text)


def _print_sources(res: dict):
    """Per source: its fitted rows, its judged rows, and the whole source left out of the fit."""
    print(f"{'source':58} {'fitted':>14} {'judged':>14} {'left out of the fit':>22}")
    for src in res["by_source"]:
        cells = []
        for role in ("fit", "judged"):
            s = _stats([x["ratio"] for x in res["rows"] if x["source"] == src and x["role"] == role])
            cells.append(f"{s['median_abs_error']:5.1%} x{s['max_factor']:.2f}" if s["n"] else "-")
        lo = res.get("leave_one_source_out", {}).get(src)
        cells.append(f"{lo['median_abs_error']:5.1%} x{lo['max_factor']:.2f}" if lo else "-")
        print(f"{src[:58]:58} {cells[0]:>14} {cells[1]:>14} {cells[2]:>22}")
    print("(median |error|, worst factor; the planner's interval before calibration is the worst of all: "
          f"x{uncalibrated_factor(res):.2f})")


def _print(res: dict):
    print("constants:", ", ".join(f"{k}={v:.3g}" for k, v in res["constants"].items()))
    print(f"{'row':46} {'role':6} {'gpu':9} {'kernel':13} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for x in res["rows"]:
        print(f"{x['id'][:46]:46} {x['role']:6} {x['gpu']:9} {x['attention_kernel']:13} {x['measured_seconds']:9.4f} "
              f"{x['predicted_seconds']:9.4f} {x['ratio']:6.2f}{'  MISS' if x['miss'] else ''}")
    for name, s in [*res["by_source"].items(), ("fitted rows", res["fitted"]), ("judged rows", res["judged"]),
                    ("after a one-row calibration on the same GPU", res["calibrated"]),
                    ("  ... same model, method and checkpointing (what a smoke run calibrates)", res["calibrated"]["same_model_and_method"])]:
        if s["n"]:
            print(f"{name}: n={s['n']}, median |error| {s['median_abs_error']:.1%}, worst x{s['max_factor']:.2f}")
    print(f"out of scope ({len(res['out_of_scope'])} rows):")
    reasons: dict = {}
    for r in res["out_of_scope"]:
        reasons.setdefault(r["reason"], []).append(r["id"])
    for why, ids in reasons.items():
        print(f"  {len(ids):2d} x {why}: {', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''}")
    for r in (r for r in res["out_of_scope"] if "shown" in r):
        sh = r["shown"]
        print(f"  shown, not judged: {r['id']}: measured {sh['measured_seconds']:.3f} s, predicted "
              f"{sh['predicted_seconds']:.3f} s (x{sh['ratio']:.2f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-fit", action="store_true", help="judge the shipped constants without fitting")
    ap.add_argument("--rows", default=str(ROWS))
    ap.add_argument("--json", default=None,
                    help="where the results go (default benchmarks/results/time_published.json after a fit; with "
                         "--no-fit none: the committed results hold the fit's leave-one-source-out, which --no-fit "
                         "does not run)")
    ap.add_argument("--no-write", action="store_true",
                    help="do not write the fitted constants and error factors into lora_kit/plan/time_constants.py")
    a = ap.parse_args(argv)
    rows, out_rows = load_rows(a.rows)
    tm = TimeModel() if a.no_fit else fit(rows)
    res = run(tm, rows, out_rows)
    res["fit"] = not a.no_fit
    if not a.no_fit:
        res["leave_one_source_out"] = leave_one_source_out(rows)
        res["uncalibrated_error_factor"] = uncalibrated_factor(res)
    _print(res)
    _print_sources(res)
    out = a.json or (None if a.no_fit else str(OUT))
    if out:
        write_json_atomic(out, res)
        print(f"-> {out}")
    if not a.no_fit and a.rows == str(ROWS) and not a.no_write:
        write_constants(res)
        print(f"-> {CONSTANTS} (FITTED and the error factors)")
    return res


if __name__ == "__main__":
    sys.exit(main() and 0)
