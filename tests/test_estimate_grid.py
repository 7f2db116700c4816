"""The estimate grid (issue 31): every row of ``benchmarks/grid.py``'s grid, recomputed with today's
``lora_kit.estimate``, equals the golden file byte for byte (peak, device total, each breakdown key,
phase). An intended change to the estimate regenerates the file (``python benchmarks/grid.py``) and
commits it with the reason; anything else that moves a number fails here, naming the rows."""
from __future__ import annotations

from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def _grid_module():
    return load_script("benchmarks/grid.py", "lora_kit_benchmark_grid")


def test_estimate_grid_matches_golden(monkeypatch):
    monkeypatch.setenv("LORA_KIT_FIT", "never")  # the shipped fits only: nothing is fitted here
    grid = _grid_module()
    golden = grid.load()
    rows = grid.rows()
    assert len(rows) >= 3000
    diff = grid.differences(golden, rows)
    assert not diff, (f"{len(diff)} of {len(rows)} grid rows differ from tests/golden/estimate_grid.json "
                      "(first 20; `python benchmarks/grid.py --check` lists them, `python benchmarks/grid.py` "
                      "regenerates after an intended change):\n" + "\n".join(diff[:20]))
