"""The closed form of ``simulate``, fitted: each operator's live bytes as exact polynomials in the step's shape.

For one architecture (a config) and one step with its categorical fields fixed, ``simulate`` runs with
``trace=True`` at a few shallow depths and short shapes; each run gives, per operator of the step in order, the
live bytes once its outputs exist and which part of them are weights, quantisation constants, adapters, gradients
and optimizer states (``SimResult.trace``): the only moments a peak can happen at. For one stack of blocks the
operator sequence depends on the shape only through regimes, each fitted on its own: ``B == 1`` versus ``B > 1``
(a few operators differ), and, for a model with a sliding window ``w``, ``S < w`` versus ``S >= w`` (from there on
transformers builds an explicit mask and attention takes another kernel). Operator ``j``'s live bytes are fitted
exactly (rational least squares, then checked to reproduce every design shape to the byte and a held-out shape) in
a basis of the shape: ``1, S, S²`` at ``B == 1``; ``1, S, S², B·S, B·S²`` above (weights and states, position
tables, masks, activations, attention scores); with LoRA also ``R, R·S`` (and ``R·B·S`` above ``B == 1``) for the
rank ``R`` (adapters, their states and gradients, the LoRA A outputs). Per phase (forward / backward / optimizer)
the peak at a shape is the largest operator's value; across depths it grows linearly, each block adding what its
type keeps, so the phase peak of the whole model is the two-block stack's plus the count of blocks times what one
more block adds (measured on a three-block stack). A model whose layer types repeat with a period ``p >= 2``
(Gemma-2/3, GPT-OSS) is fitted on whole periods instead (its first ``p + L mod p`` blocks, and one period more):
with gradient checkpointing the peak sits in one block's recomputation, and in a two- or three-block stack of mixed
types which block holds it changes as blocks are added, so extrapolating per type counted that change once per
block (GPT-OSS: +6.8 % at 4 blocks); a whole period adds the same bytes wherever the peak is. The figure is the largest
phase's; its parts are the parts of the operator holding it. Operators that can never be a phase's maximum are
pruned.

Evaluation is exact integer arithmetic: the coefficients share one denominator, so a figure is an integer dot
product divided once (Python ints for one figure; int64 arrays for a sweep when the largest term leaves room,
object arrays of Python ints otherwise). Storages are rounded to 512 bytes, so at a length that is not a multiple
of the design's step a few small storages differ from the polynomial by under 512 bytes each.

Not fitted here: sharding (one GPU; the caller composes), loops whose operator sequence follows the tokens
(``loop="sft"`` tiles them), Liger's fused cross-entropy (``liger_kernel``: chunks of a power-of-two size):
:func:`fit` refuses what it cannot align, naming the reason.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from fractions import Fraction
from math import lcm

import numpy as np

from lora_kit.memory.loops import SFT_TOKEN_TILE

RANKS = (8, 16)  # the LoRA ranks of the design
# optimizers whose state is polynomial in the rank; the 8-bit and paged ones switch a tensor's state kind at a size
# (bitsandbytes: 32-bit states under 4,096 elements; paged buffers from 100,000), so with them the rank is fixed
RANK_FREE = ("adamw", "sgd", "adafactor")
# the B regimes: basis without / with the rank, design (B, k, rank index), held-out shape; S = start + k * span
B_REGIMES = {
    "B=1": (("1", "S", "S2"), ("R", "RS"), ((1, 0, 0), (1, 2, 0), (1, 4, 0)), ((1, 0, 1), (1, 4, 1)), (1, 3, 1)),
    "B>1": (("1", "S", "S2", "BS", "BS2"), ("R", "RS", "RBS"),
            ((2, 0, 0), (2, 2, 0), (2, 4, 0), (4, 0, 0), (4, 2, 0)), ((2, 0, 1), (2, 4, 1), (4, 2, 1)),
            (3, 3, 1)),
}
SPAN = 512  # tokens between design shapes without a window
# the shortest design length below a window: shorter, a block's small storages (a few hundred bytes: norms' and
# position tables' rows) round up to 512 bytes and stop growing linearly (Gemma-3 at 64 tokens: not fitted)
SHORTEST = 192
TILED_SLACK = 64 * 1024  # bytes a tiled fit's held-out shape may differ by (the rounding of a few storages)
PARTS = 5  # weights, quant_constants, adapters, gradients, optimizer_states (the rest is activations)
ALIGNED = "aligned:"  # a stack's operators matched one by one with the other stacks' (:func:`_aligned`)


def _window(cfg) -> int | None:
    """The sliding window that switches attention's kernel at ``S >= window`` (transformers builds an explicit
    mask from there on), when the config uses one."""
    w = getattr(cfg, "sliding_window", None)
    if not isinstance(w, int) or w <= 0 or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return w


def _s_regimes(cfg) -> dict:
    """S regimes: name -> (start, span, lowest S, first S above). Without a window, one regime designed from 512
    tokens on. With a window ``w``: ``S < w`` (designed from ``SHORTEST`` tokens up to ``w`` in steps of a multiple of
    64; none when ``w`` is under ``SHORTEST + 320`` tokens) and ``S >= w`` (designed from ``max(w, 512)``: storages of fewer bytes than the allocator's
    512-byte rounding do not grow linearly)."""
    w = _window(cfg)
    if w is None:
        return {"S": (SPAN, SPAN, 0, None)}
    out = {}
    span = min(SPAN, (w - SHORTEST) // 5 // 64 * 64)
    if span >= 64:
        out["S<w"] = (w - 5 * span, span, 0, w)
    out["S>=w"] = (-(-max(w, SPAN) // 64) * 64, SPAN, w, None)
    return out


def periodic(types) -> tuple[int, int] | None:
    """``(p, d0)`` when the layer pattern repeats with a period ``p >= 2`` at least twice (Gemma's 5 sliding + 1
    global, GPT-OSS's alternation): the model is ``d0 = p + L % p`` blocks plus whole periods. None otherwise."""
    if not types:
        return None
    L = len(types)
    p = next(q for q in range(1, L + 1) if all(t == types[i % q] for i, t in enumerate(types)))
    return (p, p + L % p) if 2 <= p and 2 * p <= L else None


def _start(per: tuple, depth0: int) -> int:
    """The first periodic stack's depth: ``d0`` blocks, plus a period when that is under ``depth0``."""
    p, d0 = per
    return d0 + p if d0 < depth0 else d0


def _stacks(cfg, depth0: int = 2) -> dict:
    """The shallow stacks fitted. Without layer types: ``depth0`` (two; three for FSDP2, whose two-block step keeps
    its embedding's and top block's gathered groups at once) and one more block. With a periodic pattern (period
    ``p``, :func:`periodic`): its first ``d0`` blocks and ``d0 + p`` (one more period: whatever moment of a step
    holds the peak, each whole period adds the same bytes to it, as one block does in a uniform stack). Otherwise
    (first type ``a``, last ``z``): ``[a, a]``; per type ``t``, ``[a, t, a]`` (what one more block of ``t`` keeps,
    the top unchanged); and, when ``z`` differs from ``a``, ``[a, a, z]`` (what a top block of type ``z`` changes)."""
    types = getattr(cfg, "layer_types", None)
    if not isinstance(types, list) or not types:
        return {"base": None, "block": None}
    per = periodic(types)
    if per:
        d0 = _start(per, depth0)
        return {"base": list(types[:d0]), "block": list(types[:d0 + per[0]])}
    a, z = types[0], types[-1]
    if len(set(types)) == 1:
        return {"base": [a] * depth0, f"mid:{a}": [a] * (depth0 + 1)}
    if depth0 != 2:
        raise ValueError("a mix of layer types is fitted from two-block stacks only (FSDP2 needs three): not fitted")
    out = {"base": [a, a], **{f"mid:{t}": [a, t, a] for t in dict.fromkeys(types)}}
    if z != a:
        out["top"] = [a, a, z]
    return out


def _uniform_more(stacks: dict) -> str | None:
    """The other stack when there are two (one layer type, or a repeating pattern): its operators are matched with
    ``base``'s (:func:`_aligned`); None for a mix of layer types fitted per type."""
    more = [k for k in stacks if k != "base"]
    return more[0] if len(more) == 1 else None


def stack_weights(types, layers: int, depth0: int = 2) -> dict:
    """The full depth as a combination of the shallow stacks (:func:`_stacks`): stack -> weight (the phase peak at
    ``layers`` blocks is the weighted sum of the stacks' phase peaks)."""
    if types is None:
        return {"base": depth0 + 1 - layers, "block": layers - depth0}
    per = periodic(list(types))
    if per:
        p, d0 = per[0], _start(per, depth0)
        k, rest = divmod(layers - d0, p)
        if rest or k < 0:
            raise ValueError(f"{layers} blocks is not {d0} plus whole periods of {p} of the fitted layer pattern")
        return {"base": 1 - k, "block": k}
    types = list(types[:layers])
    a, z = types[0], types[-1]
    counts = {t: types.count(t) - (depth0 if t == a else 0) for t in dict.fromkeys(types)}
    w = {"base": 1 - sum(counts.values())}
    for t, n in counts.items():
        w[f"mid:{t}"] = w.get(f"mid:{t}", 0) + n
    if z != a:
        w[f"mid:{z}"] -= 1
        w["top"] = 1
    return w


def basis(b_reg: str, lora: bool, tiled: bool = False) -> tuple:
    """The basis terms of a B regime; ``tiled`` (a loop scoring ``B * (S - 1)`` positions in token tiles, or packed
    rows, whose FlashAttention-2 varlen buffers add 128 rows per example) adds ``B`` and ``R·B`` above ``B == 1`` (a
    per-position storage of ``B * (S - 1) * width`` bytes, a per-example one of ``B * 128 * width``)."""
    plain, rank = B_REGIMES[b_reg][:2]
    more = tiled and b_reg != "B=1"
    return plain + (("B",) if more else ()) + ((rank + (("RB",) if more else ())) if lora else ())


def _row(terms, B: int, S: int, R: int) -> list[int]:
    x = {"1": S ** 0, "S": S, "S2": S * S, "B": B, "BS": B * S, "BS2": B * S * S, "R": R, "RS": R * S,
         "RB": R * B, "RBS": R * B * S}
    return [x[k] for k in terms]


def _solver(rows: list[list[int]]) -> list[list[Fraction]]:
    """The exact least-squares solver of a design: M with coefficients = M @ ys ((XᵀX)⁻¹Xᵀ over the rationals)."""
    n, m = len(rows[0]), len(rows)
    a = [[Fraction(sum(r[i] * r[j] for r in rows)) for j in range(n)] for i in range(n)]
    inv = [[Fraction(int(i == j)) for j in range(n)] for i in range(n)]
    for c in range(n):
        p = next(k for k in range(c, n) if a[k][c] != 0)
        a[c], a[p], inv[c], inv[p] = a[p], a[c], inv[p], inv[c]
        f = a[c][c]
        a[c], inv[c] = [x / f for x in a[c]], [x / f for x in inv[c]]
        for k in range(n):
            if k != c and a[k][c] != 0:
                g = a[k][c]
                a[k] = [x - g * y for x, y in zip(a[k], a[c])]
                inv[k] = [x - g * y for x, y in zip(inv[k], inv[c])]
    return [[sum(inv[i][k] * rows[j][k] for k in range(n)) for j in range(m)] for i in range(n)]


def _shallow(cfg, stack: str, layers, depth0: int = 2):
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = len(layers) if layers is not None else depth0 + (stack != "base")
    if layers is not None:
        c.layer_types = list(layers)
    v = getattr(c, "mlp_only_layers", None)
    if isinstance(v, list):
        c.mlp_only_layers = [i for i in v if i < c.num_hidden_layers]
    return c


def _envelope(ops: list) -> list[int]:
    """Indices of the operators that can be a phase's maximum: duplicates dropped, and every operator whose
    coefficients are all at most another's (the basis terms are positive, so it never exceeds that one)."""
    first = {}
    for i, c in enumerate(ops):
        first.setdefault(c, i)
    uniq = list(first)
    d = lcm(*(x.denominator for c in uniq for x in c))
    a = np.asarray([[int(x * d) for x in c] for c in uniq], dtype=object)
    if all(abs(int(v)) < 1 << 62 for v in a.ravel()):
        a = a.astype(np.int64)
    keep = [c for i, c in enumerate(uniq) if not np.any(np.all(a >= a[i], axis=1) & np.any(a != a[i], axis=1))]
    return [first[c] for c in keep]


def largest_phase(phases: dict) -> tuple:
    """Per row, the largest of ``phases`` (phase -> (peaks, parts (rows x 5)), in step order): (peaks, parts,
    phase names); on a tie the first phase, as ``simulate`` names it."""
    names = list(phases)
    peaks = np.stack([phases[ph][0] for ph in names])
    idx = np.argmax(peaks, axis=0)
    rows = np.arange(len(idx))
    parts = np.stack([phases[ph][1] for ph in names])[idx, rows]
    return peaks[idx, rows], parts, np.asarray(names, dtype=object)[idx]


@dataclass(frozen=True)
class Fit:
    """A fitted step. ``tables[(b_reg, s_reg, stack)][phase]``: an int array (operators x (1 + 5 parts) x basis
    terms) of numerators over ``denominator``; ``s_regimes``: name -> (lowest S, first S above or None);
    ``types``: the model's layer types in order (None: one type); ``unfitted``: S regime -> why its lengths are
    refused; ``lora``: whether the rank is a variable."""
    tables: dict
    denominator: int
    s_regimes: dict
    types: tuple | None
    lora: bool
    unfitted: dict
    tile: int | None = None  # a tiled loop's positions per tile: regimes are then on B * (S - 1), not S
    depth0: int = 2  # the shallowest stack's blocks (:func:`_stacks`)
    per_row: bool = False  # storages with a term per row (varlen buffers: packed, FA2 padded): basis has B, R·B

    @property
    def aligned(self) -> bool:
        """Whether its operators are also extrapolated one by one in depth (:func:`_aligned`): then a phase's peak at
        full depth is exact whichever operator holds it, and another optimizer or sharding composes from it."""
        return any(k[2].startswith(ALIGNED) for k in self.tables)

    def size(self) -> int:
        return sum(len(t) for phases in self.tables.values() for t in phases.values())

    def covers(self, seq_lens) -> bool:
        """Whether every length of ``seq_lens`` lies in a fitted regime."""
        if self.tile:
            return True
        try:
            for S in np.unique(seq_lens):
                self._regime(int(S))
        except ValueError:
            return False
        return True

    def _regimes(self, B, S) -> np.ndarray:
        """Each row's regime: by the positions ``B * (S - 1)`` a tiled loop scores, else by ``S``."""
        if self.tile:
            return np.where(B * (S - 1) < self.tile, "N<tile", "N>=tile").astype(object)
        uniq = np.unique(S)
        return np.asarray([self._regime(int(v)) for v in uniq], dtype=object)[np.searchsorted(uniq, S)]

    def _basis(self, b_reg: str) -> tuple:
        return basis(b_reg, self.lora, bool(self.tile) or self.per_row)

    def _regime(self, S: int) -> str:
        for name, (lo, hi) in self.s_regimes.items():
            if S >= lo and (hi is None or S < hi):
                if name in self.unfitted:
                    raise ValueError(f"seq_len={S}: {self.unfitted[name]}")
                return name
        raise ValueError(f"seq_len={S} is below every fitted regime")

    def peak(self, layers: int, B: int, S: int, R: int = RANKS[0]) -> tuple[int, tuple, str]:
        """(peak allocated bytes, its five parts, its phase) at ``layers`` blocks (the model's own layer types),
        micro-batch ``B``, ``S`` tokens, LoRA rank ``R``: exact integers."""
        out = self.peak_arrays(layers, np.asarray([B], dtype=object), np.asarray([S], dtype=object),
                               np.asarray([R], dtype=object))
        return int(out[0][0]), tuple(int(p) for p in out[1][0]), str(out[2][0])

    def weights(self, layers: int, types=None) -> dict | None:
        """The stacks' weights for a model of ``layers`` blocks with layer types ``types`` (default: the fitted
        model's), or None when the fit does not describe that depth and pattern (then it must not be used)."""
        types = self.types if types is None else tuple(types)
        memo = self.__dict__.setdefault("_weights_memo", {})
        if (layers, types) not in memo:
            memo[(layers, types)] = self._weights(layers, types)
        return memo[(layers, types)]

    def _weights(self, layers: int, types) -> dict | None:
        if layers < self.depth0 or (types is None) != (self.types is None) or \
                (types and periodic(list(types)) != periodic(list(self.types))):
            return None
        try:
            w = stack_weights(types, layers, self.depth0)
        except ValueError:
            return None
        some = next(iter(self.tables))
        return w if all((some[0], some[1], st) in self.tables for st in w) else None

    def peak_arrays(self, layers: int, B, S, R, types=None) -> tuple:
        """:meth:`peak` over 1-D arrays of one integer kind (int64, or object: Python ints): (peaks, parts
        (rows x 5), phases); ``types``: the model's layer types when they are not the fitted model's."""
        return largest_phase(self.phase_arrays(layers, B, S, R, types))

    def phase_arrays(self, layers: int, B, S, R, types=None, grad_share=None) -> dict:
        """Each phase's peak over 1-D arrays ``B, S, R`` (as :meth:`peak_arrays`): phase -> (peaks, parts (rows x
        5)), exact integers; what a caller composes other settings from (sharding, another optimizer).
        ``grad_share``: per row, ``N`` when only ``1/N`` of the gradients will stay (sharded over ``N`` GPUs): each
        phase's operator is then the one largest once its gradients are divided by ``N`` (its parts undivided)."""
        n = len(B)
        if B.dtype != object and int(S.max()) ** 2 * int(B.max()) * max(int(R.max()), 1) >= 1 << 62:
            B, S, R = (a.astype(object) for a in (B, S, R))  # S²·B would wrap in int64: Python ints
        s_reg = self._regimes(B, S)
        weights = self.weights(layers, types)
        if weights is None:
            raise ValueError(f"this fit does not describe {layers} blocks of layer types {types}: refit")
        groups = []
        for b_reg in ("B=1", "B>1"):
            for reg in dict.fromkeys(s_reg.tolist()):
                rows = np.flatnonzero(((B == 1) if b_reg == "B=1" else (B > 1)) & (s_reg == reg))
                if rows.size:
                    x = np.stack(_row(self._basis(b_reg), B[rows], S[rows], R[rows]), axis=1)
                    if x.dtype != object and self._bound(b_reg, reg, weights, x) >= 1 << 62:
                        x = x.astype(object)  # past int64's room: Python ints
                    share = None if grad_share is None else np.asarray(grad_share)[rows].astype(x.dtype)
                    groups.append((rows, self._combine(b_reg, reg, weights, x, share)))
        kind = object if any(v[0].dtype == object for g in groups for v in g[1].values()) else B.dtype
        out = {}
        for rows, per_phase in groups:
            for ph, (p, q) in per_phase.items():
                peak, parts = out.setdefault(ph, (np.zeros(n, dtype=kind), np.zeros((n, PARTS), dtype=kind)))
                peak[rows], parts[rows] = p, q
        return out

    def _bound(self, b_reg: str, s_reg: str, weights: dict, x) -> int:
        """An upper bound of every magnitude the int64 evaluation of ``x``'s rows forms."""
        xmax = [int(v) for v in np.abs(x).max(axis=0)]
        return sum(abs(w) * sum(m * v for m, v in zip(self._term_max(b_reg, s_reg, st), xmax))
                   for st, w in weights.items())

    def _term_max(self, b_reg: str, s_reg: str, stack: str) -> list:
        memo = self.__dict__.setdefault("_memo", {})
        k = (b_reg, s_reg, stack)
        if k not in memo:
            tables = [*self.tables[k].values(), *self.tables.get((b_reg, s_reg, ALIGNED + stack), {}).values()]
            memo[k] = [max(int(np.abs(t[..., j]).max()) for t in tables) for j in range(len(self._basis(b_reg)))]
        return memo[k]

    def _combine(self, b_reg: str, s_reg: str, weights: dict, x, share=None) -> dict:
        """phase -> (peaks, parts) of the rows ``x`` (basis values): per stack the largest operator's value and
        parts, summed with the stacks' weights, divided once (rounded up). ``share``: per row, rank the operators by
        ``share * total - (share - 1) * gradients`` (their value with ``1/share`` of the gradients)."""
        out = {}
        d = self.denominator

        def ranked(total, grads):  # what an operator is ranked by (rows first): its value with 1/share of its
            # gradients when sharded; ``grads`` is called only then
            if share is None:
                return total
            n = share.reshape(-1, *([1] * (total.ndim - 1)))
            return n * total - (n - 1) * grads()

        def largest(t):  # rows x (1 + parts): per row, the operator of t (ops x (1 + parts) x terms) ranked largest
            vals = ranked(x @ t[:, 0, :].T, lambda: x @ t[:, 4, :].T)  # rows x ops
            return (t[np.argmax(vals, axis=1)] * x[:, None, :]).sum(axis=2)

        def cast(t):
            return t if t.dtype == x.dtype else t.astype(x.dtype)
        for ph in self.tables[(b_reg, s_reg, "base")]:
            # per stack its largest operator, extrapolated in depth with the stacks' weights
            tot = sum(w * largest(cast(self.tables[(b_reg, s_reg, st)][ph])) for st, w in weights.items())
            if all(ph in self.tables.get((b_reg, s_reg, ALIGNED + st), {}) for st in weights):
                # and each matched operator extrapolated on its own: the larger
                one = largest(sum(w * cast(self.tables[(b_reg, s_reg, ALIGNED + st)][ph]) for st, w in weights.items()))
                pick = ranked(one[:, 0], lambda: one[:, 4]) > ranked(tot[:, 0], lambda: tot[:, 4])
                tot = np.where(pick[:, None], one, tot)
            out[ph] = (-(-tot[:, 0] // d), -(-tot[:, 1:] // d))
        return out

    def to_json(self) -> dict:
        tile = {"tile": self.tile} if self.tile else {}
        depth0 = {"depth0": self.depth0} if self.depth0 != 2 else {}
        per_row = {"per_row": True} if self.per_row else {}
        return {"denominator": self.denominator, "s_regimes": self.s_regimes, **tile, **depth0, **per_row,
                "types": list(self.types) if self.types else None, "lora": self.lora, "unfitted": self.unfitted,
                "tables": {"|".join(k): {ph: t.tolist() for ph, t in v.items()} for k, v in self.tables.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Fit":
        tables = {tuple(k.split("|")): {ph: _table(t) for ph, t in v.items()} for k, v in d["tables"].items()}
        return cls(tables, int(d["denominator"]), {k: tuple(v) for k, v in d["s_regimes"].items()},
                   tuple(d["types"]) if d["types"] else None, bool(d["lora"]), dict(d["unfitted"]), d.get("tile"),
                   int(d.get("depth0", 2)), bool(d.get("per_row", False)))


def _table(rows) -> np.ndarray:
    """Numerators as int64 when they fit (always in practice), else Python ints."""
    flat = [abs(int(v)) for op in rows for part in op for v in part]
    return np.asarray(rows, dtype=np.int64 if max(flat, default=0) < 1 << 62 else object)


def fit(cfg, step, progress=None) -> Fit:
    """Fit ``simulate`` for the architecture ``cfg`` (a ``PretrainedConfig``) and ``step`` (a ``Step``; its
    ``batch_size``, ``seq_len`` and, with LoRA and an optimizer of :data:`RANK_FREE`, ``lora_rank`` are the fit's
    variables). ``progress(done, total)`` is
    called after each simulated step. Raises ValueError naming what cannot be aligned."""
    from lora_kit.memory.simulate import simulate
    if step.sharding not in ("none", "ddp") and not fsdp_step(step):
        raise ValueError(f"calibrate fits one GPU's step or FSDP2's (fsdp / zero3: LoRA or full, AdamW or SGD, no "
                         f"offload); sharding={step.sharding!r} here is composed (lora_kit.memory.compose).")
    if step.liger_kernel and step.loop != "sft":  # lora_kit.memory.liger.chunk_tokens (TRL's loop keeps its head)
        raise ValueError("liger_kernel: the fused cross-entropy holds next_power_of_2(cdiv(tokens, cdiv(vocab, hidden))) "
                         "rows of logits at a time and loops over the chunks, so its bytes and operators are not "
                         "polynomial in the shape: not fitted (estimate simulates each row).")
    tile = SFT_TOKEN_TILE if step.loop == "sft" else None
    if tile and _window(cfg) is not None:
        raise ValueError("loop 'sft' is not fitted for a model with a sliding window (two kinds of regime).")
    step = step.replace(sharding="fsdp") if fsdp_step(step) else step.one_gpu()
    lora = rank_is_variable(step)
    # varlen buffers, (T + 128 * B) rows: packed rows, and padded ones under FlashAttention-2 (its unpad path)
    per_row = step.padding == "packed" or (step.attn_implementation == "flash_attention_2" and step.padding != "none")
    depth0 = 3 if step.sharding == "fsdp" else 2
    s_regimes, stacks, raw, unfitted = _t_regimes(tile) if tile else _s_regimes(cfg), _stacks(cfg, depth0), {}, {}
    plan = [(s, b, st) for s in s_regimes for b in B_REGIMES for st in stacks]
    total = sum(len(_design(b, lora, bool(tile) or per_row)) + 1 for _, b, _ in plan)
    done = [0]

    def run(c, B, S, R):
        r = simulate(c, step, batch_size=B, seq_len=S, trace=True, **({"lora_rank": R} if lora else {})).trace
        done[0] += 1
        if progress:
            progress(done[0], total)
        return r
    for s_reg, (start, span, _, _) in s_regimes.items():
        try:
            for b_reg in B_REGIMES:
                detail = {}
                for stack, layers in stacks.items():
                    first, step_ = (v[b_reg] if isinstance(v, dict) else v for v in (start, span))
                    raw[(b_reg, s_reg, stack)], detail[stack] = _fit_stack(
                        run, _shallow(cfg, stack, layers, depth0), b_reg, lora, first, step_,
                        f"stack {stack!r}, {b_reg}, {s_reg}", tile, per_row)
                # FSDP2: next to the ends an operator's bytes are not affine in depth (which groups are gathered
                # changes), so its operators are not matched; each stack's largest are
                more = None if step.sharding == "fsdp" else _uniform_more(stacks)
                if more:
                    for ph, (xs, ys) in _aligned(detail["base"], detail[more]).items():
                        raw.setdefault((b_reg, s_reg, ALIGNED + "base"), {})[ph] = xs
                        raw.setdefault((b_reg, s_reg, ALIGNED + more), {})[ph] = ys
        except ValueError as e:
            if s_reg != "S<w":  # below a short window, storages under 512 bytes may not grow linearly
                raise
            unfitted[s_reg] = f"below the sliding window the step was not fitted ({e})"
            raw = {k: v for k, v in raw.items() if k[1] != s_reg}
    d = lcm(*(c.denominator for phases in raw.values() for ops in phases.values() for op in ops for part in op
              for c in part))
    tables = {k: {ph: _table([[[int(c * d) for c in part] for part in op] for op in ops]) for ph, ops in v.items()}
              for k, v in raw.items()}
    types = getattr(cfg, "layer_types", None)
    return Fit(tables, d, {k: v[2:] for k, v in s_regimes.items()}, tuple(types) if isinstance(types, list) and types
               else None, lora, unfitted, tile, depth0, per_row)


def fsdp_step(step) -> bool:
    """Whether the step is fitted as FSDP2 runs it, at its GPU count (``fsdp``; ``zero3`` is the same FSDP2 step):
    what ``simulate`` can shard (LoRA or full fine-tuning, AdamW or SGD, no CPU offload)."""
    return step.sharding in ("fsdp", "zero3") and step.method != "qlora" and not step.cpu_offload and \
        step.optimizer in ("adamw", "sgd")


def rank_is_variable(step) -> bool:
    """Whether a fit of ``step`` holds every LoRA rank (else it holds ``step.lora_rank`` only)."""
    return step.method != "full" and step.optimizer in RANK_FREE


def _design(b_reg: str, lora: bool, tiled: bool = False) -> tuple:
    """The design shapes (B, k, rank index): S = start + k * span. A tiled loop adds, above ``B == 1``, a shape for
    its ``B`` term and one for ``R·B``."""
    _, _, plain, rank, _ = B_REGIMES[b_reg]
    more = tiled and b_reg != "B=1"
    return plain + (((6, 1, 0),) if more else ()) + ((rank + (((6, 1, 1),) if more else ())) if lora else ())


def _held(b_reg: str, tiled: bool = False) -> tuple:
    """The held-out shape (B, k, rank index); a tiled loop's keeps its positions ``B * (S - 1)`` under the tile in
    the one-tile regime."""
    return (4, 1, 1) if tiled and b_reg != "B=1" else B_REGIMES[b_reg][4]


def _t_regimes(tile: int) -> dict:
    """A tiled loop's regimes, on the positions it scores ``N = B * (S - 1)``: one tile holding all of them (``N <
    tile``: the tile's temporaries grow with N; every design shape's N under the tile), and whole tiles (``N >=
    tile``: ``S - 1`` a multiple of the tile, every design shape whole tiles; a trace's extra tiles are folded onto
    one, :func:`_fold_tiles`). Per-token storages (``B * S``) and per-position ones (``B * (S - 1)``) cannot both be
    multiples of the allocator's 512 bytes at every design shape, so a tiled fit interpolates its design shapes and
    accepts the held-out shape within :data:`TILED_SLACK` (a few storages' rounding). Same form as
    :func:`_s_regimes` (name -> (start, span, lowest N, first N above)), start and span per B regime."""
    return {"N<tile": ({"B=1": 512, "B>1": 256}, {"B=1": 512, "B>1": 256}, 0, tile),
            "N>=tile": (tile + 1, tile, tile, None)}


def _fold_tiles(traces: list, tiles: list, where: str) -> list:
    """Traces of a loop that runs the same operators once per token tile, folded onto the trace with the fewest
    tiles: per phase, the operators of the extra tiles (inserted after the reference's, repeating the tile before
    them) are mapped onto that tile's, and each operator keeps its largest live bytes. Whole tiles hold the same
    bytes whichever they are, so the folded trace is the step's at any number of tiles; a partial last tile holds
    fewer."""
    ref = min(range(len(traces)), key=lambda i: tiles[i])
    out = []
    for t, k in zip(traces, tiles):
        folded = []
        for ph in dict.fromkeys(op[0] for op in traces[ref]):
            x, y = [op for op in traces[ref] if op[0] == ph], [op for op in t if op[0] == ph]
            folded += _fold_phase(x, y, k - tiles[ref], where)
        out.append(folded)
    return out


def _fold_phase(x: list, y: list, extra: int, where: str) -> list:
    """``y``'s operators aligned onto ``x``'s, ``y`` having ``extra`` more tiles (see :func:`_fold_tiles`)."""
    m = len(y) - len(x)
    if m == 0 or extra == 0:
        return y
    xn, yn = [op[1] for op in x], [op[1] for op in y]
    L = m // extra
    p = next((i for i, (a, b) in enumerate(zip(xn, yn)) if a != b), len(xn))
    q = next((q for q in range(p, L - 1, -1) if xn[q:] == yn[q + m:]), None)
    if m % extra or q is None or any(yn[q + i] != yn[q - L + i % L] for i in range(m)):
        raise ValueError(f"the token tiles of {where} do not repeat one operator sequence: not fitted")
    q = _tile_split(x, y, q, m, L)
    out = y[:q] + y[q + m:]
    for i in range(m):
        j = q - L + i % L
        if y[q + i][2] > out[j][2]:
            out[j] = y[q + i]
    return out


def _tile_split(x: list, y: list, q: int, m: int, L: int) -> int:
    """Where ``y``'s ``m`` extra operators (tiles of ``L``) are inserted: of the splits at and below ``q`` (the highest
    one the names allow) that the names also allow, the highest one at which the extra operators repeat the
    tile's changes in live bytes too, else ``q``. Names alone can take an operator next to the tiles for a tile's
    own: QLoRA with TRL's head (backward, tiny model): the operator after the last tile, a ``device`` query like a
    tile's first, frees the tiles' 512 MiB buffer, which the next tile's first still holds."""
    xn, yn = [op[1] for op in x], [op[1] for op in y]
    dy = [b[2] - a[2] for a, b in zip([y[0]] + y, y)]
    for s in range(q, L - 1, -1):
        if xn[s:] != yn[s + m:] or any(yn[s + i] != yn[s - L + i % L] for i in range(m)):
            break
        if all(dy[s + i] == dy[s - L + i % L] for i in range(m)):
            return s
    return q


def _fit_stack(run, cfg, b_reg: str, lora: bool, start: int, span: int, where: str, tile: int | None = None,
               per_row: bool = False) -> dict:
    """One stack in one regime: its traces at the design shapes, each operator fitted and checked; per phase the
    envelope's operators as [total, *parts] coefficient lists."""
    shapes = [(B, start + k * span, RANKS[i] if lora else RANKS[0])
              for B, k, i in _design(b_reg, lora, bool(tile) or per_row) + (_held(b_reg, bool(tile)),)]
    terms = basis(b_reg, lora, bool(tile) or per_row)
    rows = [_row(terms, *sh) for sh in shapes[:-1]]
    held_row = _row(terms, *shapes[-1])
    solve = _solver(rows)
    den = lcm(*(m.denominator for mrow in solve for m in mrow))
    solve = [[int(m * den) for m in mrow] for mrow in solve]  # integers over one denominator: fast and exact
    traces = [run(cfg, *sh) for sh in shapes]
    if tile and start > tile:  # whole tiles: fold the extra ones
        traces = _fold_tiles(traces, [B * (S - 1) // tile for B, S, _ in shapes], where)
    if len({tuple(op[:2] for op in t) for t in traces}) != 1:
        raise ValueError(f"the operator sequence of {where} changes with the shape "
                         f"({sorted(len(t) for t in traces)} operators): not fitted")
    memo: dict = {}

    def coef(ys, name, ph):
        ys = tuple(ys)
        if ys not in memo:
            c = [sum(m * y for m, y in zip(mrow, ys)) for mrow in solve]  # den x the coefficients
            if any(sum(a * x for a, x in zip(c, r)) != y * den for r, y in zip(rows, ys)) or \
                    abs(sum(a * x for a, x in zip(c, held_row)) - ys[-1] * den) > (TILED_SLACK * den if tile else 0):
                raise ValueError(f"operator {name} ({ph}) of {where} is not polynomial in {terms}: not fitted")
            memo[ys] = tuple(Fraction(v, den) for v in c)
        return memo[ys]
    by_phase: dict = {}
    for j, (ph, name, _, _) in enumerate(traces[0]):
        by_phase.setdefault(ph, []).append((j, name, coef([t[j][2] for t in traces], name, ph)))

    def full(ph: str, i: int) -> list:  # operator i of phase ph: [total, *parts] coefficients
        j, _, c = by_phase[ph][i]
        return [c] + [coef([t[j][3][p] for t in traces], "parts", ph) for p in range(PARTS)]
    out = {ph: [full(ph, i) for i in _envelope([c for _, _, c in ops])] for ph, ops in by_phase.items()}
    return out, {ph: ([n for _, n, _ in ops], [c for _, _, c in ops], full) for ph, ops in by_phase.items()}


def _aligned(base: dict, more: dict) -> dict:
    """Per phase, the operators of the shallower stack (``base``) matched with their counterparts in the stack of
    one block (or one period of blocks) more (``more``), both as [total, *parts] coefficient lists. Extrapolated one
    by one in depth (:meth:`Fit._combine`), they give these operators' bytes at full depth, where the largest of a
    shallow stack may no longer be the largest (Phi-4-mini, full fine-tuning with SGD: its large vocabulary's logits
    hold the backward peak of two and three blocks, the bottom block's backward with every gradient made that of 32).

    The extra blocks' operators are found by name: ``more`` is ``base`` with ``m`` operators inserted at a split
    ``q``, and every ``q`` in ``[lo, hi]`` (where the common head and tail of the two sequences overlap) aligns them
    by name. Physically the blocks are inserted between blocks, not next to the operators before or after them (a
    block's first operator still holds what the embedding left, the same-named one a block later does not: Mistral-7B
    QLoRA, +32 % at 32 blocks when matched so), so only the splits at least a block inside the range are used:
    ``lo + m`` and ``hi - m``. Each maps ``base``'s operator ``j`` to ``j`` below it and ``j + m`` above it, the same
    operator of the deeper model, so every operator gets the mappings these splits allow. Where the range holds no
    such split (an optimizer step over parameters, a layer pattern shorter than two periods) nothing is matched.
    """
    out = {}
    for ph, (xn, xc, xf) in base.items():
        yn, yc, yf = more[ph]
        m = len(yn) - len(xn)
        head = next((i for i, (a, b) in enumerate(zip(xn, yn)) if a != b), len(xn))
        tail = next((i for i, (a, b) in enumerate(zip(xn[::-1], yn[::-1])) if a != b), len(xn))
        lo, hi = len(xn) - tail, head
        if m == 0 and xn == yn:
            pairs = [(j, j) for j in range(len(xn))]
        elif m > 0 and hi - lo >= 2 * m:
            pairs = [(j, j) for j in range(hi - m)] + [(j, j + m) for j in range(lo + m, len(xn))]
        else:
            continue
        keep = _envelope([tuple(xc[i]) + tuple(b - a for a, b in zip(xc[i], yc[k])) for i, k in pairs])
        out[ph] = ([xf(ph, pairs[i][0]) for i in keep], [yf(ph, pairs[i][1]) for i in keep])
    return out
