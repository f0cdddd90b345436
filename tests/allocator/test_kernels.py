"""Index kernels: the torch reference against a per-token model, hand-drawn layouts,
argument checks, and Triton against the reference bit for bit (on the CPU under the
Triton interpreter in a child process; on CUDA when a GPU is present)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from allocator import kernels, reference

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ------------------------------------------------------------------ per-token model


def _model_alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size) -> list[int]:
    """SGLang's layout, one token at a time (the obvious, slow way)."""
    out: list[int] = []
    next_page = 0
    for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc):
        old_page_end = -(-prefix // page_size) * page_size
        page = -1
        for pos in range(prefix, seq):
            if pos < old_page_end:  # the rest of the old partial page, right after last_loc
                out.append(last + 1 + pos - prefix)
                continue
            if pos % page_size == 0:  # the position starts a page: take the next free one
                page = free_pages[next_page] if next_page < len(free_pages) else -1
                next_page += 1
            out.append(page * page_size + pos % page_size if page >= 0 else -1)
    return out


def _model_alloc_decode(seq_lens, last_loc, free_pages, page_size) -> list[int]:
    out: list[int] = []
    next_page = 0
    for seq, last in zip(seq_lens, last_loc):
        if (seq - 1) % page_size == 0:
            out.append(free_pages[next_page] * page_size)
            next_page += 1
        else:
            out.append(last + 1)
    return out


def _model_assign(req_to_token: np.ndarray, rows, starts, ends, out_cache_loc) -> None:
    t = 0
    for row, start, end in zip(rows, starts, ends):
        for pos in range(start, end):
            if pos < req_to_token.shape[1]:
                req_to_token[row, pos] = out_cache_loc[t]
            t += 1


def _random_extend_batch(rng: np.random.Generator, bs: int, page_size: int, max_len: int):
    """A consistent batch: pages are distinct, last_loc is on the request's own old page."""
    prefix = rng.integers(0, max_len, bs)
    extend = rng.integers(0, max_len, bs)
    extend[rng.random(bs) < 0.15] = 0
    seq = prefix + extend
    num_pages = int(((seq + page_size - 1) // page_size).sum()) + 8
    pages = rng.permutation(np.arange(1, num_pages + 1))
    # Old pages: the head of the permutation; the partial page's slot is last_loc.
    old_pages = pages[:bs]
    last_loc = np.where(prefix > 0, old_pages * page_size + (prefix - 1) % page_size, -1)
    free_pages = pages[bs:]
    return prefix, seq, last_loc, free_pages


@pytest.mark.parametrize("page_size", [1, 2, 4, 16, 64])
def test_reference_alloc_extend_matches_per_token_model(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    for bs in (1, 3, 17, 64):
        prefix, seq, last_loc, free_pages = _random_extend_batch(rng, bs, page_size, 3 * page_size + 5)
        expected = _model_alloc_extend(prefix.tolist(), seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size)
        got = reference.alloc_extend(
            torch.from_numpy(prefix), torch.from_numpy(seq), torch.from_numpy(last_loc),
            torch.from_numpy(free_pages), page_size,
        )
        assert got.dtype == torch.int64
        assert got.tolist() == expected
        # A consistent batch never hands out a slot twice.
        assert len(set(expected)) == len(expected)


@pytest.mark.parametrize("page_size", [1, 3, 8])
def test_reference_alloc_decode_matches_per_token_model(page_size: int) -> None:
    rng = np.random.default_rng(100 + page_size)
    seq = rng.integers(1, 5 * page_size + 2, 200)
    last_loc = rng.integers(0, 10_000, 200)
    free_pages = rng.permutation(np.arange(1, 400))
    expected = _model_alloc_decode(seq.tolist(), last_loc.tolist(), free_pages.tolist(), page_size)
    got = reference.alloc_decode(torch.from_numpy(seq), torch.from_numpy(last_loc), torch.from_numpy(free_pages), page_size)
    assert got.tolist() == expected


def test_reference_assign_matches_per_token_model() -> None:
    rng = np.random.default_rng(7)
    table = rng.integers(0, 1000, (12, 40)).astype(np.int32)
    bs = 9
    rows = rng.permutation(12)[:bs]
    starts = rng.integers(0, 40, bs)
    ends = starts + rng.integers(0, 12, bs)  # some run past the row width of 40
    out_cache_loc = rng.integers(0, 2**31 - 1, int((ends - starts).sum()))
    expected = table.copy()
    _model_assign(expected, rows, starts, ends, out_cache_loc)
    got = torch.from_numpy(table.copy())
    reference.assign_req_to_token_pool(
        got, torch.from_numpy(rows), torch.from_numpy(starts), torch.from_numpy(ends), torch.from_numpy(out_cache_loc)
    )
    np.testing.assert_array_equal(got.numpy(), expected)


# ----------------------------------------------------------------- hand-drawn layouts


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_paged_layout_of_sglang_vector(backend: str) -> None:
    """ps=4, 64 tokens: pages 1..16 free, page 0 reserved (slots 0..3 never handed out)."""
    free_pages = torch.arange(1, 17, dtype=torch.int64)
    # r1 0 -> 5: page 1 (slots 4..7) and page 2 (slot 8).
    out = kernels.alloc_extend(_i64(0), _i64(5), _i64(-1), free_pages, 4, backend=backend)
    assert out.tolist() == [4, 5, 6, 7, 8]
    free_pages = free_pages[2:]
    # r0 0 -> 6 takes pages 3, 4; r1 5 -> 11 fills its page 2 (9..11) and takes page 5.
    #   r0: |12 13 14 15|16 17 .  .|    r1: |4 5 6 7|8 9 10 11|20 21 22 .|
    out = kernels.alloc_extend(_i64(0, 5), _i64(6, 11), _i64(-1, 8), free_pages, 4, backend=backend)
    assert out.tolist() == [12, 13, 14, 15, 16, 17, 9, 10, 11, 20, 21, 22]
    free_pages = free_pages[3:]
    # Decode r0 to 7 (last 17) and r1 to 12 (last 22): both stay on their last page.
    out = kernels.alloc_decode(_i64(7, 12), _i64(17, 22), free_pages, 4, backend=backend)
    assert out.tolist() == [18, 23]
    # Decode r0 to 9 (last 19): position 8 starts a page, page 6 -> slot 24.
    out = kernels.alloc_decode(_i64(9), _i64(19), free_pages, 4, backend=backend)
    assert out.tolist() == [24]


def test_token_layout_is_consecutive_free_slots() -> None:
    free_slots = _i64(9, 3, 5, 7, 1, 2, 11)
    out = kernels.alloc_extend(_i64(0, 4, 2), _i64(2, 4, 5), _i64(-1, 40, 41), free_slots, 1, backend="torch")
    assert out.tolist() == [9, 3, 5, 7, 1]
    assert kernels.alloc_decode(_i64(3, 8), _i64(40, 50), free_slots, 1, backend="torch").tolist() == [9, 3]


def test_extend_inside_partial_page_takes_no_page() -> None:
    # prefix 5 (last slot 21 on page 5), seq 7: slots 22, 23; page 9 stays free.
    out = kernels.alloc_extend(_i64(5), _i64(7), _i64(21), _i64(9), 4, backend="torch")
    assert out.tolist() == [22, 23]


def test_one_request_spanning_many_pages() -> None:
    ps = 16
    free_pages = torch.arange(100, 0, -1, dtype=torch.int64)  # 100, 99, ..., 1
    out = kernels.alloc_extend(_i64(3), _i64(3 + 13 + 40 * ps + 5), _i64(1000 * ps + 2), free_pages, ps, backend="torch")
    expected = list(range(1000 * ps + 3, 1000 * ps + 16))
    for k in range(40):
        expected += list(range((100 - k) * ps, (100 - k) * ps + ps))
    expected += list(range(60 * ps, 60 * ps + 5))
    assert out.tolist() == expected


def test_short_free_pages_yield_minus_one() -> None:
    out = kernels.alloc_extend(_i64(0), _i64(10), _i64(-1), _i64(7, 8), 4, backend="torch")
    assert out.tolist() == [28, 29, 30, 31, 32, 33, 34, 35, -1, -1]
    assert kernels.alloc_decode(_i64(1, 5, 9), _i64(-1, 3, 7), _i64(6), 4, backend="torch").tolist() == [24, -1, -1]
    assert kernels.alloc_decode(_i64(2), _i64(3), _i64(), 4, backend="torch").tolist() == [4]


def test_empty_batch_and_zero_length_extends() -> None:
    empty = _i64()
    assert kernels.alloc_extend(empty, empty, empty, _i64(1, 2), 4, backend="torch").numel() == 0
    assert kernels.alloc_decode(empty, empty, _i64(1), 4, backend="torch").numel() == 0
    out = kernels.alloc_extend(_i64(4, 6), _i64(4, 6), _i64(7, 9), _i64(1), 4, backend="torch")
    assert out.numel() == 0
    table = torch.full((2, 8), 5, dtype=torch.int32)
    kernels.assign_req_to_token_pool(table, empty, empty, empty, empty, backend="torch")
    kernels.assign_req_to_token_pool(table, _i64(1), _i64(3), _i64(3), empty, backend="torch")
    assert bool((table == 5).all())


def test_extend_writes_into_given_out_indices() -> None:
    out = torch.full((3,), -7, dtype=torch.int64)
    got = kernels.alloc_extend(_i64(2), _i64(5), _i64(9), _i64(4), 4, out, backend="torch")
    assert got is out
    assert out.tolist() == [10, 11, 16]


def test_assign_never_writes_outside_a_row() -> None:
    table = torch.zeros((3, 4), dtype=torch.int32)
    kernels.assign_req_to_token_pool(table, _i64(1, 0), _i64(2, 0), _i64(7, 1), _i64(1, 2, 3, 4, 5, 6), backend="torch")
    assert table.tolist() == [[6, 0, 0, 0], [0, 0, 1, 2], [0, 0, 0, 0]]


# -------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kernels.alloc_extend(_i64(0), _i64(1), _i64(-1), _i64(1), 0), "page_size"),
        (lambda: kernels.alloc_extend(_i64(0), _i64(1), _i64(-1), _i64(1), 4.0), "page_size"),
        (lambda: kernels.alloc_extend(_i64(0, 1), _i64(1), _i64(-1), _i64(1), 4), "prefix_lens: expected 1 elements"),
        (lambda: kernels.alloc_extend(_i64(0), _i64(1).int(), _i64(-1), _i64(1), 4), "seq_lens: expected dtype"),
        (lambda: kernels.alloc_extend(_i64(0), _i64(1), [-1], _i64(1), 4), "last_loc: expected a torch.Tensor"),
        (lambda: kernels.alloc_extend(_i64(0), _i64(1), _i64(-1), torch.arange(8)[::2], 4), "free_pages: expected a contiguous"),
        (lambda: kernels.alloc_extend(_i64(0), _i64(1), _i64(-1), _i64(1), 4, backend="cuda"), "backend"),
        (lambda: kernels.alloc_decode(_i64(1), _i64(1, 2), _i64(1), 4), "last_loc: expected 1 elements"),
        (lambda: kernels.alloc_decode(_i64(1)[None], _i64(1), _i64(1), 4), "seq_lens: expected a 1-D"),
        (
            lambda: kernels.assign_req_to_token_pool(torch.zeros(4, 4, dtype=torch.float32), _i64(0), _i64(0), _i64(1), _i64(1)),
            "req_to_token: expected dtype",
        ),
        (
            lambda: kernels.assign_req_to_token_pool(torch.zeros(4, 4, dtype=torch.int32).t(), _i64(0), _i64(0), _i64(1), _i64(1)),
            "req_to_token: expected unit stride",
        ),
        (
            lambda: kernels.assign_req_to_token_pool(torch.zeros(4, dtype=torch.int32), _i64(0), _i64(0), _i64(1), _i64(1)),
            "req_to_token: expected a 2-D",
        ),
        (
            lambda: kernels.assign_req_to_token_pool(torch.zeros(4, 4, dtype=torch.int32), _i64(0), _i64(0, 1), _i64(1), _i64(1)),
            "start_offsets: expected 1 elements",
        ),
    ],
)
def test_dispatchers_reject_misuse(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------ Triton vs the reference


def _random_decode_batch(rng: np.random.Generator, bs: int, page_size: int, num_free_pages: int):
    seq = rng.integers(1, 6 * page_size + 2, bs)
    last_loc = rng.integers(0, 1 << 40, bs)
    free_pages = rng.permutation(np.arange(1, num_free_pages + 1))
    return seq, last_loc, free_pages


def _compare_backends(device: str, seed: int, bs: int, page_size: int, max_len: int, inline_offsets: bool | None) -> int:
    """Run all three kernels on ``device`` and the reference on the CPU on one random
    batch; assert identical results. Returns the number of extend tokens compared."""
    rng = np.random.default_rng(seed)
    dev = torch.device(device)

    def on(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(dev)

    def cpu(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))

    # alloc_extend, with enough pages and then with too few (the tail reads -1).
    prefix, seq, last_loc, free_pages = _random_extend_batch(rng, bs, page_size, max_len)
    num_tokens = int((seq - prefix).sum())
    num_needed = int(((seq + page_size - 1) // page_size - (prefix + page_size - 1) // page_size).sum())
    for pages in (free_pages, free_pages[: num_needed // 2]):
        expected = reference.alloc_extend(cpu(prefix), cpu(seq), cpu(last_loc), cpu(pages), page_size)
        out = torch.full((num_tokens,), -99, dtype=torch.int64, device=dev)
        got = kernels._launch_alloc_extend(on(prefix), on(seq), on(last_loc), on(pages), page_size, out, inline_offsets)
        assert torch.equal(got.cpu(), expected), f"alloc_extend differs: bs={bs} ps={page_size} pages={len(pages)}"
    if inline_offsets is None:
        got = kernels.alloc_extend(on(prefix), on(seq), on(last_loc), on(free_pages), page_size, backend="triton")
        expected = reference.alloc_extend(cpu(prefix), cpu(seq), cpu(last_loc), cpu(free_pages), page_size)
        assert torch.equal(got.cpu(), expected)

    # assign_req_to_token_pool: write those slots into rows [prefix, seq); some spans
    # run past the row width and one request names a row outside the table.
    num_rows = bs + 3
    row_width = int(np.quantile(seq, 0.9)) + 1 if bs else 1
    rows = rng.permutation(num_rows)[:bs].astype(np.int64)
    if bs > 2:
        rows[bs // 2] = num_rows + 5
    for dtype in (torch.int32, torch.int64):
        table = torch.from_numpy(rng.integers(0, 1 << 30, (num_rows, row_width))).to(dtype)
        out_cache_loc = torch.from_numpy(rng.integers(0, 1 << 30, num_tokens))
        expected_table = table.clone()
        reference.assign_req_to_token_pool(expected_table, cpu(rows), cpu(prefix), cpu(seq), out_cache_loc)
        got_table = table.to(dev)
        if inline_offsets is None:
            # As a table writer stages them: slices of one buffer, at odd offsets.
            packed = on(np.concatenate([[7], rows, prefix, seq, out_cache_loc.numpy()]))
            parts = packed[1:].split([bs, bs, bs, num_tokens])
            kernels.assign_req_to_token_pool(got_table, *parts, backend="triton")
        else:
            kernels._launch_assign_req_to_token_pool(got_table, on(rows), on(prefix), on(seq), out_cache_loc.to(dev), inline_offsets)
        assert torch.equal(got_table.cpu(), expected_table), f"assign differs: bs={bs} dtype={dtype}"

    # alloc_decode, with enough pages and with too few.
    seq_d, last_d, free_d = _random_decode_batch(rng, bs, page_size, bs + 4)
    for pages in (free_d, free_d[: bs // (2 * page_size)]):
        expected = reference.alloc_decode(cpu(seq_d), cpu(last_d), cpu(pages), page_size)
        got = kernels.alloc_decode(on(seq_d), on(last_d), on(pages), page_size, backend="triton")
        assert torch.equal(got.cpu(), expected), f"alloc_decode differs: bs={bs} ps={page_size}"
    return num_tokens


_INTERPRETER_UNUSABLE = 3  # exit code of the child when this Triton's interpreter cannot run the kernels


def _interpreter_runs_loops_over_loaded_bounds() -> bool:
    """Probe: can this Triton interpreter loop up to a bound loaded from memory?

    NOTE: Triton 3.6's interpreter turns such a bound into an int with ``int(array)``
    on a one-element array, which NumPy >= 2.5 refuses (Triton 3.9 squeezes it first).
    The compiled kernels are unaffected.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def probe(hi_ptr, lo_ptr, out_ptr):
        # The same shape of loop as the kernels': a span of two loaded values.
        bound = (tl.load(hi_ptr) - tl.load(lo_ptr)).to(tl.int32)
        total = bound * 0
        for _ in range(0, bound, 2):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int64)
    try:
        probe[(1,)](_i64(9), _i64(3), out)
    except Exception as error:  # noqa: BLE001 - any failure means the interpreter cannot be used here
        print(f"this Triton interpreter cannot run loops over loaded bounds ({error!r})")
        return False
    return out.item() == 3


def _interpreter_checks() -> None:
    """Entry point of the child process started under TRITON_INTERPRET=1."""
    assert kernels.TRITON_INTERPRETED, "TRITON_INTERPRET=1 was not in effect when allocator.kernels was imported"
    if not _interpreter_runs_loops_over_loaded_bounds():
        sys.exit(_INTERPRETER_UNUSABLE)
    seed = 0
    # (bs, page_size, max_len): small batches with both offset modes, one batch wider
    # than a scan block, extends longer than a token block (512).
    cases = [(0, 4, 8), (1, 1, 5), (5, 1, 9), (7, 4, 13), (33, 16, 70), (9, 64, 700), (3, 3, 1500)]
    for bs, page_size, max_len in cases:
        for inline_offsets in (True, False, None):
            seed += 1
            _compare_backends("cpu", seed, bs, page_size, max_len, inline_offsets)
    _compare_backends("cpu", 99, 1100, 4, 6, None)
    # The hand-drawn layout through the Triton path.
    free_pages = torch.arange(1, 17, dtype=torch.int64)
    out = kernels.alloc_extend(_i64(0, 5), _i64(6, 11), _i64(-1, 8), free_pages[2:], 4, backend="triton")
    assert out.tolist() == [12, 13, 14, 15, 16, 17, 9, 10, 11, 20, 21, 22]
    assert kernels.alloc_decode(_i64(7, 12, 9), _i64(17, 22, 19), free_pages[5:], 4, backend="triton").tolist() == [18, 23, 24]


@pytest.mark.slow
def test_triton_matches_reference_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(_REPO_ROOT))
    code = "from tests.allocator.test_kernels import _interpreter_checks; _interpreter_checks()"
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if child.returncode == _INTERPRETER_UNUSABLE:
        import triton

        pytest.skip(f"Triton {triton.__version__} interpreter with NumPy {np.__version__}: {child.stdout.strip()}")
    assert child.returncode == 0, f"interpreter comparison failed:\n{child.stdout}\n{child.stderr[-4000:]}"


def test_triton_backend_needs_cuda_or_interpreter() -> None:
    if kernels.TRITON_INTERPRETED:
        pytest.skip("kernels were decorated under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="backend='triton': needs CUDA tensors"):
        kernels.alloc_decode(_i64(1), _i64(0), _i64(1), 4, backend="triton")


_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.cuda
@_needs_cuda
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("inline_offsets", [None, True, False])
def test_triton_on_cuda_matches_reference_10000_requests(page_size: int, inline_offsets: bool | None) -> None:
    num_tokens = _compare_backends("cuda", 1000 + page_size, 10_000, page_size, 600, inline_offsets)
    assert num_tokens > 1_000_000


@pytest.mark.cuda
@_needs_cuda
@pytest.mark.parametrize("bs", [1, 8, 256, 1024, 1025])
def test_triton_on_cuda_matches_reference_small_batches(bs: int) -> None:
    _compare_backends("cuda", bs, bs, 16, 9000 // bs + 20, None)


@pytest.mark.cuda
@_needs_cuda
def test_auto_backend_runs_triton_on_cuda_and_keeps_the_layout() -> None:
    dev = torch.device("cuda")
    free_pages = torch.arange(1, 17, dtype=torch.int64, device=dev)
    out = kernels.alloc_extend(_i64(0, 5).to(dev), _i64(6, 11).to(dev), _i64(-1, 8).to(dev), free_pages[2:], 4)
    assert out.device.type == "cuda"
    assert out.tolist() == [12, 13, 14, 15, 16, 17, 9, 10, 11, 20, 21, 22]
