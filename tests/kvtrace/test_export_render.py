"""tools/render_pftrace.py: the README's picture is drawn from an export by the project's own
means; it runs on a tiny export (with flows) and writes a PNG of the layout it decodes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvtrace.cli import app
from tests.kvtrace.test_export_flows import _evicting_trace

ROOT = Path(__file__).resolve().parents[2]


def test_the_renderer_draws_a_tiny_export_as_a_png(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.pftrace"
    assert CliRunner().invoke(app, ["export", str(_evicting_trace(tmp_path)), "--out", str(trace), "--flows"]).exit_code == 0
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import render_pftrace
    finally:
        sys.path.remove(str(ROOT / "tools"))
    (proc,) = render_pftrace.decode(trace)[0]
    assert "full free" in proc.counters and sorted(proc.lanes) == ["lane 0", "lane 1"]
    assert len([e for e in proc.flow_ends.values() if set(e) == {"src", "dst"}]) == 2
    png = tmp_path / "tiny.png"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "render_pftrace.py"), str(trace), "--out", str(png)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 1_000 < len(data) < 300_000


def test_the_renderer_refuses_to_overwrite_and_damaged_input_in_one_line(tmp_path: Path) -> None:
    tool = [sys.executable, str(ROOT / "tools" / "render_pftrace.py")]
    trace = tmp_path / "t.pftrace"
    trace.write_bytes(b"not a perfetto trace at all")
    existing = tmp_path / "old.png"
    existing.write_bytes(b"keep me")
    for args, says in (
        ([str(trace), "--out", str(trace)], "is the trace itself"),
        ([str(trace), "--out", str(existing)], "give --force"),
        ([str(tmp_path / "missing.pftrace"), "--out", str(tmp_path / "m.png")], "no such file"),
        ([str(trace), "--out", str(tmp_path / "new.png")], "not a readable kvtrace export"),
    ):
        done = subprocess.run([*tool, *args], capture_output=True, text=True)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and says in lines[-1] and "Traceback" not in done.stderr, done.stderr
    assert existing.read_bytes() == b"keep me" and trace.read_bytes() == b"not a perfetto trace at all"
