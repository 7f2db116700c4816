"""A loop that runs the same operators once per token tile (TRL's SFT head): traces with more tiles fold onto the
trace with the fewest (``lora_kit.memory.calibrate._fold_tiles``), so one operator sequence is fitted."""
from __future__ import annotations

import numpy as np
import pytest

from lora_kit.memory.calibrate import TILED_SLACK, Fit, _fold_tiles, _t_regimes, fit
from lora_kit.memory.loops import SFT_TOKEN_TILE

PARTS = (0, 0, 0, 0, 0)


def trace(tiles: int, base: int) -> list:
    """forward: two operators, ``tiles`` tiles of three (the second tile's bytes a little higher, as when an output
    buffer is written), two operators; backward: one operator, the tiles again (two operators each), one."""
    fwd = [("forward", "embed", base, PARTS), ("forward", "norm", base + 1, PARTS)]
    for t in range(tiles):
        fwd += [("forward", "mm", base + 10 + t, PARTS), ("forward", "logsumexp", base + 20, PARTS),
                ("forward", "copy", base + 5, PARTS)]
    fwd += [("forward", "cat", base + 3, PARTS), ("forward", "loss", base + 2, PARTS)]
    bwd = [("backward", "grad", base, PARTS)]
    bwd += [op for t in range(tiles) for op in (("backward", "mm_bwd", base + 30 + t, PARTS),
                                                ("backward", "add", base + 4, PARTS))]
    return fwd + bwd + [("backward", "end", base, PARTS)]


def test_extra_tiles_fold_onto_the_reference_keeping_each_operators_largest_bytes():
    traces = [trace(1, 100), trace(3, 200), trace(2, 300)]
    folded = _fold_tiles(traces, [1, 3, 2], "test")
    names = [[op[:2] for op in t] for t in folded]
    assert names[0] == names[1] == names[2] == [op[:2] for op in trace(1, 0)]
    assert folded[0] == traces[0]
    by_name = {op[1]: op[2] for op in folded[1]}
    assert by_name["mm"] == 200 + 12 and by_name["mm_bwd"] == 200 + 32  # the largest of the three tiles
    assert by_name["logsumexp"] == 220 and by_name["cat"] == 203


def test_tiles_that_do_not_repeat_one_sequence_are_refused():
    odd = trace(2, 0)
    odd[5] = ("forward", "something_else", 0, PARTS)  # the second tile's first operator differs
    with pytest.raises(ValueError, match="do not repeat one operator sequence"):
        _fold_tiles([trace(1, 0), odd], [1, 2], "test")


def test_a_tiled_fit_picks_its_regime_by_the_positions_scored():
    """``B * (S - 1)`` positions decide the regime, not ``S``: one tile below the tile size, whole tiles from it."""
    regimes = _t_regimes(SFT_TOKEN_TILE)
    f = Fit({}, 1, {k: v[2:] for k, v in regimes.items()}, None, True, {}, SFT_TOKEN_TILE)
    B, S = np.asarray([1, 1, 2, 2, 4]), np.asarray([4096, 4097, 2048, 2049, 1025])
    assert f._regimes(B, S).tolist() == ["N<tile", "N>=tile", "N<tile", "N>=tile", "N>=tile"]
    assert f.covers(S) and Fit.from_json(f.to_json()).tile == SFT_TOKEN_TILE


def buffered(tiles: int) -> list:
    """backward: a tile buffer allocated, ``tiles`` tiles of three operators (a ``device`` query first), then another
    ``device`` query that frees the buffer, and one operator."""
    ops = [("alloc", 1100)] + [op for _ in range(tiles) for op in (("device", 1100), ("mm", 1110), ("del", 1100))]
    return [("backward", n, b, PARTS) for n, b in ops + [("device", 100), ("end", 100)]]


def test_an_operator_after_the_tiles_named_as_a_tiles_first_is_not_folded_onto_a_tile():
    """QLoRA with TRL's head: names alone also let the tiles be split one operator later, which would map the query
    that frees the buffer onto the next tile's first (buffer live); the changes in live bytes tell them apart."""
    folded = _fold_tiles([buffered(1), buffered(3)], [1, 3], "test")
    assert [op[1:3] for op in folded[1]] == [op[1:3] for op in buffered(1)]


@pytest.mark.slow
def test_qlora_with_trls_head_is_fitted_and_matches_simulate_on_shapes_it_never_ran():
    from lora_kit.memory.simulate import simulate
    from lora_kit.memory.specs import load_config
    from lora_kit.settings import PLANNING
    cfg, step = load_config("tiny"), PLANNING.replace(method="qlora", loop="sft", gradient_checkpointing=False)
    f = fit(cfg, step)
    assert not f.unfitted
    for B, S in ((1, 5000), (3, 3000)):  # 4,999 and 8,997 positions: whole tiles and a partial one
        sim = simulate(cfg, step, batch_size=B, seq_len=S)
        peak, _, phase = f.peak(cfg.num_hidden_layers, B, S, step.lora_rank)
        assert phase == sim.phase and abs(peak - sim.peak_allocated_bytes) <= TILED_SLACK
