"""``kvtrace record``'s HiCache options (SGLang's ``--hicache-*``) and the host tier they
resolve to (``traces.hicache_layout.resolve_host_tier``), kept apart from the rest of
the command's options."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import typer

from kvtrace.cli.options import finite

# What an option not given falls back to (the record command's wording).
_FROM_TRACE = "the trace's own; for a workload file "


class WritePolicyOption(str, Enum):
    write_through = "write_through"
    write_through_selective = "write_through_selective"
    write_back = "write_back"


HiCacheOpt = Annotated[
    bool | None,
    typer.Option(
        "--hicache/--no-hicache",
        help="Serve with HiCache's host KV tier under the radix cache (SGLang's --enable-hierarchical-cache); "
        "any --hicache-* option turns it on.",
        show_default=_FROM_TRACE + "off",
    ),
]
HiCacheRatioOpt = Annotated[
    float | None,
    typer.Option(
        "--hicache-ratio",
        help="Host pool tokens per device pool token (SGLang's --hicache-ratio).",
        show_default=_FROM_TRACE + "2.0",
        callback=finite,
    ),
]
HiCacheSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--hicache-size",
        help="Host pool in GB (SGLang's --hicache-size; overrides the ratio; full-attention models only).",
        show_default=_FROM_TRACE + "0: the ratio",
    ),
]
HiCacheWritePolicyOpt = Annotated[
    WritePolicyOption | None,
    typer.Option(
        "--hicache-write-policy",
        help="When device KV is backed up to the host (SGLang's --hicache-write-policy).",
        show_default=_FROM_TRACE + "write_through",
    ),
]


def host_tier_option(
    settings: dict[str, Any], *, enabled: bool | None, ratio: float | None, size_gb: int | None,
    write_policy: WritePolicyOption | None, resized: bool,
) -> Any:
    """The host tier a recording serves with (``traces.hicache_layout.resolve_host_tier``
    over the tier of the trace in ``settings``: a ``--like`` trace or a trace as the
    workload), or None.

    Raises:
        typer.BadParameter: naming the option whose value is refused.
    """
    from kvtrace.record.simulate import DEFAULT_MODEL_SHAPE
    from traces.hicache_layout import HostTierOptionError, resolve_host_tier

    model = settings.get("model", DEFAULT_MODEL_SHAPE)  # a workload file without --model: RecordOptions' default
    hybrid = settings.get("attention") is not None or settings.get("mamba") is not None
    try:
        return resolve_host_tier(
            settings.get("hicache"), enabled=enabled, ratio=ratio, size_gb=size_gb,
            write_policy=None if write_policy is None else write_policy.value,
            device_tokens=settings["pool_tokens"], page_size=settings["page_size"],
            bytes_per_token=model.bytes_per_token, hybrid_model=model.name if hybrid else None, resized=resized,
        )  # fmt: skip
    except HostTierOptionError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None
