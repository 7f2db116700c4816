"""Tables a person reads: the method x GPU plan and any sweep, formatted once, shown two ways.

- :func:`method_rows` turns a :func:`lora_kit.plan.planner.compare_methods` table (or the ``rows`` of
  ``plan.json``) into display strings: one spelling per method (full, LoRA, QLoRA), units in the
  headers (GiB, s, h, tokens/s), the currency in the price and cost headers (the catalog's example
  prices are USD per GPU-hour, and are labelled as examples), ✓ / ✗ for fits, rounded numbers, and
  never NaN: a row that does not fit reads ✗ and "—" where a time or a cost would be. "memory / GPU"
  is the plan's device total over the CUDA-visible capacity that fits is judged on (not nvidia-smi's total).
  The planner's recommendation (the cheapest fitting row per epoch) and the fastest row are named in
  the last column.
- :func:`method_table` is the same as a pandas ``Styler`` for notebooks (the recommendation
  highlighted, rows that do not fit greyed); :func:`method_markdown` the same as a markdown table for
  the run card.
- :func:`sweep_rows` / :func:`sweep_table` / :func:`sweep_markdown` do the same for a
  :func:`lora_kit.plan.planner.sweep` table: the settings that vary as columns, the ones that do not
  in the caption, memory in GiB (MiB when every value is under 1 GiB).
- :func:`examples_rows` / :func:`examples_table` for the evaluation's examples
  (``EvalResult.examples_table``): answers marked ✓ / ✗, chrF rounded, outcomes coloured.
"""
from __future__ import annotations

import math

import pandas as pd

from lora_kit.plan.planner import fastest_index, needs_attention_fix, runs_on_gpu, usable
from lora_kit.settings import method_label

GIB = 2 ** 30
NONE = "—"  # a value that does not apply (never NaN)
EXAMPLE_CURRENCY = "USD"  # lora_kit/catalog/gpus.csv: example_price_per_hour is USD per GPU-hour
RECOMMENDED = "★ cheapest"  # the planner's recommendation
FASTEST = "fastest"
SETTINGS = ("model", "method", "gpu", "dtype", "autocast", "double_quant", "lora_targets", "gradient_checkpointing",
            "attn_implementation", "optimizer", "sharding", "cpu_offload", "seq_len", "batch_size", "lora_rank",
            "num_gpus")
SETTING_HEADERS = {"model": "model", "method": "method", "gpu": "GPU", "dtype": "dtype", "autocast": "autocast",
                   "double_quant": "double quant", "lora_targets": "LoRA targets",
                   "gradient_checkpointing": "checkpointing", "attn_implementation": "attention",
                   "optimizer": "optimizer", "sharding": "sharding", "cpu_offload": "CPU offload",
                   "seq_len": "seq_len (tokens)", "batch_size": "micro-batch", "lora_rank": "LoRA rank",
                   "num_gpus": "GPUs"}
TEXT_COLUMNS = ("method", "GPU", "note", "model", "peak in", "dtype", "LoRA targets", "attention", "optimizer",
                "sharding")  # left-aligned; the rest are numbers or marks
PARTS = ("weights", "quant_constants", "adapters", "gradients", "optimizer_states", "activations")


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _num(x, digits: int = 2, sign: bool = False) -> str:
    if _missing(x):
        return NONE
    return f"{x:+,.{digits}f}" if sign else f"{x:,.{digits}f}"


def _amount(x) -> str:
    """Hours or money: two decimals, or two significant digits below 1 (a short job's 0.0054 h is not 0.00)."""
    if _missing(x):
        return NONE
    return f"{x:,.2f}" if abs(x) >= 0.995 or x == 0 else f"{x:#.2g}"


def _with_interval(r, col: str) -> str:
    """``col``'s value and, when the table has them, its interval from the time model's error ("1.2 (0.88-1.6)")."""
    v, lo, hi = r[col], r.get(f"{col}_low"), r.get(f"{col}_high")
    if _missing(v) or lo is None or hi is None or _missing(lo) or _missing(hi):
        return _amount(v)
    return f"{_amount(v)} ({_amount(lo)}–{_amount(hi)})"


def _headroom(h) -> str:
    """GiB left under the usable memory ("+2.7"), or short by ("-0.7")."""
    return _num(h, 1, sign=True)


def _frame(table) -> pd.DataFrame:
    """A compare_methods DataFrame, or plan.json's list of row dicts (None where NaN was)."""
    if isinstance(table, pd.DataFrame):
        return table.reset_index(drop=True)
    if isinstance(table, dict) and "rows" in table:
        table = table["rows"]
    if isinstance(table, list):
        return pd.DataFrame(table)
    raise ValueError(f"expected a compare_methods DataFrame or plan.json rows, got {type(table).__name__}.")


def recommended_index(df: pd.DataFrame):
    """Row label of the recommendation: the cheapest fitting row per epoch whose GPU runs its step (what
    ``compare_methods``' recommendation names first), else the fastest such one; None if there is none."""
    ok = df[usable(df)]
    cost = pd.to_numeric(ok["epoch_cost"], errors="coerce")
    if cost.notna().any():
        return cost.idxmin()
    hours = pd.to_numeric(ok["epoch_hours"], errors="coerce")
    return hours.idxmin() if hours.notna().any() else None


def method_rows(table, currency: str = EXAMPLE_CURRENCY, fits_only: bool = False,
                cheapest_first: bool = False) -> pd.DataFrame:
    """Display strings of a compare_methods table (see the module docstring); ``attrs`` carry
    ``recommended`` (row position or None), ``fits`` (a bool per row) and ``caption``.

    ``currency`` names the currency of the prices you passed to compare_methods; rows at the catalog's
    example prices are USD. ``fits_only`` keeps the rows that fit; ``cheapest_first`` sorts by cost
    per epoch (then time)."""
    df = _frame(table)
    need = {"method", "gpu", "fits", "batch_size", "device_total_gib", "capacity_gib", "headroom_gib",
            "step_seconds", "tokens_per_second", "epoch_hours", "price_per_hour", "price_source", "epoch_cost"}
    if not need <= set(df.columns):
        raise ValueError(f"method_rows needs a compare_methods table; missing columns {sorted(need - set(df.columns))}.")
    sources = set(df["price_source"].dropna())
    if sources == {"example"}:
        money, note = EXAMPLE_CURRENCY, ", example"
    elif "example" in sources and currency != EXAMPLE_CURRENCY:
        raise ValueError(f"the table mixes your prices ({currency}) with the catalog's example prices (USD): "
                         "pass prices= for every GPU to compare_methods, or currency='USD'.")
    else:
        money, note = currency, ""
    best, fastest = recommended_index(df), fastest_index(df)
    blocked = "runs_on_gpu" in df and not all(runs_on_gpu(r) for _, r in df.iterrows())
    reasons: dict = {}  # GPU -> why it cannot run the step (compare_methods' gpu_problem)
    many_epochs = ("total_hours" in df and not pd.to_numeric(df["total_hours"], errors="coerce").fillna(0).equals(
        pd.to_numeric(df["epoch_hours"], errors="coerce").fillna(0)))
    rows = []
    for i, r in df.iterrows():
        fits = bool(r["fits"]) if not _missing(r["fits"]) else False
        head = r["headroom_gib"]
        cap = r.get("cuda_capacity_gib", r["capacity_gib"])  # what fits is judged on (older plan.json: catalog's)
        price = _num(r["price_per_hour"])
        if len(sources) > 1 and r["price_source"] == "example" and price != NONE:
            price += " (example)"
        fixed = fits and needs_attention_fix(r)
        runs = runs_on_gpu(r)
        if not runs:
            reasons.setdefault(r["gpu"], r.get("gpu_problem") or "")
        row = {"method": method_label(r["method"]), "GPU": r["gpu"],
               "fits": ("✓*" if fixed else "✓") if fits else "✗",
               **({"runs on GPU": "✓" if runs else "✗"} if blocked else {}),
               "micro-batch": f"{int(r['batch_size'])}",
               "memory / GPU (GiB)": f"{_num(r['device_total_gib'], 1)} / {_num(cap, 1)}",
               "headroom (GiB)": _headroom(head),
               "step (s)": _num(r["step_seconds"]) if fits else NONE,
               "tokens/s": _num(r["tokens_per_second"], 0) if fits else NONE,
               "time per epoch (h)": _with_interval(r, "epoch_hours") if fits else NONE,
               f"price ({money}/h{note})": price,
               f"cost per epoch ({money}{note})": _with_interval(r, "epoch_cost") if fits else NONE}
        if many_epochs:
            row["total time (h)"] = _amount(r["total_hours"]) if fits else NONE
            row[f"total cost ({money}{note})"] = _amount(r.get("total_cost")) if fits else NONE
        row["note"] = RECOMMENDED if i == best else FASTEST if i == fastest else ""
        if not runs:  # memory shown, no time or cost: the card cannot run the step (a ✓ fit reads as memory only)
            row.update({k: NONE for k in row if k.startswith(("step", "tokens", "time", "cost", "total"))})
        rows.append((i, fits and runs, row))
    if fits_only:
        rows = [x for x in rows if x[1]]
    if cheapest_first:
        key = pd.to_numeric(df["epoch_cost"], errors="coerce").fillna(math.inf)
        hours = pd.to_numeric(df["epoch_hours"], errors="coerce").fillna(math.inf)
        rows.sort(key=lambda x: (not x[1], key[x[0]], hours[x[0]]))
    out = pd.DataFrame([row for _, _, row in rows])
    out.attrs["recommended"] = next((k for k, (i, _, _) in enumerate(rows) if i == best), None)
    out.attrs["fits"] = [f for _, f, _ in rows]
    priced = (f"costs at the catalog's EXAMPLE prices in {EXAMPLE_CURRENCY}, not quotes: pass "
              "prices={gpu: your price} to compare_methods" if note else f"costs at your prices in {money}")
    out.attrs["caption"] = (f"Method x GPU: memory per GPU at the micro-batch shown (the largest that fits) / the "
                            f"GPU's memory; headroom below the usable memory (negative: short by); {priced} (prices "
                            "per GPU-hour); time and cost per epoch with their interval from the time model's measured "
                            "error in brackets; ✗ = does not fit (memory at micro-batch 1, no time or cost: —); "
                            "★ = the recommendation."
                            + (" ✓* = fits only with the attention fix in the plan's note: as configured, CUDA runs "
                               "the attention in its math kernel (time shown: the math kernel's)."
                               if any(r["fits"] == "✓*" for _, _, r in rows) else "")
                            + (" ✓ fits is memory only; ✗ in 'runs on GPU' = the GPU cannot run this step as planned "
                               "(no time or cost): " + "; ".join(dict.fromkeys(reasons.values())) + "."
                               if reasons else ""))
    return out


def _styled(rows: pd.DataFrame, caption: str, highlight=None, fits=None):
    """A Styler of display strings: index hidden, the ``highlight`` row marked, rows that do not fit grey."""
    fits = fits if fits is not None else [True] * len(rows)

    def row_style(row):
        k = rows.index.get_loc(row.name)
        if highlight is not None and k == highlight:
            return ["background-color: #fff3c4; font-weight: bold"] * len(row)
        return [("color: #888" if not fits[k] else "")] * len(row)

    def mark(v):
        return "color: #1a7f37; font-weight: bold" if v == "✓" else "color: #c62828; font-weight: bold" if v == "✗" else ""

    st = rows.style.apply(row_style, axis=1).hide(axis="index").set_caption(caption)
    st = st.map(mark, subset=[c for c in ("fits",) if c in rows.columns])
    text = [c for c in rows.columns if c in TEXT_COLUMNS]
    st = st.set_properties(subset=text, **{"text-align": "left"})
    st = st.set_properties(subset=[c for c in rows.columns if c not in text], **{"text-align": "right"})
    # headers may wrap (units in parentheses), cells never: ~900 px holds the method x GPU table
    return st.set_table_styles([{"selector": "th", "props": "text-align: center; vertical-align: bottom; "
                                                            "max-width: 7em; padding: 2px 5px"},
                                {"selector": "td", "props": "white-space: nowrap; padding: 2px 5px"},
                                {"selector": "caption", "props": "caption-side: top; text-align: left; max-width: 900px"}],
                               overwrite=False)


def method_table(table, currency: str = EXAMPLE_CURRENCY, fits_only: bool = False, cheapest_first: bool = False):
    """The compare_methods table for a notebook: a pandas Styler (see :func:`method_rows`)."""
    rows = method_rows(table, currency, fits_only, cheapest_first)
    return _styled(rows, rows.attrs["caption"], rows.attrs["recommended"], rows.attrs["fits"])


def markdown(rows: pd.DataFrame) -> str:
    """A pipe table of display strings (``|`` in a cell escaped); numbers right-aligned."""
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", " ")
    cols = list(rows.columns)
    align = ["---" if c in TEXT_COLUMNS else "--:" for c in cols]
    lines = ["| " + " | ".join(cell(c) for c in cols) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows.itertuples(index=False)]
    return "\n".join(lines)


def method_markdown(table, currency: str = EXAMPLE_CURRENCY, fits_only: bool = False,
                    cheapest_first: bool = False, caption: bool = True) -> str:
    """The compare_methods table (or plan.json rows) as markdown, for the run card."""
    rows = method_rows(table, currency, fits_only, cheapest_first)
    body = markdown(rows) if len(rows) else "_No method x GPU fits._"
    return f"{rows.attrs['caption']}\n\n{body}" if caption else body


# --- sweeps -----------------------------------------------------------------------------------------------------

def _setting(col: str, v) -> str:
    if col == "method":
        return method_label(v)
    if isinstance(v, bool) or col in ("gradient_checkpointing", "autocast", "double_quant", "cpu_offload"):
        return "on" if bool(v) else "off"
    if isinstance(v, (int,)) or (hasattr(v, "dtype") and str(getattr(v, "dtype", "")).startswith("int")):
        return f"{int(v):,}"
    return str(v)


def sweep_rows(df: pd.DataFrame, columns=None, parts: bool = False) -> pd.DataFrame:
    """Display strings of a sweep: the settings that vary (or ``columns``), memory per GPU, and when
    the sweep has a GPU: fits ✓/✗ and headroom. ``parts`` adds the breakdown, part by part.
    ``attrs["caption"]`` lists the settings every row shares."""
    if not isinstance(df, pd.DataFrame) or "peak_allocated_bytes" not in df.columns:
        raise ValueError("sweep_rows needs a DataFrame from lora_kit.sweep (with peak_allocated_bytes).")
    present = [c for c in SETTINGS if c in df.columns]
    varying = list(columns) if columns is not None else [c for c in present if df[c].astype(str).nunique() > 1]
    unknown = [c for c in varying if c not in df.columns]
    if unknown:
        raise ValueError(f"sweep_rows: columns {unknown} are not in the sweep; choose from {present}.")
    fixed = [c for c in present if c not in varying]
    mem_cols = ["peak_allocated_bytes", "device_total_bytes"] + ([p for p in PARTS if p in df.columns] if parts else [])
    small = float(df[mem_cols].abs().max().max()) < GIB
    unit, div = ("MiB", 2 ** 20) if small else ("GiB", GIB)
    out = pd.DataFrame({SETTING_HEADERS.get(c, c): [_setting(c, v) for v in df[c]] for c in varying})
    out[f"peak allocated ({unit})"] = [_num(v / div) for v in df["peak_allocated_bytes"]]
    out[f"memory per GPU ({unit})"] = [_num(v / div) for v in df["device_total_bytes"]]
    if "phase" in df.columns:
        out["peak in"] = df["phase"].astype(str).tolist()
    if parts:
        for p in PARTS:
            if p in df.columns:
                out[f"{p.replace('_', ' ')} ({unit})"] = [_num(v / div) for v in df[p]]
    fits = [True] * len(df)
    if "fits" in df.columns:
        fits = df["fits"].astype(bool).tolist()
        out["fits"] = ["✓" if f else "✗" for f in fits]
        out["headroom (GiB)"] = [_headroom(h) for h in df["headroom_gib"]]
    out.attrs["fits"] = fits
    shared = [f"{SETTING_HEADERS.get(c, c).split(' (')[0]} {_setting(c, df[c].iloc[0])}" for c in fixed if len(df)]
    out.attrs["caption"] = ("Every row: " + ", ".join(shared) + ".") if shared else ""
    return out


def sweep_table(df: pd.DataFrame, columns=None, parts: bool = False):
    """A sweep for a notebook: a pandas Styler (see :func:`sweep_rows`); rows that do not fit grey."""
    rows = sweep_rows(df, columns, parts)
    return _styled(rows, rows.attrs["caption"], None, rows.attrs["fits"])


def sweep_markdown(df: pd.DataFrame, columns=None, parts: bool = False) -> str:
    """A sweep as markdown (see :func:`sweep_rows`)."""
    rows = sweep_rows(df, columns, parts)
    return (f"{rows.attrs['caption']}\n\n" if rows.attrs["caption"] else "") + markdown(rows)


def qlora_vs_lora_table(df: pd.DataFrame):
    """:func:`lora_kit.plan.planner.qlora_vs_lora` for a notebook: MiB to one decimal, the ratio to two,
    checkpointing on/off, rows where QLoRA needs more memory than LoRA (ratio above 1) marked."""
    from lora_kit.plan.planner import QLORA_VS_LORA
    flat = df.reset_index()
    rows = pd.DataFrame({"model": flat["model"].astype(str),
                         "checkpointing": [_setting("gradient_checkpointing", v) for v in flat["gradient_checkpointing"]],
                         "seq_len (tokens)": [f"{int(v):,}" for v in flat["seq_len"]]})
    for c in QLORA_VS_LORA[:2]:
        rows[c] = [_num(v, 1, sign=True) for v in flat[c]]
    rows[QLORA_VS_LORA[2]] = [_num(v, 2) for v in flat[QLORA_VS_LORA[2]]]
    more = (flat[QLORA_VS_LORA[2]] > 1).tolist()
    st = _styled(rows, "Weight bytes QLoRA saves (4-bit constants included) vs the activation bytes its fp32 "
                       "up-casts add; a peak ratio above 1 (red): QLoRA needs more memory than LoRA.")
    return st.apply(lambda col: ["color: #c62828; font-weight: bold" if m else "" for m in more],
                    subset=[QLORA_VS_LORA[2]])


# --- evaluation examples ----------------------------------------------------------------------------------------

def _clip(text, width: int) -> str:
    s = " ".join(str(text).split())  # newlines and runs of spaces as one space
    return s if len(s) <= width else s[: width - 1] + "…"


def examples_rows(df: pd.DataFrame, width: int = 60) -> pd.DataFrame:
    """Display strings of ``EvalResult.examples_table(...)``: each answer marked ✓ / ✗ (exact match),
    chrF to one decimal and its change signed, texts on one line and clipped to ``width`` characters."""
    preds = [c.split(":", 1)[1] for c in df.columns if c.startswith("pred:")]
    if len(preds) != 2 or "base" not in preds:
        raise ValueError("examples_rows needs an examples_table(...) DataFrame (pred:base and one adapter's pred:).")
    a = next(p for p in preds if p != "base")
    out = pd.DataFrame({"split": df["split"].astype(str), "task": df["task"].astype(str),
                        "#": [f"{int(i)}" for i in df["index"]],
                        "prompt": [_clip(p, width) for p in df["prompt"]],
                        "reference": [_clip(r, width) for r in df["reference"]]})
    for s in ("base", a):
        out[f"{s} answer"] = [("✓ " if em >= 1 else "✗ ") + _clip(p, width)
                              for p, em in zip(df[f"pred:{s}"], df[f"exact_match:{s}"])]
    out["chrF base"] = [_num(v, 1) for v in df["chrf:base"]]
    out[f"chrF {a}"] = [_num(v, 1) for v in df[f"chrf:{a}"]]
    out["chrF change"] = [_num(v, 1, sign=True) for v in df[f"delta_chrf:{a}"]]
    out["outcome"] = df[f"outcome:{a}"].astype(str).tolist()
    return out


def examples_table(df: pd.DataFrame, width: int = 28):
    """Evaluation examples for a notebook: a Styler, worse outcomes red, better green (see :func:`examples_rows`);
    a split shared by every row goes to the caption, headers wrap, so the table fits a notebook's width."""
    rows = examples_rows(df, width)
    caption = ""
    if len(rows) and rows["split"].nunique() == 1:
        caption = f"{rows['split'].iloc[0]} examples; ✓ / ✗ = exact match; chrF 0-100"
        rows = rows.drop(columns=["split"])
    colour = {"worse": "background-color: #fde0dc", "better": "background-color: #e3f4e1"}
    st = rows.style.hide(axis="index").map(lambda v: colour.get(v, ""), subset=["outcome"]).set_caption(caption)
    text = [c for c in rows.columns if not c.startswith("chrF") and c != "#"]
    st = st.set_properties(subset=text, **{"text-align": "left"})
    return st.set_table_styles([{"selector": "td", "props": "white-space: nowrap; padding: 2px 4px"},
                                {"selector": "th", "props": "max-width: 6em; vertical-align: bottom; padding: 2px 4px"},
                                {"selector": "caption", "props": "caption-side: top; text-align: left"}],
                               overwrite=False)
