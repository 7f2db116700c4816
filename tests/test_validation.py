"""``estimate`` against ``simulate`` on the validation set (``benchmarks/grid.py``: ``validation()``), one tolerance.

The simulate side is the golden file ``tests/golden/validation.json`` (full depth, 8,192 tokens). Catalog rows are
estimated from the fits shipped with the package, the 13 outside families' from ``tests/golden/fits``
(``benchmarks/validation.py`` makes the missing ones and prints the whole table); nothing is fitted here except in
the last test, which checks that a stored fit is what fitting gives today.
"""
from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE_PCT = 0.5  # the one tolerance: every fitted or composed row
MODELLED = ("fitted", "composed")  # memory_model of every row: a fit, or a fit composed with static arithmetic


@pytest.fixture(scope="module")
def table():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORA_KIT_FITS", str(ROOT / "tests" / "golden" / "fits"))
        mp.setenv("LORA_KIT_FIT", "never")
        bench = load_script("benchmarks/validation.py", "lora_kit_benchmark_validation")
        grid = load_script("benchmarks/grid.py", "grid")
        yield [bench.compare(r) for r in grid.load(grid.VALIDATION)], grid


def test_the_golden_file_is_the_validation_set(table):
    rows, grid = table
    assert [(r["model"], grid.dumps(r["settings"])) for r in rows] == \
        [(m, grid.dumps(kw)) for m, kw in grid.validation()]


def test_every_fitted_row_is_within_the_tolerance(table):
    rows, grid = table
    fitted = [r for r in rows if r["memory_model"].startswith(MODELLED)]
    assert len(fitted) == len(rows) >= 30  # estimate has no other memory model
    off = [f"{r['model']} {grid.dumps(r['settings'])}: {r['error_pct']:+.4f} %" for r in fitted
           if abs(r["error_pct"]) > TOLERANCE_PCT]
    assert not off, "\n".join(off)
    assert statistics.median(abs(r["error_pct"]) for r in fitted) <= 0.05
    assert {r["model"] for r in fitted if r["model"].startswith("small-")} == \
        {f"small-{mt}" for mt in grid.OUTSIDE}  # every family outside the catalog is among them


def test_a_stored_fit_is_what_fitting_gives_today():
    """The stored fits are not stale: one is made again (the family the arithmetic missed most) and compared."""
    grid = load_script("benchmarks/grid.py", "grid")
    from lora_kit.memory import fits
    from lora_kit.memory.calibrate import fit
    from lora_kit.memory.specs import load_config
    from lora_kit.settings import PLANNING
    config = grid.small_config("seed_oss")
    step = PLANNING.replace(dtype="float32", method="lora", gradient_checkpointing=True)
    stored = json.loads(gzip.decompress(fits.stored_path(config, step, ROOT / "tests" / "golden" / "fits").read_bytes()))
    assert stored["fit"] == json.loads(json.dumps(fit(load_config(config), step).to_json()))
