"""Where a shared-memory all-reduce's arrays sit, and the buffers of its results.

For `HostAllReduce` (`keras_distrib.collectives.host_allreduce`): the
arrays of one call are packed by dtype into regions of a slot
(`layout`), each region split into one chunk per worker (`chunk`), which
that worker sums. The results are views of a buffer from `ResultBuffers`,
reused across calls once nothing refers to it.

NumPy only.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

ALIGN = 64  # bytes: each dtype region, and each array in it, starts on a cache line
_RESULT_BUFFERS = 4  # kept for reuse (see ResultBuffers.take)


def layout(arrays: Sequence[np.ndarray]):
    """`(groups, nbytes)`: a `(dtype, members, offset, count)` region per dtype,
    `members` the `(index, start)` of each array of that dtype in the region,
    and the bytes all regions take."""
    members: dict = {}
    for i, a in enumerate(arrays):
        members.setdefault(a.dtype, []).append(i)
    groups, offset = [], 0
    for dtype, indices in members.items():
        # Every array starts on a cache line (padding between them):
        # its result is then a view TensorFlow takes without a copy.
        step = max(1, ALIGN // dtype.itemsize)
        starts, count = [], 0
        for i in indices:
            starts.append((i, round_up(count, step)))
            count = starts[-1][1] + arrays[i].size
        groups.append((dtype, starts, offset, count))
        offset = round_up(offset + count * dtype.itemsize, ALIGN)
    return groups, offset


def layout_key(arrays: Sequence[np.ndarray]) -> tuple:
    """What `layout` depends on: each array's dtype and size, in order."""
    return tuple((a.dtype.str, a.dtype.name, a.size) for a in arrays)


class ResultBuffers:
    """Aligned memory for the results of successive calls, reused when free."""

    def __init__(self) -> None:
        self._buffers: list = []  # buffers the results are views of

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes starting on a cache line, that no earlier result
        still uses, for this call's results (views of it).

        TensorFlow takes a `numpy_function` result without a copy only when
        its data is aligned (`EIGEN_MAX_ALIGN_BYTES`, at most 64), and memory
        fresh from the system costs a page fault per 4 KB on first write;
        so up to `_RESULT_BUFFERS` buffers are kept and reused once nothing
        refers to them (TensorFlow drops a step's results before the next
        step's `numpy_function` runs).
        """
        for i in range(len(self._buffers)):
            # A result array, whatever view it is, refers to its buffer as
            # its base: a buffer nothing else refers to has no result alive.
            if _references(self._buffers, i) == _UNREFERENCED:
                if self._buffers[i].nbytes < nbytes + ALIGN:
                    self._buffers[i] = np.empty(nbytes + ALIGN, np.uint8)
                raw = self._buffers[i]
                break
        else:
            raw = np.empty(nbytes + ALIGN, np.uint8)
            if len(self._buffers) < _RESULT_BUFFERS:
                self._buffers.append(raw)
        skip = -raw.ctypes.data % ALIGN
        return raw[skip : skip + nbytes]


def chunk(count: int, parts: int, index: int) -> tuple:
    """The `(lo, hi)` of part `index` of `count` elements split in `parts`."""
    return count * index // parts, count * (index + 1) // parts


def pieces(members: list, flats: list):
    """`(start, end, flat)` for each range of a dtype region in order: the
    padding before each member array (`flat` None; zeros, summed like the
    rest), then the array's elements."""
    end = 0
    for i, start in members:
        yield end, start, None
        end = start + flats[i].size
        yield start, end, flats[i]


def outside(start: int, end: int, span: tuple) -> list:
    """The parts of `[start, end)` outside `span` (`(lo, hi)`), as ranges."""
    lo, hi = span
    parts = [(start, min(end, lo)), (max(start, hi), end)]
    return [(a, b) for a, b in parts if a < b]


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return -(-value // multiple) * multiple


def _references(items: list, index: int) -> int:
    """`sys.getrefcount` of `items[index]`."""
    return sys.getrefcount(items[index])


# What `_references` counts for an object only a list refers to, measured
# the same way (so that an interpreter counting temporaries differently
# cannot make a buffer in use look unused).
_UNREFERENCED = _references([object()], 0)
