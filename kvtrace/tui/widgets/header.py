"""The header: trace and source, pool and page configuration, version, step N of M,
simulated time, replay speed and play state; for a trace with streaming sessions, the
sessions open and held between turns (where the line has room for them beside the trace's
name: the occupancy panel's title says it too); for a hybrid model (more than one KV pool)
a third line with each pool's use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from kvtrace.tui.widgets.text_lines import TextLines

if TYPE_CHECKING:
    from kvtrace.tui.driver import Frame
    from kvtrace.tui.remote.sources import SourceInfo

__all__ = ["STOP_REASONS", "ReplayHeader", "clock_time", "config_text", "pools_text", "sessions_text", "speed_label",
           "state_text"]

# What stopped a replay early, by the kind of the alarm at its last step.
STOP_REASONS = {"oom": "out of memory", "violation": "invariant violation", "bad_op": "impossible op"}


def clock_time(seconds: float) -> str:
    """Simulated seconds as H:MM:SS.s, rounded to the tenth before it is split into
    hours, minutes and seconds, so a time just under a minute never reads as :60.0."""
    tenths = round(max(seconds, 0.0) * 10)
    minutes, tenths = divmod(tenths, 600)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{tenths // 10:02d}.{tenths % 10}"


def state_text(frame: Frame, info: SourceInfo) -> Text:
    """The play state: playing, paused, done, or why the replay stopped before its last step
    (an out-of-memory with ``--on-oom stop``, a violation past ``--max-violations``, a
    replay process that died)."""
    if frame.died is not None:
        return Text("■ replay process died", style="bold white on red")
    if frame.done:
        reason = None
        if frame.step is not None and info.last_step is not None and frame.step < info.last_step:
            for e in reversed(frame.events()):
                if e.step != frame.step:
                    break
                reason = STOP_REASONS.get(e.kind, reason)
        if reason is not None:
            return Text(f"■ stopped: {reason}", style="bold red")
        return Text("■ done", style="bold red" if frame.alerts else "bold")
    if frame.playing:
        return Text("▶ playing", style="bold green")
    return Text("‖ paused", style="bold yellow")


def pools_text(frame: Frame, shown: str | None = None) -> Text:
    """Each pool's use: 'full 12,345/50,000 24.7%  swa 1,234/8,000 15.4%' (``shown``: the
    pool the occupancy panel shows, underlined). The Mamba pool counts state slots and
    says so: 'mamba 4/16 slots 25.0%'."""
    parts: list[str | tuple[str, str]] = [("pools ", "dim")]
    for i, (name, pool) in enumerate(frame.pools.items()):
        used, total = pool.used_tokens, pool.pool_tokens
        unit = " slots" if name == "mamba" else ""
        parts += ["  " if i else "", (name, "bold underline" if name == shown else "bold"),
                  f" {used:,}/{total:,}{unit} {100 * used / max(total, 1):.1f}%"]
    return Text.assemble(*parts)


def sessions_text(frame: Frame) -> Text:
    """The streaming sessions now: 'sessions 12 open · 6 held' (held: between turns, their
    KV kept; open: held, or in a later turn)."""
    req = frame.requests
    num_open = int(req.open_sessions().sum())
    num_held = int(req.held().sum())
    return Text.assemble(("sessions ", "dim"), (f"{num_open:,}", "bold"), " open · ",
                         (f"{num_held:,}", "bold"), " held")


def config_text(info: SourceInfo, room: int) -> Text:
    """The configuration line in ``room`` cells: pool, page, the radix cache where it is
    not the default (``SourceInfo.cache``: 'slru · 3 namespaces'), pages, running max,
    device, and for a state log 'from a state log'. Where it does not fit, whole parts go
    from its end (a part cut in the middle read as '248 pa…'), down to pool, page and the
    cache; then 'tokens' and 'namespaces' shorten ('pool 60,000 · page 16 · slru · 3 ns');
    what still does not fit is cut."""
    parts = info.config.split(" · ")
    head, rest = parts[:2], parts[2:] + ([] if info.live else ["from a state log"])
    cache = [info.cache] if info.cache else []

    def line(first: list[str], kept: list[str], after: list[str]) -> Text:
        text = Text(" · ".join(first))
        for part in kept:
            text.append(" · ")
            text.append(part, style="bold")
        for part in after:
            text.append(" · " + part)
        return text

    for n in range(len(rest), -1, -1):
        text = line(head, cache, rest[:n])
        if text.cell_len <= room:
            return text
    short_head = [head[0].removesuffix(" tokens"), *head[1:]]
    short_cache = [c.replace(" namespaces", " ns").replace(" namespace", " ns") for c in cache]
    return line(short_head, short_cache, [])


def speed_label(speed: float | None, achieved: float | None) -> str:
    """'max (1,131× real time)' / '100× (98×)'."""
    asked = "max" if speed is None else f"{speed:,.0f}×"
    return asked if achieved is None else f"{asked} ({achieved:,.0f}× real time)"


class ReplayHeader(TextLines):
    """Two lines about the replay; ``show`` redraws what changed for a frame. Until the first
    frame it says that the replay is starting (reading the trace, building the allocator
    can take seconds: the screen is never blank meanwhile)."""

    def on_mount(self) -> None:
        if not self.content.plain:
            self.set_lines([Text.assemble(("kvtrace ", "bold"), ("starting the replay…", "bold yellow")),
                            Text("reading the trace and setting up the allocator", style="dim")])

    def show(self, info: SourceInfo, frame: Frame, shown_pool: str | None = None) -> None:
        state = state_text(frame, info)
        if frame.busy:
            state.append(f" · {frame.busy}…", style="italic")
        step = "-" if frame.step is None else f"{frame.step:,}"
        total = f" of {info.last_step:,}" if info.last_step is not None else ""
        width = max(self.size.width - 2, 40)
        left1 = Text.assemble(("kvtrace ", "bold"), (info.name, "bold cyan"), "  ", (info.source, "dim"))
        right1 = Text.assemble("version ", (info.version, "bold"), "  ", state)
        if info.sessions and frame.requests is not None:
            # only where the trace's name keeps its room (the occupancy panel's title says it too)
            with_sessions = Text.assemble(sessions_text(frame), "  ", right1)
            name = len("kvtrace ") + Text(info.name).cell_len
            if name + 2 + with_sessions.cell_len + 1 <= width:
                right1 = with_sessions
        right2 = Text.assemble(
            ("step ", "dim"), (step, "bold"), total,
            ("  t=", "dim"), clock_time(frame.time_s),
            ("  speed ", "dim"), speed_label(frame.speed, frame.achieved_speed if frame.playing else None),
        )
        left2 = config_text(info, width - right2.cell_len - 1)
        lines = [_spread(left1, right1, width), _spread(left2, right2, width)]
        if frame.other_pools:  # a hybrid model: each pool's use (a full-attention one has line 2's config)
            lines.append(_spread(pools_text(frame, shown_pool), Text("p: next pool", style="dim"), width))
        self.set_lines(lines)


def _spread(left: Text, right: Text, width: int) -> Text:
    """``left`` and ``right`` on one line of ``width`` cells (left cut first)."""
    room = width - right.cell_len - 1
    if left.cell_len > room:
        left = left[: max(room - 1, 0)] + Text("…")
    return Text.assemble(left, " " * max(width - left.cell_len - right.cell_len, 1), right)
