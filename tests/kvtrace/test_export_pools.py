"""``kvtrace export`` of a sliding-window (SWA) model: a counter track per pool and counter,
checked against the replay, and full-attention exports unchanged by the per-pool tracks."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import kvtrace.export.timeline as timeline
from kvtrace.cli import app
from kvtrace.export.timeline import COUNTERS
from kvtrace.replay.session import ReplaySession
from tests.kvtrace.test_export import _FIELDS, _decode, _value_at

runner = CliRunner()
SWA_SAMPLE = "sample:mooncake-gpt-oss"


def test_an_swa_export_has_counter_tracks_per_pool_matching_the_replay(tmp_path: Path) -> None:
    out = tmp_path / "swa.pftrace"
    result = runner.invoke(app, ["export", SWA_SAMPLE, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pools"] == ["full", "swa"]
    got = _decode(out)
    for pool in ("full", "swa"):
        for counter in COUNTERS:
            assert f"{pool} {counter}" in got["counters"], (pool, counter)
    with ReplaySession(SWA_SAMPLE) as session:
        snaps = list(session.snapshots())
    assert snaps[0].other_pools
    swa_free = {snap.other_pools[0].available for snap in snaps}
    assert len(swa_free) > 1  # the SWA pool moves: the check below reads real values
    for snap in (snaps[0], snaps[len(snaps) // 3], snaps[len(snaps) // 2], snaps[-1]):
        ts = int(round(snap.time_s * 1e9))
        for pool, counters in snap.pools.items():
            for counter, field in zip(COUNTERS, _FIELDS, strict=True):
                assert _value_at(got["counters"][f"{pool} {counter}"], ts) == getattr(counters, field), (
                    snap.step, pool, counter)


def test_a_full_attention_export_is_byte_identical_to_one_pool_tracks(tmp_path: Path, monkeypatch) -> None:
    # The full-attention file is the one the single-pool timeline wrote: per-pool tracks add nothing.
    new = tmp_path / "new.pftrace"
    assert runner.invoke(app, ["export", "sample:tiny", "--out", str(new)]).exit_code == 0
    monkeypatch.setattr(timeline, "pools_of", lambda snap: (("full", snap.pool),))
    old = tmp_path / "old.pftrace"
    assert runner.invoke(app, ["export", "sample:tiny", "--out", str(old)]).exit_code == 0
    assert new.read_bytes() == old.read_bytes()


def test_a_mamba_export_names_its_second_pool_mamba(tmp_path: Path) -> None:
    # The pools are named as the replay names them, not by position ("swa" was second).
    out = tmp_path / "mamba.pftrace"
    result = runner.invoke(app, ["export", "sample:mooncake-qwen3-next", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pools"] == ["full", "mamba"]
    got = _decode(out)
    assert f"mamba {COUNTERS[0]}" in got["counters"]
    assert not any(name.startswith("swa ") for name in got["counters"]), sorted(got["counters"])
