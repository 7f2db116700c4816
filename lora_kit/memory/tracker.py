"""Live-bytes tracking: the peak memory of a step, measured from the tensors themselves.

:class:`LiveBytesTracker` is a ``TorchDispatchMode``: every tensor an operator returns has its
storage counted once (views share a storage), each storage rounded up to 512 bytes as the CUDA
caching allocator rounds its blocks, and a weak-reference callback subtracts it when the storage dies.
It works the same on real CPU tensors and under ``FakeTensorMode`` (where nothing is allocated),
which is what makes ``lora_kit.memory.simulate`` possible without a GPU.

Trade-offs, stated:

- Tensors created *before* the tracker was entered (weights, optimizer state, ...) are invisible to
  the dispatch mode; register them with :meth:`LiveBytesTracker.track` (``label`` does it too) so
  that "counting everything already live" holds.
- Only storages that pass through the dispatcher are seen. Memory a kernel allocates internally
  (cuBLAS workspaces, bitsandbytes' paged buffers) is not -- neither does
  ``torch.cuda.max_memory_allocated`` see paged (managed) memory. Tensors an opaque operator creates and frees
  inside itself are not seen either; where the kit knows them (:data:`KERNEL_TEMPORARIES`: bitsandbytes'
  ``gemm_4bit`` dequantises its weight), ``trace=True`` records their bytes per operator (:attr:`temporaries`),
  apart from the live bytes, so that a caller can place them (``lora_kit.memory.cuda_kernels.kernel_extra``).
- Storages resized in place are followed: FSDP2 frees a gathered parameter with
  ``untyped_storage().resize_(0)`` and re-allocates it with ``resize_(nbytes)``, outside the
  dispatcher; while a tracker is active, ``torch.UntypedStorage.resize_`` reports to it (a storage
  it has not seen yet is counted from its new size on).
- Distributed tensors (``DTensor``: FSDP2's sharded parameters, their gradients and optimizer
  states) are counted by their local shard, the memory this rank holds.
- The breakdown at the peak is kept as a snapshot of live storage ids, taken lazily at the first
  free after a new peak (when the live set is still exactly the peak's), so it costs one dict copy
  per new maximum, not one per operator.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

BLOCK = 512  # bytes: CUDA caching allocator block rounding
OTHER = "other"


def round_bytes(nbytes: int, block: int = BLOCK) -> int:
    """``nbytes`` rounded up to the allocator block (0 stays 0: empty tensors allocate nothing)."""
    return 0 if nbytes <= 0 else -(-nbytes // block) * block


def _gemm_4bit_temporaries(args, kwargs, block: int) -> tuple:
    """``bitsandbytes::gemm_4bit``'s tensors live beside its output, freed before it returns, on the path that
    dequantises (bitsandbytes 0.50: ``backends/default/ops.py: _gemm_4bit_default_impl``, the CPU kernel, and
    ``backends/cuda/ops.py: _dequant_linear_fallback``, which CUDA takes above 1,536 rows on every card and above
    256 to 512 rows for weights of 4 Mi elements or more, by ``_gemm_4bit_use_custom_cuda``), in the order CUDA's
    fallback allocates them: with double quant the fp32 absmax and absmax + offset, one per block of the weight
    (CUDA's fallback keeps both to the end), then the weight dequantised to A's dtype, (N, K). CUDA's fused kernel,
    for fewer rows, allocates none of them."""
    names = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit")
    a = {**dict(zip(names, args)), **(kwargs or {})}
    n, k = a["shapeB"]
    nested = () if a.get("absmax_8bit") is None else (round_bytes(a["absmax_8bit"].numel() * 4, block),) * 2
    return nested + (round_bytes(n * k * a["A"].element_size(), block),)


# operator -> the storages it allocates and frees inside itself, in order, from (args, kwargs, block)
KERNEL_TEMPORARIES = {"bitsandbytes::gemm_4bit": _gemm_4bit_temporaries}


def kernel_temporaries(func, args, kwargs, block: int = BLOCK) -> tuple:
    """The bytes of each storage operator ``func`` holds inside itself beside its outputs (:data:`KERNEL_TEMPORARIES`;
    () for every other operator)."""
    schema = getattr(func, "_schema", None)  # operator overloads have one; higher-order operators do not
    inside = KERNEL_TEMPORARIES.get(schema.name) if schema is not None and func.namespace != "aten" else None
    return () if inside is None else inside(args, kwargs, block)


class LiveBytesTracker(TorchDispatchMode):
    """Count live storage bytes while active; keep the peak and what was live at the peak.

    ``block``: rounding of each storage (512 like the CUDA caching allocator; 1 = exact bytes).
    ``trace``: keep, per operator, the phase, its name and the live bytes once its outputs exist (the moments a peak can
    happen at, in order; ``lora_kit.memory.calibrate`` fits them).
    ``limit_bytes``: raise ``torch.OutOfMemoryError`` when an allocation takes the live bytes
    above it (a CPU stand-in for a GPU running out of memory). ``phase``: a free-form label
    (e.g. "forward") that the caller sets; the phase current at the peak is kept in
    :attr:`peak_phase`.

    Usage::

        tr = LiveBytesTracker()
        tr.label(model.parameters(), "params")           # already-live tensors
        with tr:
            loss = model(**batch).loss; loss.backward()
        tr.label((p.grad for p in model.parameters()), "grads")
        tr.peak_bytes, tr.peak_breakdown()               # {"params": ..., "grads": ..., "other": ...}
    """

    def __init__(self, limit_bytes: int | None = None, block: int = BLOCK, trace: bool = False):
        super().__init__()
        self.trace: list | None = [] if trace else None  # per operator: (phase, name, live bytes with its outputs)
        self.temporaries: dict[int, int] = {}  # trace: operator index -> bytes it held inside (KERNEL_TEMPORARIES)
        if block < 1:
            raise ValueError(f"block must be a positive number of bytes (512 = CUDA rounding, 1 = exact), got {block!r}.")
        self.block = block
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be a positive number of bytes, got {limit_bytes!r}.")
        self.limit_bytes = limit_bytes
        self.phase = ""
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_phase = ""
        self._serial = itertools.count()
        self._serial_of: dict[int, int] = {}  # id of a live storage's C++ object -> serial
        self._refs: dict[int, weakref.ref] = {}  # serial -> weak reference (its callback frees)
        self._live: dict[int, int] = {}  # serial -> rounded bytes
        self._labels: dict[int, str] = {}  # serial -> category
        self._snapshot: dict[int, int] = {}  # live set at the peak
        self._pending = False  # a new peak was reached and not yet snapshotted
        self._life: dict[int, list] = {}  # trace: serial -> [first operator live after, operator it died in, bytes]
        self._allocs: list[tuple[int, int]] = []  # trace: (operator index, bytes) per storage an operator returned new
        self._in_op = False
        self._paused = False  # inside untracked(): operators run unseen

    # -- counting -----------------------------------------------------------------------------
    def _free(self, serial: int, cdata: int) -> None:
        if self._pending:
            self._snapshot = dict(self._live)
            self._pending = False
        self.current_bytes -= self._live.pop(serial, 0)
        self._refs.pop(serial, None)
        if self.trace is not None and serial in self._life:
            self._life[serial][1] = len(self.trace)
        if self._serial_of.get(cdata) == serial:
            del self._serial_of[cdata]

    def _add(self, t: torch.Tensor) -> int | None:
        if t.layout != torch.strided:
            return None
        local = getattr(t, "_local_tensor", None)  # DTensor: its own storage is a full-size stand-in
        if local is not None:
            return self._add(local)  # count this rank's shard
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # e.g. sparse or functional wrappers
            return None
        return self._add_storage(st)

    def _add_storage(self, st) -> int:
        cdata = st._cdata  # unique among live storages; the weakref callback retires it at death
        serial = self._serial_of.get(cdata)
        nbytes = round_bytes(st.nbytes(), self.block)
        if serial is not None:
            old = self._live.get(serial)
            if old is None or old == nbytes:
                return serial
            self.current_bytes += nbytes - old  # storage was resized in place
            self._live[serial] = nbytes
            if serial in self._life:
                self._life[serial][2] = nbytes
        else:
            serial = next(self._serial)
            self._serial_of[cdata] = serial
            self._live[serial] = nbytes
            self.current_bytes += nbytes
            if self.trace is not None:
                self._life[serial] = [len(self.trace), None, nbytes]
                if self._in_op and nbytes:
                    self._allocs.append((len(self.trace), nbytes))
            free = self._free
            self._refs[serial] = weakref.ref(st, lambda _r, s=serial, c=cdata: free(s, c))
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_phase = self.phase
            self._pending = True
        if self.limit_bytes is not None and self.current_bytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"LiveBytesTracker: {self.current_bytes} live bytes exceed limit_bytes={self.limit_bytes} "
                f"(phase {self.phase!r}); lower batch_size or seq_len, or enable gradient_checkpointing.")
        return serial

    def __enter__(self):
        _ACTIVE.append(self)
        if len(_ACTIVE) == 1:
            _SAVED[:] = [torch.UntypedStorage.__dict__.get("resize_")]
            torch.UntypedStorage.resize_ = _tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            if not _ACTIVE:  # back to what it was (torch._C.StorageBase.resize_, inherited)
                if _SAVED and _SAVED[0] is not None:
                    torch.UntypedStorage.resize_ = _SAVED[0]
                else:
                    del torch.UntypedStorage.resize_

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        self._in_op = True  # storages added now are this operator's outputs (allocations())
        try:
            if isinstance(out, torch.Tensor):  # fast path: most operators return one tensor
                self._add(out)
            elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) or o is None for o in out):
                for o in out:
                    if o is not None:
                        self._add(o)
            else:
                tree_map_only(torch.Tensor, self._add, out)
        finally:
            self._in_op = False
        if self.trace is not None:
            inside = kernel_temporaries(func, args, kwargs, self.block)
            if inside:
                self.temporaries[len(self.trace)] = sum(inside)
            self.trace.append((self.phase, func.__name__, self.current_bytes))
        return out

    def allocations(self) -> list[tuple[str, str, int]]:
        """``trace=True``: (phase, operator, bytes) for each new non-empty storage an operator returned, in order. Unlike the
        live bytes, this sequence does not depend on when storages die, so a real step's and ``simulate``'s are
        equal item for item when the same kernels run (:func:`first_divergence` names where they part)."""
        if self.trace is None:
            raise ValueError("allocations() needs LiveBytesTracker(trace=True).")
        return [self.trace[j][:2] + (nbytes,) for j, nbytes in self._allocs if j < len(self.trace)]

    # -- already-live tensors and categories --------------------------------------------------
    def track(self, tensors) -> int:
        """Count tensors that exist already (created outside the tracker); returns bytes added."""
        before = self.current_bytes
        for t in _tensors(tensors):
            self._add(t)
        return self.current_bytes - before

    def label(self, tensors, category: str) -> None:
        """Put the storages of ``tensors`` in ``category`` (tracking them first if needed).

        A storage keeps its first label; unlabelled storages count as ``"other"``.
        """
        for t in _tensors(tensors):
            serial = self._add(t)
            if serial is not None:
                self._labels.setdefault(serial, category)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (everything already live still counts)."""
        self.peak_bytes = self.current_bytes
        self.peak_phase = self.phase
        self._snapshot = dict(self._live)
        self._pending = False

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes live at the peak, by category; sums to :attr:`peak_bytes`."""
        snap = dict(self._live) if self._pending else self._snapshot
        out: dict[str, int] = defaultdict(int)
        for serial, nbytes in snap.items():
            out[self._labels.get(serial, OTHER)] += nbytes
        return dict(out)

    def trace_parts(self, categories) -> list[tuple]:
        """Per traced operator, the live bytes of each of ``categories`` (labels as they are now), in order: which
        part of each moment's live bytes the weights, the gradients made by then, ... are."""
        n = len(self.trace or ())
        diff = {c: [0] * (n + 1) for c in categories}
        for serial, (born, died, nbytes) in self._life.items():
            d = diff.get(self._labels.get(serial))
            if d is not None and born < n:
                d[born] += nbytes
                d[n if died is None else died] -= nbytes
        out, run = [], {c: 0 for c in categories}
        for j in range(n):
            for c in categories:
                run[c] += diff[c][j]
            out.append(tuple(run[c] for c in categories))
        return out

    def current_breakdown(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for serial, nbytes in self._live.items():
            out[self._labels.get(serial, OTHER)] += nbytes
        return dict(out)


_ACTIVE: list[LiveBytesTracker] = []  # trackers inside their ``with`` block
_SAVED: list = []  # UntypedStorage's own resize_ attribute before the first tracker patched it (None: inherited)
_RESIZE = torch._C.StorageBase.resize_


def _tracked_resize(storage, size):
    """``UntypedStorage.resize_`` that tells the active trackers (FSDP2 frees and re-allocates this way)."""
    out = _RESIZE(storage, size)
    for tr in _ACTIVE:
        tr._add_storage(storage)
    return out


@contextlib.contextmanager
def untracked():
    """Operators run inside are not seen by the active trackers (neither counted nor traced): for a kernel
    emulation that allocates the emulated kernel's buffers where the trackers see them, then computes the values with
    other operators whose temporaries the emulated kernel does not have (``lora_kit.memory.flash_attention``). Whatever
    is allocated inside must die inside."""
    saved = [(tr, tr._paused) for tr in _ACTIVE]
    for tr, _ in saved:
        tr._paused = True
    try:
        yield
    finally:
        for tr, was in saved:
            tr._paused = was


def first_divergence(a: list, b: list) -> dict | None:
    """Where two allocation sequences (:meth:`LiveBytesTracker.allocations`) part: None when equal, else the index,
    the two items there (None past an end) and the bytes each allocates that the other does not, per (phase, operator)
    (the multiset difference: a kernel that allocates differently shows up there even if the sequences realign)."""
    from collections import Counter
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == len(a) == len(b):
        return None
    ca, cb = Counter(a), Counter(b)

    def extra(c1, c2) -> dict:
        out: dict = defaultdict(int)
        for (ph, op, nbytes), n in (c1 - c2).items():
            out[f"{ph} {op}"] += n * nbytes
        return dict(out)
    return {"index": i, "a": a[i] if i < len(a) else None, "b": b[i] if i < len(b) else None,
            "only_a": extra(ca, cb), "only_b": extra(cb, ca)}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
        return
    for t in x:
        if isinstance(t, torch.Tensor):
            yield t
        elif isinstance(t, (list, tuple)):
            yield from _tensors(t)
