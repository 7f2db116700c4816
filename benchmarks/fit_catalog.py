"""Build the fits shipped with the package (``lora_kit/catalog/fits``): the memory model of every catalog model
(and the embedded tiny model) for the steps the planner, the widgets and the notebooks estimate.

Each fit runs ``simulate`` on shallow, short steps (:mod:`lora_kit.memory.calibrate`); the fit's variables (micro-
batch, tokens, LoRA rank, depth) need no more fits, every other step field does. Prints each fit's CPU seconds and
the total, and writes ``benchmarks/results/fit_catalog.json`` (what was built, with which libraries, in how long).
A fit already in the folder for the installed libraries is kept (``--refit`` makes it again).

    HF_HUB_OFFLINE=1 python benchmarks/fit_catalog.py [--models llama-3.1-8b,tiny] [--methods full] [--refit]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from grid import FAMILY_MODELS  # noqa: E402  (one catalog model per family: the validation set's)


PAPER = dict(method="qlora", optimizer="paged_adamw_32bit", lora_rank=64)  # lora_kit.plan.headline's PAPER_STEP
EXTRA = {"llama-3.1-8b": [dict(method="qlora", optimizer="paged_adamw_8bit")]  # params/, and the headline's steps
         # eager attention without checkpointing: the largest figures a user can ask for (tests/test_exact_bytes.py)
         + [dict(method=m, attn_implementation="eager", gradient_checkpointing=False) for m in ("lora", "qlora", "full")],
         "llama-3.1-70b": [PAPER, {**PAPER, "lora_rank": 16},
                           {**PAPER, "lora_rank": 16, "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}],
         "llama-65b": [PAPER],
         # the validation set's autocast and SFT rows (benchmarks/grid.py)
         **{m: [dict(method="lora", autocast=True), dict(method="lora", loop="sft")]
            for m in ("llama-3.2-1b", "qwen3-0.6b", "pythia-1b")}}
for _m in ("llama-3.2-1b", "qwen3-0.6b", "pythia-1b"):  # and its FSDP2 rows: FSDP2's own step, per GPU count
    EXTRA[_m] += [dict(method="lora", sharding="fsdp", num_gpus=2), dict(method="full", sharding="fsdp", num_gpus=2)]
EXTRA["llama-3.2-1b"] += [dict(method="full", sharding="fsdp", num_gpus=4)]  # the planner's multi-GPU sweep (tests)
# the run card's loops (the Trainer's and TRL's beside the kit's) for the model its tests plan
EXTRA["llama-3.1-8b"] += [dict(method=m, loop=lp) for m in ("lora", "qlora", "full") for lp in ("trainer", "sft")]


def steps_for(name: str, extra_only: bool = False) -> list:
    """The steps a model is estimated at by the kit's own journey: the planning step per method, checkpointing on
    and off (notebooks 01/02, the planner and the widgets start from it and sweep checkpointing), sharded QLoRA's
    recipe (``qlora_prepare="none"``: what FSDP / ZeRO-3 plans resolve to), the shipped
    params files' plans; for the tiny model also the embedded step per method (what the tutorial's smoke run
    measures)."""
    from lora_kit.memory.specs import SDPA_UNSUPPORTED, model_spec
    from lora_kit.settings import EMBEDDED, PLANNING
    attn = "eager" if model_spec(name).model_type in SDPA_UNSUPPORTED else "sdpa"
    out = [] if extra_only else [PLANNING.for_method(m).replace(gradient_checkpointing=gc, attn_implementation=attn)
                                 for gc in (True, False) for m in ("lora", "qlora", "full")]
    if not extra_only:  # sharded QLoRA's recipe (no up-casts: what 'auto' gives fsdp / zero3), checkpointed
        out.append(PLANNING.for_method("qlora").replace(qlora_prepare="none", attn_implementation=attn))
    out += [PLANNING.replace(**{"attn_implementation": attn, **kw}) for kw in EXTRA.get(name, [])]
    if name == "tiny" and not extra_only:
        out += [EMBEDDED.for_method(m) for m in ("lora", "qlora", "full")] + grid_steps(name)
    return out


def grid_steps(name: str) -> list:
    """One step per fit the golden estimate grid's rows of ``name`` need (``benchmarks/grid.py``): the tutorial's
    model is estimated at every setting a user can click, so all of them ship fitted. Rows another fit serves (an
    optimizer composed from AdamW's: ``lora_kit.memory.compose``) are left out."""
    import grid

    from lora_kit.memory import fits
    from lora_kit.memory.compose import SWAPPABLE
    from lora_kit.memory.specs import model_spec
    from lora_kit.settings import as_step
    config, out, seen = model_spec(name).config, [], set()
    for model, kw in grid.grid():
        step = as_step(None, **kw)
        if model != name:
            continue
        if step.optimizer in SWAPPABLE:
            step = step.replace(optimizer="adamw")
        d = fits.digest(fits.key(config, step))
        if d not in seen:
            seen.add(d)
            out.append(step)
    return out


def ordered(names: list) -> list:
    """The tutorial's models first, then one per family, then the rest: a build cut short ships the most used."""
    first = ["tiny", "llama-3.1-8b", "llama-3.1-70b", *FAMILY_MODELS]
    return [n for n in first if n in names] + [n for n in names if n not in first]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names (default: tiny and every catalog model)")
    ap.add_argument("--refit", action="store_true", help="fit again what is already there")
    ap.add_argument("--methods", default="", help="comma-separated methods to (re)fit (default: all)")
    ap.add_argument("--extra-only", action="store_true", help="only the params files' and the headline's steps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fit_catalog.json"))
    a = ap.parse_args()
    from lora_kit.memory import fits
    from lora_kit.memory.specs import catalog, model_spec
    from lora_kit.noise import quiet
    quiet()
    names = [n for n in a.models.split(",") if n] or ordered(["tiny", *catalog()])  # given: in the order given
    rows, cpu0, wall0 = [], time.process_time(), time.perf_counter()
    for name in names:
        config = model_spec(name).config
        for step in steps_for(name, a.extra_only):
            if a.methods and step.method not in a.methods.split(","):
                continue
            p = fits.stored_path(config, step, fits.SHIPPED)
            if p.is_file() and not a.refit:
                print(f"{name:22s} {step.method:5s} kept {p.name}", flush=True)
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                f, info = fits.make(config, step, folder=fits.SHIPPED)
            except Exception as e:  # noqa: BLE001 - a step the fit cannot align is a result
                rows.append({"model": name, "step": step.to_dict(), "error": f"{type(e).__name__}: {e}"})
                print(f"{name:22s} {step.method:5s} not fitted: {e}", flush=True)
                continue
            rows.append({"model": name, "step": step.to_dict(), "file": p.name, "operators": f.size(),
                         "seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1)})
            print(f"{name:22s} {step.method:5s} {rows[-1]['seconds']:6.1f} s  {f.size():4d} operators", flush=True)
    print(f"this run: {sum('file' in r for r in rows)} fits in {(time.process_time() - cpu0) / 3600:.3f} CPU-hours "
          f"({(time.perf_counter() - wall0) / 3600:.3f} h wall)")
    Path(a.out).write_text(json.dumps(shipped_summary(), indent=1))


def shipped_summary() -> dict:
    """Every fit in the package's folder: what it is, with which libraries, how long it took (wall seconds on the
    machine that made it, which may have been shared), and the totals."""
    import gzip

    from lora_kit.memory import fits
    rows = []
    for p in sorted(fits.SHIPPED.glob("*.json.gz")):
        d = json.loads(gzip.decompress(p.read_bytes()))
        rows.append({"file": p.name, "model_type": d["key"]["architecture"].get("model_type"),
                     "settings": d["key"]["settings"], "seconds": d["seconds"], "versions": d["versions"],
                     "where": d["where"]})
    return {"total": {"fits": len(rows), "wall_hours": round(sum(r["seconds"] for r in rows) / 3600, 3),
                      "bytes": sum(p.stat().st_size for p in fits.SHIPPED.glob("*.json.gz"))}, "rows": rows}


if __name__ == "__main__":
    main()
