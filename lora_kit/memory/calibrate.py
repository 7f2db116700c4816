"""The closed form of ``simulate``, fitted: each operator's live bytes as exact polynomials in the step's shape.

For one architecture (a config) and one step with its categorical fields fixed, ``simulate`` runs with
``trace=True`` at a few shallow depths and short shapes; each run gives, per operator of the step in order, the
live bytes once its outputs exist (``LiveBytesTracker(trace=True)``): the only moments a peak can happen at. For one
stack of blocks the operator sequence depends on the shape only through regimes, each fitted on its own: ``B == 1``
versus ``B > 1`` (a few operators differ), and, for a model with a sliding window ``w``, ``S < w`` versus
``S >= w`` (from there on transformers builds an explicit mask and attention takes another kernel). Operator ``j``'s live bytes are fitted exactly (rational least
squares, then checked to reproduce every design shape to the byte and a held-out shape) in a basis of the shape:
``1, S, S²`` at ``B == 1``; ``1, S, S², B·S, B·S²`` above (weights and states, position tables, masks, activations,
attention scores). Per phase (forward / backward / optimizer) the peak at a shape is the largest operator's value;
across depths it grows linearly, each block adding what its type keeps, so the phase peak of the whole model is
the two-block stack's plus, per layer type, the count of its blocks times what one block of that type adds
(measured on a three-block stack). The figure is the largest phase's. Operators that can never be a phase's maximum are pruned.

Evaluation is exact integer arithmetic (Python ints: no overflow, no float bytes). Not fitted here yet: LoRA rank
and targets (fixed per fit), sharding (one GPU), loops whose operator sequence follows the tokens
(``loop="sft"`` tiles them): :func:`fit` refuses what it cannot align, naming the reason.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from fractions import Fraction

# the B regimes: (basis terms, design shapes as (B, k): S = start + k * span, held-out shape)
B_REGIMES = {
    "B=1": (("1", "S", "S2"), ((1, 0), (1, 2), (1, 4)), (1, 3)),
    "B>1": (("1", "S", "S2", "BS", "BS2"), ((2, 0), (2, 2), (2, 4), (4, 0), (4, 2), (3, 1)), (3, 3)),
}
SPAN = 512  # tokens between design shapes without a window


def _window(cfg) -> int | None:
    """The sliding window that switches attention's kernel at ``S >= window`` (transformers builds an explicit
    mask from there on), when the config uses one."""
    w = getattr(cfg, "sliding_window", None)
    if not isinstance(w, int) or w <= 0 or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return w


def _s_regimes(cfg) -> dict:
    """S regimes: name -> (start, span, contains(S)). Without a window, one regime from 512 tokens on. With a
    window ``w``: ``S < w`` (designed below ``w`` in steps of a multiple of 64; none when ``w`` is under 320 tokens)
    and ``S >= w`` (designed from ``max(w, 512)``: storages of fewer bytes than the allocator's 512-byte rounding do
    not grow linearly)."""
    w = _window(cfg)
    if w is None:
        return {"S": (SPAN, SPAN, lambda S: True)}
    out = {}
    span = min(SPAN, w // 5 // 64 * 64)
    if span >= 64:
        out["S<w"] = (w - 5 * span, span, lambda S, w=w: S < w)
    out["S>=w"] = (-(-max(w, SPAN) // 64) * 64, SPAN, lambda S, w=w: S >= w)
    return out


def _stacks(cfg) -> dict:
    """The shallow stacks fitted. Without layer types: two and three blocks. With them (first type ``a``, last
    ``z``): ``[a, a]``; per type ``t``, ``[a, t, a]`` (what one more block of ``t`` keeps, the top unchanged); and,
    when ``z`` differs from ``a``, ``[a, a, z]`` (what a top block of type ``z`` changes)."""
    types = getattr(cfg, "layer_types", None)
    if not isinstance(types, list) or not types:
        return {"base": None, "block": None}
    a, z = types[0], types[-1]
    out = {"base": [a, a], **{f"mid:{t}": [a, t, a] for t in dict.fromkeys(types)}}
    if z != a:
        out["top"] = [a, a, z]
    return out


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


def _shallow(cfg, stack: str, layers):
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = len(layers) if layers is not None else (2 if stack == "base" else 3)
    if layers is not None:
        c.layer_types = list(layers)
    v = getattr(c, "mlp_only_layers", None)
    if isinstance(v, list):
        c.mlp_only_layers = [i for i in v if i < c.num_hidden_layers]
    return c


def _envelope(ops: list) -> list:
    """The operators that can be a phase's maximum: duplicates dropped, and every operator whose coefficients are
    all at most another's (the basis terms are positive, so it never exceeds that one)."""
    uniq = list(dict.fromkeys(tuple(c) for c in ops))
    return [c for c in uniq if not any(d != c and all(x <= y for x, y in zip(c, d)) for d in uniq)]


@dataclass(frozen=True)
class Fit:
    """Per (B regime, S regime, stack), per phase: the coefficient vectors (rationals) of the operators that can
    peak; ``types``: the model's layer types in order (None: one type)."""
    phases: dict
    s_regimes: dict
    types: tuple | None
    unfitted: dict  # S regime -> why it could not be fitted (its lengths are refused)

    def _phase_peaks(self, b_reg: str, s_reg: str, stack: str, B: int, S: int) -> dict:
        basis = B_REGIMES[b_reg][0]
        return {ph: max(_value(basis, c, B, S) for c in ops) for ph, ops in self.phases[(b_reg, s_reg, stack)].items()}

    def peak(self, layers: int, B: int, S: int) -> int:
        """Peak allocated bytes at ``layers`` blocks (the model's own layer types when it has them), micro-batch
        ``B``, ``S`` tokens: exact."""
        b_reg = "B=1" if B == 1 else "B>1"
        s_reg = next((k for k, (start, _, has) in self.s_regimes.items() if has(S)), None)
        if s_reg is None:
            raise ValueError(f"seq_len={S} is below every fitted regime")
        if s_reg in self.unfitted:
            raise ValueError(f"seq_len={S}: {self.unfitted[s_reg]}")
        def peaks(stack):
            return self._phase_peaks(b_reg, s_reg, stack, B, S)
        base = peaks("base")
        if self.types is None:
            block = peaks("block")
            best = max(base[ph] + (layers - 2) * (block[ph] - base[ph]) for ph in base)
        else:
            types = list(self.types[:layers])
            a, z = types[0], types[-1]
            counts = {t: types.count(t) - (2 if t == a else 0) for t in dict.fromkeys(types)}
            mids = {t: peaks(f"mid:{t}") for t in counts}
            top = peaks("top") if z != a else None
            best = max(base[ph] + sum(n * (mids[t][ph] - base[ph]) for t, n in counts.items())
                       + (top[ph] - mids[z][ph] if top else 0) for ph in base)
        if best.denominator != 1:
            raise ArithmeticError(f"the fitted peak is not a whole number of bytes ({best}): refit")
        return int(best)

    def size(self) -> int:
        return sum(len(ops) for phases in self.phases.values() for ops in phases.values())


def fit(cfg, step) -> Fit:
    """Fit ``simulate`` for the architecture ``cfg`` (a ``PretrainedConfig``) and ``step`` (a ``Step``; its
    ``batch_size`` and ``seq_len`` are the fit's variables). Raises ValueError naming what cannot be aligned."""
    from lora_kit.memory.simulate import simulate
    if step.sharding not in ("none", "ddp") or step.loop == "sft":
        raise ValueError("calibrate fits one GPU's step with loop 'kit' or 'trainer' (sft's tiles follow the tokens).")
    s_regimes, stacks, phases, unfitted = _s_regimes(cfg), _stacks(cfg), {}, {}
    for s_reg, (start, span, _) in s_regimes.items():
        try:
            for b_reg, (basis, design, held) in B_REGIMES.items():
                shapes = [(B, start + k * span) for B, k in design + (held,)]
                for stack, layers in stacks.items():
                    phases[(b_reg, s_reg, stack)] = _fit_stack(simulate, _shallow(cfg, stack, layers), step, basis,
                                                               shapes, f"stack {stack!r}, {b_reg}, {s_reg}")
        except ValueError as e:
            if s_reg != "S<w":  # below a short window, storages under 512 bytes may not grow linearly
                raise
            unfitted[s_reg] = f"below the sliding window the step was not fitted ({e})"
    types = getattr(cfg, "layer_types", None)
    return Fit(phases, s_regimes, tuple(types) if isinstance(types, list) and types else None, unfitted)


def _fit_stack(simulate, cfg, step, basis, shapes, where: str) -> dict:
    """One stack in one regime: its traces at the design shapes, each operator fitted and checked."""
    rows = [_row(basis, B, S) for B, S in shapes[:-1]]
    traces = [simulate(cfg, step, batch_size=B, seq_len=S, trace=True).trace for B, S in shapes]
    if len({tuple(op[:2] for op in t) for t in traces}) != 1:
        raise ValueError(f"the operator sequence of {where} changes with the shape "
                         f"({sorted(len(t) for t in traces)} operators): not fitted")
    by_phase: dict = {}
    for j, (ph, name, _) in enumerate(traces[0]):
        ys = [t[j][2] for t in traces[:-1]]
        coef = _solve(rows, ys)
        if any(_value(basis, coef, B, S) != y for (B, S), y in zip(shapes, ys)) or \
                _value(basis, coef, *shapes[-1]) != traces[-1][j][2]:
            raise ValueError(f"operator {j} ({name}, {ph}) of {where} is not polynomial in {basis}: not fitted")
        by_phase.setdefault(ph, []).append(coef)
    return {ph: _envelope(ops) for ph, ops in by_phase.items()}
