"""Whether a trace fails the way a shrink wants: finding the failure on the input
(``Oracle.locate``) and recognising it again on a smaller trace (``Oracle.judge``).

* A violation: the replay runs without per-call checks; the allocator's invariant
  check (``check_integrity``) runs after the last step, and the engine's own checks
  (request rows too narrow) run always. On the input, ``locate`` checks every few
  steps (as often as keeps the checks' cost near the replay's own) and then step by
  step in a second replay between the last clean check and the first broken one, so
  the failure's step is exact and the table can end there.
* An out-of-memory: the replay stops at the first one (``on_oom="stop"``). A
  candidate that fits its pool (fewer requests need less) is judged again at the
  pool that just fails to hold it: a page below its peak, or with a baseline the
  baseline's peak; the outcome carries that pool and the candidate takes it.
* A divergence: ``kvtrace.diff.diff.diff_trace`` of the two versions, first divergence only.

With a ``baseline`` version, a violation or out-of-memory counts only when the
baseline does not fail the same way on the same trace (the failure is the version's,
not the trace's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtrace.shrink.signature import Signature, Target

__all__ = ["Failure", "Oracle", "Outcome"]

Status = Literal["reproduced", "other", "invalid", "crashed"]
_MAX_STRIDE = 4096  # steps between two checks of the input, at most


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure found on a trace.

    Attributes:
        signature: how to recognise it.
        step: the step it happens at (the end of the trace for a violation that the
            last check found).
        rid: the request it is blamed on (None: the pool as a whole).
        detail: one line saying what happened.
    """

    signature: Signature
    step: int
    rid: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What judging a candidate found.

    Attributes:
        status: ``reproduced`` (the same failure), ``other`` (no failure or another
            one), ``invalid`` (not a legal trace, or no allocator takes its
            configuration), ``crashed`` (the replay raised).
        step: the step of the failure in the candidate's numbering (None: not known).
        detail: one line.
        pool_tokens: the pool it failed with, when not the candidate's own (an
            out-of-memory judged at the pool that just fails to hold the trace).
    """

    status: Status
    step: int | None = None
    detail: str = ""
    pool_tokens: int | None = None

    @property
    def reproduced(self) -> bool:
        return self.status == "reproduced"


@dataclass(frozen=True, slots=True)
class Oracle:
    """How traces are replayed and judged.

    Args:
        target: the failure asked for.
        allocator: the version replayed for a violation or an out-of-memory.
        a, b: the versions compared for a divergence.
        exact: compare the physical slots too (``diff --exact``).
        baseline: a version that must not fail the same way (violation, out-of-memory).
        device: ``cpu`` or ``cuda``.
    """

    target: Target
    allocator: str = "builtin"
    a: str = "builtin"
    b: str | None = None
    exact: bool = False
    baseline: str | None = None
    device: str = "cpu"

    # ------------------------------------------------------------------ judging
    def judge(self, path: Path, signature: Signature) -> Outcome:
        """Replay (or diff) the trace at ``path`` and say whether it fails as ``signature``.

        Raises:
            KvtraceError, TraceError: the trace or configuration is refused (the
                caller counts the candidate invalid).
        """
        if signature.kind == "divergence":
            return self._judge_divergence(path, signature)
        if signature.kind == "oom":
            return self._judge_oom(path, signature)
        v = signature.matching_violation(self._replay(path, self.allocator, "end").stats.violations)
        if v is None:
            return Outcome("other", None, f"{self.allocator} shows no {signature.describe()}")
        if self.baseline is not None and signature.matching_violation(
            self._replay(path, self.baseline, "end").stats.violations
        ):
            return Outcome("other", v.step, f"the baseline {self.baseline} fails the same way")
        return Outcome("reproduced", v.step, f"{v.check}: {v.detail}")

    def _judge_oom(self, path: Path, signature: Signature) -> Outcome:
        """An out-of-memory in the same op, at the trace's pool or else at the pool that
        just fails to hold the trace: one page below the version's peak, or with a
        baseline the baseline's peak (the baseline fits, the version does not)."""
        from allocator.pages import ceil_align, floor_align

        main = self._replay(path, self.allocator, "never")
        pool = None
        if main.stats.oom is None:
            ref = main if self.baseline is None else self._replay(path, self.baseline, "never")
            if ref.stats.oom is not None:
                return Outcome("other", None, f"the baseline {self.baseline} runs out of memory first")
            ps, peak = ref.config.page_size, ref.stats.peak_used_tokens
            pool = ceil_align(peak, ps) if self.baseline is not None else floor_align(peak - 1, ps)
            if pool >= main.config.pool_tokens or pool < 2 * ps:
                return Outcome("other", None, f"{self.allocator} does not run out of memory")
            main = self._replay(path, self.allocator, "never", pool_tokens=pool)
        oom = main.stats.oom
        if oom is None or not signature.matches_oom(oom):
            what = "no out of memory" if oom is None else f"out of memory in {oom.op}"
            return Outcome("other", None, f"{what} with {self.allocator}" + (f" at a pool of {pool}" if pool else ""))
        if self.baseline is not None and signature.matches_oom(
            self._replay(path, self.baseline, "never", pool_tokens=pool).stats.oom
        ):
            return Outcome("other", oom.step, f"the baseline {self.baseline} runs out of memory the same way")
        return Outcome("reproduced", oom.step, _oom_failure(signature, oom).detail, pool)

    def _replay(self, path: Path, version: str, check: str, pool_tokens: int | None = None) -> Any:
        """One replay of a candidate (stopping at an out-of-memory); its ``ReplayResult``."""
        from kvtrace.replay.engine import ReplayOptions
        from kvtrace.replay.session import ReplaySession

        options = ReplayOptions(check=check, on_oom="stop")  # type: ignore[arg-type]
        with ReplaySession(path, version=_version(version), options=options, device=self.device,
                           pool_tokens=pool_tokens, checker="inline") as s:
            return s.run()

    def _judge_divergence(self, path: Path, signature: Signature) -> Outcome:
        report = self._diff(path, lockstep=True)
        first = report.first_divergence
        if first is None:
            return Outcome("other", None, "identical")
        d = first.divergence
        if not signature.matches_divergence(d):
            return Outcome("other", d.step, f"diverges first in {d.field}")
        return Outcome("reproduced", d.step, _divergence_text(d))

    def _diff(self, path: Path | str, *, lockstep: bool, page_size: int | None = None,
              pool_tokens: int | None = None) -> Any:
        """``diff_trace`` of A and B, first divergence only; ``lockstep``: both sides in
        this process when they can (a small trace: no child processes to start)."""
        from kvtrace.diff.diff import DiffOptions, diff_trace
        from kvtrace.versions.registry import AllocatorVersion, resolve_any

        assert self.b is not None
        in_process = all(isinstance(resolve_any(v), AllocatorVersion) for v in (self.a, self.b))
        return diff_trace(
            str(path), self.a, self.b, options=DiffOptions(exact=self.exact), page_size=page_size,
            pool_tokens=pool_tokens, device=self.device, jobs=1 if lockstep and in_process else None,
        )

    # ------------------------------------------------------------------ the input
    def locate(self, trace: str, *, page_size: int | None, pool_tokens: int | None) -> Failure | str:
        """Find the failure on the input trace (the what-if options applied).

        Returns:
            The failure, or one line saying why none was found.

        Raises:
            KvtraceError, TraceError: the trace, a version or an option is bad.
        """
        if self.target.kind == "divergence":
            report = self._diff(trace, lockstep=False, page_size=page_size, pool_tokens=pool_tokens)
            first = report.first_divergence
            if first is None:
                return f"{self.a} and {self.b} are identical over {report.steps_compared:,} steps"
            d = first.divergence
            return Failure(Signature("divergence", d.field), d.step, d.rid, _divergence_text(d))
        if self.target.kind == "oom":
            return self._locate_oom(trace, page_size, pool_tokens)
        return self._locate_violation(trace, page_size, pool_tokens)

    def _session(self, trace: str, what_if: dict[str, Any], check: str, stop: int | None = None) -> Any:
        from kvtrace.replay.engine import ReplayOptions
        from kvtrace.replay.session import ReplaySession

        options = ReplayOptions(check=check, on_oom="stop", stop_step=stop)  # type: ignore[arg-type]
        return ReplaySession(trace, version=_version(self.allocator), options=options, device=self.device, **what_if)

    def _locate_oom(self, trace: str, page_size: int | None, pool_tokens: int | None) -> Failure | str:
        with self._session(trace, {"page_size": page_size, "pool_tokens": pool_tokens}, "never") as s:
            result = s.run()
        oom = result.stats.oom
        if oom is None:
            return f"{self.allocator} replays all {result.stats.steps:,} steps without running out of memory"
        return _oom_failure(Signature("oom", oom.op), oom)

    def _locate_violation(self, trace: str, page_size: int | None, pool_tokens: int | None) -> Failure | str:
        what_if = {"page_size": page_size, "pool_tokens": pool_tokens}
        with self._session(trace, what_if, "never") as s:
            last_clean, broken, steps = self._scan(s)
            oom = s.engine.stats.oom
        if broken is None:
            why = f"the replay ran out of memory at step {oom.step} first" if oom is not None else "none was found"
            wanted = f"no {self.target.check} violation" if self.target.check else "no invariant violation"
            return f"{wanted} with {self.allocator} over {steps:,} steps ({why})"
        if isinstance(broken, Failure):
            return broken
        # A second replay, checked after every step between the two checks.
        with self._session(trace, what_if, "never", stop=broken + 1) as s:
            for snap in s.snapshots():
                if last_clean is not None and snap.step <= last_clean:
                    continue
                found = self._violation_now(s, snap.step)
                if found is not None:
                    return found
        return f"the violation found after step {broken} did not show again in a second replay (is {self.allocator} deterministic?)"

    def _scan(self, s: Any) -> tuple[int | None, int | Failure | None, int]:
        """Replay with a check every few steps: (the last step checked clean, the
        first step found broken or the failure when exact, steps replayed)."""
        stride, since, steps = 1, 0, 0
        last_clean: int | None = None
        step_s = 0.0
        t_prev = time.perf_counter()
        last = None
        for snap in s.snapshots():
            steps += 1
            last = snap.step
            now = time.perf_counter()
            step_s = 0.9 * step_s + 0.1 * (now - t_prev) if steps > 1 else now - t_prev
            engine_found = self._engine_violation(s)
            if engine_found is not None:
                return last_clean, engine_found, steps  # the engine's own checks are exact
            since += 1
            if since >= stride:
                t0 = time.perf_counter()
                found = self._matching(s.allocator.check_integrity(), snap.step)
                check_s = time.perf_counter() - t0
                if found is not None:
                    return last_clean, snap.step if since > 1 else found, steps
                last_clean, since = snap.step, 0
                stride = min(_MAX_STRIDE, max(1, int(check_s / max(step_s, 1e-6))))
            t_prev = time.perf_counter()
        if last is not None and since:
            found = self._matching(s.allocator.check_integrity(), last)
            if found is not None:
                return last_clean, last, steps
        return last_clean, None, steps

    def _violation_now(self, s: Any, step: int) -> Failure | None:
        return self._engine_violation(s) or self._matching(s.allocator.check_integrity(), step)

    def _engine_violation(self, s: Any) -> Failure | None:
        for v in s.engine.stats.violations:
            if self.target.check is None or v.check == self.target.check:
                return Failure(Signature.of_violation(v), v.step, v.rid, f"{v.check}: {v.detail}")
        return None

    def _matching(self, violations: list[Any], step: int) -> Failure | None:
        from kvtrace.replay.result import ViolationRecord

        for v in violations:
            if self.target.check is None or v.check == self.target.check:
                record = ViolationRecord(step, v.rid, "", v.check, v.detail, pool=getattr(v, "pool", "full"))
                return Failure(Signature.of_violation(record), step, v.rid, f"{v.check}: {v.detail}")
        return None


_VERSIONS: dict[str, Any] = {}


def _version(spec: str) -> Any:
    """The resolved version of a spec, resolved once per process (a file spec is run once)."""
    from kvtrace.versions.registry import resolve_version

    if spec not in _VERSIONS:
        _VERSIONS[spec] = resolve_version(spec)
    return _VERSIONS[spec]


def _oom_failure(signature: Signature, oom: Any) -> Failure:
    return Failure(
        signature, oom.step, oom.rid,
        f"out of memory in {oom.op}: request {oom.rid} needed {oom.needed:,}, free {oom.free:,}, evictable {oom.evictable:,}",
    )


def _divergence_text(d: Any) -> str:
    who = f"request {d.rid}" if d.rid is not None else "the pool"
    return f"{d.field} of {who} after {d.op}: {d.a} vs {d.b}"
