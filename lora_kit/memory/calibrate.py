"""The closed form of ``simulate``, fitted: each operator's live bytes as exact polynomials in the step's shape.

For one architecture (a config) and one step with its categorical fields fixed, ``simulate`` runs with
``trace=True`` at a few shallow depths and short shapes; each run gives, per operator of the step in order, the
live bytes once its outputs exist (``LiveBytesTracker(trace=True)``): the only moments a peak can happen at. At one
depth the operator sequence depends on the micro-batch ``B`` only through ``B == 1`` versus ``B > 1`` (a few
operators differ), so each regime has its own fit. Operator ``j``'s live bytes are fitted exactly (rational least
squares, then checked to reproduce every design shape to the byte and a held-out shape) in a basis of the shape:
``1, S, S²`` at ``B == 1``; ``1, S, S², B·S, B·S²`` above (weights and states, position tables, masks, activations,
attention scores). Per phase (forward / backward / optimizer) the peak at a shape is the largest operator's value;
across depths it grows linearly (each block adds what it keeps), so the phase peak at depth ``L`` is extrapolated
from two depths. The figure is the largest phase's. Operators that can never be a phase's maximum are pruned.

Evaluation is exact integer arithmetic (Python ints: no overflow, no float bytes). Not fitted here yet: LoRA rank
and targets (fixed per fit), sharding (one GPU), loops whose operator sequence follows the tokens
(``loop="sft"`` tiles them): :func:`fit` refuses what it cannot align, naming the reason.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from fractions import Fraction

DEPTHS = (2, 3)
# per regime: (basis terms, design shapes (B, S), held-out shape); each design is full rank in its basis
REGIMES = {
    "B=1": (("1", "S", "S2"), ((1, 512), (1, 1024), (1, 2048)), (1, 1536)),
    "B>1": (("1", "S", "S2", "BS", "BS2"), ((2, 512), (2, 1024), (2, 2048), (4, 512), (4, 1024), (3, 768)),
            (3, 1536)),
}


def _regime(B: int) -> str:
    return "B=1" if B == 1 else "B>1"


def _row(basis, B: int, S: int) -> list[int]:
    x = {"1": 1, "S": S, "S2": S * S, "BS": B * S, "BS2": B * S * S}
    return [x[k] for k in basis]


def _solve(rows: list[list[int]], ys: list[int]) -> list[Fraction]:
    """Exact least squares (normal equations over the rationals, Gauss-Jordan)."""
    n = len(rows[0])
    a = [[Fraction(sum(r[i] * r[j] for r in rows)) for j in range(n)] for i in range(n)]
    b = [Fraction(sum(r[i] * y for r, y in zip(rows, ys))) for i in range(n)]
    for c in range(n):
        p = next(k for k in range(c, n) if a[k][c] != 0)
        a[c], a[p], b[c], b[p] = a[p], a[c], b[p], b[c]
        for k in range(n):
            if k != c and a[k][c] != 0:
                f = a[k][c] / a[c][c]
                a[k] = [x - f * y for x, y in zip(a[k], a[c])]
                b[k] -= f * b[c]
    return [b[i] / a[i][i] for i in range(n)]


def _value(basis, coef, B: int, S: int) -> Fraction:
    return sum(c * x for c, x in zip(coef, _row(basis, B, S)))


def _traces(cfg, step, depth: int, shapes) -> list[list[tuple]]:
    from lora_kit.memory.simulate import simulate
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = depth
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the depth
        v = getattr(c, key, None)
        if isinstance(v, list) and len(v) > depth:
            setattr(c, key, v[:depth])
    return [simulate(c, step, batch_size=B, seq_len=S, trace=True).trace for B, S in shapes]


def _envelope(ops: list) -> list:
    """The operators that can be a phase's maximum: duplicates dropped, and every operator whose coefficients are
    all at most another's (the basis terms are positive, so it never exceeds that one)."""
    uniq = list(dict.fromkeys(tuple(c) for c in ops))
    return [c for c in uniq if not any(d != c and all(x <= y for x, y in zip(c, d)) for d in uniq)]


@dataclass(frozen=True)
class Fit:
    """Per regime and depth, per phase: the coefficient vectors (rationals) of the operators that can peak."""
    phases: dict  # (regime, depth) -> {phase: [coefficient tuples]}

    def phase_peaks(self, depth: int, B: int, S: int) -> dict:
        reg = _regime(B)
        basis = REGIMES[reg][0]
        return {ph: max(_value(basis, c, B, S) for c in ops) for ph, ops in self.phases[(reg, depth)].items()}

    def peak(self, layers: int, B: int, S: int) -> int:
        """Peak allocated bytes at ``layers`` blocks, micro-batch ``B``, ``S`` tokens: exact."""
        lo, hi = DEPTHS
        p_lo, p_hi = self.phase_peaks(lo, B, S), self.phase_peaks(hi, B, S)
        best = max(p_lo[ph] + (layers - lo) * (p_hi[ph] - p_lo[ph]) / (hi - lo) for ph in p_lo)
        if best.denominator != 1:
            raise ArithmeticError(f"the fitted peak is not a whole number of bytes ({best}): refit")
        return int(best)

    def size(self) -> int:
        return sum(len(ops) for phases in self.phases.values() for ops in phases.values())


def fit(cfg, step) -> Fit:
    """Fit ``simulate`` for the architecture ``cfg`` (a ``PretrainedConfig``) and ``step`` (a ``Step``; its
    ``batch_size`` and ``seq_len`` are the fit's variables). Raises ValueError naming what cannot be aligned."""
    if step.sharding not in ("none", "ddp") or step.loop == "sft":
        raise ValueError("calibrate fits one GPU's step with loop 'kit' or 'trainer' (sft's tiles follow the tokens).")
    phases = {}
    for reg, (basis, design, held) in REGIMES.items():
        rows = [_row(basis, B, S) for B, S in design]
        for depth in DEPTHS:
            traces = _traces(cfg, step, depth, design + (held,))
            if len({tuple(op[:2] for op in t) for t in traces}) != 1:
                raise ValueError(f"the operator sequence at depth {depth}, {reg}, changes with the shape "
                                 f"({sorted(len(t) for t in traces)} operators): not fitted")
            by_phase: dict = {}
            for j, (ph, name, _) in enumerate(traces[0]):
                ys = [t[j][2] for t in traces[:len(design)]]
                coef = _solve(rows, ys)
                if any(_value(basis, coef, B, S) != y for (B, S), y in zip(design, ys)) or \
                        _value(basis, coef, *held) != traces[-1][j][2]:
                    raise ValueError(f"operator {j} ({name}, {ph}) at depth {depth}, {reg}, is not polynomial in "
                                     f"{basis}: not fitted")
                by_phase.setdefault(ph, []).append(coef)
            phases[(reg, depth)] = {ph: _envelope(ops) for ph, ops in by_phase.items()}
    return Fit(phases)
