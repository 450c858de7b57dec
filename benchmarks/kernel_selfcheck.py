"""Check and time the LoRA Triton kernels in one go.

    TRITON_INTERPRET=1 python -m benchmarks.kernel_selfcheck --interpret   # CPU, Triton's interpreter
    python -m benchmarks.kernel_selfcheck --out DIR                         # GPU: sweep + bench

The interpreter check runs the kernels on fresh random inputs at odd sizes against float64,
outputs pre-filled with NaN. (bf16 is left to the GPU: Triton 3.6's interpreter gets bf16 dots
wrong.) On a GPU: a tile-config sweep of each launch against cuBLAS at the GPT-2 1558M layer
shapes, host launch cost, then ``run_kernel_bench``; the short table prints last.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


def interpreter_check(*, verbose: bool = True) -> list[str]:
    """Failures (empty when all pass). Needs TRITON_INTERPRET=1 set before Triton is imported."""
    from lora_bench.kernels import lora_triton as lt

    failures = []
    gen = torch.Generator().manual_seed(int(time.time()))  # fresh inputs each run
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}
    for dt in (torch.float32, torch.float16):
        cases = ((45, 70, 53, 5, 0.7), (64, 64, 64, 16, 2.0), (33, 96, 17, 1, 0.0), (20, 40, 36, 33, 1.5))
        # each case with H formed in the GEMM's K loop and before the launch (lora_triton.h_apart)
        for (M, K, N, R, s), apart in itertools.product(cases, (False, True)):
            def rnd(*shape, scale=1.0):
                return (torch.randn(*shape, generator=gen) * scale).to(dt)

            x, g = rnd(M, K), rnd(M, N)
            w, a, b, bias = rnd(N, K, scale=K ** -0.5), rnd(K, R, scale=K ** -0.5), rnd(R, N), rnd(N)
            nan = float("nan")
            y, h = torch.full((M, N), nan, dtype=dt), torch.full((M, R), nan, dtype=dt)
            lt.lora_mm(x, w.t(), a, b, bias, scale=s, out=y, h_out=h, apart=apart)
            gx, u = torch.full((M, K), nan, dtype=dt), torch.full((M, R), nan, dtype=dt)
            lt.lora_mm(g, w, b.t(), a.t(), None, scale=s, out=gx, h_out=u, apart=apart)
            ga, gb = torch.full((K, R), nan), torch.full((R, N), nan)
            lt.lora_grad_ab(x, u, h, g, scale=s, ga_out=ga, gb_out=gb)
            X, G, W, A, B = (t.double() for t in (x, g, w, a, b))
            H, U = X @ A, G @ B.t()
            checks = {
                "y": (y, X @ W.t() + bias.double() + s * H @ B), "h": (h, H),
                "grad_x": (gx, G @ W + s * U @ A.t()), "u": (u, U),
                "grad_A": (ga, s * X.t() @ u.double()) if s else (ga, None),
                "grad_B": (gb, s * h.double().t() @ G) if s else (gb, None),
            }
            if dt != torch.float32:  # fp32 master A/B (autocast): rounded in registers, same result as a cast
                y32, h32 = torch.full((M, N), nan, dtype=dt), torch.full((M, R), nan, dtype=dt)
                lt.lora_mm(x, w.t(), a.float(), b.float(), bias, scale=s, out=y32, h_out=h32, apart=apart)
                checks["y(fp32 A,B)"] = (y32, y.double()) if torch.equal(h32, h) else (h32, h.double())
            for name, (out, ref) in checks.items():
                if ref is None:  # alpha 0: the gradient is exactly zero
                    ok, e = bool((out == 0).all()), 0.0
                else:
                    e = _err(out, ref)
                    ok = e <= tol[dt] and not out.isnan().any()
                if verbose:
                    print(f"interp {str(dt)[6:]:8} M{M} K{K} N{N} r{R} s{s} {'apart' if apart else 'fused'} {name:6} err {e:.1e} {'ok' if ok else 'FAIL'}")
                if not ok:
                    failures.append(f"{dt} {(M, K, N, R, s)} apart={apart} {name} err={e:.2e}")
    failures += _function_check(gen, verbose=verbose)
    return failures


def _function_check(gen: torch.Generator, *, verbose: bool) -> list[str]:
    """The autograd Function end to end on each of its plans, forced through the plan policy (3-D,
    non-contiguous input, a trainable bias to exercise grad_b, frozen weight) against float64."""
    from lora_bench.kernels.autograd import lora_linear
    from lora_bench.kernels.policy import Plan, PlanPolicy, record_plans, use_policy

    failures = []
    x0 = torch.randn(3, 29, 41, generator=gen).transpose(0, 1)  # (29, 3, 41), non-contiguous
    w, bias = torch.randn(37, 41, generator=gen) * 41 ** -0.5, torch.randn(37, generator=gen)
    a, b, g = torch.randn(41, 7, generator=gen), torch.randn(7, 37, generator=gen), torch.randn(29, 3, 37, generator=gen)
    ref_in = [t.double().requires_grad_(True) for t in (x0, bias, a, b)]
    xr, br, ar, bmr = ref_in
    yr = xr @ w.double().t() + br + 1.5 * (xr @ ar) @ bmr
    refs = [yr, *torch.autograd.grad(yr, ref_in, g.double())]
    for plan in (Plan.FUSED, Plan.CUBLAS, Plan.TORCH):
        mode = plan.value
        with use_policy(PlanPolicy(forced=plan)), record_plans() as ran:
            ins = [t.clone().requires_grad_(True) for t in (x0, bias, a, b)]
            y = lora_linear(ins[0], w, ins[1], ins[2], ins[3], 1.5)
            outs = [y, *torch.autograd.grad(y, ins, g)]
        if list(ran) != [plan]:
            failures.append(f"Function forced {mode} ran {[p.value for p in ran]}")
        for name, out, ref in zip(("y", "grad_x", "grad_bias", "grad_A", "grad_B"), outs, refs):
            e = _err(out, ref.detach())
            ok = e <= 1e-5 and out.shape == ref.shape
            if verbose:
                print(f"interp Function mode={mode:11} {name:9} err {e:.1e} {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(f"Function {mode} {name} err={e:.2e}")
    return failures


def _dev_us(fn) -> float:
    """Device-only microseconds per call: ``fn`` captured in a CUDA graph and replayed (no launch
    gaps; inputs stay in L2 for cuBLAS and Triton alike)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def sweep(shapes: list[tuple[int, int, int, int]], dtype: torch.dtype) -> list[str]:
    """Each launch per tile config against cuBLAS doing the plain GEMM (the floor for it); the
    fastest tile per launch shape goes into ``lora_tiles.TUNED`` for the bench that follows."""
    from lora_bench.kernels import lora_tiles
    from lora_bench.kernels import lora_triton as lt

    lines = []
    dev = torch.device("cuda")
    cands = lora_tiles._MM_CANDIDATES_32 if dtype == torch.float32 else lora_tiles._MM_CANDIDATES_16
    for M, k, n, r in shapes:
        x, g = torch.randn(M, k, device=dev, dtype=dtype), torch.randn(M, n, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5
        a, b, bias = (torch.randn(k, r, device=dev, dtype=dtype), torch.randn(r, n, device=dev, dtype=dtype),
                      torch.randn(n, device=dev, dtype=dtype))
        h, u = x @ a, g @ b.t()
        tag = f"{M}x{k}->{n} r{r} {str(dtype)[6:]}"
        res = {"fwd cublas addmm (floor)": _dev_us(lambda: torch.addmm(bias, x, w.t())),
               "bwd cublas g@W (floor)": _dev_us(lambda: g @ w),
               "fwd torch 3 ops": _dev_us(lambda: torch.addmm(bias, x, w.t()).addmm_(x @ a, b, alpha=2.0)),
               "bwd torch 3 ops": _dev_us(lambda: (g @ w).addmm_(g @ b.t(), a.t(), alpha=2.0))}
        best = {}
        for c in cands:
            for phase, (MM, NN, KK), fn in (
                ("fwd", (M, n, k), lambda c=c: lt.lora_mm(x, w.t(), a, b, bias, scale=2.0, config=c)),
                ("bwd", (M, k, n), lambda c=c: lt.lora_mm(g, w, b.t(), a.t(), None, scale=2.0, config=c)),
            ):
                t = res[f"{phase} triton {tuple(c)}"] = _dev_us(fn)
                if t < best.get((MM, NN, KK), (None, 1e9))[1]:
                    best[(MM, NN, KK)] = (c, t)
        for key, (c, _) in best.items():
            lora_tiles.TUNED[(*key, dtype)] = c
        res["ab torch 2 mm"] = _dev_us(lambda: (x.t() @ u, h.t() @ g))
        for bd in (32, 64):
            c = lt.ABConfig(64, bd, 4, 3)  # bf16 grads: always one row split (no atomics)
            res[f"ab triton {tuple(c)}"] = _dev_us(lambda c=c: lt.lora_grad_ab(x, u, h, g, scale=2.0, config=c))
            for split in (1, 0):  # fp32 grads (autocast's master weights): one split, the auto split
                c = lt.ABConfig(64, bd, 4, 3, split)
                res[f"ab triton {tuple(c)} fp32"] = _dev_us(
                    lambda c=c: lt.lora_grad_ab(x, u, h, g, scale=2.0, grad_dtype=torch.float32, config=c))
        for name, us in res.items():
            lines.append(f"sweep {tag:24} {name:34} {us:8.1f} us")
        lines.append(f"tuned {tag:24} " + "  ".join(f"{kk}: {tuple(c)}" for kk, (c, _) in best.items()))
    return lines


def host_cost(dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Launch-bound throughput (tiny shapes, no sync per call) = host cost per call."""
    from lora_bench.kernels import triton_launch as launch
    from lora_bench.kernels import lora_triton as lt
    from lora_bench.kernels.autograd import lora_linear
    from lora_bench.lora.layer import LinearWithLoRA

    dev = torch.device("cuda")
    x = torch.randn(64, 64, device=dev, dtype=dtype, requires_grad=True)
    w, bias = torch.randn(64, 64, device=dev, dtype=dtype), torch.randn(64, device=dev, dtype=dtype)
    a = torch.randn(64, 16, device=dev, dtype=dtype, requires_grad=True)
    b = torch.randn(16, 64, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(64, 64, device=dev, dtype=dtype)
    ref = LinearWithLoRA(torch.nn.Linear(64, 64), 16, 2.0).to(dev, dtype).requires_grad_(True)
    ref.linear.requires_grad_(False)
    xd, ad, bd = x.detach(), a.detach(), b.detach()

    def jit_launch():
        launch.FAST = False
        try:
            lt.lora_fwd(xd, w, ad, bd, bias, 2.0)
        finally:
            launch.FAST = True

    cases = {
        "torch.mm": lambda: torch.mm(xd, w),
        "triton lora_fwd, fast launch": lambda: lt.lora_fwd(xd, w, ad, bd, bias, 2.0),
        "triton lora_fwd, triton launch": jit_launch,
        "F.linear fwd only (frozen)": lambda: torch.nn.functional.linear(x, w, bias),
        "lora_linear fwd only": lambda: lora_linear(x, w, bias, a, b, 2.0),
        "F.linear fwd+bwd (frozen)": lambda: torch.autograd.grad(torch.nn.functional.linear(x, w, bias), [x], g),
        "lora_linear fwd+bwd": lambda: torch.autograd.grad(lora_linear(x, w, bias, a, b, 2.0), [x, a, b], g),
        "LinearWithLoRA fwd+bwd": lambda: torch.autograd.grad(ref(x), [x, ref.lora.A, ref.lora.B], g),
    }
    lines = []
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        lines.append(f"host  {name:32} {1e6 * (time.perf_counter() - t0) / 300:7.1f} us/call")
    lines.append(f"host  fast launch {launch.FAST}, direct C launch {launch._DIRECT_C}, cached {len(launch._COMPILED)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="CPU check under TRITON_INTERPRET=1")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for sweep.txt and kernel_bench.csv")
    ap.add_argument("--shapes", nargs="*", default=["1558m"])
    ap.add_argument("--impls", nargs="*", default=["frozen", "lora", "lora-merged", "lora-kernel", "lora-kernel:cpp",
                                                     "lora-kernel:fused", "lora-kernel:cublas"])
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args(argv)
    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("set TRITON_INTERPRET=1 before running the interpreter check", file=sys.stderr)
            return 2
        failures = interpreter_check()
        print("interpreter check:", "all ok" if not failures else f"{len(failures)} FAILED: {failures}")
        return 1 if failures else 0

    import triton
    from rich.console import Console

    from lora_bench.bench.kernel_bench import render_kernel_table, resolve_shapes, run_kernel_bench

    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    lines = host_cost()
    print("\n".join(lines), flush=True)
    if not args.no_sweep:
        shapes = [(s.tokens, s.d_in, s.d_out, s.rank) for s in resolve_shapes(args.shapes)]
        swept = sweep(shapes, torch.bfloat16)
        print("\n".join(swept), flush=True)
        lines += swept
    (args.out / "sweep.txt").write_text("\n".join(lines) + "\n")
    rows = run_kernel_bench(shapes=args.shapes, impls=args.impls, dtypes=args.dtypes, device="cuda",
                            repeats=args.repeats, warmup=10, out_csv=args.out / "kernel_bench.csv", cpu=False,
                            progress=True)
    Console(width=200).print(render_kernel_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
