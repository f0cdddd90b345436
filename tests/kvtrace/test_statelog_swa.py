"""The state log of a hybrid SWA replay holds each listed request's SWA cursor
(``swa_evicted_seqlen``), as the live snapshots have it; a full-attention log has no
such column (``test_swa_replay.test_a_full_attention_state_log_has_one_pool``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.statelog.log import SWA_EVICTED_COLUMN, block_of, open_state_log, read_state_log

SWA = "sample:mooncake-gpt-oss"
STOP = 150  # the window has slid past some requests' first tokens by then


def test_the_state_log_holds_each_requests_swa_cursor_as_the_snapshots_do(tmp_path: Path) -> None:
    log = tmp_path / "swa.kvstate"
    result = CliRunner().invoke(app, ["replay", SWA, "--steps", f":{STOP}", "--out", str(log)])
    assert result.exit_code == 0, result.stderr
    with ReplaySession(SWA, options=ReplayOptions(stop_step=STOP)) as s:
        live = list(s.snapshots())
    _, snaps = read_state_log(log)
    logged = list(snaps)
    assert [x.step for x in logged] == [x.step for x in live]
    for got, want in zip(logged, live):
        assert want.swa_evicted is not None and got.swa_evicted is not None
        assert np.array_equal(got.swa_evicted, want.swa_evicted), got.step
    assert max(int(x.swa_evicted.max(initial=0)) for x in logged) > 0, "the window never slid"
    # the dashboard's block read has them too, row for row
    _, reader = open_state_log(log)
    assert SWA_EVICTED_COLUMN in reader.schema.names
    blocks = [block_of(b) for b in reader.iter_batches()]
    assert np.array_equal(
        np.concatenate([b.swa_evicted for b in blocks]), np.concatenate([x.swa_evicted for x in logged])
    )
