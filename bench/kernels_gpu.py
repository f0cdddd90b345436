"""Time the allocator's index kernels: Triton against the plain-torch reference.

Cases (page size 16): ``alloc_extend`` and ``assign_req_to_token_pool`` on extend
batches of 1x8192, 8x1024, 256x1, 512 and 1024 random requests (prefix 0..2000,
extend 1..64) and 10,000 random requests (prefix 0..2000, extend 1..400), and ``alloc_decode`` on 256 and 10,000 requests.
Every timed Triton result is first checked equal to the reference.

On CUDA, per call, in microseconds:
* ``loop``: CUDA events around 200 back-to-back calls after a warm-up, divided by
  200; includes the host's launch overhead, i.e. what a replay step pays.
* ``kernel``: ``triton.testing.do_bench`` median (one call per measurement).
Each is measured twice (``loop1``/``loop2``, ``kernel1``/``kernel2``): a difference
between versions smaller than the spread of one version is noise.
Triton variants: ``auto`` (what the dispatcher does), ``inline`` (each program sums
its own offsets over a padded window) and ``scan`` (a scan kernel writes them first).

Without a GPU the CUDA part is skipped with a message and only the reference is
timed on the CPU (wall clock, median of a few calls).

Usage: ``python bench/kernels_gpu.py [--out results.json] [--cpu-only]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import kernels, reference  # noqa: E402

PAGE_SIZE = 16
LOOP_CALLS = 200


class ExtendCase(NamedTuple):
    name: str
    prefix_lens: np.ndarray  # int64 [bs]
    seq_lens: np.ndarray  # int64 [bs]


def _extend_cases(rng: np.random.Generator) -> list[ExtendCase]:
    cases = [ExtendCase("1x8192", np.array([0]), np.array([8192]))]
    prefix = rng.integers(0, 2000, 8)
    cases.append(ExtendCase("8x1024", prefix, prefix + 1024))
    prefix = rng.integers(100, 4000, 256)
    cases.append(ExtendCase("256x1", prefix, prefix + 1))
    for bs in (512, 1024):  # around the in-kernel offsets threshold
        prefix = rng.integers(0, 2000, bs)
        cases.append(ExtendCase(f"{bs} random", prefix, prefix + rng.integers(1, 65, bs)))
    prefix = rng.integers(0, 2000, 10_000)
    cases.append(ExtendCase("10000 random", prefix, prefix + rng.integers(1, 401, 10_000)))
    return cases


class ExtendInputs(NamedTuple):
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    last_loc: torch.Tensor
    free_pages: torch.Tensor
    out_indices: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor


def _extend_inputs(case: ExtendCase, page_size: int, device: torch.device, rng: np.random.Generator) -> ExtendInputs:
    bs = len(case.seq_lens)
    prefix, seq = case.prefix_lens.astype(np.int64), case.seq_lens.astype(np.int64)
    num_pages = int(((seq + page_size - 1) // page_size).sum()) + bs + 1
    pages = rng.permutation(np.arange(1, num_pages + 1))
    last_loc = np.where(prefix > 0, pages[:bs] * page_size + (prefix - 1) % page_size, -1)
    num_tokens = int((seq - prefix).sum())

    def on(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

    return ExtendInputs(
        on(prefix), on(seq), on(last_loc), on(pages[bs:]),
        torch.empty(num_tokens, dtype=torch.int64, device=device),
        torch.zeros((bs + 1, int(seq.max()) + 8), dtype=torch.int32, device=device),
        on(rng.permutation(np.arange(1, bs + 1))),
    )


def _time_cuda(fn: Callable[[], object]) -> dict[str, float]:
    """Two passes of each measure, so the spread between runs of one version shows."""
    import triton.testing

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    figures: dict[str, float] = {}
    for run in (1, 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(LOOP_CALLS):
            fn()
        end.record()
        end.synchronize()
        figures[f"loop{run}_us"] = round(start.elapsed_time(end) * 1000.0 / LOOP_CALLS, 2)
    for run in (1, 2):
        figures[f"kernel{run}_us"] = round(triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1000.0, 2)
    return figures


def _time_cpu(fn: Callable[[], object], calls: int = 7) -> dict[str, float]:
    fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return {"wall_us": round(statistics.median(samples) * 1e6, 2)}


def _variants(bs: int) -> dict[str, bool | None]:
    variants: dict[str, bool | None] = {"auto": None, "scan": False}
    if bs <= 16_384:
        variants["inline"] = True
    return variants


def _bench_cuda(rng: np.random.Generator, device: torch.device, timer: Callable[[Callable[[], object]], dict[str, float]]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for case in _extend_cases(rng):
        x = _extend_inputs(case, PAGE_SIZE, device, rng)
        bs = x.seq_lens.shape[0]
        expected = reference.alloc_extend(x.prefix_lens, x.seq_lens, x.last_loc, x.free_pages, PAGE_SIZE)
        expected_table = x.req_to_token.clone()
        reference.assign_req_to_token_pool(expected_table, x.req_pool_indices, x.prefix_lens, x.seq_lens, expected)
        timings: dict[str, object] = {}
        for label, inline in _variants(bs).items():
            x.out_indices.fill_(-1)
            kernels._launch_alloc_extend(x.prefix_lens, x.seq_lens, x.last_loc, x.free_pages, PAGE_SIZE, x.out_indices, inline)
            assert torch.equal(x.out_indices, expected), f"alloc_extend {case.name} {label}: Triton differs from the reference"
            timings[f"extend triton {label}"] = timer(
                lambda inline=inline: kernels._launch_alloc_extend(
                    x.prefix_lens, x.seq_lens, x.last_loc, x.free_pages, PAGE_SIZE, x.out_indices, inline
                )
            )
            x.req_to_token.zero_()
            kernels._launch_assign_req_to_token_pool(x.req_to_token, x.req_pool_indices, x.prefix_lens, x.seq_lens, expected, inline)
            assert torch.equal(x.req_to_token, expected_table), f"assign {case.name} {label}: Triton differs from the reference"
            timings[f"assign triton {label}"] = timer(
                lambda inline=inline: kernels._launch_assign_req_to_token_pool(
                    x.req_to_token, x.req_pool_indices, x.prefix_lens, x.seq_lens, expected, inline
                )
            )
        timings["extend torch"] = timer(
            lambda: reference.alloc_extend(x.prefix_lens, x.seq_lens, x.last_loc, x.free_pages, PAGE_SIZE, x.out_indices)
        )
        timings["assign torch"] = timer(
            lambda: reference.assign_req_to_token_pool(x.req_to_token, x.req_pool_indices, x.prefix_lens, x.seq_lens, expected)
        )
        rows.append({"case": case.name, "bs": bs, "tokens": int(expected.numel()), "page_size": PAGE_SIZE, "timings": timings})

    for bs in (256, 10_000) if device.type == "cuda" else (256, 1500):
        seq = torch.from_numpy(rng.integers(1, 4000, bs)).to(device)
        last_loc = torch.from_numpy(rng.integers(0, 1 << 30, bs)).to(device)
        free_pages = torch.from_numpy(rng.permutation(np.arange(1, bs + 2))).to(device)
        expected = reference.alloc_decode(seq, last_loc, free_pages, PAGE_SIZE)
        got = kernels.alloc_decode(seq, last_loc, free_pages, PAGE_SIZE, backend="triton")
        assert torch.equal(got, expected), f"alloc_decode bs={bs}: Triton differs from the reference"
        timings = {
            "decode triton": timer(lambda: kernels.alloc_decode(seq, last_loc, free_pages, PAGE_SIZE, backend="triton")),
            "decode torch": timer(lambda: reference.alloc_decode(seq, last_loc, free_pages, PAGE_SIZE)),
        }
        rows.append({"case": f"decode {bs}", "bs": bs, "tokens": bs, "page_size": PAGE_SIZE, "timings": timings})
    return rows


def _bench_cpu(rng: np.random.Generator) -> list[dict[str, object]]:
    device = torch.device("cpu")
    rows: list[dict[str, object]] = []
    for case in _extend_cases(rng):
        x = _extend_inputs(case, PAGE_SIZE, device, rng)
        slots = reference.alloc_extend(x.prefix_lens, x.seq_lens, x.last_loc, x.free_pages, PAGE_SIZE)
        timings = {
            "extend torch": _time_cpu(
                lambda: reference.alloc_extend(x.prefix_lens, x.seq_lens, x.last_loc, x.free_pages, PAGE_SIZE, x.out_indices)
            ),
            "assign torch": _time_cpu(
                lambda: reference.assign_req_to_token_pool(x.req_to_token, x.req_pool_indices, x.prefix_lens, x.seq_lens, slots)
            ),
        }
        rows.append({"case": case.name, "bs": len(case.seq_lens), "tokens": int(slots.numel()), "page_size": PAGE_SIZE, "timings": timings})
    return rows


def _print_table(title: str, rows: list[dict[str, object]]) -> None:
    print(f"\n{title}")
    for row in rows:
        print(f"  {row['case']}  (bs={row['bs']}, tokens={row['tokens']}, page_size={row['page_size']})")
        for variant, figures in row["timings"].items():  # type: ignore[union-attr]
            shown = "  ".join(f"{key}={value:>8.2f}" for key, value in figures.items())
            print(f"    {variant:<22} {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--cpu-only", action="store_true", help="skip the CUDA part even if a GPU is present")
    args = parser.parse_args()

    import triton

    result: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "machine": platform.machine(),
    }
    rng = np.random.default_rng(2024)
    if torch.cuda.is_available() and not args.cpu_only:
        result["device"] = torch.cuda.get_device_name(0)
        result["cuda"] = _bench_cuda(rng, torch.device("cuda"), _time_cuda)
        _print_table(f"CUDA ({result['device']}), microseconds per call", result["cuda"])  # type: ignore[arg-type]
    else:
        reason = "--cpu-only" if args.cpu_only else "no CUDA device"
        print(f"GPU part skipped ({reason}): timing only the torch reference on the CPU.")
        result["device"] = "cpu"
    result["cpu_reference"] = _bench_cpu(np.random.default_rng(2024))
    _print_table("CPU torch reference, microseconds per call (median wall clock)", result["cpu_reference"])  # type: ignore[arg-type]
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
