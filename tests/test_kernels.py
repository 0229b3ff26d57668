"""Triton NSA kernels vs the dense reference, on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, and another test module of this pytest process
may already have imported it; so the kernel checks run in child processes (env TRITON_INTERPRET=1; one per CPU
core up to 2, sharing the cases and checks through a claim directory, slowest first: the interpreter is
single-threaded and the checks take ~14 minutes in one process, 2026-12-07) that print a JSON verdict per case, and
the tests below only read those verdicts. tests/conftest.py starts the children right after collection, at a lower
CPU priority, and runs the verdicts' tests last (tests/_kernel_children.py): the checks use the cores the rest of the
suite leaves idle.
Running this file as a script (``python tests/test_kernels.py``) is that child; on a CUDA machine
``python tests/test_kernels.py --cuda`` runs the same checks on the GPU, but there they are not a verdict: the
fp32 cases' dots run in tf32 (errors ~2e-3 against the CPU tolerance of 2e-4) and the torch path's FlexAttention
fails to lower fp32 at head dim 48 (H100, 2026-11-26: 12 of 14 cases fail on every tree). The GPU correctness
check is ``benchmarks/bench_attention.py --check`` (bf16 against float64). The cases and checks themselves are in
tests/_kernel_checks.py (the registry; the cases in _kernel_cases.py, the checks by area in _kernel_checks_*.py);
on the interpreter the child first installs tests/_interp_speed.py (same results, faster).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import _kernel_children
from _kernel_checks import CASES, CHECKS, DOC_CASES, PREFIX_CASES, run_case

# The slowest checks on the interpreter, slowest first (seconds on a 2-core dev machine, 2026-12-07, two claiming
# children: 108, 107, 97, 96, 45, 42, 38, 37, 36, 32 of ~842 in all; each child's first check also makes the
# selected cases' inputs, _sel_inputs). The children claim work in this order, then the registry's: longest first is
# what lets two greedy workers finish together (that run: 428 s and 414 s; a fixed every-other split once left one
# child 567 s and the other 362 s, near the fixture's timeout, then 600 s).
SLOW_FIRST = ("sel_tma", "sel_dq_tokens", "sel_tokens", "sel_bwd_paths", "band_tma", "band_dq2_partials", "sel_blocks",
              "decode_fused", "band_dq2", "sel_dq_ds_tma")


# Each child's time limit. The checks took ~930 s of one core in all on the CI machine (2026-11-27); on a 2-core dev
# machine this file took 714 s (2026-12-06: children past the earlier 600 s, so two cases had no verdict) and 753 s
# (2026-12-07, ~1384 core-s). With tests/_interp_speed.py's speed-ups 3-5 and the dQ-only checks' cheaper walks:
# ~842 core-s on that machine the same day, ~428 s a child. A limit, not a tolerance: a hang still fails; 900 s
# leaves room for a slower CI machine. Counted from when the verdicts are first needed (the children may have run
# beside the other tests for minutes before).
CHILD_TIMEOUT_S = 900


def _work(device: str):
    """-> [(name, run)]: every case and check, the slow ones first (SLOW_FIRST), each a call returning its verdict."""
    items = [(case[0], lambda case=case: run_case(case, device)) for case in CASES + DOC_CASES + PREFIX_CASES]
    items += [(name, lambda check=check: check(device)) for name, check in CHECKS]
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    return sorted(items, key=lambda item: rank.get(item[0], len(rank)))  # stable: the rest in registry order


def _claim(claim_dir: str, name: str) -> bool:
    """Whether this process takes ``name``: the first to create its file in ``claim_dir`` does (atomic)."""
    try:
        os.close(os.open(os.path.join(claim_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main(device: str, shard: int = 0, shards: int = 1, claim_dir: str | None = None) -> None:
    """Run the cases and checks: with ``claim_dir``, each one that no other child has claimed yet (in _work's order);
    else every ``shards``-th from ``shard`` on (all of them by default)."""
    for i, (name, run) in enumerate(_work(device)):
        if not (_claim(claim_dir, name) if claim_dir else i % shards == shard):
            continue
        t0 = time.time()
        try:
            res = run()
        except Exception as e:  # noqa: BLE001 - report, do not stop: each case and check is its own test
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["sec"] = round(time.time() - t0, 1)
        print("RESULT " + json.dumps({"case": name, **res}), flush=True)


@pytest.fixture(scope="module")
def verdicts():
    pytest.importorskip("triton")
    _kernel_children.start()  # started at collection already (conftest.py) unless this module was run some other way
    found, errors = _kernel_children.collect(CHILD_TIMEOUT_S)
    if not found:
        pytest.fail("kernel check processes failed:\n" + "\n".join(errors))
    return found


@pytest.mark.parametrize("name", [c[0] for c in CASES + DOC_CASES + PREFIX_CASES] + [name for name, _ in CHECKS])
def test_kernel_case(verdicts, name):
    r = verdicts.get(name)
    assert r is not None, f"case {name} produced no verdict"
    assert r["ok"], json.dumps(r, indent=1)


def test_the_children_share_every_case_once_slowest_first(tmp_path):
    """The claim order holds every registered case and check once, SLOW_FIRST's names (all registered) first; a name
    is claimed by one process only."""
    names = [name for name, _ in _work("cpu")]
    registry = [c[0] for c in CASES + DOC_CASES + PREFIX_CASES] + [name for name, _ in CHECKS]
    assert sorted(names) == sorted(registry) and len(set(names)) == len(names)
    assert names[:len(SLOW_FIRST)] == list(SLOW_FIRST)
    assert _claim(str(tmp_path), "sel_tma") and not _claim(str(tmp_path), "sel_tma")


def test_kernel_case_tests_run_last_in_their_order_and_nothing_else_moves():
    """conftest.py's reordering: the verdicts' tests after every other test (their children run beside those)."""
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    ids = ["tests/test_a.py::t1", "tests/test_kernels.py::test_kernel_case[g1]", "tests/test_kernels.py::test_x",
           "tests/test_kernels.py::test_kernel_case[doc]", "tests/test_z.py::t2"]
    items, any_cases = _kernel_children.kernel_cases_last([Item(i) for i in ids])
    assert any_cases and [i.nodeid for i in items] == [ids[0], ids[2], ids[4], ids[1], ids[3]]
    rest = [Item(i) for i in (ids[0], ids[4])]
    assert _kernel_children.kernel_cases_last(rest) == (rest, False)


def test_pair_keys_are_int32_below_the_overflow_bound_and_int64_above():
    """The selected kernels' (block, token, slot) sort keys: int32 (half the radix passes) while every key fits,
    int64 from T = 92.7k on (l' = 64, n = 16); the same sorted keys and block ranges either way."""
    import torch

    from nsa_titan.kernels.pair_sort import pair_keys

    n, lp = 16, 64
    for T, dtype in ((1000, torch.int32), (92600, torch.int32), (92800, torch.int64)):
        nb = -(-T // lp)
        idx = torch.randint(-1, nb, (1, 1, T, n), generator=torch.Generator().manual_seed(T))
        keys, off = pair_keys(idx, nb)
        flat = torch.where(idx >= 0, idx * (T * n) + torch.arange(T * n).view(1, 1, T, n), nb * T * n)
        want = torch.sort(flat.view(1, -1)).values
        assert keys.dtype == dtype
        assert torch.equal(keys.long(), want)
        assert torch.equal(off, torch.searchsorted(want, torch.arange(nb + 1).view(1, -1) * (T * n)))


def test_i32_rows_only_where_one_batch_of_every_buffer_stays_below_2_31():
    """The launch option i32_rows (32-bit row arithmetic from each batch's bases) is taken only where one batch of Q,
    through its strides, and of the kernel's other buffers has < 2^31 elements; a strided Q view counts its span."""
    import torch

    from nsa_titan.kernels.combine import fits_i32

    q = torch.empty(4, 8192, 12, 64, device="meta")
    assert fits_i32(q, 2**31 - 1)
    assert not fits_i32(q, 2**31)  # the per-(token, slot) buffers of one batch reach 2^31
    wide = torch.empty_strided((2, 65537, 64, 128), (1, 2**15, 128, 1), device="meta")  # one batch spans > 2^31
    assert not fits_i32(wide, 1)
    assert fits_i32(wide[:, :65536], 1)  # its last element is 2^31 - 24,577 past the batch's first


def test_i32_rows_is_the_default_but_not_for_the_g16_walk():
    """Attempt 95's 32-bit row arithmetic is on by default in the selected kernels' launch shapes and the band dK/dV;
    tuned.py turns it off for the G 16 walk, which ran slower with it (1b 8k batch 2 0.931 -> 0.972 ms); an
    explicit cfg (a sweep) still decides."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels import band, selected

    def cfg(G, D, explicit=None):
        q, k = torch.empty(1, 64, 2 * G, D, device="meta"), torch.empty(1, 64, 2, D, device="meta")
        return selected._cfg("sel_dkdv", q, k, G, 16, 64, explicit)

    assert cfg(6, 64)["i32_rows"] and cfg(7, 128)["i32_rows"]  # m7c's and qwen7b's walks
    assert not cfg(16, 128)["i32_rows"]  # the 1b's and the paper config's walk
    assert cfg(16, 128, dict(i32_rows=True))["i32_rows"]
    x = torch.empty(1, 64, 12, 64, device="meta")
    assert band._launch("band_dkdv", 6, 64, True, x, None)[2]["I32"]
    assert not band._launch("band_dkdv", 6, 64, True, x, dict(i32_rows=False))[2]["I32"]


def test_band_bwd_refuses_an_unknown_part_before_launching():
    """band_bwd's ``parts`` (the halves the NSA op runs on two streams) accepts 'all', 'dq' and 'dkdv' only; a typo
    would otherwise silently run both halves."""
    import torch

    from nsa_titan.kernels import band_bwd

    x = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="'all', 'dq' or 'dkdv'"):
        band_bwd.band_bwd(x, x, x[:, :, :1], x[:, :, :1], x, x[..., 0], 1, 0, 2, parts="dk")


def test_band_dkdv_takes_its_few_tiles_shape_only_for_small_grids_and_never_over_an_explicit_cfg(monkeypatch):
    """TUNED's G 16 dK/dV shape (128-key tiles, keys as MMA rows) gives the 1b's 8k window at batch 1 only 64
    programs for 132 SMs, where the older 64-key shape ran faster: band_bwd._dkdv_launch takes the entry's
    ``few_tiles`` shape below half the SMs, the tuned one at or above, and an explicit cfg (a sweep) as it is."""
    from types import SimpleNamespace

    from nsa_titan.kernels import band_bwd

    monkeypatch.setattr(band_bwd, "sm_count", lambda index: 132)
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0))  # only its device is read

    def shape(batch, cfg=None, window=512, S=8192):
        rows, bk, _, _, kt, (nsplit, _, _) = band_bwd._dkdv_launch(16, 128, window, gpu, cfg, S, 8192, batch, 1)
        return bk, kt, nsplit

    assert shape(1) == (64, False, 1)  # 64 tiles of 128 keys: 64 programs < 66
    assert shape(2) == (128, True, 1)  # 128 programs
    assert shape(1, dict(rows=64, BK=128, num_warps=8, num_stages=3)) == (128, True, 1)  # explicit: inherits KT
    assert shape(1, window=0, S=511)[:2] == (128, True)  # compressed keys: split over queries, enough programs


def test_band_dkdv_balanced_splits_give_each_key_tile_splits_by_the_queries_that_see_it(monkeypatch):
    """Attempt 109's split plan, checked on the 1b's compressed keys at 64k (32 tiles of 128 keys, key i at 16 i + 31):
    every split but a tile's last walks the same chunk (a multiple of the row tile, ~4 programs per SM), each tile's
    splits cover exactly the packed rows that see it, the grid is their sum over the heads, and nsplit (the partial
    slots) is the first tile's count. Chunks shorter than min_queries (default 1024: the 1b at 32k, 528 queries) keep
    the uniform plan, as do the plan turned off and a windowed branch (_num_splits)."""
    import math
    from types import SimpleNamespace

    from nsa_titan.kernels import band_bwd

    monkeypatch.setattr(band_bwd, "sm_count", lambda index: 132)
    gpu = SimpleNamespace(type="cuda", index=0)
    T, S, bk, rows, G = 65536, 4095, 128, 64, 16
    seen = [(T - (n * bk * 16 + 31)) * G for n in range(32)]
    nsplit, chunk, programs = band_bwd._split_plan(T, S, bk, rows, G, 16, 31, 0, 1, gpu, True)
    assert chunk % rows == 0 and chunk >= 1024 * G and chunk == math.ceil(sum(seen) / (4 * 132) / rows) * rows
    counts = [math.ceil(x / chunk) for x in seen]
    assert all((c - 1) * chunk < x <= c * chunk for c, x in zip(counts, seen))
    assert nsplit == counts[0] > counts[-1] and programs == sum(counts) <= 4 * 132

    def fits(chunk, heads):  # the grid of this chunk fits per_sm x SMs programs
        return heads * sum(max(1, math.ceil(x / chunk)) for x in seen) <= 4 * 132

    # 4 heads: 4x the rows; with the cap the chunk is the first row-tile multiple from the even share whose grid fits
    _, chunk4, programs4 = band_bwd._split_plan(T, S, bk, rows, G, 16, 31, 0, 4, gpu, True, cap=True)
    first = math.ceil(4 * sum(seen) / (4 * 132) / rows) * rows
    assert chunk4 % rows == 0 and chunk4 >= first and fits(chunk4, 4)
    assert chunk4 == first or not fits(chunk4 - rows, 4)
    assert programs4 == 4 * sum(math.ceil(x / chunk4) for x in seen)
    uniform = band_bwd._num_splits(T, 32, 0, gpu)
    assert band_bwd._split_plan(T, S, bk, rows, G, 16, 31, 0, 1, gpu, False) == (uniform, 0, uniform * 32)
    assert band_bwd._split_plan(T, T, 64, rows, G, 1, 0, 512, 1, gpu, True) == (1, 0, T // 64)  # window: one split
    # the 1b at 32k: 528 queries per chunk, under the 1024 that balanced splits need (uniform), unless told otherwise
    u32 = band_bwd._num_splits(32768, 16, 0, gpu)
    assert band_bwd._split_plan(32768, 2047, bk, rows, G, 16, 31, 0, 1, gpu, True) == (u32, 0, u32 * 16)
    # with a lower threshold it is balanced: rounding 16 tiles' counts up gives 535 programs at 528 queries a chunk,
    # and the cap grows the chunk until the grid fits 528
    plan32 = band_bwd._split_plan(32768, 2047, bk, rows, G, 16, 31, 0, 1, gpu, True, min_queries=512)
    assert plan32 == (63, 528 * G, 535)
    _, c32, p32 = band_bwd._split_plan(32768, 2047, bk, rows, G, 16, 31, 0, 1, gpu, True, min_queries=512, cap=True)
    assert c32 > 528 * G and c32 % rows == 0 and p32 <= 4 * 132
    # key tiles no query sees (past the last query) still get one program, which writes their zero dK/dV: tile 0 is
    # seen by 69 queries (138 rows, chunks of 16 rows), tiles 1-3 by none
    assert band_bwd._split_plan(100, 50, 16, 16, 2, 16, 31, 0, 1, gpu, True, min_queries=0) == (9, 16, 9 + 3)


def test_band_launch_falls_back_to_pointer_loads_once_when_the_descriptor_form_does_not_compile(monkeypatch):
    """ptxas crashed on some descriptor-form launch shapes (H100, Triton 3.6): such a shape must still run, with
    pointer loads, warn once, and not be compiled again in the descriptor form; other shapes keep descriptors."""
    pytest.importorskip("triton")
    import torch
    import triton

    from nsa_titan.kernels import tma

    calls = []

    class FakeKernel:  # records each launch's K argument kind and TMA flag; the descriptor form of BK=32 "crashes"
        class fn:
            __name__ = "_fake_band"

        def __getitem__(self, grid):
            def launch(q, k, v, *args, TMA, **const):
                calls.append((const["BK"], TMA, isinstance(k, torch.Tensor)))
                if TMA and const["BK"] == 32:
                    raise triton.runtime.errors.PTXASError("ptxas failed with error code -11")
            return launch

    monkeypatch.setattr(tma, "TMA_REJECTED", set())
    k = torch.zeros(1, 64, 1, 16)
    with pytest.warns(UserWarning, match="pointer loads"):
        tma.launch_tma(FakeKernel(), (1,), (k, k, k), tma.kv_specs(k, k, 32), True, dict(BK=32))
    tma.launch_tma(FakeKernel(), (1,), (k, k, k), tma.kv_specs(k, k, 32), True, dict(BK=32))  # memo: no retry
    tma.launch_tma(FakeKernel(), (1,), (k, k, k), tma.kv_specs(k, k, 16), True, dict(BK=16))
    assert calls == [(32, True, False), (32, False, True), (32, False, True), (16, True, False)]

def test_causal_prefix_is_every_token_up_to_n_blocks_and_refuses_more():
    """The selected branch runs as causal attention for the tokens that select all their candidate blocks
    (t < n * l'): every token of a sequence that short; a request past n * l' would be wrong and is refused; on the
    CPU (token-centric sparse kernels) a longer sequence gets no prefix unless asked."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels.selected import causal_prefix

    n, lp, G = 4, 16, 2
    q, v = torch.zeros(1, 64, 4, 8), torch.zeros(1, 64, 2, 8)
    assert causal_prefix(q, v, G, n, lp) == 64  # T = n * l'
    assert causal_prefix(q[:, :40], v[:, :40], G, n, lp) == 40
    long_q, long_v = torch.zeros(1, 200, 4, 8), torch.zeros(1, 200, 2, 8)
    assert causal_prefix(long_q, long_v, G, n, lp) == 0
    assert causal_prefix(long_q, long_v, G, n, lp, requested=64) == 64
    assert causal_prefix(q[:, :40], v[:, :40], G, n, lp, requested=64) == 40
    with pytest.raises(ValueError, match="at most n \\* l' = 64"):
        causal_prefix(long_q, long_v, G, n, lp, requested=65)


def test_sel_dq_cfg_with_the_removed_pairs_key_is_refused_before_launching():
    """The pair dQ kernels (cfg pairs=True, attempts 77/78) were removed after attempt 80: a dQ cfg that still asks
    for them is refused with the fix (NT 2 or 4, the multi-token kernels), not silently run one token per program;
    pairs=False (what sweeps passed to mean one token) and NT 2 still pass."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels import selected, selected_bwd

    B, T, HQ, HKV, D, n, lp = 1, 32, 4, 2, 16, 2, 16
    q, k = torch.zeros(B, T, HQ, D), torch.zeros(B, T, HKV, D)
    idx = torch.zeros(B, HKV, T, n, dtype=torch.int64)
    for algo in ("ds", "recompute"):
        with pytest.raises(ValueError, match="NT=2 or NT=4"):
            selected._cfg("sel_dq", q, k, 2, n, lp, dict(algo=algo, pairs=True))
        with pytest.raises(ValueError, match="pair dQ kernels"):  # through the backward, before any launch
            selected_bwd.sel_bwd(q, q, k, k, q, q[..., 0], idx, lp, cfg_dq=dict(algo=algo, pairs=True),
                                 delta=q[..., 0])
        assert selected._cfg("sel_dq", q, k, 2, n, lp, dict(algo=algo, pairs=False, NT=2))["NT"] == 2
    # The forward's old pair kernel (algo "pairs", attempt 74) is NT 2 of algo "tokens": an unknown algo is refused.
    with pytest.raises(ValueError, match="algo='tokens' with NT=2"):
        selected._cfg("sel_fwd", q, k, 2, n, lp, dict(algo="pairs"))
    assert selected._cfg("sel_fwd", q, k, 2, n, lp, dict(algo="tokens", NT=2))["NT"] == 2


def test_walk_token_order_runs_every_chunk_once_by_first_token_and_spare_programs_last():
    """pair_sort.chunk_token_order (attempt 114) against the torch spec of the pair tables: per (batch, KV head) row
    a permutation of the program ids in which the live chunks come by their first pair's token (ties in chunk id
    order, i.e. block order) and the spare programs (block NB) last, in their own order; chunks of 1, 3 and 16
    pairs over selections with unused slots."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels.pair_sort import block_pairs_reference, chunk_token_order

    gen = torch.Generator().manual_seed(3)
    B, HKV, T, n, nb = 2, 2, 90, 4, 9
    idx = torch.randint(-1, nb, (B, HKV, T, n), generator=gen)
    for ch in (1, 3, 16):
        keys, off, coff, poff, prog = block_pairs_reference(idx, nb, ch)
        order = chunk_token_order(keys, off, coff, prog, nb, ch, n)
        assert order.dtype == torch.int32 and order.shape == prog.shape
        for row in range(B * HKV):
            want = []  # (first token or T for a spare program, chunk id): the spec's sort key
            for c in range(prog.shape[1]):
                blk = int(prog[row, c])
                if blk == nb:
                    want.append((T, c))
                    continue
                lo = int(off[row, blk]) + (c - int(coff[row, blk])) * ch
                assert lo < int(off[row, blk + 1])  # a live chunk has pairs
                want.append((int(keys[row, lo]) // n - blk * T, c))
            assert order[row].tolist() == [c for _, c in sorted(want)], (ch, row)
            assert sorted(order[row].tolist()) == list(range(prog.shape[1]))


def test_walk_takes_the_tables_token_order_from_its_pair_count_on_and_never_over_a_callers_chunking():
    """selected_bwd.walk_shape (attempt 114): the G 16 / head dim 128 entry's many_pairs shape (token order, 64 tiles
    per chunk) from its from_pairs count of one launch's pairs on, not below it, not where the caller's cfg names
    order or chunk_tiles (a sweep's variant), and never in the returned option itself; other entries have none."""
    pytest.importorskip("triton")
    from nsa_titan.kernels.selected_bwd import walk_shape
    from nsa_titan.kernels.tuned import TUNED

    entry = TUNED[("sel_dkdv", 16, 128, False)]
    at = entry["many_pairs"]["from_pairs"]
    got = walk_shape(entry, at, None)
    assert got["order"] == "tokens" and got["chunk_tiles"] == 64 and "many_pairs" not in got
    assert walk_shape(entry, at, {"rows": 64})["order"] == "tokens"  # a cfg of other keys keeps the table's chunking
    below = walk_shape(entry, at - 1, None)
    assert "order" not in below and "chunk_tiles" not in below and "many_pairs" not in below
    assert "order" not in walk_shape(entry, at, {"chunk_tiles": 8})
    assert walk_shape(entry, at, {"order": "blocks"}).get("chunk_tiles") is None
    assert "many_pairs" in entry  # the table itself is left as it was
    for key in (("sel_dkdv", 8, 64, False), ("sel_dkdv", 8, 128, False)):
        assert "order" not in walk_shape(TUNED[key], 1 << 30, None)
    # The threshold's two measured sides (tuned.py): the paper config from 16k tokens (4 KV heads, dS unchunked) and
    # the 1b at 64k reach it; the 1b at 32k (2^19 pairs) and the paper config at 8k do not.
    n = 16
    assert 4 * 16384 * n >= at and 65536 * n >= at and 32768 * n < at and 4 * 8192 * n < at


def test_walk_order_cfg_is_checked_before_launching():
    """sel_dkdv's order is 'blocks' or 'tokens'; anything else is refused with both names."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels import selected

    q, k = torch.zeros(1, 32, 4, 16), torch.zeros(1, 32, 2, 16)
    with pytest.raises(ValueError, match="'blocks'.*'tokens'"):
        selected._cfg("sel_dkdv", q, k, 2, 2, 16, dict(order="token"))
    assert selected._cfg("sel_dkdv", q, k, 2, 2, 16, dict(order="tokens"))["order"] == "tokens"


def test_band_dq2_refuses_a_second_branch_without_keys():
    """band_dq2.band_dq2 (two branches' dQ in one launch) needs keys in its second branch; with none (T shorter
    than one compression block) it names the one-branch call to make instead, before any launch."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels import band_dq2

    q, k, lse = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 2)
    with pytest.raises(ValueError, match="parts='dq'"):
        band_dq2.band_dq2(q, q, (k, k, lse, lse, 1, 0, 4), (k[:, :0], k[:, :0], lse, lse, 4, 7, 0), q.clone())


def test_band_dq2_takes_its_many_keys_shape_from_the_named_key_count():
    """A band_dq2 table entry may name a larger shape for long compressed walks (tuned.py: from 1536 keys, 32k at
    stride 16); below the count, or without one, the entry's own shape (None) applies, and the count itself is not
    a launch parameter."""
    pytest.importorskip("triton")
    from nsa_titan.kernels.band import many_keys_shape
    from nsa_titan.kernels.tuned import TUNED

    entry = dict(rows=64, BK=32, many_keys=dict(from_keys=1536, rows=128, BK=64, num_warps=8, num_stages=4))
    assert many_keys_shape(entry, 1535) is None
    assert many_keys_shape(entry, 1536) == dict(rows=128, BK=64, num_warps=8, num_stages=4)
    assert many_keys_shape(dict(rows=64, BK=32), 10**6) is None
    # The adopted entries: the 1b / paper key switches at 32k tokens (2047 compressed keys), not at 16k (1023).
    g16 = TUNED[("band_dq2", 16, 128, False)]
    assert many_keys_shape(g16, 1023) is None and many_keys_shape(g16, 2047)["rows"] == 128


def test_band_fwd_takes_its_many_keys_shape_only_without_an_explicit_cfg(monkeypatch):
    """band_fwd reads its table entry's many_keys shape for its own key count (attempt 112: the paper's compressed
    forward at 64k, 4,095 keys), the entry itself below the count, and a caller's cfg (a sweep) over both."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels import band

    many = dict(rows=128, BK=64, num_warps=4, num_stages=2)
    monkeypatch.setattr(band, "launch_cfg", lambda *a: dict(rows=64, many_keys=dict(from_keys=96, **many)))
    seen = []

    class Stop(Exception):
        pass

    def fake_launch(kernel, G, dmax, windowed, x, cfg):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(band, "_launch", fake_launch)
    q = torch.zeros(1, 8, 2, 16)
    for n_keys, cfg in ((96, None), (95, None), (96, dict(rows=16))):
        k = torch.zeros(1, n_keys, 1, 16)
        with pytest.raises(Stop):
            band.band_fwd(q, k, k, 1, 0, 0, cfg=cfg)
    assert seen == [many, None, dict(rows=16)]
    # The adopted entry: the G 16 / head dim 128 compressed forward switches between 32k and 64k tokens.
    from nsa_titan.kernels.tuned import TUNED

    g16 = TUNED[("band_fwd", 16, 128, False)]
    assert band.many_keys_shape(g16, 2047) is None and band.many_keys_shape(g16, 4095) == many


def test_sel_dq_from_chunked_ds_takes_the_tables_chunked_shape():
    """selected._cfg: where the dS is stored a chunk of (batch, KV head) pairs at a time, dQ = dS K takes the
    sel_dq_ds entry's ``chunked`` shape (attempt 112), and the entry's own shape where all of the dS fits."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels.selected import _cfg
    from nsa_titan.kernels.tuned import TUNED

    entry = TUNED[("sel_dq_ds", 16, 128, False)]
    q = torch.zeros(1, 64, 32, 128, dtype=torch.bfloat16)  # G 16 over two KV heads
    v = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    one_pair = 64 * 16 * 16 * 64 * 2  # one KV head's dS bytes: T x G x n x l' x 2 B
    whole = _cfg("sel_dq", q, v, 16, 16, 64, None, budget=2 * one_pair)
    chunked = _cfg("sel_dq", q, v, 16, 16, 64, None, budget=2 * one_pair - 1)
    assert whole["algo"] == chunked["algo"] == "ds"
    assert whole["ds_chunk"] == 2 and chunked["ds_chunk"] == 1
    for key in ("NT", "num_warps", "num_stages"):
        assert whole[key] == entry[key] and chunked[key] == entry["chunked"][key]
    assert "chunked" not in whole and "chunked" not in chunked


def test_an_eager_backward_forks_from_the_size_threshold_on_and_never_on_the_cpu():
    """ops.eager_backward_forks: all of q's values (batch x tokens x query heads x head dim) against EAGER_FORK_VALUES
    (attempt 113), so a batch of shorter sequences and a smaller head dim count as the work they are; _Side forks
    only on a GPU, even when asked to."""
    pytest.importorskip("triton")
    import torch

    from nsa_titan.kernels import ops

    values = ops.EAGER_FORK_VALUES
    assert values % (2 * 64 * 128) == 0
    at = torch.empty(1, values // (64 * 128), 64, 128, device="meta")
    below = torch.empty(1, values // (64 * 128) - 1, 64, 128, device="meta")
    batched = torch.empty(2, values // (2 * 64 * 128), 64, 128, device="meta")
    half_dim = torch.empty(1, values // (64 * 128), 64, 64, device="meta")
    assert ops.eager_backward_forks(at) and ops.eager_backward_forks(batched)
    assert not ops.eager_backward_forks(below) and not ops.eager_backward_forks(half_dim)
    # The measured sides of the threshold: m7c 8k batch 2 lost with the fork, m7c 32k and qwen7b 8k gained; the 1b's
    # 8k at batch 1 (unmeasured, host-bound in eager calls) stays on one stream.
    assert not ops.eager_backward_forks(torch.empty(2, 8192, 12, 64, device="meta"))
    assert not ops.eager_backward_forks(torch.empty(1, 8192, 16, 128, device="meta"))
    assert ops.eager_backward_forks(torch.empty(1, 32768, 12, 64, device="meta"))
    assert ops.eager_backward_forks(torch.empty(1, 8192, 28, 128, device="meta"))
    fork = ops._Side(torch.zeros(1), eager=True)
    with fork as side:
        assert side is None
    assert fork.side is None and fork.main is None


def test_kernel_resources_reads_cuobjdump_usage_lines():
    """benchmarks/kernel_resources.py (offline sm_90 compiles: registers and spills without a GPU) parses the
    resource line of cuobjdump --dump-resource-usage."""
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from kernel_resources import parse_usage

    text = ("Resource usage:\n Function _band_bwd_dkdv:\n  REG:255 STACK:88 SHARED:1024 LOCAL:0 CONSTANT[0]:688 "
            "TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    got = parse_usage(text)
    assert (got["REG"], got["STACK"], got["SHARED"], got["LOCAL"]) == (255, 88, 1024, 0)


def test_loop_instructions_counts_each_backward_branch_body():
    """benchmarks/loop_instructions.py's SASS reading: a loop is the span from a backward branch's target to the
    branch, counted by opcode (predicates and modifiers stripped); a forward branch is no loop."""
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from loop_instructions import sass_loops

    sass = "\n".join(f"        /*{a:04x}*/  {t} ;  /* 0x0 */" for a, t in [
        (0x00, "MOV R1, c[0x0][0x28]"), (0x10, "@P0 BRA 0x40"), (0x20, "IMAD.WIDE R2, R3, R4, R5"),
        (0x30, "@!P1 FFMA R6, R7, R8, R9"), (0x40, "IMAD R2, R3, R4, R5"), (0x50, "@P2 BRA 0x20"), (0x60, "EXIT")])
    assert sass_loops(sass) == [dict(instructions=4, ops={"IMAD": 2, "FFMA": 1, "BRA": 1})]


def test_import_without_triton_raises_importerror():
    """A missing triton must surface as ImportError (the model then falls back to the torch path)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "try:\n import nsa_titan.kernels\nexcept ImportError:\n print('IMPORTERROR')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert "IMPORTERROR" in proc.stdout, proc.stderr[-2000:]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get("TRITON_INTERPRET") == "1":
        from _interp_speed import install  # tests/ is on the path only in this child

        install()
    shard_arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--shard=")), "0/1")
    claim = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--claim-dir=")), None)
    main("cuda" if "--cuda" in sys.argv else "cpu", *map(int, shard_arg.split("/")), claim_dir=claim)
