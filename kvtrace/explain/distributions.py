"""Distributions for choosing a pool size: power-of-two histograms and their text bars.

Age at hit and reuse distance (steps), reuse count (hits per page), age at eviction
(steps a node stayed in the cache). Buckets: 0, 1, 2-3, 4-7, ... so a trace of any
length fits in a screen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Histogram"]

_BAR = 30


@dataclass
class Histogram:
    """Counts (or weights) in power-of-two buckets of a non-negative integer.

    Bucket 0 holds 0; bucket ``k >= 1`` holds ``[2**(k-1), 2**k)``.
    """

    name: str
    unit: str
    counts: list[int] = field(default_factory=list)

    def add(self, value: int, weight: int = 1) -> None:
        k = max(int(value), 0).bit_length()
        if k >= len(self.counts):
            self.counts.extend([0] * (k + 1 - len(self.counts)))
        self.counts[k] += weight

    @property
    def total(self) -> int:
        return sum(self.counts)

    @staticmethod
    def bucket_label(k: int) -> str:
        if k == 0:
            return "0"
        lo, hi = 1 << (k - 1), (1 << k) - 1
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def to_dict(self) -> dict[str, Any]:
        """``{"unit", "total", "buckets": [{"lo", "hi", "count"}]}`` (empty buckets left out)."""
        buckets = []
        for k, n in enumerate(self.counts):
            if n:
                lo = 0 if k == 0 else 1 << (k - 1)
                buckets.append({"lo": lo, "hi": 0 if k == 0 else (1 << k) - 1, "count": n})
        return {"unit": self.unit, "total": self.total, "buckets": buckets}

    def render(self) -> list[str]:
        """Text lines: a title, then one bar per bucket from the first to the last non-empty."""
        lines = [f"{self.name} ({self.unit}), {self.total:,} in all"]
        used = [k for k, n in enumerate(self.counts) if n]
        if not used:
            return lines + ["  (none)"]
        top = max(self.counts)
        width = max(len(self.bucket_label(k)) for k in range(used[0], used[-1] + 1))
        for k in range(used[0], used[-1] + 1):
            n = self.counts[k]
            bar = "#" * (round(_BAR * n / top) if n else 0)
            lines.append(f"  {self.bucket_label(k):>{width}} | {bar:<{_BAR}} {n:,}")
        return lines
