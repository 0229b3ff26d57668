"""The window's and the compressed branch's dQ in one launch (attempt 82), with the selected branch's dQ partials
added in the same pass where its dK/dV walk stored them (attempt 88): band_bwd.py's dQ tile walk run over two key
sets for the same query rows, so that Q and dO are loaded once and dQ is written once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_titan.kernels.band import LOG2E, _launch, launch_cfg, many_keys_shape
from nsa_titan.kernels.band_bwd import _dq_branch, _dq_rows, _store_band_dq
from nsa_titan.kernels.combine import pow2
from nsa_titan.kernels.selected_blocks import used_slots
from nsa_titan.kernels.tma import kv_specs, launch_tma
from nsa_titan.kernels.tuned import TUNED


@triton.jit
def add_slot_partials(dq, DQP, IDX, b, kv, t, g, row_ok, dk, T, HKV, G: tl.constexpr, NSEL: tl.constexpr,
                      DK: tl.constexpr, SG: tl.constexpr):
    """dq [rows, DKP] (fp32) plus, per row (token t, head g of KV head kv), its dQ partials over the token's used
    slots (IDX [B, HKV, T, n] >= 0) from DQP [B, T, HKV, n, G, DK] (selected_blocks.used_slots; unused
    slots were never written). SG slots per load, groups added in slot order: a fixed order, deterministic."""
    for s0 in range(0, NSEL, SG):
        used, prow = used_slots(IDX, b, kv, t, g, row_ok, s0 + tl.arange(0, SG), T, HKV, G, NSEL)
        part = tl.load(DQP + prow[:, :, None] * DK + dk[None, None, :],
                       mask=used[:, :, None] & (dk[None, None, :] < DK), other=0.0)
        dq += tl.sum(part.to(tl.float32), 1)
    return dq


@triton.jit
def _band_bwd_dq2(Q, K, V, K2, V2, DO, LSE, DELTA, LSE2, DELTA2, DQ, DS, sqb, sqt, sqh, skb, sks, skh, svb, svs,
                  svh, skb2, sks2, skh2, svb2, svs2, svh2, T, S, S2, HKV, qk_scale, sm_scale, DQP, IDX, G: tl.constexpr,
                  KSTRIDE: tl.constexpr, KOFF: tl.constexpr, WIN: tl.constexpr, KSTRIDE2: tl.constexpr,
                  KOFF2: tl.constexpr, WIN2: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr,
                  DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, ACC: tl.constexpr,
                  DOC: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, NSEL: tl.constexpr, SG: tl.constexpr,
                  PSUM: tl.constexpr):
    """_band_bwd_dq for two branches over the same queries (the window's and the compressed branch's keys): Q and
    dO loaded once, one dQ accumulator, one read-modify-write of DQ instead of two (attempt 82). PSUM: also the
    selected branch's dQ, the sum of the per-(token, slot) partials DQP that its dK/dV walk stored (IDX: the
    walk's block_idx, -1 for unused slots), so that no separate sum kernel writes a dQ for this one to read back
    (attempt 88)."""
    pid_m, pid_bh, b, kv, t, h, row_ok, q, do, dk = _dq_rows(Q, DO, sqb, sqt, sqh, T, T, HKV, G, ROWS, DK, DV, DKP,
                                                             DVP)
    dq = _dq_branch(q, do, tl.zeros([ROWS, DKP], tl.float32), K, V, LSE, DELTA, DS, pid_m, pid_bh, b, kv, t, h,
                    row_ok, skb, sks, skh, svb, svs, svh, T, T, S, HKV, qk_scale, G, KSTRIDE, KOFF, WIN, ROWS, BK,
                    DK, DV, DKP, DVP, DOC, SPLIT, TMA)
    dq = _dq_branch(q, do, dq, K2, V2, LSE2, DELTA2, DS, pid_m, pid_bh, b, kv, t, h, row_ok, skb2, sks2, skh2, svb2,
                    svs2, svh2, T, T, S2, HKV, qk_scale, G, KSTRIDE2, KOFF2, WIN2, ROWS, BK2, DK, DV, DKP, DVP, DOC,
                    SPLIT, TMA)
    if PSUM:
        dq = add_slot_partials(dq, DQP, IDX, b, kv, t, h - kv * G, row_ok, dk, T, HKV, G, NSEL, DK, SG)
    _store_band_dq(DQ, dq * sm_scale, b, t, h, row_ok, dk, T, HKV, G, DK, ACC)


def band_dq2(do, q, first: tuple, second: tuple, dq_acc, doc_start=None, cfg: dict | None = None,
             dq_partials: tuple | None = None, acc: bool = True):
    """dQ of two band branches over the same queries in one launch (_band_bwd_dq2), added into ``dq_acc``
    (contiguous [B,T,HQ,Dk]; returned), or written there with ``acc`` False (its values are not read). Each branch
    is (k, v, lse, delta, kstride, koff, window), as band_bwd takes them; the second must have keys (S > 0).
    ``dq_partials``: (dqp, block_idx) of selected_bwd.sel_bwd_parts, the selected branch's dQ partials, added in the
    same pass (attempt 88). Launch shape: tuned.py's ("band_dq2", ...) entry (``cfg`` overrides it,
    as in band_bwd), one key tile size for both branches. The entry may name a ``many_keys`` shape (with its
    ``from_keys``) for a second branch of at least that many keys: the long compressed walk wants larger tiles.

    Attempt 82: the model's backward runs the window's and the compressed branch's dQ this way where
    ``dq2_enabled`` says so (a tuned.py entry), else as two band_bwd calls."""
    B, T, HQ, DK = q.shape
    (k, v, lse, delta, kstride, koff, window), (k2, v2, lse2, delta2, kstride2, koff2, window2) = first, second
    if k2.shape[1] == 0:
        raise ValueError("band_dq2: the second branch has no keys; run band_bwd(parts='dq') for the first alone")
    HKV, DV = k.shape[2], v.shape[-1]
    G = HQ // HKV
    entry = launch_cfg("band_dq2", pow2(G), max(DK, DV), False, q.is_cuda)
    if not cfg:
        cfg = many_keys_shape(entry, k2.shape[1])
    rows, bk, kw, tma = _launch("band_dq2", G, max(DK, DV), False, q, cfg)
    do = do.contiguous()
    ds = delta if doc_start is None else doc_start
    dims = dict(G=G, KSTRIDE=kstride, KOFF=koff, WIN=window, KSTRIDE2=kstride2, KOFF2=koff2, WIN2=window2, DK=DK,
                DV=DV, DKP=pow2(max(DK, 16)), DVP=pow2(max(DV, 16)), DOC=doc_start is not None)
    specs = {**kv_specs(k, v, bk), **{i + 2: spec for i, spec in kv_specs(k2, v2, bk).items()}}
    dqp, idx = (q, q) if dq_partials is None else dq_partials  # any tensors without partials (never read)
    if dq_partials is not None and (dqp.shape[:3] != (B, T, HKV) or dqp.shape[4:] != (G, DK)
                                    or tuple(idx.shape) != (B, HKV, T, dqp.shape[3])):
        raise ValueError(f"band_dq2: dq_partials {tuple(dqp.shape)} / block_idx {tuple(idx.shape)} do not match "
                         f"q {tuple(q.shape)} with {HKV} KV heads; pass sel_bwd_parts' (dqp, block_idx) unchanged")
    nsel = dqp.shape[3] if dq_partials is not None else 1
    # Slots per load of the partials: a loop over groups of 2 keeps the m7c shape at 127 registers (4 programs per
    # SM, as without partials: 118); 4 took 134, 8 143 (sm_90 offline). ``psum_slots`` in cfg overrides it.
    sg = min(pow2(nsel), dict(entry, **(cfg or {})).get("psum_slots", 2))
    launch_tma(_band_bwd_dq2, (triton.cdiv(T * G, rows), B * HKV),
               (q, k, v, k2, v2, do, lse, delta, lse2, delta2, dq_acc, ds, *q.stride()[:3], *k.stride()[:3],
                *v.stride()[:3], *k2.stride()[:3], *v2.stride()[:3], T, k.shape[1], k2.shape[1], HKV,
                DK**-0.5 * LOG2E, DK**-0.5, dqp, idx), specs, tma,
               dict(ROWS=rows, BK=bk, BK2=bk, **dims, ACC=acc, NSEL=nsel, SG=sg,
                    PSUM=dq_partials is not None, **kw))
    return dq_acc


def dq2_enabled(G: int, dmax: int) -> bool:
    """Whether the model's backward fuses the window's and the compressed branch's dQ (band_dq2): tuned.py has a
    ("band_dq2", next_pow2(G), head dim, False) launch shape."""
    return ("band_dq2", pow2(G), dmax, False) in TUNED
