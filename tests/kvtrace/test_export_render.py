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
