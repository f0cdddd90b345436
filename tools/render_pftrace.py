"""Render a ``kvtrace export`` Perfetto trace as a PNG, laid out as the Perfetto UI shows it.

Usage (from the repository root)::

    python tools/render_pftrace.py conversation.pftrace --out docs/img/perfetto-conversation.png

No browser and no network: the file is decoded with Perfetto's own protobuf definitions
(the ``perfetto`` package) and drawn with matplotlib, one row per track as in the UI: the
process's counter tracks (each a filled step chart), the events track (instants as
ticks, coloured by kind), then the request lanes (each request a slice coloured by its
name as Perfetto colours slices, its phases nested under it) and flows as arrows. The
README's picture of the one-hour sample is made this way.
"""

from __future__ import annotations

import argparse
import colorsys
import sys
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_COUNTER_POINTS = 2000  # per counter track, resampled on the time axis
PHASE_COLOURS = {"waiting": "#b0bec5", "prefill": "#ef6c00", "decode": "#1e88e5", "spec": "#8e24aa"}
INSTANT_COLOURS = {"evict": "#d32f2f", "retract": "#f9a825", "abort": "#6d4c41", "oom": "#000000",
                   "overalloc_release": "#7cb342", "first divergence": "#c2185b"}


@dataclass
class Process:
    """The tracks of one process (one replay) of the file."""

    name: str
    counters: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    units: dict[str, str] = field(default_factory=dict)
    lanes: dict[str, list[tuple[int, int, str, int]]] = field(default_factory=lambda: defaultdict(list))
    instants: list[tuple[int, str]] = field(default_factory=list)
    flow_ends: dict[int, dict[str, tuple[int, str]]] = field(default_factory=lambda: defaultdict(dict))


def decode(path: Path) -> tuple[list[Process], int, int]:
    """The processes of a .pftrace (tracks in the order described) and its time span (ns).

    Each lane holds its slices as (begin, end, name, depth): depth 0 a request, 1 a phase.
    """
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    trace = Trace.FromString(path.read_bytes())
    processes: dict[int, Process] = {}
    tracks: dict[int, tuple[Process, str]] = {}
    stacks: dict[int, list[tuple[int, str]]] = defaultdict(list)
    lo, hi = None, 0
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.HasField("process"):
                processes[d.uuid] = Process(d.process.process_name)
            else:
                proc = processes[d.parent_uuid]
                tracks[d.uuid] = (proc, d.name)
                if d.HasField("counter"):
                    proc.units[d.name] = d.counter.unit_name
            continue
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        ts = p.timestamp
        lo = ts if lo is None else min(lo, ts)
        hi = max(hi, ts)
        proc, track = tracks[e.track_uuid]
        if e.type == TrackEvent.TYPE_COUNTER:
            value = e.double_counter_value if e.HasField("double_counter_value") else e.counter_value
            proc.counters[track].append((ts, value))
            for uuid, extra in zip(e.extra_counter_track_uuids, e.extra_counter_values):
                proc.counters[tracks[uuid][1]].append((ts, extra))
        elif e.type == TrackEvent.TYPE_SLICE_BEGIN:
            stacks[e.track_uuid].append((ts, e.name))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            begin, name = stacks[e.track_uuid].pop()
            proc.lanes[track].append((begin, ts, name, len(stacks[e.track_uuid])))
        elif e.type == TrackEvent.TYPE_INSTANT:
            if e.flow_ids or e.terminating_flow_ids:
                for fid in e.flow_ids:
                    proc.flow_ends[fid]["src"] = (ts, track)
                for fid in e.terminating_flow_ids:
                    proc.flow_ends[fid]["dst"] = (ts, track)
            elif track == "events":
                proc.instants.append((ts, e.name))
    return list(processes.values()), lo or 0, hi


def slice_colour(name: str) -> tuple[float, float, float]:
    """A stable colour per slice name (Perfetto colours slices by a hash of the name)."""
    h = zlib.crc32(name.encode()) % 360
    return colorsys.hls_to_rgb(h / 360, 0.62, 0.55)


def _resample(series: list[tuple[int, float]], grid: np.ndarray) -> np.ndarray:
    """The counter's value at each grid time (the last written at or before; 0 before the first)."""
    ts = np.array([t for t, _ in series], np.int64)
    vs = np.array([v for _, v in series], np.float64)
    idx = np.searchsorted(ts, grid, side="right") - 1
    out = np.where(idx >= 0, vs[np.clip(idx, 0, None)], 0.0)
    return out


def render(path: Path, out: Path, *, lanes: int = 24, width: float = 16.0, title: str | None = None) -> Path:
    """Draw the file at ``path`` as a PNG at ``out`` (at most ``lanes`` request lanes per process)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    processes, lo, hi = decode(path)
    span = max(hi - lo, 1)
    grid = np.linspace(lo, hi, MAX_COUNTER_POINTS).astype(np.int64)
    sec = lambda ts: (np.asarray(ts, np.float64) - lo) / 1e9  # noqa: E731
    rows: list[tuple[str, str, object]] = []  # (kind, label, payload)
    for proc in processes:
        rows.append(("process", proc.name, None))
        for name, series in proc.counters.items():
            unit = proc.units.get(name, "")
            rows.append(("counter", f"{name} ({unit})" if unit else name, series))
        rows.append(("events", "events", proc.instants))
        names = sorted(proc.lanes, key=lambda n: int(n.split()[-1]))
        for name in names[:lanes]:
            rows.append(("lane", name, proc.lanes[name]))
        if len(names) > lanes:
            rows.append(("note", f"... {len(names) - lanes} more lanes", None))
    heights = {"process": 0.35, "counter": 0.55, "events": 0.4, "lane": 0.28, "note": 0.25}
    total = sum(heights[k] for k, _, _ in rows)
    fig = plt.figure(figsize=(width, total + 0.9), dpi=100)
    fig.patch.set_facecolor("white")
    top = 1 - 0.45 / (total + 0.9)
    bottom = 0.45 / (total + 0.9)
    left, right = 0.17, 0.99
    y = top
    scale = (top - bottom) / total
    axes = []
    for kind, label, payload in rows:
        h = heights[kind] * scale
        y -= h
        ax = fig.add_axes((left, y, right - left, h))
        ax.set_xlim(0, span / 1e9)
        ax.set_yticks([])
        ax.tick_params(axis="x", labelbottom=False, length=0)
        for s in ("top", "right", "left"):
            ax.spines[s].set_visible(False)
        ax.spines["bottom"].set_color("#e0e0e0")
        fig.text(left - 0.005, y + h / 2, label, ha="right", va="center", fontsize=7 if kind != "process" else 8,
                 fontweight="bold" if kind == "process" else "normal", color="#202124")
        if kind == "process":
            ax.set_facecolor("#f1f3f4")
            ax.set_xticks([])
        elif kind == "counter":
            vals = _resample(payload, grid)  # type: ignore[arg-type]
            ax.fill_between(sec(grid), vals, step="post", color="#5c8dd6", alpha=0.55, linewidth=0)
            ax.plot(sec(grid), vals, drawstyle="steps-post", color="#3367d6", linewidth=0.5)
            peak = float(vals.max()) if vals.size else 0.0
            ax.set_ylim(0, peak * 1.1 or 1)
            ax.text(0.002, 0.92, f"max {peak:,.0f}" if peak >= 100 else f"max {peak:.3g}", transform=ax.transAxes,
                    fontsize=5.5, va="top", color="#5f6368", bbox={"facecolor": "white", "alpha": 0.7, "pad": 0.5,
                                                                   "linewidth": 0})
        elif kind == "events":
            by_kind: dict[str, list[int]] = defaultdict(list)
            for ts, name in payload:  # type: ignore[union-attr]
                by_kind[name].append(ts)
            for name, tss in sorted(by_kind.items()):
                ax.vlines(sec(tss), 0.1, 0.9, color=INSTANT_COLOURS.get(name, "#455a64"), linewidth=0.6)
            ax.set_ylim(0, 1)
            handles = [plt.Line2D([], [], color=INSTANT_COLOURS.get(n, "#455a64"), linewidth=2) for n in sorted(by_kind)]
            if handles:
                ax.legend(handles, sorted(by_kind), fontsize=5.5, loc="upper right", ncol=len(handles), frameon=False,
                          bbox_to_anchor=(1, 1.45))
        elif kind == "lane":
            for begin, end, name, depth in payload:  # type: ignore[union-attr]
                x0, w = (begin - lo) / 1e9, max((end - begin) / 1e9, span / 1e9 / 4000)
                if depth == 0:
                    ax.broken_barh([(x0, w)], (0.5, 0.48), facecolors=[slice_colour(name)], linewidth=0)
                else:
                    ax.broken_barh([(x0, w)], (0.02, 0.46), facecolors=[PHASE_COLOURS.get(name, "#9e9e9e")],
                                   linewidth=0)
            ax.set_ylim(0, 1)
        axes.append((kind, label, ax))
    # Flows: an arrow from the evicting request's lane to the lane of the admission that missed.
    by_label = {label: ax for kind, label, ax in axes if kind in ("lane", "events")}
    for proc in processes:
        for ends in proc.flow_ends.values():
            if "src" not in ends or "dst" not in ends:
                continue
            (ts0, t0), (ts1, t1) = ends["src"], ends["dst"]
            a0, a1 = by_label.get(t0), by_label.get(t1)
            if a0 is None or a1 is None:
                continue
            p0 = fig.transFigure.inverted().transform(a0.transData.transform(((ts0 - lo) / 1e9, 0.5)))
            p1 = fig.transFigure.inverted().transform(a1.transData.transform(((ts1 - lo) / 1e9, 0.5)))
            fig.add_artist(matplotlib.patches.FancyArrowPatch(p0, p1, transform=fig.transFigure, arrowstyle="-|>",
                                                              mutation_scale=5, color="#202124", linewidth=0.4,
                                                              alpha=0.6))
    last = axes[-1][2]
    last.tick_params(axis="x", labelbottom=True, labelsize=7, length=3)
    last.set_xlabel("simulated serving time (s)", fontsize=7)
    fig.text(0.5, 1 - 0.12 / (total + 0.9), title or path.name, ha="center", va="top", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a .pftrace written by kvtrace export")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--lanes", type=int, default=24, help="request lanes drawn per process (default 24)")
    parser.add_argument("--width", type=float, default=16.0, help="figure width in inches (100 dpi)")
    parser.add_argument("--title", default=None, help="a title (default: the file's name)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    args = parser.parse_args(argv)
    if args.out.resolve() == args.trace.resolve():
        parser.error("--out is the trace itself: give another path")
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists: give --force to overwrite it")
    if not args.trace.is_file():
        parser.error(f"{args.trace}: no such file")
    try:
        render(args.trace, args.out, lanes=args.lanes, width=args.width, title=args.title)
    except Exception as exc:  # a damaged or foreign file: one line, not a traceback
        parser.exit(2, f"render_pftrace: error: {args.trace}: not a readable kvtrace export ({exc})\n")
    print(f"{args.out}: {args.out.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
