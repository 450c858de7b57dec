"""The Hopper TMA LoRA kernel's device code (Triton JIT functions); the design, the schedules and
the host side that launches them are in :mod:`lora_bench.kernels.lora_tma`."""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _tile_mn(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the columns together (X rows and W columns in L2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_size
    pid_n = (tile % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _mainloop(x_desc, w_desc, p_arg, stride_pk, stride_pr, off_m, off_n, kb0, kb1, K, R, ht, wsb_ptr, pid_n, gb_per_n,
              W_KN: tl.constexpr, HAS_LORA: tl.constexpr, P_MODE: tl.constexpr, GRAD_AB: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_R: tl.constexpr):
    """acc = X[rows, K blocks kb0..kb1)·Wt[.., cols], hacc = X[rows, ..]·P[.., :R] (fp32). GRAD_AB (the
    fused backward, X = g): the K blocks this column tile owns (kb // gb_per_n == pid_n) also add
    X[rows, block]ᵀ·ht (ht = h[rows, :]) into the grad_B workspace (K×BLOCK_R fp32), so each
    (row tile, K block) adds once however many column tiles load it."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hacc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k0 = kb * BLOCK_K
        xt = x_desc.load([off_m, k0])  # (BM, BK); rows past M and columns past K read as zeros
        if W_KN:
            wt = w_desc.load([k0, off_n])  # (BK, BN)
        else:
            wt = w_desc.load([off_n, k0]).T  # W stored n×k: its (BN, BK) tile, transposed in shared memory
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if HAS_LORA:
            if P_MODE == 1:  # P as stored, K×R (A in the forward)
                pt = p_arg.load([k0, 0])
            elif P_MODE == 2:  # P stored transposed, R×K (Bᵀ in the backward: B as stored)
                pt = p_arg.load([0, k0]).T
            else:  # rows not 16-byte aligned for TMA: pointer loads (not pipelined: slower)
                ks = k0 + tl.arange(0, BLOCK_K)
                offs_r = tl.arange(0, BLOCK_R)
                pt = tl.load(p_arg + ks[:, None] * stride_pk + offs_r[None, :] * stride_pr,
                             mask=(ks < K)[:, None] & (offs_r < R)[None, :], other=0.0)
            hacc = tl.dot(xt, pt.to(xt.dtype), hacc, input_precision=PRECISION)
        if GRAD_AB:  # noqa: SIM102 (a constexpr: the branch compiles away without it)
            if kb // gb_per_n == pid_n:  # this K block's share of grad_B belongs to this column tile
                part = tl.dot(xt.T, ht, input_precision=PRECISION)  # (BK, BR): g[rows, block]ᵀ·h[rows, :]
                ks_b = k0 + tl.arange(0, BLOCK_K)
                offs_rb = tl.arange(0, BLOCK_R)
                tl.atomic_add(wsb_ptr + ks_b[:, None] * BLOCK_R + offs_rb[None, :], part,
                              mask=(ks_b < K)[:, None] & (offs_rb < BLOCK_R)[None, :], sem="relaxed", scope="gpu")
    return acc, hacc


@triton.jit
def _tile_operands(q_ptr, bias_ptr, hb_ptr, off_m, off_n, M, N, R, stride_qr, stride_qn, stride_hbm, stride_hbr,
                   dt: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD_AB: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The epilogue's Q tile (BR×BN) and bias (BN), and for GRAD_AB the forward's h rows (BM×BR) that
    the K loop multiplies into grad_B: loaded before the K loop so that their latency hides behind it."""
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    qt = tl.zeros((BLOCK_R, BLOCK_N), dtype=dt)
    bt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ht = tl.zeros((BLOCK_M, BLOCK_R), dtype=dt)
    if HAS_LORA:
        qt = tl.load(q_ptr + offs_r[:, None] * stride_qr + offs_n[None, :] * stride_qn,
                     mask=(offs_r < R)[:, None] & (offs_n < N)[None, :], other=0.0).to(dt)
    if HAS_BIAS:
        bt = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    if GRAD_AB:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        ht = tl.load(hb_ptr + offs_m[:, None] * stride_hbm + offs_r[None, :] * stride_hbr,
                     mask=(offs_m < M)[:, None] & (offs_r < R)[None, :], other=0.0).to(dt)
    return qt, bt, ht


@triton.jit
def _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, off_m, off_n, pid_n, num_pid_m, gb_per_n,
                  N, K, R, stride_gak, stride_gar, stride_gbr, stride_gbn, scale, PRECISION: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """The fused backward's adapter gradients, once per output tile (rows off_m.., columns off_n.. of
    grad_x, i.e. k-columns of x): sh = s·u[rows] rounded as in the epilogue; this row tile's share of
    grad_A[cols] = xᵀ·sh is added into the grad_A workspace (N×BLOCK_R fp32). Then the tile arrives at
    its column's counter; the last of the column's num_pid_m row tiles (every add of the column's
    grad_A rows and of its grad_B rows, K blocks [pid_n·gb_per_n, (pid_n+1)·gb_per_n), is in by
    then) converts them into grad_A and s·(grad_B workspace), zeroes the workspace rows it read and
    the counter for the next launch."""
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    xa = xa_desc.load([off_m, off_n])  # x[rows, cols] (BM, BN); zeros outside
    part = tl.dot(xa.T, sh, input_precision=PRECISION)  # (BN, BR)
    wa = wsa_ptr + offs_n[:, None] * BLOCK_R + offs_r[None, :]
    a_mask = (offs_n < N)[:, None] & (offs_r < BLOCK_R)[None, :]
    tl.atomic_add(wa, part, mask=a_mask, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # every thread's adds (here and in the K loop) issued before the release below
    arrived = tl.atomic_add(cab_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == num_pid_m - 1:
        tl.store(ga_ptr + offs_n[:, None] * stride_gak + offs_r[None, :] * stride_gar,
                 tl.load(wa, mask=a_mask, other=0.0, cache_modifier=".cg").to(ga_ptr.dtype.element_ty),
                 mask=(offs_n < N)[:, None] & (offs_r < R)[None, :])
        tl.store(wa, tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32), mask=a_mask)
        # this column's grad_B rows: one contiguous range of K, read RB rows at a time
        RB: tl.constexpr = 4 * BLOCK_K
        k_hi = min((pid_n + 1) * gb_per_n * BLOCK_K, K)
        for k0 in range(pid_n * gb_per_n * BLOCK_K, k_hi, RB):
            ks = k0 + tl.arange(0, RB)
            wb = wsb_ptr + ks[:, None] * BLOCK_R + offs_r[None, :]
            b_mask = (ks < k_hi)[:, None] & (offs_r < BLOCK_R)[None, :]
            vb = tl.load(wb, mask=b_mask, other=0.0, cache_modifier=".cg") * scale
            tl.store(gb_ptr + offs_r[None, :] * stride_gbr + ks[:, None] * stride_gbn,
                     vb.to(gb_ptr.dtype.element_ty), mask=(ks < k_hi)[:, None] & (offs_r < R)[None, :])
            tl.store(wb, tl.zeros((RB, BLOCK_R), dtype=tl.float32), mask=b_mask)
        tl.atomic_xchg(cab_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _epilogue(acc, hacc, qt, bt, out_desc, h_ptr, off_m, off_n, pid_n, M, R, stride_hm, stride_hr, scale,
              HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_H: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """out tile = acc + s·H·Q + bias; H stored by column tile 0. Returns s·H rounded to the input dtype."""
    dt = h_ptr.dtype.element_ty  # the input dtype (h, or the output itself when there is no h)
    # H rounded to the input dtype (as torch's x @ A), s folded in before the rounding:
    # exact for a power-of-two s, one rounding of s·H otherwise
    sh = (hacc * scale).to(dt)
    if HAS_LORA:
        if WRITE_H:
            if pid_n == 0:
                offs_m = off_m + tl.arange(0, BLOCK_M)
                offs_r = tl.arange(0, BLOCK_R)
                tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr, hacc.to(dt),
                         mask=(offs_m < M)[:, None] & (offs_r < R)[None, :])
        acc = tl.dot(sh, qt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += bt[None, :]
    out_desc.store([off_m, off_n], acc.to(dt))  # clipped to M×N by the descriptor
    return sh


@triton.jit
def _lora_tma_kernel(
    x_desc, w_desc, out_desc, p_arg, q_ptr, bias_ptr, h_ptr, ws_ptr, cnt_ptr,
    xa_desc, hb_ptr, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr,
    M, N, K, R, stride_pk, stride_pr, stride_qr, stride_qn, stride_hm, stride_hr, iters_per_prog, scale,
    stride_hbm, stride_hbr, stride_gak, stride_gar, stride_gbr, stride_gbn,
    W_KN: tl.constexpr, HAS_LORA: tl.constexpr, P_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
    WRITE_H: tl.constexpr, GRAD_AB: tl.constexpr, STREAM_K: tl.constexpr, FLATTEN: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):
    dt: tl.constexpr = h_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    gb_per_n = tl.cdiv(k_tiles, num_pid_n)  # GRAD_AB: the K blocks of grad_B each column tile owns
    if STREAM_K:
        # this program's K iterations [start, end) of all tiles' (the host makes none empty)
        start = pid * iters_per_prog
        end = min(start + iters_per_prog, num_tiles * k_tiles)
        first_tile = start // k_tiles
        WS_N: tl.constexpr = BLOCK_N + BLOCK_R  # a workspace slot: BM rows of [acc | hacc], fp32
        offs_wm = tl.arange(0, BLOCK_M)
        offs_wn = tl.arange(0, BLOCK_N)
        offs_wr = tl.arange(0, BLOCK_R)
        for tile in range(first_tile, (end - 1) // k_tiles + 1):
            pid_m, pid_n = _tile_mn(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            kb0 = max(start - tile * k_tiles, 0)
            kb1 = min(end - tile * k_tiles, k_tiles)
            qt, bt, ht = _tile_operands(q_ptr, bias_ptr, hb_ptr, off_m, off_n, M, N, R, stride_qr, stride_qn,
                                        stride_hbm, stride_hbr, dt, HAS_LORA, HAS_BIAS, GRAD_AB, BLOCK_M, BLOCK_N,
                                        BLOCK_R)
            acc, hacc = _mainloop(x_desc, w_desc, p_arg, stride_pk, stride_pr, off_m, off_n, kb0, kb1, K, R, ht,
                                  wsb_ptr, pid_n, gb_per_n, W_KN, HAS_LORA, P_MODE, GRAD_AB, PRECISION, BLOCK_M,
                                  BLOCK_N, BLOCK_K, BLOCK_R)
            if (kb0 == 0) & (kb1 == k_tiles):  # the whole tile is this program's
                sh = _epilogue(acc, hacc, qt, bt, out_desc, h_ptr, off_m, off_n, pid_n, M, R, stride_hm, stride_hr,
                               scale, HAS_LORA, HAS_BIAS, WRITE_H, PRECISION, BLOCK_M, BLOCK_R)
                if GRAD_AB:
                    _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, off_m, off_n, pid_n,
                                  num_pid_m, gb_per_n, N, K, R, stride_gak, stride_gar, stride_gbr, stride_gbn,
                                  scale, PRECISION, BLOCK_N, BLOCK_K, BLOCK_R)
            else:
                # a cut tile: this program's partial goes to its slot (slot 0: its first tile,
                # 1: its last; a program cuts at most those two)
                seg = (tile != first_tile).to(tl.int32)
                slot = ws_ptr + (pid * 2 + seg) * (BLOCK_M * WS_N)
                tl.store(slot + offs_wm[:, None] * WS_N + offs_wn[None, :], acc)
                if HAS_LORA:
                    tl.store(slot + offs_wm[:, None] * WS_N + BLOCK_N + offs_wr[None, :], hacc)
                tl.debug_barrier()  # every thread's partial stored before the release below
                p_lo = (tile * k_tiles) // iters_per_prog  # the programs that share this tile
                p_hi = ((tile + 1) * k_tiles - 1) // iters_per_prog
                arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == p_hi - p_lo:  # the last one: sum the partials in program order
                    tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    htot = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for p in range(p_lo, p_hi + 1):
                        seg_p = (((p * iters_per_prog) // k_tiles) != tile).to(tl.int32)
                        slot_p = ws_ptr + (p * 2 + seg_p) * (BLOCK_M * WS_N)
                        tot += tl.load(slot_p + offs_wm[:, None] * WS_N + offs_wn[None, :], cache_modifier=".cg")
                        if HAS_LORA:
                            htot += tl.load(slot_p + offs_wm[:, None] * WS_N + BLOCK_N + offs_wr[None, :],
                                            cache_modifier=".cg")
                    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                    sh = _epilogue(tot, htot, qt, bt, out_desc, h_ptr, off_m, off_n, pid_n, M, R, stride_hm,
                                   stride_hr, scale, HAS_LORA, HAS_BIAS, WRITE_H, PRECISION, BLOCK_M, BLOCK_R)
                    if GRAD_AB:
                        _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, off_m, off_n, pid_n,
                                      num_pid_m, gb_per_n, N, K, R, stride_gak, stride_gar, stride_gbr, stride_gbn,
                                      scale, PRECISION, BLOCK_N, BLOCK_K, BLOCK_R)
    else:
        # the epilogue's tile index is counted separately from the loop's (as Triton's persistent
        # matmul tutorial does), so a flattened loop need not carry one value into both
        tile_c = pid - nprog
        for tile in tl.range(pid, num_tiles, nprog, flatten=FLATTEN):
            pid_m, pid_n = _tile_mn(tile, num_pid_m, num_pid_n, GROUP_M)
            qt, bt, ht = _tile_operands(q_ptr, bias_ptr, hb_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, R,
                                        stride_qr, stride_qn, stride_hbm, stride_hbr, dt, HAS_LORA, HAS_BIAS, GRAD_AB,
                                        BLOCK_M, BLOCK_N, BLOCK_R)
            acc, hacc = _mainloop(x_desc, w_desc, p_arg, stride_pk, stride_pr, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                  0, k_tiles, K, R, ht, wsb_ptr, pid_n, gb_per_n, W_KN, HAS_LORA, P_MODE, GRAD_AB,
                                  PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
            tile_c += nprog
            pid_m_c, pid_n_c = _tile_mn(tile_c, num_pid_m, num_pid_n, GROUP_M)
            sh = _epilogue(acc, hacc, qt, bt, out_desc, h_ptr, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, pid_n_c, M, R,
                           stride_hm, stride_hr, scale, HAS_LORA, HAS_BIAS, WRITE_H, PRECISION, BLOCK_M, BLOCK_R)
            if GRAD_AB:
                _grad_ab_tail(sh, xa_desc, ga_ptr, gb_ptr, wsa_ptr, wsb_ptr, cab_ptr, pid_m_c * BLOCK_M,
                              pid_n_c * BLOCK_N, pid_n_c, num_pid_m, gb_per_n, N, K, R, stride_gak, stride_gar,
                              stride_gbr, stride_gbn, scale, PRECISION, BLOCK_N, BLOCK_K, BLOCK_R)
