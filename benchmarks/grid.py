"""The estimate grid: ``lora_kit.estimate`` on a fixed grid of settings, frozen as a golden file (issue 31).

Every catalog model (and "tiny") crossed with every value of every step field -- not the whole
product: each field is varied from a per-model base, crossed with the fields it interacts with
(method with everything; seq_len with batch_size and checkpointing; sharding with num_gpus and
cpu_offload; loop with optimizer; dtype with autocast; lora_rank with lora_targets). Only valid
combinations are built; a row that ``estimate`` still refuses fails the script (nothing is skipped).

Usage::

    HF_HUB_OFFLINE=1 python benchmarks/grid.py           # (re)write tests/golden/estimate_grid.json
    HF_HUB_OFFLINE=1 python benchmarks/grid.py --check   # compare with it; print differing rows, exit 1
    HF_HUB_OFFLINE=1 python benchmarks/grid.py --validation  # simulate the validation set: tests/golden/validation.json

**The validation set** (:func:`validation`) is what ``estimate`` is judged against: ``simulate`` at full depth on
one model per catalog family x {LoRA, QLoRA, full} x checkpointing on/off at 8,192 tokens; rank 64, autocast,
``loop="sft"``, 2-GPU FSDP (LoRA and full), 8-bit optimizers and full fine-tuning with SGD on three families;
Phi-4-mini's full fine-tuning with SGD; and 13 families the catalog does not model (small configs of their real
layers, 4 blocks; built here) x {LoRA, full} x checkpointing on/off. ``tests/test_validation.py``
compares ``estimate`` with a sample of it in CI; ``benchmarks/validation.py`` with all of it.

``tests/test_estimate_grid.py`` imports :func:`grid` and :func:`compute` from here and compares every
row byte for byte. The golden file is one JSON object per line (sorted keys) so diffs read row by row:
``{"model", "settings" (the keyword arguments passed), "peak_allocated_bytes", "device_total_bytes",
"breakdown", "phase"}``. After an intended change to the estimate, rerun without ``--check`` and commit
the new file with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "estimate_grid.json"
VALIDATION = GOLDEN.with_name("validation.json")

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd", "adafactor")
SHARDINGS = ("ddp", "zero1", "zero2", "zero3", "fsdp")  # "none" is every other row
OFFLOADABLE = ("zero1", "zero2", "zero3", "fsdp")  # cpu_offload needs sharded states
LOOPS = ("kit", "trainer", "sft")
SEQ_LENS = (512, 1024, 2048, 4096, 8192)
BATCH_SIZES = (1, 2, 4, 8)
LORA_RANKS = (8, 16, 64)
# models crossed more densely (a dense Llama, the embedded model, MoE, MLA, fused-QKV, eager-only)
DENSE_MODELS = ("tiny", "llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v2-lite", "pythia-1b", "gemma-2-2b")


FAMILY_MODELS = ("llama-3.2-1b", "mistral-7b", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b",
                 "gemma-2-2b", "gemma-3-1b", "phi-3-mini", "pythia-1b", "mixtral-8x7b", "deepseek-v2-lite", "olmo-2-7b",
                 "granite-3.1-2b")  # one catalog model per family
EXTRA_FAMILIES = ("llama-3.2-1b", "qwen3-0.6b", "pythia-1b")  # rank 64, autocast, sft, 2-GPU FSDP, 8-bit optimizers
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384, pad_token_id=0, bos_token_id=0, eos_token_id=0)
OUTSIDE = {  # model_type -> extra config fields (small experts for the mixtures): families the catalog does not model
    "smollm3": {}, "olmo3": {}, "glm4": {"head_dim": 64}, "cohere2": {"head_dim": 64}, "stablelm": {},
    "starcoder2": {}, "gemma": {"head_dim": 64}, "ernie4_5": {"head_dim": 64}, "exaone4": {},
    "helium": {"head_dim": 64}, "seed_oss": {"head_dim": 64},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
}
OUTSIDE_STEP = {"gpt_oss": {"attn_implementation": "eager"}}  # transformers runs GPT-OSS with eager attention only
VALIDATION_SHAPE = {"seq_len": 8192, "batch_size": 1}


def small_config(model_type: str) -> dict:
    """The config dict of a small model of an outside family (its real layers, 4 blocks)."""
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **{**SMALL, **OUTSIDE[model_type]}).to_dict()


def validation() -> list[tuple[str, dict]]:
    """``(model, settings)`` of the validation set; ``model`` is a catalog name or ``small-<model_type>``."""
    out = []
    for model in FAMILY_MODELS:
        base = {**_model_base(model), **VALIDATION_SHAPE}
        out += [(model, {**base, "method": m, "gradient_checkpointing": gc}) for m in METHODS for gc in (True, False)]
    for model in EXTRA_FAMILIES:
        base = {**_model_base(model), **VALIDATION_SHAPE}
        out += [(model, {**base, "method": "lora", "lora_rank": 64}), (model, {**base, "method": "lora", "autocast": True}),
                (model, {**base, "method": "lora", "loop": "sft"}),
                (model, {**base, "method": "lora", "sharding": "fsdp", "num_gpus": 2}),
                # another optimizer, composed from the AdamW fit (lora_kit.memory.compose)
                (model, {**base, "method": "lora", "optimizer": "paged_adamw_8bit"}),
                (model, {**base, "method": "qlora", "optimizer": "adamw_8bit"}),
                # full fine-tuning: SGD composed from the AdamW fit (each operator extrapolated in depth), FSDP2's own
                (model, {**base, "method": "full", "optimizer": "sgd"}),
                (model, {**base, "method": "full", "sharding": "fsdp", "num_gpus": 2})]
    # the case that made a fit extrapolate each operator in depth: a large tied vocabulary, full fine-tuning with SGD
    out.append(("phi-4-mini", {**_model_base("phi-4-mini"), "seq_len": 2048, "batch_size": 1, "method": "full",
                               "optimizer": "sgd"}))
    for mt in OUTSIDE:
        base = {**OUTSIDE_STEP.get(mt, {}), **VALIDATION_SHAPE, "dtype": "float32"}
        out += [(f"small-{mt}", {**base, "method": m, "gradient_checkpointing": gc}) for m in ("lora", "full")
                for gc in (True, False)]
    return out


def validation_model(model: str):
    """What ``estimate`` / ``simulate`` take for a validation row's model."""
    if model.startswith("small-"):
        from lora_kit.memory.specs import load_config
        cfg = load_config(small_config(model[len("small-"):]))
        cfg.name_or_path = model
        return cfg
    return model


def simulate_row(model: str, settings: dict) -> dict:
    from lora_kit.memory.simulate import simulate
    r = simulate(validation_model(model), **settings)
    return {"model": model, "settings": dict(settings), "peak_allocated_bytes": int(r.peak_allocated_bytes),
            "breakdown": {k: int(v) for k, v in r.breakdown.items()}, "phase": r.phase,
            "simulate_seconds": round(r.wall_seconds, 1)}


def _models() -> list[str]:
    from lora_kit.memory.specs import catalog
    return ["tiny"] + sorted(catalog())


def _attention_targets(names: list[str]) -> list[str]:
    """An attention-only target set that exists in the model (q/v where there are separate ones)."""
    for choice in (["q_proj", "v_proj"], ["qkv_proj"], ["query_key_value"], ["q_proj", "kv_b_proj"]):
        if all(n in names for n in choice):
            return choice
    raise ValueError(f"no attention-only target set among {names}; add one to benchmarks/grid.py")


def _mlp_targets(names: list[str], dense: list[str]) -> list[str]:
    """An MLP-only target set (``dense``: the model's non-expert linear names).

    Excluded on purpose: on Mixtral and Qwen3-MoE the MLP names are expert-only (no dense linear
    of that name), and at f64021a ``check_targets`` refuses any lora_rank > 1 for an expert-only set
    (its smallest-targeted-layer default is 1). There the set is o_proj plus the experts' down
    projection instead, which still puts LoRA on the experts."""
    for choice in (["down_proj"], ["w2"], ["dense_4h_to_h"], ["gate_up_proj", "down_proj"]):
        if all(n in names for n in choice):
            return choice if any(n in dense for n in choice) else ["o_proj", *choice]
    raise ValueError(f"no MLP-only target set among {names}; add one to benchmarks/grid.py")


def _model_base(model: str) -> dict:
    """The keyword arguments every row of ``model`` starts from. Gemma-2 runs with eager attention
    only (``check_targets`` refuses sdpa for it), so its rows pass attn_implementation="eager" and its
    sdpa rows are left out -- the one exclusion of the grid."""
    from lora_kit.memory.specs import SDPA_UNSUPPORTED, model_spec
    return {"attn_implementation": "eager"} if model_spec(model).model_type in SDPA_UNSUPPORTED else {}


def _per_model(model: str) -> list[dict]:
    """Each step field varied from the model's base, crossed with method (and what it interacts with)."""
    from lora_kit.memory.specs import model_spec, valid_targets
    spec = model_spec(model)
    names, dense = valid_targets(spec), [lin.name for lin in spec.linears]
    base = _model_base(model)
    eager_only = base.get("attn_implementation") == "eager"
    rows = []
    for method in METHODS:
        m = {**base, "method": method}
        lora = method != "full"
        # shape: seq_len x batch_size, and checkpointing off at a short and a long shape
        rows += [{**m, "seq_len": s, "batch_size": b} for s, b in ((512, 8), (2048, 8), (8192, 1), (8192, 8))]
        rows += [{**m, "gradient_checkpointing": False, "seq_len": s, "batch_size": b} for s, b in ((512, 8), (2048, 1))]
        # attention kernel (eager with and without checkpointing; sdpa for an eager-only model is invalid)
        if not eager_only:
            rows += [{**m, "attn_implementation": "eager"},
                     {**m, "attn_implementation": "eager", "gradient_checkpointing": False}]
        # padding
        rows += [{**m, "padding": p, "batch_size": 4} for p in ("longest", "max_length")]
        # dtype x autocast
        rows += [{**m, "dtype": d, "autocast": a} for d in ("float32", "bfloat16", "float16") for a in (False, True)
                 if (d, a) != ("bfloat16", False)]
        if method == "qlora":
            rows += [{**m, "double_quant": False}, {**m, "double_quant": False, "autocast": True}]
        # optimizers
        rows += [{**m, "optimizer": o} for o in OPTIMIZERS if o != "adamw"]
        # loops (their optimizer phase differs with the optimizer: crossed with a second one)
        rows += [{**m, "loop": lp, "optimizer": o} for lp in ("trainer", "sft") for o in ("adamw", "adamw_8bit")]
        # LoRA rank x targets
        if lora:
            for targets in ("all-linear", _attention_targets(names), _mlp_targets(names, dense)):
                rows += [{**m, "lora_rank": r, "lora_targets": targets} for r in LORA_RANKS]
        # sharding x num_gpus x cpu_offload
        for sh in SHARDINGS:
            for n in (2, 8):
                rows.append({**m, "sharding": sh, "num_gpus": n})
                if sh in OFFLOADABLE:
                    rows.append({**m, "sharding": sh, "num_gpus": n, "cpu_offload": True})
    return rows


def _dense(model: str) -> list[dict]:
    """A denser cross on a few models: shapes x checkpointing, optimizer x loop, sharding x shape,
    padding x shape, and the fields that cost no memory."""
    base = _model_base(model)
    rows = []
    for method in METHODS:
        m = {**base, "method": method}
        rows += [{**m, "seq_len": s, "batch_size": b, "gradient_checkpointing": gc}
                 for s in SEQ_LENS for b in BATCH_SIZES for gc in (True, False)]
        rows += [{**m, "optimizer": o, "loop": lp} for o in OPTIMIZERS for lp in LOOPS]
        rows += [{**m, "sharding": sh, "num_gpus": 8, "cpu_offload": off, "seq_len": s, "batch_size": 4}
                 for sh in OFFLOADABLE for off in (False, True) for s in (512, 8192)]
        rows += [{**m, "padding": p, "seq_len": s, "batch_size": 8, "gradient_checkpointing": False}
                 for p in ("longest", "max_length") for s in (512, 4096)]
        # fields that cost no memory (the estimate must not move): grad_accum, lora_alpha
        rows += [{**m, "grad_accum": g} for g in (2, 8)]
        if method != "full":
            rows += [{**m, "lora_alpha": a} for a in (16, 128)]
    return rows


def grid() -> list[tuple[str, dict]]:
    """``(model, settings)`` pairs in a fixed order, each settings dict the keyword arguments passed to
    ``estimate``; duplicates (a dense-cross row equal to a per-model row) appear once, first place kept. Every row:
    what ``benchmarks/fit_catalog.py`` fits for the tiny model; :func:`rows` keeps those the shipped fits serve."""
    out, seen = [], set()
    models = _models()
    for model in models:
        for kw in _per_model(model) + (_dense(model) if model in DENSE_MODELS else []):
            key = (model, json.dumps(kw, sort_keys=True))
            if key not in seen:
                seen.add(key)
                out.append((model, kw))
    missing = [m for m in DENSE_MODELS if m not in models]
    if missing:
        raise ValueError(f"DENSE_MODELS not in the catalog: {missing}")
    return out


def _shipped_only():
    """What a fresh install estimates with: the shipped fits, no user cache, nothing fitted on the spot."""
    from lora_kit.memory import fits
    return mock.patch.dict(os.environ, LORA_KIT_FIT="never", LORA_KIT_FITS=str(fits.SHIPPED / "no-user-cache"))


def rows() -> list[dict]:
    """The golden grid's rows: :func:`grid`'s pairs the fits shipped with the package serve (fitted, or composed
    from one; the tiny model ships a fit for every row), in its order, each estimated once, as a fresh install
    estimates it whatever the user's cache holds."""
    from lora_kit.memory import fits
    out = []
    with _shipped_only():
        for model, kw in grid():
            try:
                out.append(compute(model, kw))
            except fits.MissingFit:
                continue
    return out


def compute(model: str, settings: dict) -> dict:
    """One golden row: the settings as passed and every byte field of the estimate (raises if refused; a missing
    fit with ``LORA_KIT_FIT=never`` raises :class:`lora_kit.memory.fits.MissingFit`)."""
    from lora_kit import estimate
    from lora_kit.memory.fits import MissingFit
    try:
        e = estimate(model, **settings)
    except MissingFit:
        raise
    except ValueError as err:
        raise ValueError(f"estimate({model!r}, **{settings}) refused a grid row: {err}") from err
    return {"model": model, "settings": dict(settings), "peak_allocated_bytes": int(e.peak_allocated_bytes),
            "device_total_bytes": int(e.device_total_bytes),
            "breakdown": {k: int(v) for k, v in e.breakdown.items()}, "phase": str(e.phase),
            "memory_model": e.memory_model}


def dumps(row: dict) -> str:
    return json.dumps(row, sort_keys=True, separators=(",", ":"))


def load(path: Path = GOLDEN) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def differences(golden: list[dict], rows: list[dict]) -> list[str]:
    """Human-readable differences between golden rows and recomputed rows (same grid expected)."""
    out = []
    if len(golden) != len(rows):
        out.append(f"row count: golden {len(golden)}, grid {len(rows)} (regenerate after changing the grid)")
    for i, (g, r) in enumerate(zip(golden, rows)):
        if g == r:
            continue
        if (g["model"], g["settings"]) != (r["model"], r["settings"]):
            out.append(f"row {i}: settings differ: golden {g['model']} {dumps(g['settings'])}, "
                       f"grid {r['model']} {dumps(r['settings'])}")
            continue
        fields = [k for k in ("peak_allocated_bytes", "device_total_bytes", "phase", "memory_model")
                  if g.get(k) != r.get(k)]
        fields += [f"breakdown.{k}" for k in sorted(set(g["breakdown"]) | set(r["breakdown"]))
                   if g["breakdown"].get(k) != r["breakdown"].get(k)]
        detail = "; ".join(f"{f}: {_get(g, f)} -> {_get(r, f)}" for f in fields)
        out.append(f"row {i}: estimate({r['model']!r}, **{dumps(r['settings'])}): {detail}")
    return out


def _get(row: dict, field: str):
    return row["breakdown"].get(field.split(".", 1)[1]) if field.startswith("breakdown.") else row.get(field)


def coverage(rows: list[dict]) -> dict:
    """Rows per value of each step field (the value estimate used: passed, else its default)."""
    from lora_kit.settings import PLANNING
    out: dict = {"model": {}}
    for row in rows:
        out["model"][row["model"]] = out["model"].get(row["model"], 0) + 1
        for k, default in PLANNING.to_dict().items():
            v = row["settings"].get(k, default)
            v = "+".join(v) if isinstance(v, list) else str(v)
            out.setdefault(k, {})
            out[k][v] = out[k].get(v, 0) + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    ap.add_argument("--coverage", action="store_true", help="print rows per value of each step field")
    ap.add_argument("--validation", action="store_true", help="simulate the validation set (its golden file)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.validation:
        return _write_validation(args.out or VALIDATION)
    args.out = args.out or GOLDEN
    import lora_kit
    print(f"lora_kit: {lora_kit.__file__}")
    t0 = time.perf_counter()
    computed = rows()
    took = time.perf_counter() - t0
    print(f"{len(computed):,} rows in {took:.2f} s")
    if args.coverage:
        for field, counts in coverage(computed).items():
            print(f"{field}: " + ", ".join(f"{v}={n}" for v, n in counts.items()))
    if args.check:
        diff = differences(load(args.out), computed)
        for line in diff[:20]:
            print(line)
        if diff:
            print(f"{len(diff)} difference(s) from {args.out}", file=sys.stderr)
            return 1
        print(f"identical to {args.out}")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(dumps(r) + "\n" for r in computed))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")
    return 0


def _write_validation(path: Path) -> int:
    """simulate every validation row (kept rows of an earlier, interrupted run are reused), one line per row."""
    from lora_kit.noise import quiet
    quiet()
    done = {(r["model"], dumps(r["settings"])): r for r in (load(path) if path.is_file() else [])}
    t0, rows = time.process_time(), []
    for model, kw in validation():
        row = done.get((model, dumps(kw))) or simulate_row(model, kw)
        rows.append(row)
        path.write_text("".join(dumps(r) + "\n" for r in rows))
        print(f"{model:20s} {dumps(kw)}: {row['peak_allocated_bytes']:,} B ({row['simulate_seconds']} s)", flush=True)
    print(f"{len(rows)} rows; {(time.process_time() - t0) / 3600:.2f} CPU-hours this run; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
