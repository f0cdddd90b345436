"""The ``--spec`` option's text (``off`` or ALGORITHM:STEPS,TOPK,DRAFT) -> the recorded
engine's speculative-decoding settings, checked as SGLang checks them."""

from __future__ import annotations

from typing import Any

import typer


def parse_spec(text: str) -> Any:
    """``--spec`` text -> ``SpecSettings``, or None for ``off``.

    Raises:
        typer.BadParameter: not ``off`` nor ALGORITHM:STEPS,TOPK,DRAFT with sane numbers.
    """
    if text.strip().lower() in ("off", "none"):
        return None
    algorithm, sep, numbers = text.partition(":")
    algorithm = algorithm.strip().lower()
    valid = ("eagle", "eagle3", "standalone", "dflash")
    if algorithm not in valid or not sep:
        raise typer.BadParameter(
            f"{text!r} is not off nor ALGORITHM:STEPS,TOPK,DRAFT with ALGORITHM one of {', '.join(valid)} "
            "(e.g. eagle:3,1,4)",
            param_hint="--spec",
        )
    try:
        steps, topk, draft = (int(x) for x in numbers.split(","))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r}: expected three integers STEPS,TOPK,DRAFT after '{algorithm}:' (e.g. eagle:3,1,4)",
            param_hint="--spec",
        ) from None
    if steps < 1 or topk < 1 or draft < 2:
        raise typer.BadParameter(f"{text!r}: STEPS and TOPK must be >= 1 and DRAFT >= 2", param_hint="--spec")
    if algorithm == "dflash":
        # SGLang's _handle_dflash: one step, topk 1, a verify block of DRAFT tokens
        if steps != 1 or topk != 1:
            raise typer.BadParameter(f"{text!r}: DFlash takes STEPS 1 and TOPK 1 (e.g. dflash:1,1,16)",
                                     param_hint="--spec")
    elif topk == 1 and draft > steps + 1:
        why = f"with TOPK 1 a chain of {steps} draft steps verifies at most {steps + 1} tokens"
        raise typer.BadParameter(f"{text!r}: {why}", param_hint="--spec")
    from kvtrace.record.simulate import spec_settings

    return spec_settings(text)
