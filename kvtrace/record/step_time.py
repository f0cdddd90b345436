"""How long one scheduler step takes on the modelled GPU: the clock of ``kvtrace record``.

The scheduler model maps a workload's wall-clock arrivals onto steps: the clock
advances by each step's modelled time, and jumps to the next arrival when idle. The
model is linear in what a step does::

    t = fixed_s
      + prefill_token_s  * (tokens prefilled this step)
      + prefill_pair_s   * (causal attention pairs of the prefill: sum e * (p + e/2)
                            over extended requests, e = extend length, p = prefix)
      + decode_req_s     * (decode tokens this step: one per decoding request, or
                            num_draft_tokens per request in a speculative verify)
      + context_token_s  * (KV tokens read by decode attention: sum of seq_lens)
      + draft_step_s     * (speculative draft steps this step)

Defaults: Llama-3.1-8B (32 layers, hidden 4096, 8 KV heads of 128, bf16: 128 KiB of
KV per token) on one NVIDIA H200 (989 TFLOPS dense bf16, 4.8 TB/s HBM3e), from these
published figures and this arithmetic:

* ``fixed_s`` = 6.2 ms. vLLM's CI benchmark on H200, Llama-3.1-8B, batch 8, 32 input
  and 128 output tokens: 833.4 ms mean latency (buildkite.com/vllm/performance-benchmark
  build 9515, test ``latency_llama8B_tp1``) = 6.51 ms per step; less the per-request
  and attention terms below (8 x 27 us + 8 x ~96 x 36 ns = 0.24 ms) = 6.27 ms, rounded
  to 6.2 ms. It is dominated by reading the 16.1 GB of weights (3.35 ms at 4.8 TB/s)
  plus launch and sampling overhead.
* ``prefill_token_s`` = 33 us. SGLang PR #1060 (Aug 2024, a Hopper H100 run;
  prefill is compute-bound and H200 has the H100's 989 TFLOPS, so the figure carries
  over, as NVIDIA's H200 launch notes say of first-token latency): Llama-3.1-8B-Instruct,
  ``bench_serving --random-input 8192 --random-output 8``, 1000 prompts, 4,064,944
  input tokens in 146.91 s (27,670 input tok/s). Subtracting the steps' fixed cost
  (about 248 batches of 16,384 tokens x 6.2 ms = 1.5 s) and the prompts' own causal
  attention (1000 x 11.2 M pairs x 1.06 ns = 11.9 s; uniform lengths up to 8192 give
  E[L^2]/2 = 11.2 M pairs each): (146.91 - 1.5 - 11.9) s / 4,064,944 = 32.8 us.
* ``prefill_pair_s`` = 1.06 ns. One (query, key) pair costs 4 x layers x hidden =
  4 x 32 x 4096 = 524,288 FLOP (QK^T and PV); at 50% of 989 TFLOPS (FlashAttention-3
  reaches about 75% of peak on Hopper in bf16, Shah et al. 2024; 50% allows for
  the paged KV and small chunks): 524,288 / 4.95e14 = 1.06 ns.
* ``decode_req_s`` = 27 us. One generated token costs 2 x 8.03e9 = 16.1 GFLOP of
  weight matmuls; at 60% of 989 TFLOPS: 16.1e9 / 5.93e14 = 27 us. (At small batches
  decode is bound by the weight read already in ``fixed_s``, so this overestimates a
  little there; at a few hundred requests it is the compute the GPU must do.)
* ``context_token_s`` = 36 ns. Decode attention reads each context token's KV,
  2 x 32 layers x 8 heads x 128 x 2 B = 131,072 B, at 75% of 4.8 TB/s:
  131,072 / 3.6e12 = 36.4 ns.
* ``draft_step_s`` = 0.5 ms. An EAGLE draft step runs one decoder layer plus the LM
  head (128,256 x 4096 x 2 B = 1.05 GB, + 0.22 GB for the layer) = 1.27 GB read,
  0.26 ms at 4.8 TB/s, about doubled by launch overhead as in ``fixed_s``.

Example: 64 decoding requests of about 4,600 tokens each give a step of
6.2 + 64 x 0.027 + 64 x 4,600 x 36e-6 = 18.5 ms; one 8,192-token prefill chunk after a
16k-token prefix, 6.2 + 8192 x 0.033 + 8192 x 20,480 x 1.06e-6 = 454 ms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np

__all__ = ["Percentiles", "StepTimeModel"]

_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Linear step-time model; every coefficient is in seconds (see the module docstring)."""

    fixed_s: float = 6.2e-3
    prefill_token_s: float = 33e-6
    prefill_pair_s: float = 1.06e-9
    decode_req_s: float = 27e-6
    context_token_s: float = 36e-9
    draft_step_s: float = 0.5e-3

    def prefill(self, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> float:
        """Seconds for one prefill (extend) batch.

        Args:
            prefix_lens: tokens already in KV per request (radix hit or earlier chunks).
            extend_lens: tokens computed this step per request.
        """
        extend = extend_lens.astype(np.float64, copy=False)
        tokens = float(extend.sum())
        pairs = float(np.dot(extend, prefix_lens + 0.5 * extend))
        return self.fixed_s + self.prefill_token_s * tokens + self.prefill_pair_s * pairs

    def decode(self, seq_lens: np.ndarray) -> float:
        """Seconds for one decode step of the requests with these lengths (before the step)."""
        return (
            self.fixed_s
            + self.decode_req_s * float(seq_lens.shape[0])
            + self.context_token_s * float(seq_lens.sum())
        )

    def spec(self, seq_lens: np.ndarray, num_draft_tokens: int, num_steps: int) -> float:
        """Seconds for one speculative step: ``num_steps`` draft steps, then one verify
        forward of ``num_draft_tokens`` tokens per request."""
        return (
            self.fixed_s
            + self.draft_step_s * num_steps
            + self.decode_req_s * float(seq_lens.shape[0] * num_draft_tokens)
            + self.context_token_s * float(seq_lens.sum())
        )

    def idle(self) -> float:
        """Seconds for a step that runs no forward pass (PD decode pre-allocation)."""
        return self.fixed_s

    @classmethod
    def parse(cls, text: str) -> StepTimeModel:
        """Defaults overridden by ``name=value[unit]`` pairs, e.g. ``fixed_s=5ms,decode_req_s=20us``.

        Raises:
            ValueError: unknown name, bad number or negative value (message lists the names).
        """
        names = [f.name for f in fields(cls)]
        model = cls()
        changes: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise ValueError(f"unknown step-time coefficient {part!r}; expected NAME=VALUE with NAME one of {', '.join(names)}")
            value = value.strip()
            scale = 1.0
            for unit in ("ns", "us", "ms", "s"):
                if value.endswith(unit):
                    value, scale = value[: -len(unit)], _UNITS[unit]
                    break
            try:
                seconds = float(value) * scale
            except ValueError:
                raise ValueError(f"step-time coefficient {name} needs a number of seconds (e.g. 6ms, 30us), found {part!r}") from None
            if not seconds >= 0:
                raise ValueError(f"step-time coefficient {name} must be >= 0, found {part!r}")
            changes[name] = seconds
        return replace(model, **changes)


class Percentiles(NamedTuple):
    """A latency distribution on the model's clock, in seconds (NaN without values)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Percentiles:
        """Summarise ``values``, ignoring NaN (requests that never got that far)."""
        finite = values[~np.isnan(values)]
        if finite.shape[0] == 0:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        p50, p90, p99 = (float(x) for x in np.percentile(finite, [50, 90, 99]))
        return cls(int(finite.shape[0]), float(finite.mean()), p50, p90, p99, float(finite.max()))

    def to_dict(self) -> dict[str, float | int]:
        """The JSON object (``count``, ``mean``, ``p50``, ``p90``, ``p99``, ``max``)."""
        return self._asdict()
