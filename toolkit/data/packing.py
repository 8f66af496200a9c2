"""Best-fit-decreasing packing of tokenized documents into rows of at most `capacity` tokens.

Documents are taken longest first (ties in a seeded random order); each goes into the open bin
whose remaining capacity is the smallest that still fits it, or into a new bin when none fits.
Among bins with the same remaining capacity, the one that reached that capacity first is used.

Bins are counted per remaining capacity 0..capacity in a segment tree, so "smallest remaining
capacity >= L" is O(log capacity). Documents of equal length are placed in batches: the bins at
one remaining capacity r all take the same number of documents (r // L; the loop says why), so
the Python loop runs once per (length, bucket visited), not once per document.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class PackStats:
    rows: int  # bins
    documents: int
    tokens: int  # sum of lengths
    fill: float  # tokens / (rows * capacity)


def pack_stats(bins: list[np.ndarray], lengths: np.ndarray, capacity: int) -> PackStats:
    """Rows, documents, tokens and fill of a packing returned by `best_fit_decreasing`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = len(bins)
    placed = np.concatenate(bins) if bins else np.zeros(0, dtype=np.int64)
    documents, tokens = len(placed), int(lengths[placed].sum())
    fill = tokens / (rows * capacity) if rows else 0.0
    return PackStats(rows=rows, documents=documents, tokens=tokens, fill=fill)


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int) -> list[np.ndarray]:
    """Bins of document indices (into `lengths`), each bin's total length <= capacity; every index
    exactly once; no document split. Deterministic for (lengths, capacity, seed): ties between equal
    lengths are broken by a seeded permutation. Documents longer than capacity raise ValueError
    (callers truncate or drop them first), as do empty (length < 1) documents. Order of documents
    inside a bin: the order they were placed. The order of bins: order of creation. Bins are int64
    arrays."""
    lengths, capacity = np.asarray(lengths), operator.index(capacity)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    n = len(lengths)
    if n == 0:
        return []
    lengths = lengths.astype(np.int64)
    if lengths.max() > capacity:
        i = int(lengths.argmax())
        raise ValueError(f"document {i} has {lengths[i]} tokens, more than capacity {capacity}")
    if lengths.min() < 1:
        i = int(lengths.argmin())
        raise ValueError(f"document {i} has {lengths[i]} tokens; documents must have at least 1")

    # Longest first; a seeded shuffle before the stable sort decides the order among equal lengths.
    shuffled = np.random.RandomState(seed).permutation(n)
    order = shuffled[np.argsort(-lengths[shuffled], kind="stable")]
    sorted_lengths = lengths[order]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_lengths)) + 1, [n]))

    tree = _CapacityTree(capacity)
    buckets: list[deque] = [deque() for _ in range(capacity + 1)]  # FIFO chunks of bin ids per remaining capacity
    bin_of = np.empty(n, dtype=np.int64)  # bin of the document at each position of `order`
    n_bins = 0

    for start, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
        length, pos, left = int(sorted_lengths[start]), start, end - start
        while left:
            r = tree.smallest_at_least(length)
            if r < 0:  # no open bin fits: open new ones, each filled before the next is opened
                r, available = capacity, left
                ids = np.arange(n_bins, n_bins + -(-left // (capacity // length)), dtype=np.int64)
                n_bins += len(ids)
            else:
                available = tree.count(r)
                ids = None
            # A bin at remaining r takes documents until it has < length left: r // length of them,
            # because the bin just filled is then the tightest fit (no bucket lies in [length, r)).
            per_bin = r // length
            full = min(available, left // per_bin)
            if full:
                taken = ids[:full] if ids is not None else _take_bins(buckets[r], tree, r, full)
                bin_of[pos:pos + full * per_bin] = np.repeat(taken, per_bin)
                _put_bins(buckets, tree, r - per_bin * length, taken)
                pos, left = pos + full * per_bin, left - full * per_bin
            if left and available > full:  # fewer than per_bin left: one more bin takes them all
                taken = ids[full:full + 1] if ids is not None else _take_bins(buckets[r], tree, r, 1)
                bin_of[pos:pos + left] = taken[0]
                _put_bins(buckets, tree, r - left * length, taken)
                pos, left = pos + left, 0

    # Group positions by bin; the stable sort keeps each bin's documents in placement order.
    grouped = order[np.argsort(bin_of, kind="stable")]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(bin_of, minlength=n_bins)))).tolist()
    return [grouped[a:b] for a, b in zip(bounds[:-1], bounds[1:])]  # views; np.split is 5x slower here


def _take_bins(bucket: deque, tree: _CapacityTree, r: int, count: int) -> np.ndarray:
    """Remove the `count` oldest bin ids from the bucket of remaining capacity r."""
    chunks, need = [], count
    while need:
        chunk = bucket.popleft()
        if len(chunk) > need:
            bucket.appendleft(chunk[need:])
            chunk = chunk[:need]
        chunks.append(chunk)
        need -= len(chunk)
    tree.add(r, -count)
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def _put_bins(buckets: list[deque], tree: _CapacityTree, r: int, ids: np.ndarray) -> None:
    buckets[r].append(ids)
    tree.add(r, len(ids))


class _CapacityTree:
    """Number of open bins per remaining capacity 0..capacity, as a sum segment tree in numpy."""

    def __init__(self, capacity: int):
        self.size = 1 << capacity.bit_length()  # a power of two > capacity: leaves 0..capacity
        self.sums = np.zeros(2 * self.size, dtype=np.int64)

    def count(self, r: int) -> int:
        return int(self.sums[self.size + r])

    def add(self, r: int, delta: int) -> None:
        i = self.size + r
        while i:
            self.sums[i] += delta
            i >>= 1

    def smallest_at_least(self, lo: int) -> int:
        """Smallest remaining capacity >= lo held by some bin, or -1."""
        sums, i = self.sums, self.size + lo
        while sums[i] == 0:  # climb to the next subtree to the right until one holds a bin
            while i & 1:
                i >>= 1
            if i == 0:
                return -1
            i += 1
        while i < self.size:  # descend to its leftmost non-empty leaf
            i <<= 1
            if sums[i] == 0:
                i += 1
        return i - self.size
