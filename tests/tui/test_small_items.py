"""The dashboard's smaller fixes of issue #41, one Pilot test each: the ``finish``
event kind lists the requests the trace finished, ..."""

from __future__ import annotations

import numpy as np

from kvtrace.replay.snapshot import PHASES
from kvtrace.tui.widgets.events_log import EventsLog
from tests.helpers import SIZE, at_step, live_app, settle


async def test_the_finish_kind_lists_the_requests_the_trace_finished() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("shift+right")
        await settle(pilot, at_step(99))
        log = app.main.query_one(EventsLog)
        while log.kind != "finish":  # k cycles the kinds shown
            await pilot.press("k")
        shown = log.shown
        req = app.frame.requests
        finished = np.flatnonzero(req.phase == PHASES.index("finished"))
        assert shown and finished.shape[0]
        assert {e.kind for e in shown} == {"finish"} and all(e.step <= 99 for e in shown)
        assert {e.rid for e in shown} >= set(finished.tolist())
        for rid in finished.tolist():  # the last finish of each is the step it ended
            assert max(e.step for e in shown if e.rid == rid) == int(req.ended_step[rid]), rid
