"""What a device adds around torch's peak allocated bytes: the one place for device constants.

``estimate``, ``simulate`` and the planner import these; the CUDA issue replaces the assumptions with
measured, per-device terms.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

ALLOC_ROUND = 512  # the CUDA caching allocator hands out storages in multiples of 512 bytes
CUDA_CONTEXT_BYTES = 512 * 2**20  # assumption until benchmarks/gpu_validate.py measures it
RESERVE_FRACTION = 0.08  # assumption: allocator reserve / fragmentation as a share of the peak
# DeepSpeed ZeRO-2 / ZeRO-3 allocate one gradient bucket of ``reduce_bucket_size`` elements (default 5e8, which the
# accelerate config lora_kit writes leaves as is), in the trained dtype, whatever the model's size
# (benchmarks/deepspeed_accuracy.py measures it on CPU ranks)
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def alloc_bytes(nbytes):
    """Bytes of a storage as the CUDA caching allocator hands it out (rounded up to 512). Exact whatever the size:
    an integer gives a Python int, an object array (of Python ints) an object array, anything else int64."""
    if isinstance(nbytes, (int, np.integer)) and not isinstance(nbytes, bool):
        return (int(nbytes) + ALLOC_ROUND - 1) // ALLOC_ROUND * ALLOC_ROUND
    arr = np.asarray(nbytes)
    if arr.dtype != object:
        arr = arr.astype(np.int64)
    return (arr + ALLOC_ROUND - 1) // ALLOC_ROUND * ALLOC_ROUND


RESERVE = Fraction(RESERVE_FRACTION).limit_denominator(1000)  # 2/25: one exact rational for every path


def _exact_total(peak: int) -> int:
    return peak + CUDA_CONTEXT_BYTES + -(-RESERVE.numerator * peak // RESERVE.denominator)


def device_total(peak):
    """What the process adds to the card for a peak of ``peak`` allocated bytes: the CUDA context plus
    the allocator's reserve (an int for an int, an int64 array for an array; an object array of Python ints, exact,
    for an object array or a peak too large for int64)."""
    arr = np.asarray(peak)
    if arr.dtype == object or (arr.ndim == 0 and abs(int(peak)) >= 2 ** 62):
        out = np.frompyfunc(lambda x: _exact_total(int(x)), 1, 1)(arr)
        return int(out) if np.ndim(out) == 0 else out
    arr = arr.astype(np.int64)
    if arr.size and int(np.abs(arr).max()) >= (1 << 62) // RESERVE.numerator:  # the integer product would wrap
        return device_total(arr.astype(object))
    out = arr + CUDA_CONTEXT_BYTES + -(-RESERVE.numerator * arr // RESERVE.denominator)
    return int(out) if out.ndim == 0 else out
