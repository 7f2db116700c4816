"""PyTorch's CUDA caching allocator, replayed: what ``max_memory_reserved`` will be for a sequence of allocations.

A small model of ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch), written from
its public rules, one stream, no CUDA graphs. Each rule names the function it follows:

- ``round_size``: a request is rounded up to 512 bytes (``kMinBlockSize``).
- ``get_pool``: requests of at most 1 MiB (``kSmallSize``) come from the small pool, the rest from the large pool;
  the pools never share blocks.
- ``get_allocation_size``: a new segment (one ``cudaMalloc``) is 2 MiB (``kSmallBuffer``) for the small pool, 20 MiB
  (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB
  (``kRoundLarge``).
- ``get_free_block``: best fit, the smallest cached free block of the pool that holds the request (lowest address
  among equals); with ``max_split_size_mb`` a request below it never takes a block at or above it, and a request at
  or above it takes no block ``max_non_split_rounding_mb`` (default 20 MiB) or more larger than itself.
- ``should_split``: the rest of a block becomes a free block of its own if it is at least 512 bytes (small pool, or
  expandable segments) or, in the large pool, more than 1 MiB and the request is below ``max_split_size``; else the
  whole block is handed out and counted as allocated.
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its segment.
- ``malloc``: no fitting block -> a new segment; if the device is full, ``release_available_cached_blocks`` (only with
  ``max_split_size_mb``: free oversize cached segments) and retry, then ``release_cached_blocks`` (free every cached
  segment that is wholly free, as ``empty_cache``; counted in ``num_alloc_retries``) and retry; then out of memory.
- ``expandable_segments:True`` (``find_expandable_block``, ``map_block``, ``unmap_block``): each pool keeps one
  segment of virtual addresses whose physical pages (2 MiB small, 20 MiB large) are mapped on demand; a request that
  no free block holds maps just the pages it lacks in the lowest-address unmapped range that has room (with the free
  block before it; a hole left by releasing comes before the end), merged with free neighbours, so reserved grows by
  pages, not by segments; releasing unmaps the whole pages inside free blocks.
- Statistics: ``allocated`` is the sum of handed-out block sizes (a block not split counts whole), ``reserved`` the
  sum of segments (mapped pages), ``inactive_split`` the free blocks of split segments (not counted for expandable
  segments, whose free space is unmapped rather than split).

Input: events ``("alloc", key, nbytes)`` and ``("free", key)`` in the order they happen; :func:`replay` returns the
peaks. :class:`Recorder` records that order from real (or fake) tensors: a ``TorchDispatchMode`` that sees every
storage an operator returns and a weak-reference callback when it dies.
"""
from __future__ import annotations

import bisect
import itertools
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from lora_kit.memory.tracker import kernel_temporaries

MIB = 1 << 20
MIN_BLOCK = 512           # kMinBlockSize
SMALL_SIZE = 1 * MIB      # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MIB    # kSmallBuffer: small-pool segment and expandable page
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
LARGE_BUFFER = 20 * MIB   # kLargeBuffer: large-pool segment under 10 MiB and expandable page
ROUND_LARGE = 2 * MIB     # kRoundLarge
NO_LIMIT = 1 << 62
SEGMENT_GAP = LARGE_BUFFER << 24  # segments start this far apart: page-aligned for both pools, never overlapping


class OutOfMemory(RuntimeError):
    """The replayed allocator could not find or reserve memory for a request (``.stats`` holds the figures so far)."""


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "small", "seg", "prev", "next", "allocated", "mapped")

    def __init__(self, addr, size, small, seg, mapped=True):
        self.addr, self.size, self.small, self.seg, self.mapped = addr, size, small, seg, mapped
        self.prev = self.next = None
        self.allocated = False


@dataclass
class Stats:
    """Peaks of a replay, in bytes, as ``torch.cuda.memory_stats`` names them."""
    max_reserved: int = 0
    max_allocated: int = 0
    max_inactive_split: int = 0
    reserved: int = 0
    allocated: int = 0
    inactive_split: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    segments: int = 0
    events: int = 0
    settings: dict = field(default_factory=dict)


class CachingAllocator:
    """The allocator's state. ``capacity``: bytes it may reserve (the CUDA total less the context and whatever else
    lives outside torch); ``expandable_segments`` and ``max_split_size_mb`` as in ``PYTORCH_CUDA_ALLOC_CONF``."""

    def __init__(self, capacity: int | None = None, expandable_segments: bool = False,
                 max_split_size_mb: int | None = None, max_non_split_rounding_mb: int | None = None):
        if max_split_size_mb is not None and max_split_size_mb * MIB < LARGE_BUFFER:
            raise ValueError(f"max_split_size_mb must be >= {LARGE_BUFFER // MIB} (as torch requires), "
                             f"got {max_split_size_mb}.")
        self.capacity = NO_LIMIT if capacity is None else int(capacity)
        self.expandable = bool(expandable_segments)
        self.max_split = NO_LIMIT if max_split_size_mb is None else max_split_size_mb * MIB
        self.non_split_rounding = LARGE_BUFFER if max_non_split_rounding_mb is None else max_non_split_rounding_mb * MIB
        self.stats = Stats(settings={"expandable_segments": self.expandable, "max_split_size_mb": max_split_size_mb,
                                     "capacity": capacity})
        self._free = {True: [], False: []}  # pool (small?) -> sorted [(size, addr)] of free mapped blocks
        self._at: dict[int, _Block] = {}    # addr -> free mapped block
        self._live: dict = {}               # key -> allocated block
        self._es = {}                       # pool -> the expandable segment's first block
        self._next_base = itertools.count(1)

    # -- pools ----------------------------------------------------------------------------------
    def _insert(self, b: _Block) -> None:
        bisect.insort(self._free[b.small], (b.size, b.addr))
        self._at[b.addr] = b
        if b.seg is not None and (b.prev or b.next) and not self.expandable:
            self._inactive(b.size)

    def _remove(self, b: _Block) -> None:
        lst = self._free[b.small]
        del lst[bisect.bisect_left(lst, (b.size, b.addr))]
        del self._at[b.addr]
        if b.seg is not None and (b.prev or b.next) and not self.expandable:
            self._inactive(-b.size)

    def _inactive(self, delta: int) -> None:
        s = self.stats
        s.inactive_split += delta
        s.max_inactive_split = max(s.max_inactive_split, s.inactive_split)

    def _reserve(self, delta: int) -> None:
        s = self.stats
        s.reserved += delta
        s.max_reserved = max(s.max_reserved, s.reserved)

    # -- malloc ---------------------------------------------------------------------------------
    def malloc(self, key, nbytes: int) -> int:
        """Hand out a block for ``nbytes`` (0 bytes: nothing, as torch); returns the block's size."""
        if key in self._live:
            raise ValueError(f"allocation {key!r} is live already; free it first.")
        if nbytes <= 0:
            return 0
        size = round_size(int(nbytes))
        small = size <= SMALL_SIZE
        b = self._get_free_block(small, size)
        if b is None:
            b = self._alloc_block(small, size)
            if b is None and self._release_available_cached_blocks(small, size):
                b = self._alloc_block(small, size)
            if b is None:
                self._release_cached_blocks()
                self.stats.num_alloc_retries += 1
                b = self._alloc_block(small, size)
            if b is None:
                self.stats.num_ooms += 1
                raise OutOfMemory(f"replayed allocator: {size} bytes do not fit ({self.stats.reserved} reserved of "
                                  f"{self.capacity})")
        if self._should_split(b, size):
            rest = _Block(b.addr + size, b.size - size, small, b.seg)
            rest.prev, rest.next = b, b.next
            if b.next:
                b.next.prev = rest
            b.next, b.size = rest, size
            self._insert(rest)
        b.allocated = True
        self._live[key] = b
        s = self.stats
        s.allocated += b.size
        s.max_allocated = max(s.max_allocated, s.allocated)
        return b.size

    def _get_free_block(self, small: bool, size: int):
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        b = self._at[lst[i][1]]
        if self.expandable and b.seg == "es":  # best fit by the size a block can grow to (find the smallest)
            def grows(x):
                return x.size + (x.next.size if x.next and not x.next.mapped else 0)
            j = i + 1
            while j < len(lst) and self._at[lst[j][1]].seg == "es" and grows(self._at[lst[j][1]]) < grows(b):
                b, j = self._at[lst[j][1]], j + 1
        if size < self.max_split <= b.size or (size >= self.max_split and b.size >= size + self.non_split_rounding):
            return None
        self._remove(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        rest = b.size - size
        if b.small or self.expandable:
            return rest >= MIN_BLOCK
        return size < self.max_split and rest > SMALL_SIZE

    def _alloc_block(self, small: bool, size: int):
        if self.expandable:
            return self._expand(small, size)
        n = allocation_size(size)
        if self.stats.reserved + n > self.capacity:
            return None
        self._reserve(n)
        self.stats.segments += 1
        return _Block(next(self._next_base) * SEGMENT_GAP, n, small, seg=object())

    # -- expandable segments ----------------------------------------------------------------------
    def _expand(self, small: bool, size: int):
        """``try_allocate_expandable_block``: the block :meth:`_find_expandable` picks, its unmapped part mapped page by
        page until it holds ``size``; None when the pages do not fit the capacity."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        if small not in self._es:  # one virtual range per pool, as large as the device: never exhausted here
            self._es[small] = _Block(next(self._next_base) * SEGMENT_GAP, NO_LIMIT, small, "es", mapped=False)
            self.stats.segments += 1
        c = self._find_expandable(small, size)
        if not c.mapped:
            c = self._map(c, min(c.size, size), page)
        while c is not None and c.size < size:  # free -> unmapped -> ...: map the next range, merged into c
            c = self._map(c.next, min(size - c.size, c.next.size), page)
        if c is not None:
            self._remove(c)
        return c

    def _find_expandable(self, small: bool, size: int) -> _Block:
        """``find_expandable_block``: the lowest-address unmapped range (with the free block before it, when there is
        one) whose run of blocks not handed out adds up to ``size``: a hole left by :meth:`_unmap` comes first."""
        u = self._es[small]
        while True:
            if not u.mapped:
                c = u.prev if u.prev is not None and not u.prev.allocated else u
                room, x = 0, c
                while room < size and x is not None and not x.allocated:
                    room, x = room + x.size, x.next
                if room >= size:
                    return c
            u = u.next

    def _map(self, u: _Block, n: int, page: int):
        """``map_block``: map the whole pages covering the first ``n`` bytes of unmapped block ``u`` (the rest stays
        unmapped after it), merge with free mapped neighbours and return the free block; None beyond capacity."""
        need = min(-(-n // page) * page, u.size)
        if self.stats.reserved + need > self.capacity:
            return None
        self._reserve(need)
        if u.size > need:
            rest = _Block(u.addr + need, u.size - need, u.small, "es", mapped=False)
            rest.prev, rest.next = u, u.next
            if u.next:
                u.next.prev = rest
            u.next, u.size = rest, need
        u.mapped = True
        return self._merge_and_insert(u)

    def _merge_and_insert(self, b: _Block) -> _Block:
        """``try_merge_blocks`` with both neighbours (free, mapped alike), then into the free list; the merged block."""
        for nb in (b.prev, b.next):
            if nb is not None and not nb.allocated and nb.mapped == b.mapped and nb.addr in self._at:
                self._remove(nb)
                if nb is b.prev:
                    self._join(nb, b)
                    b = nb
                else:
                    self._join(b, nb)
        self._insert(b)
        return b

    def _unmap(self, b: _Block) -> None:
        """Unmap the whole pages inside free block ``b`` (``unmap_block``)."""
        page = SMALL_BUFFER if b.small else LARGE_BUFFER
        lo, hi = -(-b.addr // page) * page, (b.addr + b.size) // page * page
        if hi <= lo:
            return
        self._remove(b)
        parts = [(b.addr, lo - b.addr, True), (lo, hi - lo, False), (hi, b.addr + b.size - hi, True)]
        prev, nxt, blocks = b.prev, b.next, []
        for addr, n, mapped in parts:
            if n:
                blocks.append(_Block(addr, n, b.small, "es", mapped=mapped))
        for x, y in zip([prev] + blocks, blocks + [nxt]):
            if x:
                x.next = y
            if y:
                y.prev = x
        if prev is None:
            self._es[b.small] = blocks[0]
        self._reserve(-(hi - lo))
        for x in blocks:
            if x.mapped:
                self._insert(x)
        u = next(x for x in blocks if not x.mapped)
        if u.next is not None and not u.next.mapped:  # merge with unmapped neighbours
            self._join(u, u.next)
        if u.prev is not None and not u.prev.mapped:
            self._join(u.prev, u)

    def _join(self, a: _Block, c: _Block) -> None:
        """Merge block ``c`` into its predecessor ``a`` (both free, same mapping, neither in a free list)."""
        a.size += c.size
        a.next = c.next
        if c.next:
            c.next.prev = a

    # -- free -------------------------------------------------------------------------------------
    def free(self, key) -> None:
        b = self._live.pop(key, None)
        if b is None:
            return  # a zero-byte or unknown allocation
        b.allocated = False
        self.stats.allocated -= b.size
        self._merge_and_insert(b)

    # -- releasing cached memory --------------------------------------------------------------------
    def _release_cached_blocks(self) -> None:
        for small in (False, True):
            for _, addr in list(self._free[small]):
                b = self._at.get(addr)
                if b is None:
                    continue
                if b.seg == "es":
                    self._unmap(b)
                elif b.prev is None and b.next is None:
                    self._remove(b)
                    self._reserve(-b.size)

    def _release_available_cached_blocks(self, small: bool, size: int) -> bool:
        if self.max_split == NO_LIMIT or self.expandable:
            return False
        lst = self._free[small]
        want = max(size, self.max_split)
        i = bisect.bisect_left(lst, (want, -1))
        if i < len(lst):
            b = self._at[lst[i][1]]
            self._remove(b)
            self._reserve(-b.size)
            return True
        freed = 0
        for sz, addr in reversed(list(lst)):  # largest first, oversize ones only
            if freed >= want or sz < self.max_split:
                break
            b = self._at[addr]
            self._remove(b)
            self._reserve(-b.size)
            freed += sz
        return freed >= want


def replay(events, capacity: int | None = None, expandable_segments: bool = False,
           max_split_size_mb: int | None = None) -> Stats:
    """Replay ``events`` (``("alloc", key, nbytes)`` / ``("free", key)``); returns :class:`Stats`. Out of memory
    raises :class:`OutOfMemory` with ``.stats``."""
    a = CachingAllocator(capacity, expandable_segments, max_split_size_mb)
    for ev in events:
        a.stats.events += 1
        try:
            if ev[0] == "alloc":
                a.malloc(ev[1], ev[2])
            elif ev[0] == "free":
                a.free(ev[1])
            else:
                raise ValueError(f"event {ev!r}: the first item must be 'alloc' or 'free'.")
        except OutOfMemory as e:
            e.stats = a.stats
            raise
    return a.stats


class Recorder(TorchDispatchMode):
    """Record allocation events in the order they happen: every new storage an operator returns (``alloc``) and the
    death of each (``free``, from a weak-reference callback), and the storages an opaque operator holds inside itself
    (``lora_kit.memory.tracker.kernel_temporaries``). :meth:`track` records tensors that exist already
    (weights, optimizer states), as allocated before everything else. Real tensors or fake ones alike."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self._ids = itertools.count()
        self._seen: dict[int, int] = {}  # storage _cdata -> key
        self._refs: dict[int, weakref.ref] = {}

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        cdata = st._cdata
        if cdata in self._seen or st.nbytes() == 0:
            return
        key = next(self._ids)
        self._seen[cdata] = key
        self.events.append(("alloc", key, st.nbytes()))

        def gone(_r, key=key, cdata=cdata):
            self.events.append(("free", key))
            self._refs.pop(key, None)
            if self._seen.get(cdata) == key:
                del self._seen[cdata]
        self._refs[key] = weakref.ref(st, gone)

    def track(self, tensors) -> None:
        for t in tensors:
            self._add(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inside = [(("inside", next(self._ids)), b) for b in kernel_temporaries(func, args, kwargs, block=1)]
        self.events.extend(("alloc", key, b) for key, b in inside)  # an opaque operator's own storages, before its
        out = func(*args, **(kwargs or {}))  # outputs, freed when it returns
        tree_map_only(torch.Tensor, self._add, out)
        self.events.extend(("free", key) for key, _ in inside)
        return out
