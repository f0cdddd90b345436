"""What a shrink keeps: the kind of failure asked for, and the signature of the one found.

``Target`` is what ``--until`` asks for (``violation[:CHECK]``, ``oom``,
``divergence``); ``Signature`` is how the failure found on the input is recognised
again on a smaller trace: for a violation the invariant check that broke (and the
counter, for the ``counters`` check; on a hybrid SWA model the pool, when not the
full one), for an out-of-memory the op kind that ran out,
for a divergence the first field that differs. Never the step number: a smaller
trace fails earlier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvtrace.errors import ConfigError

if TYPE_CHECKING:
    from kvtrace.diff.compare import Divergence
    from kvtrace.replay.result import OomRecord, ViolationRecord

__all__ = ["CHECKS", "KINDS", "Kind", "Signature", "Target", "violation_field"]

Kind = Literal["violation", "oom", "divergence"]
KINDS: tuple[Kind, ...] = ("violation", "oom", "divergence")
# The invariant checks a replay reports (``allocator.check.invariants``, its incremental
# versions, and the replay's own ``row_width``): what ``violation:CHECK`` may name.
CHECKS: tuple[str, ...] = (
    "conservation", "counters", "device", "double_free", "hisparse", "inflight", "leak", "lengths", "mapping",
    "namespace", "ownership", "residency", "row", "row_width", "rows", "state_reuse", "tracking", "tree",
    "tree_ledger", "window", "session_held", "session_hold_bound",
)


@dataclass(frozen=True, slots=True)
class Target:
    """The failure ``--until`` asks for.

    Attributes:
        kind: ``violation``, ``oom`` or ``divergence``.
        check: for a violation, the invariant check that must break (None: the first
            one that breaks on the input).
    """

    kind: Kind
    check: str | None = None

    @classmethod
    def parse(cls, text: str) -> Target:
        """``violation``, ``violation:CHECK``, ``oom`` or ``divergence``.

        Raises:
            ConfigError: anything else, or a CHECK not in ``CHECKS`` (the message
                lists the valid forms, or the checks).
        """
        kind, _, check = text.strip().partition(":")
        if kind not in KINDS or (check and kind != "violation") or (kind == "violation" and ":" in text and not check):
            raise ConfigError(
                f"--until {text!r}: give violation, violation:CHECK (e.g. violation:ownership), oom or divergence"
            )
        if check and check not in CHECKS:
            raise ConfigError(f"--until {text!r}: no invariant check is named {check!r}; the checks are {', '.join(CHECKS)}")
        return cls(kind, check or None)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self.kind if self.check is None else f"{self.kind}:{self.check}"


def violation_field(v: ViolationRecord) -> str | None:
    """The field a violation names, where its check has one: the counter of a
    ``counters`` violation (``sum_committed kept as 7, recomputed 5``)."""
    if v.check == "counters" and v.detail:
        return v.detail.split(" ", 1)[0]
    return None


@dataclass(frozen=True, slots=True)
class Signature:
    """How a failure is recognised on any trace.

    Attributes:
        kind: ``violation``, ``oom`` or ``divergence``.
        name: the check (violation), the op kind that ran out (oom: ``extend``,
            ``decode``, ``spec``, ``prealloc``, ``extend_rows``, ``prealloc_rows``) or the
            first differing field (divergence: ``kv_allocated_len``, ``available``, ...).
        field: the counter a ``counters`` violation names (None elsewhere).
        pool: the KV pool a violation is about when it is not the full one (a hybrid
            model's ``swa``); None: the full pool (every full-attention violation).
    """

    kind: Kind
    name: str
    field: str | None = None
    pool: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" + (f".{self.field}" if self.field else "") + (f"@{self.pool}" if self.pool else "")

    def describe(self) -> str:
        """A few words: ``violation of the ownership check``, ``out of memory in spec``."""
        if self.kind == "violation":
            return (f"violation of the {self.name} check" + (f" ({self.field})" if self.field else "")
                    + (f" in the {self.pool.upper()} pool" if self.pool else ""))
        if self.kind == "oom":
            return f"out of memory in {self.name}"
        return f"divergence in {self.name}"

    # ------------------------------------------------------------------ recognising it
    def matching_violation(self, violations: list[ViolationRecord]) -> ViolationRecord | None:
        """The first of ``violations`` this (violation) signature recognises."""
        for v in violations:
            if v.check == self.name and (self.field is None or violation_field(v) == self.field) and (
                _pool_of(v) == self.pool
            ):
                return v
        return None

    def matches_oom(self, oom: OomRecord | None) -> bool:
        """Whether an out-of-memory record is this (oom) signature's."""
        return oom is not None and oom.op == self.name

    def matches_divergence(self, divergence: Divergence | None) -> bool:
        """Whether a first divergence is this (divergence) signature's."""
        return divergence is not None and divergence.field == self.name

    @classmethod
    def of_violation(cls, v: ViolationRecord) -> Signature:
        return cls("violation", v.check, violation_field(v), _pool_of(v))


def _pool_of(v: ViolationRecord) -> str | None:
    """A violation's pool as a signature keeps it: None for the full pool."""
    pool = getattr(v, "pool", "full")
    return None if pool == "full" else pool
