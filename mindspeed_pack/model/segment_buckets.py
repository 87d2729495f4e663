"""How packed attention groups segments: by length, rounded up to a bucket.

Both the packed and the context-parallel attention batch segments of one bucket into a single
SDPA call, so the bucket rule is shared and lives below both.
"""
from __future__ import annotations


def bucket_width(length: int) -> int:
    """Round a segment length up to its bucket: at most 1/8 longer (16 below 128 tokens)."""
    step = 1 << max(4, length.bit_length() - 4)  # the largest power of two <= length / 8, at least 16
    return -(-length // step) * step


def segments_by_width(lengths) -> dict:
    """Indices of the non-empty segments of ``lengths``, grouped by bucket width (narrowest first)."""
    groups: dict = {}
    for i, n in enumerate(lengths.tolist()):
        if n:
            groups.setdefault(bucket_width(n), []).append(i)
    return dict(sorted(groups.items()))
