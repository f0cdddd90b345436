"""A sweep's results read back: one summary row per cell, and plots against pool size.

``load_results`` opens the Parquet file ``kvtrace sweep`` wrote; ``report_rows``
gives each cell's parameters (the effective pool and page size: a replay's
``pool_tokens``, a simulation's ``config.pool_tokens``) and the figures a capacity
planner reads first; ``write_plots`` draws, per input, the prefix hit rate, the
peak KV occupancy, the retractions and the simulated duration against the pool size
(log scale), one line per combination of the other parameters (page size, version,
…), as PNG (matplotlib, headless). A line joins complete runs only: a replay an
out-of-memory stopped is a cross off the line (its figures cover part of the trace),
and a cell whose check found violations is ringed in red. A sweep over HiCache's host
tier also gets, per input, its prefix reuse split by tier (device hit, host hit) against
the host pool (``write_hicache_plots``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvtrace.errors import ConfigError, OutputError
from kvtrace.sweep.grid import PARAM_PREFIX

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "PANELS",
    "SeriesPoints",
    "fmt_cell",
    "hicache_lines",
    "load_results",
    "report_rows",
    "series_points",
    "write_plots",
]

# (row key, panel title, y-axis label) of each plot panel.
PANELS: tuple[tuple[str, str, str], ...] = (
    ("prefix_hit_rate", "prefix hit rate", "hit rate"),
    ("peak_occupancy", "peak KV occupancy", "share of the pool"),
    ("retractions", "retractions", "retractions"),
    ("duration_s", "simulated duration", "seconds"),
)
# The PNG ``Software`` text of the plots: a re-run of the report may replace them.
PLOT_SOFTWARE = "kvtrace sweep report"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Legend entries of the marks off or on the lines: (text, Line2D style).
_MARKS: dict[str, tuple[str, dict[str, Any]]] = {
    "stopped": ("stopped by an out-of-memory (part of the trace)", {"marker": "x", "color": "gray"}),
    "violations": ("invariant violations", {"marker": "o", "markersize": 11, "markerfacecolor": "none", "color": "red"}),
}
# Parameters that tell the lines of a plot apart (the pool size is the x axis).
SERIES_KEYS = (
    "page_size", "version", "spec", "max_running", "chunk", "swa_window", "swa_full_tokens_ratio", "eviction_policy",
    "hicache_ratio", "hicache_write_policy",
)


def load_results(path: Path) -> pa.Table:
    """Read a sweep's results.

    Raises:
        OutputError: no such file, or not a Parquet file of ``kvtrace sweep``.
    """
    import pyarrow.parquet as pq

    if not path.is_file():
        raise OutputError(f"{path}: no such file; give the --out of a finished kvtrace sweep")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a non-Parquet file
        raise OutputError(f"{path}: not a Parquet file ({exc})") from None
    missing = [c for c in ("cell", "input", "kind", "status") if c not in table.column_names]
    if missing:
        raise OutputError(f"{path}: not the results of kvtrace sweep (no {', '.join(missing)} column)")
    return table


def _first(row: dict[str, Any], *names: str) -> Any:
    for name in names:
        value = row.get(name)
        if value is not None:
            return value
    return None


def report_rows(table: pa.Table) -> list[dict[str, Any]]:
    """One dict per cell: its input, kind, status, parameters and headline figures."""
    rows = []
    for raw in table.to_pylist():
        # A failed cell has no summary: its parameters are the ones it asked for.
        pool = _first(raw, "pool_tokens", "config.pool_tokens", PARAM_PREFIX + "pool_tokens")
        peak = raw.get("peak_used_tokens")
        spec = raw.get(PARAM_PREFIX + "spec")
        violations = _num_violations(raw)
        status = raw["status"]
        if status == "ok" and (violations or raw.get("stopped_early")):  # a file of a kvtrace that called them ok
            status = "violations" if violations else "oom"
        rows.append(
            {
                "input": raw["input"],
                "kind": raw["kind"],
                "status": status,
                "version": raw.get(PARAM_PREFIX + "version") or "builtin",
                "pool_tokens": pool,
                "page_size": _first(raw, "page_size", "config.page_size", PARAM_PREFIX + "page_size"),
                "spec": spec if spec is not None else raw.get("config.spec"),
                "max_running": _first(raw, "max_running", "config.max_running", PARAM_PREFIX + "max_running"),
                "chunk": _first(raw, PARAM_PREFIX + "chunk", "config.chunk"),
                "eviction_policy": raw.get(PARAM_PREFIX + "eviction_policy") or "own",
                "prefix_hit_rate": raw.get("prefix_hit_rate"),
                "peak_used_tokens": peak,
                "peak_occupancy": peak / pool if peak is not None and pool else None,
                "retractions": raw.get("retractions"),
                "duration_s": raw.get("duration_s"),
                "ttft_p50_s": raw.get("ttft_s.p50"),
                "ttft_p99_s": raw.get("ttft_s.p99"),
                "oom_step": raw.get("oom.step"),
                "violations": violations,
                "stopped_early": bool(raw.get("stopped_early")),
                "problem": raw.get("problem"),
                "error": raw.get("error"),
                **_swa_figures(raw),
                **_mamba_figures(raw),
                **_hicache_figures(raw, pool),
            }
        )
    return rows


def _swa_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """A hybrid (SWA) model's cell: its window and pool ratio (None: the input's own), the
    SWA pool and its peak. Nothing for a full-attention cell (its row stays as it was)."""
    asked = {k: raw.get(PARAM_PREFIX + k) for k in ("swa_window", "swa_full_tokens_ratio")}
    pool = raw.get("pools.swa.pool_tokens")
    if pool is None and all(v is None for v in asked.values()):
        return {}
    peak = raw.get("pools.swa.peak_used_tokens")
    return {**asked, "swa_pool_tokens": pool, "swa_peak_used_tokens": peak,
            "swa_peak_occupancy": peak / pool if peak is not None and pool else None}


def _mamba_figures(raw: dict[str, Any]) -> dict[str, Any]:
    """A hybrid linear-attention model's cell: its Mamba state slots and their peak use.
    Nothing for any other cell (its row stays as it was)."""
    slots = raw.get("pools.mamba.pool_tokens")
    if slots is None:
        return {}
    peak = raw.get("pools.mamba.peak_used_tokens")
    return {"mamba_slots": slots, "mamba_peak_used_slots": peak,
            "mamba_peak_occupancy": peak / slots if peak is not None and slots else None}


def _hicache_figures(raw: dict[str, Any], pool: int | None) -> dict[str, Any]:
    """A cell of a sweep over HiCache's host tier, or of a tiered input: the tier's ratio,
    pool and write policy, and the admitted prefix tokens split by where they came from
    (shares of all admitted: ``device_hit_rate + host_hit_rate`` is the prefix hit rate,
    ``miss_rate`` the rest). A cell without a tier (ratio 0) hits the device only. Nothing
    for any other cell (its row stays as it was)."""
    asked = raw.get(PARAM_PREFIX + "hicache_ratio")
    host_pool = raw.get("hicache.host_pool_tokens")
    if asked is None and host_pool is None and raw.get(PARAM_PREFIX + "hicache_write_policy") is None:
        return {}
    split = {k: raw.get(f"hicache.prefix_tokens.{k}") for k in ("device", "host", "miss")}
    total = sum(v for v in split.values() if v is not None)
    hit = raw.get("prefix_hit_rate")
    if host_pool is None:  # no tier: every reused token was on the device
        rates = (hit, 0.0 if hit is not None else None, None if hit is None else 1.0 - hit)
    elif total:
        rates = tuple((split[k] or 0) / total for k in ("device", "host", "miss"))
    else:
        rates = (None, None, None)
    ratio = asked if asked is not None else (host_pool / pool if host_pool is not None and pool else 0.0)
    return {
        "hicache_ratio": ratio,
        "hicache_write_policy": raw.get("hicache.write_policy") or raw.get(PARAM_PREFIX + "hicache_write_policy"),
        "host_pool_tokens": host_pool or 0,
        "device_hit_rate": rates[0],
        "host_hit_rate": rates[1],
        "miss_rate": rates[2],
    }


def _num_violations(raw: dict[str, Any]) -> int | None:
    """A replay's violations, or a simulation's allocator integrity violations (JSON text)."""
    if raw.get("num_violations") is not None:
        return raw["num_violations"]
    found = raw.get("integrity_violations")
    return len(json.loads(found)) if isinstance(found, str) else None


class SeriesPoints(NamedTuple):
    """One plot line's (pool tokens, value) points.

    Attributes:
        line: complete runs, joined by the line.
        stopped: replays an out-of-memory stopped (their figures cover part of the
            trace), drawn apart from the line.
        violations: the points (of either kind) whose check found violations.
    """

    line: list[tuple[int, float]]
    stopped: list[tuple[int, float]]
    violations: list[tuple[int, float]]


def series_points(cells: Sequence[dict[str, Any]], key: str) -> dict[str, SeriesPoints]:
    """The points of panel ``key``, per line (a combination of the parameters other
    than the pool size), of the cells that ran (not ``failed``)."""
    ran = [r for r in cells if r["status"] != "failed" and r["pool_tokens"] and r[key] is not None]
    out = {}
    for label, line in _series(ran).items():
        points = SeriesPoints([], [], [])
        for row in sorted(line, key=lambda r: r["pool_tokens"]):
            point = (row["pool_tokens"], row[key])
            (points.stopped if row["stopped_early"] else points.line).append(point)
            if row["violations"]:
                points.violations.append(point)
        out[label] = points
    return out


def _series(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    varying = [k for k in SERIES_KEYS if len({str(r.get(k)) for r in rows}) > 1]
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        label = ", ".join(f"{k.replace('_', ' ')} {row.get(k)}" for k in varying) or "all cells"
        lines.setdefault(label, []).append(row)
    return lines


def write_plots(rows: Sequence[dict[str, Any]], directory: Path, *, force: bool, inputs: Sequence[Path]) -> list[Path]:
    """One PNG per input (four panels against the pool size) in ``directory``.

    Returns:
        The files written (an input whose cells all failed gets none).

    Raises:
        ConfigError: matplotlib is not installed.
        OutputError: the directory cannot be made or is a file, or a plot would replace
            an input, or without ``force`` an existing file an earlier report did not draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from None

    if directory.exists() and not directory.is_dir():
        raise OutputError(f"--plots {directory} is a file, not a directory; give a directory (or pass --no-plots)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"--plots {directory}: cannot create the directory ({exc.strerror or exc})") from None
    written = []
    by_input: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["status"] != "failed" and row["pool_tokens"]:
            by_input.setdefault(row["input"], []).append(row)
    for name, cells in by_input.items():
        target = _plot_target(directory, name, "", force=force, inputs=inputs)
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        marks: set[str] = set()
        for ax, (key, title, ylabel) in zip(axes.flat, PANELS):
            for i, (label, points) in enumerate(sorted(series_points(cells, key).items())):
                color = colors[i % len(colors)]
                ax.plot(*(zip(*points.line) if points.line else ([], [])), marker="o", color=color, label=label)
                if points.stopped:
                    ax.scatter(*zip(*points.stopped), marker="x", s=60, color=color)
                    marks.add("stopped")
                if points.violations:
                    ax.scatter(*zip(*points.violations), s=160, facecolors="none", edgecolors="red")
                    marks.add("violations")
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
            ax.xaxis.set_minor_formatter(FuncFormatter(_tokens))
            ax.set_title(title)
            ax.set_xlabel("pool size (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylim(bottom=0)
        handles, labels = axes.flat[0].get_legend_handles_labels()
        for mark, (text, style) in _MARKS.items():
            if mark in marks:
                handles.append(Line2D([], [], linestyle="none", **style))
                labels.append(text)
        if handles:
            fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)))
        fig.suptitle(f"kvtrace sweep: {name} ({cells[0]['kind']})")
        _save(fig, target)
        written.append(target.path)
    return [*written, *write_hicache_plots(rows, directory, force=force, inputs=inputs)]


def hicache_lines(cells: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The lines of an input's host-tier plot: its cells with tier figures that ran to the
    end, per combination of the other parameters (the write policy among them), in host
    pool order. A cell without a tier (ratio 0, no write policy) starts every line of
    its other parameters."""
    ran = [r for r in cells if "device_hit_rate" in r and r["status"] != "failed" and not r["stopped_early"]
           and r["device_hit_rate"] is not None]
    keys = [k for k in ("pool_tokens", *SERIES_KEYS) if k not in ("hicache_ratio", "hicache_write_policy")]
    varying = [k for k in keys if len({str(r.get(k)) for r in ran}) > 1]
    policies = sorted({r["hicache_write_policy"] for r in ran if r["host_pool_tokens"] and r["hicache_write_policy"]})
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in ran:
        base = [f"{k.replace('_', ' ')} {row.get(k)}" for k in varying]
        # a cell with no tier has no write policy: it belongs to every policy's line
        for policy in [row["hicache_write_policy"]] if row["host_pool_tokens"] else policies or [None]:
            label = ", ".join([*base, *([policy] if len(policies) > 1 and policy else [])]) or "all cells"
            lines.setdefault(label, []).append(row)
    return {label: sorted(rows, key=lambda r: r["host_pool_tokens"]) for label, rows in lines.items()}


def write_hicache_plots(rows: Sequence[dict[str, Any]], directory: Path, *, force: bool, inputs: Sequence[Path]) -> list[Path]:
    """Per input whose cells vary HiCache's host tier: the prefix hit rate (device and
    host hits together, solid) and its device part (dashed) against the host pool, as
    ``STEM-hicache.png`` in ``directory`` (which ``write_plots`` made).

    Raises:
        OutputError: as ``write_plots``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    written = []
    by_input: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_input.setdefault(row["input"], []).append(row)
    for name, cells in by_input.items():
        lines = hicache_lines(cells)
        if len({r["host_pool_tokens"] for line in lines.values() for r in line}) < 2:
            continue  # no host-tier axis to draw
        target = _plot_target(directory, name, "-hicache", force=force, inputs=inputs)
        fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (label, line) in enumerate(sorted(lines.items())):
            x = [r["host_pool_tokens"] for r in line]
            color = colors[i % len(colors)]
            ax.plot(x, [r["device_hit_rate"] + (r["host_hit_rate"] or 0) for r in line], marker="o", color=color,
                    label=f"{label}: device + host hits" if label != "all cells" else "device + host hits")
            ax.plot(x, [r["device_hit_rate"] for r in line], marker=".", linestyle="--", color=color,
                    label=f"{label}: device hits" if label != "all cells" else "device hits")
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel("HiCache host pool (tokens)")
        ax.set_ylabel("admitted prefix tokens reused")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        ax.set_title(f"kvtrace sweep: {name}: prefix reuse by HiCache tier")
        _save(fig, target)
        written.append(target.path)
    return written


def _plot_target(directory: Path, name: str, suffix: str, *, force: bool, inputs: Sequence[Path]) -> Any:
    """The ``OutputFile`` of input ``name``'s plot in ``directory`` (``STEM{suffix}.png``); a
    plot an earlier report drew is this command's own output, drawn again."""
    from kvtrace.outputs import OutputFile

    stem = Path(name.removeprefix("sample:")).name.split(".")[0] or "input"
    path = directory / f"{stem}{suffix}.png"
    return OutputFile(path, option="--plots", force=force or _made_by_report(path), inputs=inputs)


def _save(fig: Any, target: Any) -> None:
    """Write ``fig`` to ``target`` as a PNG that names its maker, and close it."""
    import matplotlib.pyplot as plt

    with target.writing() as tmp:
        fig.savefig(tmp, format="png", dpi=110, metadata={"Software": PLOT_SOFTWARE})
    plt.close(fig)


def _made_by_report(path: Path) -> bool:
    """Whether ``path`` is a PNG whose ``Software`` text chunk says ``kvtrace sweep report``
    (the text chunks come before the image data: only the head is read)."""
    try:
        with path.open("rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    if not head.startswith(_PNG_SIGNATURE):
        return False
    at = len(_PNG_SIGNATURE)
    while at + 8 <= len(head):
        length, kind = int.from_bytes(head[at : at + 4], "big"), head[at + 4 : at + 8]
        if kind == b"IDAT":
            break
        if kind == b"tEXt":
            key, _, value = head[at + 8 : at + 8 + length].partition(b"\0")
            if key == b"Software" and value == PLOT_SOFTWARE.encode():
                return True
        at += 12 + length  # length, type, data, CRC
    return False


def _tokens(value: float, _pos: int) -> str:
    """An axis tick in tokens: 150k, 1.2M."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def fmt_cell(value: Any, kind: str = "") -> str:
    """A table cell: integers with separators, rates as percentages, '-' for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
