"""What pip installs: Triton only where it exists, the dev readers, one version."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

import kvtrace

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _environment(system: str, machine: str) -> dict[str, str]:
    return {"platform_system": system, "platform_machine": machine, "sys_platform": system.lower()}


def test_triton_is_installed_only_where_it_exists() -> None:
    (triton,) = [Requirement(r) for r in PROJECT["dependencies"] if r.startswith("triton")]
    assert triton.marker is not None
    assert triton.marker.evaluate(_environment("Linux", "x86_64"))
    assert triton.marker.evaluate(_environment("Linux", "aarch64"))
    for system, machine in (("Darwin", "arm64"), ("Darwin", "x86_64"), ("Windows", "AMD64"), ("Linux", "ppc64le")):
        assert not triton.marker.evaluate(_environment(system, machine)), (system, machine)
    # Nothing else needs a GPU toolchain: torch installs everywhere (CPU build or CUDA build).
    assert all(not r.startswith(("nvidia", "cuda")) for r in PROJECT["dependencies"])


def test_the_dev_extras_hold_the_readers_the_tests_check() -> None:
    dev = {Requirement(r).name for r in PROJECT["optional-dependencies"]["dev"]}
    assert {"polars", "pandas", "duckdb", "pytest", "hypothesis"} <= dev


def test_the_version_is_written_once() -> None:
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert kvtrace.__version__.count(".") == 2
