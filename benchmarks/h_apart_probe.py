"""What the adapters cost inside the fused LoRA GEMM, per launch (docs/kernel-design.md, "H formed apart").

    python -m benchmarks.h_apart_probe [NAME ...]     # a CUDA GPU; NAME filters the shapes, e.g. 1558M

At GPT-2's attention shapes (960 rows, bf16), each replayed from a CUDA graph (12 launches per replay,
median of 40 replays, six operand sets rotated so the weights come from memory; µs per launch):
cuBLAS's frozen product and its three-launch LoRA, the fused kernel (``lora_mm``) with H formed in its
K loop and apart (``apart=True``: H by torch's GEMM before the launch), per tile configuration, and a
probe GEMM with TMA loads (``_tma_kernel``: the same tiles, with and without the adapters) that shows
what the GEMM alone costs. Outputs are checked against float64 before they are timed."""
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lora_bench.kernels import lora_triton as LT
from lora_bench.kernels.lora_tiles import MMConfig
from lora_bench.kernels.lora_triton import _tile


@triton.jit
def _tma_kernel(x_desc, w_desc, a_ptr, b_ptr, out_desc, h_ptr, M, N, K, R, stride_ak, stride_ar, stride_br,
                stride_bn, stride_hm, scale, W_T: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
                STAGES: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)  # the fused kernel's tile order
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    a_ptrs = a_ptr + offs_k[:, None] * stride_ak + offs_r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hacc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        xt = x_desc.load([off_m, k])
        if W_T:
            wt = w_desc.load([off_n, k]).T
        else:
            wt = w_desc.load([k, off_n])
        acc = tl.dot(xt, wt, acc)
        if HAS_LORA:
            at = tl.load(a_ptrs, mask=((k + offs_k) < K)[:, None] & (offs_r < R)[None, :], other=0.0)
            hacc = tl.dot(xt, at.to(xt.dtype), hacc)
            a_ptrs += BLOCK_K * stride_ak
    if HAS_LORA:
        h = hacc.to(h_ptr.dtype.element_ty)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if pid_n == 0:
            tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :], h,
                     mask=(offs_m < M)[:, None] & (offs_r < R)[None, :])
        bt = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                     mask=(offs_r < R)[:, None] & (offs_n < N)[None, :], other=0.0)
        acc += scale * tl.dot(h, bt.to(h.dtype))
    out_desc.store([off_m, off_n], acc.to(h_ptr.dtype.element_ty))


def tma_call(x, w, a, b, out, h, w_t, cfg, has_lora=True):
    M, K = x.shape
    N = w.shape[0] if w_t else w.shape[1]
    R = a.shape[1]
    xd = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    wd = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k] if w_t else [cfg.block_k, cfg.block_n])
    od = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _tma_kernel[grid](xd, wd, a, b, od, h, M, N, K, R, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                      h.stride(0), 0.5, w_t, has_lora, cfg.block_m, cfg.block_n, cfg.block_k,
                      max(16, triton.next_power_of_2(R)), 8, cfg.num_stages, num_warps=cfg.num_warps)


def gtime(fns, reps=12, iters=40):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / (reps * len(fns)))
    return statistics.median(ts)


CFGS = [MMConfig(64, 128, 64, 4, 4), MMConfig(64, 128, 64, 4, 3), MMConfig(128, 128, 64, 8, 3),
        MMConfig(128, 128, 64, 8, 4), MMConfig(128, 256, 64, 8, 3), MMConfig(64, 256, 64, 4, 3),
        MMConfig(128, 64, 64, 4, 4), MMConfig(128, 128, 64, 4, 3)]
# (name, K, N, R, W transposed (forward) or not (backward grad_x))
SHAPES = [("1558M qkv fwd", 1600, 4800, 48, True), ("1558M out fwd", 1600, 1600, 16, True),
          ("1558M qkv bwd", 4800, 1600, 48, False), ("1558M out bwd", 1600, 1600, 16, False),
          ("124M qkv fwd", 768, 2304, 48, True), ("124M out fwd", 768, 768, 16, True),
          ("124M qkv bwd", 2304, 768, 48, False)]


def main():
    torch.manual_seed(0)
    M, dt, SETS = 960, torch.bfloat16, 6
    only = sys.argv[1:] or None
    for name, K, N, R, w_t in SHAPES:
        if only and not any(o in name for o in only):
            continue
        sets = []
        for _ in range(SETS):
            x = torch.randn(M, K, device="cuda", dtype=dt)
            w = torch.randn(N, K, device="cuda", dtype=dt) / 40 if w_t else torch.randn(K, N, device="cuda", dtype=dt) / 40
            a = torch.randn(K, R, device="cuda", dtype=dt) / 40
            b = torch.randn(R, N, device="cuda", dtype=dt) / 4
            out = torch.empty(M, N, device="cuda", dtype=dt)
            h = torch.empty(M, R, device="cuda", dtype=dt)
            sets.append((x, w, a, b, out, h))
        wt = (lambda w: w.t()) if w_t else (lambda w: w)
        res = {}
        res["cublas x@W"] = gtime([lambda s=s: torch.mm(s[0], wt(s[1]), out=s[4]) for s in sets])
        res["cublas x@W + (x@A)@B"] = gtime([lambda s=s: torch.addmm(torch.mm(s[0], wt(s[1])), torch.mm(s[0], s[2]), s[3],
                                                                     out=s[4]) for s in sets])
        x, w, a, b, out, h = sets[0]
        ref = (x.double() @ wt(w).double() + 0.5 * (x @ a).double() @ b.double())
        for c in CFGS:
            for apart in (False, True):
                tag = f"fused{' apart' if apart else ''} {tuple(c)}"
                try:
                    LT.lora_mm(x, wt(w), a, b, scale=0.5, out=out, h_out=h, config=c, apart=apart)
                    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
                    if err > 2e-2:
                        res[tag] = f"WRONG {err:.3g}"
                        continue
                    f = [lambda s=s, c=c, apart=apart: LT.lora_mm(s[0], wt(s[1]), s[2], s[3], scale=0.5, out=s[4],
                                                                  h_out=s[5], config=c, apart=apart) for s in sets]
                    res[tag] = gtime(f)
                except Exception as e:  # noqa: BLE001
                    res[tag] = f"fail {type(e).__name__}: {str(e)[:80]}"
            for lora in (True, False):
                tag = f"tma{'' if lora else '-gemm'} {tuple(c)}"
                try:
                    tma_call(x, w, a, b, out, h, w_t, c, lora)
                    if lora:
                        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
                        if err > 2e-2:
                            res[tag] = f"WRONG {err:.3g}"
                            continue
                    f = [lambda s=s, c=c, lora=lora: tma_call(s[0], s[1], s[2], s[3], s[4], s[5], w_t, c, lora) for s in sets]
                    res[tag] = gtime(f)
                except Exception as e:  # noqa: BLE001
                    res[tag] = f"fail {type(e).__name__}: {str(e)[:120]}"
        for k, v in res.items():
            print(f"{name:16s} {k:40s} {v if isinstance(v, str) else f'{v:8.2f}'}", flush=True)


if __name__ == "__main__":
    main()
