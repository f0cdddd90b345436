"""Pilot tests of the aggregated alarms (``kvtrace.tui.widgets.toasts``): a replay that runs
out of memory again and again shows one card per kind with the count, not a toast each."""

from __future__ import annotations

from kvtrace.replay.engine import ReplayOptions
from kvtrace.tui.widgets.events_log import EventsLog
from kvtrace.tui.widgets.toasts import AlertToasts
from tests.helpers import SIZE, live_app, play_to_end, settle, text_of


async def test_many_ooms_make_one_card_with_their_count_and_m_mutes_it() -> None:
    # A pool too small for the tiny sample, and --on-oom skip: an OOM at many steps.
    app = live_app(pool_tokens=640, options=ReplayOptions(on_oom="skip"))
    async with app.run_test(size=SIZE) as pilot:
        frame = await play_to_end(pilot)
        ooms = [e for e in frame.events() if e.kind == "oom"]
        assert len(ooms) > 5, "a 640-token pool with --on-oom skip runs out again and again"
        toasts = app.main.query_one(AlertToasts)
        await settle(pilot, lambda a: toasts.counts().get((0, "oom")) == len(ooms))
        assert set(toasts.counts()) == {(0, "oom")}
        [card] = toasts.shown()
        text = text_of(card)
        assert f"out of memory ×{len(ooms):,}" in text
        assert f"latest: step {ooms[-1].step:,}" in text
        # No toast per event: Textual's own notifications carry none of them.
        assert not [n for n in app._notifications if "oom" in n.message.lower()]
        # The events log stays the full record.
        log = app.main.query_one(EventsLog)
        assert sum(e.kind == "oom" for e in log.shown) == len(ooms)

        await pilot.press("m")
        assert toasts.shown() == [] and not toasts.display
        assert any("muted" in n.message for n in app._notifications)
        await pilot.press("m")
        assert toasts.display and toasts.counts()[(0, "oom")] == len(ooms)


async def test_the_mute_key_is_in_the_help_and_the_footer() -> None:
    from kvtrace.tui.widgets.keybar import KeyBar

    from kvtrace.tui.screens import KEYS

    assert any(key == "m" and "mute" in what for key, what in KEYS)
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "m" in [h.key for h in app.main.query_one(KeyBar).shown()]
