"""A sweep's results read back: one summary row per cell, and plots against pool size.

``load_results`` opens the Parquet file ``kvtrace sweep`` wrote; ``report_rows``
gives each cell's parameters (the effective pool and page size: a replay's
``pool_tokens``, a simulation's ``config.pool_tokens``) and the figures a capacity
planner reads first; ``write_plots`` draws, per input, the prefix hit rate, the
peak KV occupancy, the retractions and the simulated duration against the pool size
(log scale), one line per combination of the other parameters (page size, version,
…), as PNG (matplotlib, headless).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.errors import ConfigError, OutputError
from kvtrace.sweep.grid import PARAM_PREFIX

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["PANELS", "fmt_cell", "load_results", "report_rows", "write_plots"]

# (row key, panel title, y-axis label) of each plot panel.
PANELS: tuple[tuple[str, str, str], ...] = (
    ("prefix_hit_rate", "prefix hit rate", "hit rate"),
    ("peak_occupancy", "peak KV occupancy", "share of the pool"),
    ("retractions", "retractions", "retractions"),
    ("duration_s", "simulated duration", "seconds"),
)
# Parameters that tell the lines of a plot apart (the pool size is the x axis).
SERIES_KEYS = ("page_size", "version", "spec", "max_running", "chunk")


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
        pool = _first(raw, "pool_tokens", "config.pool_tokens")
        peak = raw.get("peak_used_tokens")
        spec = raw.get(PARAM_PREFIX + "spec")
        rows.append(
            {
                "input": raw["input"],
                "kind": raw["kind"],
                "status": raw["status"],
                "version": raw.get(PARAM_PREFIX + "version") or "builtin",
                "pool_tokens": pool,
                "page_size": _first(raw, "page_size", "config.page_size"),
                "spec": spec if spec is not None else raw.get("config.spec"),
                "max_running": _first(raw, "max_running", "config.max_running"),
                "chunk": _first(raw, PARAM_PREFIX + "chunk", "config.chunk"),
                "prefix_hit_rate": raw.get("prefix_hit_rate"),
                "peak_used_tokens": peak,
                "peak_occupancy": peak / pool if peak is not None and pool else None,
                "retractions": raw.get("retractions"),
                "duration_s": raw.get("duration_s"),
                "ttft_p50_s": raw.get("ttft_s.p50"),
                "ttft_p99_s": raw.get("ttft_s.p99"),
                "oom_step": raw.get("oom.step"),
                "error": raw.get("error"),
            }
        )
    return rows


def _series(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    varying = [k for k in SERIES_KEYS if len({str(r[k]) for r in rows}) > 1]
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        label = ", ".join(f"{k.replace('_', ' ')} {row[k]}" for k in varying) or "all cells"
        lines.setdefault(label, []).append(row)
    return lines


def write_plots(rows: Sequence[dict[str, Any]], directory: Path, *, force: bool, inputs: Sequence[Path]) -> list[Path]:
    """One PNG per input (four panels against the pool size) in ``directory``.

    Returns:
        The files written (an input whose cells all failed gets none).

    Raises:
        ConfigError: matplotlib is not installed.
        OutputError: a plot would replace an existing file without ``force``, or an input.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from None
    from kvtrace.outputs import OutputFile

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    by_input: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["status"] == "ok" and row["pool_tokens"]:
            by_input.setdefault(row["input"], []).append(row)
    for name, cells in by_input.items():
        stem = Path(name.removeprefix("sample:")).name.split(".")[0] or "input"
        target = OutputFile(directory / f"{stem}.png", option="--plots", force=force, inputs=inputs)
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
        for ax, (key, title, ylabel) in zip(axes.flat, PANELS):
            for label, line in sorted(_series(cells).items()):
                points = sorted((r["pool_tokens"], r[key]) for r in line if r[key] is not None)
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
            ax.xaxis.set_minor_formatter(FuncFormatter(_tokens))
            ax.set_title(title)
            ax.set_xlabel("pool size (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylim(bottom=0)
        handles, labels = axes.flat[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)))
        fig.suptitle(f"kvtrace sweep: {name} ({cells[0]['kind']})")
        with target.writing() as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        written.append(target.path)
    return written


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
