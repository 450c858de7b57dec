"""lora_bench/kernels/lora_tma.py (the Hopper TMA kernels of the ``tma+ab`` / ``tma-fused`` /
``tma-frozen`` graph candidates): the kernels against float64 under Triton's CPU interpreter (both
schedules, tiles cut between programs, odd row counts, K tails, ranks 1-64, with and without a
bias, NaN-poisoned outputs; the fused backward's grad_A and grad_B, its workspaces and counters
back at zero after every launch); why they cannot run where they cannot; the config labels and the
untuned choice; and, where Triton brings its NVIDIA backend, that every config compiles for sm_90
within the shared memory of one H100/H200 block, the fused backward included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

KERNELS_CODE = r'''
import torch
from lora_bench.kernels import lora_tma as T

T.POISON_OUTPUTS = True
torch.manual_seed(0)
bad, cut, idle, modes, refused = [], 0, 0, set(), 0
orig = T._p_operand
def spy(*args):
    arg, mode = orig(*args)
    modes.add(mode)
    return arg, mode
T._p_operand = spy


def rel(out, ref):
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm())


# (M, k, n, r, bias): odd row counts, K tails (k or n not a multiple of 16), ranks 1..64
CASES = [(45, 40, 56, 4, True), (37, 64, 48, 16, False), (20, 32, 24, 33, True), (64, 48, 96, 1, True),
         (10, 128, 16, 8, True), (33, 96, 40, 8, False), (7, 24, 40, 64, True)]
for dt, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
    for M, k, n, r, bias in CASES:
        for c in T._CONFIGS_CPU:
            for K, N in ((k, n), (n, k)):  # the forward's and the backward's launch
                progs, ipp = T._plan(M, N, K, c, torch.device("cpu"))
                cut += bool(c.stream_k and ipp % -(-K // c.block_k))
            x = torch.randn(M, k).to(dt)
            w = (torch.randn(n, k) * k ** -0.5).to(dt)
            a = (torch.randn(k, r) * k ** -0.5).to(dt)
            b = (torch.randn(r, n) * r ** -0.5).to(dt)
            bb = (torch.randn(n) * 0.5).to(dt) if bias else None
            g = torch.randn(M, n).to(dt)
            s = 1.7
            y, h = T.lora_fwd(x, w, a, b, bb, s, config=c)
            gx, u = T.lora_bwd_x(g, w, a, b, s, config=c)
            cf = c
            if c.stream_k:  # the fused backward refuses stream-K; it runs the data-parallel twin here
                try:
                    T.lora_bwd_ab(g, x, h, w, a, b, s, config=c)
                except ValueError as exc:
                    refused += "data-parallel schedule only" in str(exc)
                cf = T.TMAConfig(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages)
            for _ in range(2):  # the second launch finds the workspaces and counters the first left
                gxf, ga, gb = T.lora_bwd_ab(g, x, h, w, a, b, s, config=cf)
            n_cols, k_blocks = -(-k // cf.block_n), -(-n // cf.block_k)
            idle += n_cols > -(-k_blocks // -(-k_blocks // n_cols))  # a column tile that owns no grad_B block
            yl = T.linear_fwd(x, w, bb, config=c)
            gxl = T.linear_bwd_x(g, w, config=c)
            xd, wd, ad, bd, gd = (t.double() for t in (x, w, a, b, g))
            bias_d = bb.double() if bias else 0
            H, U = xd @ ad, gd @ bd.t()
            refs = {"y": xd @ wd.t() + s * H @ bd + bias_d, "h": H, "grad_x": gd @ wd + s * U @ ad.t(), "u": U,
                    "y frozen": xd @ wd.t() + bias_d, "grad_x frozen": gd @ wd,
                    "grad_x fused": gd @ wd + s * U @ ad.t(), "grad_A": s * xd.t() @ U, "grad_B": s * H.t() @ gd}
            outs = {"y": y, "h": h, "grad_x": gx, "u": u, "y frozen": yl, "grad_x frozen": gxl,
                    "grad_x fused": gxf, "grad_A": ga, "grad_B": gb}
            for name, ref in refs.items():
                e = rel(outs[name], ref)
                if not e <= tol:
                    bad.append(f"{dt} {(M, k, n, r, bias)} {c.label} {name} {e:.2e}")
left = [t for t in T._CNT.values() if int(t.count_nonzero())]
dirty = [key[1] for key, t in T._WS.items() if len(key) > 1 and int(t.count_nonzero())]
# a workspace left dirty (a launch that never finished) spoils the next launch until reset_scratch
T._WS[(torch.device("cpu"), "grad_A")] += 1.0
spoilt = rel(T.lora_bwd_ab(g, x, h, w, a, b, s)[1], refs["grad_A"]) > 10 * tol
T.reset_scratch()
fixed = rel(T.lora_bwd_ab(g, x, h, w, a, b, s)[1], refs["grad_A"]) <= tol
print("FAILURES", bad)
print("DIRTY", dirty, "IDLE", idle, "RESET", spoilt, fixed)
print("CUT", cut, "MODES", sorted(modes), "COUNTERS_LEFT", len(left))
print("REFUSED", refused)
'''




@needs_triton
@pytest.mark.slow
def test_tma_kernels_match_float64_under_the_interpreter():
    """Forward (y, h), backward (grad_x, u), the fused backward (grad_x, grad_A, grad_B, launched
    twice) and the frozen kernels against float64, in both schedules; tiles cut between stream-K
    programs occur, as do column tiles that own no block of grad_B; the counters and the fused
    backward's workspaces are back at zero after every launch (a dirty one spoils the next launch
    until ``reset_scratch``), and the rank-r operand takes all three paths (descriptor as stored,
    descriptor transposed, pointer loads for rows TMA cannot take)."""
    proc = run_interpreted(["-c", KERNELS_CODE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILURES []" in proc.stdout, proc.stdout[-3000:]
    dirty, idle = proc.stdout.split("DIRTY ")[1].split(" IDLE ")
    assert dirty == "[]" and int(idle.split()[0]) >= 4 and idle.split(" RESET ")[1].startswith("True True"), idle
    cut, modes = proc.stdout.split("CUT ")[1].split()[0], proc.stdout.split("MODES ")[1]
    left = proc.stdout.split("COUNTERS_LEFT ")[1].split()[0]
    assert int(cut) >= 10 and modes.startswith("[0, 1, 2]") and left == "0", proc.stdout[-500:]
    # every stream-K config given to the fused backward was refused with the reason (2 dtypes × 7 cases)
    assert proc.stdout.split("REFUSED ")[1].split()[0] == "14", proc.stdout[-500:]


TUNE_CODE = r'''
import torch
from lora_bench.kernels import lora_tma as T
from lora_bench.kernels import lora_tma_tune as TT

# the CPU stands in for CUDA: no device to synchronise, one "microsecond" per config
torch.cuda.synchronize = lambda *a: None
TT._graph_us = lambda fn: (fn(), float(len(T.TUNE_LOG) + 1))[1]
bad_cfg = T.TMAConfig(12, 16, 16, 4, 1)  # not a power of two: the descriptor refuses it
T.configs = lambda dtype, device: (bad_cfg, *T._CONFIGS_CPU)
lines = []
x, w = torch.randn(37, 32), torch.randn(48, 32) * 32 ** -0.5
a, b = torch.randn(32, 4) * 32 ** -0.5, torch.randn(4, 48) * 0.5
bias, g = torch.randn(48), torch.randn(37, 48)
why = TT.tune_layer(x, w, bias, a, b, g, 2.0, log=lines.append)
print("WHY", why)
print("TUNED", sorted((k[2], k[3], k[4], k[5], c.label) for k, c in T.TUNED.items()))
print("CHOSEN", T.chosen(x, w))
print("LOG", " || ".join(lines))
again = []
print("AGAIN", TT.tune_layer(x, w, bias, None, None, g, 2.0, lora=False, log=again.append), len(again))
fused = []
print("FUSED", TT.tune_layer(x, w, bias, a, b, g, 2.0, grad_ab=True, log=fused.append), len(fused),
      T.chosen(x, w, grad_ab=True), "|", " || ".join(fused))
T.configs = lambda dtype, device: (bad_cfg,)
print("NONE", TT.tune_layer(torch.randn(5, 32), w, None, a, b, torch.randn(5, 48), 2.0))
'''


@needs_triton
@pytest.mark.slow
def test_tuning_keeps_a_correct_config_per_launch_and_reports_the_rest():
    """tune_layer on the CPU (interpreter; timing stubbed): each launch shape gets a config that ran
    and matched float64, a config that cannot build is listed as failed with its error, the frozen
    kernels reuse the shape's choice, the fused backward is tuned on its own (checked with grad_A
    and grad_B) beside the forward already chosen, and a shape where nothing runs says so."""
    proc = run_interpreted(["-c", TUNE_CODE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert out["WHY"] == "None", out
    assert out["TUNED"] == ("[(37, 32, 48, True, '16x16x16w4s1sk'), (37, 48, 32, False, '16x16x16w4s1sk')]"), out
    assert out["CHOSEN"] == "fwd 16x16x16w4s1sk, bwd 16x16x16w4s1sk"
    assert out["LOG"].count("failed: 12x16x16w4s1 ValueError") == 2 and "fwd 37x48x32:" in out["LOG"], out
    assert out["AGAIN"] == "None 0", out
    # the fused backward is tuned over the data-parallel configs only (stream-K is refused there)
    assert out["FUSED"].startswith("None 1 fwd 16x16x16w4s1sk, bwd+ab 16x32x16w4s1 | bwd+ab 37x32x48: "), out
    assert "sk" not in out["FUSED"].split("bwd+ab 37x32x48: ")[1], out
    assert "failed: 12x16x16w4s1 ValueError" in out["FUSED"], out
    assert out["NONE"].startswith("fwd: no config ran") and "bwd: no config ran" in out["NONE"], out


@needs_triton
def test_unavailable_says_why(monkeypatch):
    from lora_bench.kernels import lora_tma

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "compute capability 9.0" in lora_tma.unavailable(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert lora_tma.unavailable(torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(lora_tma.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(lora_tma.torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    why = lora_tma.unavailable(torch.device("cuda"))
    assert "9.0" in why and "A100" in why and "8.0" in why
    monkeypatch.setattr(lora_tma, "TensorDescriptor", None)
    assert ">= 3.4" in lora_tma.unavailable(torch.device("cuda"))


@needs_triton
def test_shape_unsupported_names_the_unaligned_sides():
    from lora_bench.kernels import lora_tma

    assert lora_tma.shape_unsupported(1600, 6400, 16, torch.bfloat16) is None
    assert lora_tma.shape_unsupported(33, 44, 1, torch.float32) is not None
    why = lora_tma.shape_unsupported(70, 53, 1, torch.float16)
    assert "d_in 70" in why and "d_out 53" in why and "multiples of 8" in why
    assert lora_tma.shape_unsupported(70, 64, 4, torch.bfloat16).endswith("(d_in 70)")
    assert lora_tma.shape_unsupported(64, 64, 129, torch.bfloat16) is not None
    assert lora_tma.shape_unsupported(64, 64, 4, torch.float64) is not None


@needs_triton
def test_config_labels_round_trip_and_the_environment_narrows_the_list(monkeypatch):
    from lora_bench.kernels import lora_tma

    for c in (*lora_tma._CONFIGS_16, *lora_tma._CONFIGS_32, *lora_tma._CONFIGS_CPU):
        assert lora_tma.parse_config(c.label) == c
    with pytest.raises(ValueError, match="128x128x64w8s4"):
        lora_tma.parse_config("128x128")
    monkeypatch.setenv("LORA_TMA_CONFIGS", "64x128x64w4s4sk, 128x128x64w8s4")
    assert [c.label for c in lora_tma.configs(torch.bfloat16, torch.device("cuda"))] == [
        "64x128x64w4s4sk", "128x128x64w8s4"]
    assert lora_tma.configs(torch.bfloat16, torch.device("cpu")) == lora_tma._CONFIGS_CPU


@needs_triton
def test_untuned_choice_and_launch_plan_at_gpt2_shapes(monkeypatch):
    """Without tuning, the 104-tile 1600-wide launches run stream-K (every program the same number
    of K iterations, none empty); the plan never launches more programs than SMs times per_sm."""
    from lora_bench.kernels import lora_tma

    monkeypatch.setattr(lora_tma, "_sms", lambda device: 132)
    monkeypatch.delenv("LORA_TMA_CONFIGS", raising=False)
    dev = torch.device("cuda")
    for M, N, K in ((960, 768, 768), (960, 3072, 768), (960, 1600, 1600), (960, 6400, 1600), (960, 1600, 6400)):
        c = lora_tma.default_config(M, N, K, torch.bfloat16, dev)
        assert c in lora_tma._CONFIGS_16
        for cfg in lora_tma._CONFIGS_16:
            progs, ipp = lora_tma._plan(M, N, K, cfg, dev)
            tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
            assert 1 <= progs <= 132 * cfg.per_sm
            if cfg.stream_k:
                total = tiles * -(-K // cfg.block_k)
                assert (progs - 1) * ipp < total <= progs * ipp
            else:
                assert ipp == 0 and progs == min(tiles, 132 * cfg.per_sm)
    assert lora_tma.default_config(960, 1600, 6400, torch.bfloat16, dev).stream_k


COMPILE_CODE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lora_bench.kernels import lora_tma as T

SMEM = 232448  # an H100/H200 block's shared memory (227 KB)
bad = []
for dt, cfgs in (("bf16", T._CONFIGS_16), ("fp32", T._CONFIGS_32)):
    for c in cfgs:
        # the forward's launch, the backward's, the fused backward's (grad_A and grad_B too; never flattened)
        for w_kn, p_mode, bias, ab in ((False, 1, True, False), (True, 2, False, False), (True, 2, False, True)):
            desc = lambda shape, t=dt: f"tensordesc<{t}[{shape[0]},{shape[1]}]>"
            sig = {"x_desc": desc([c.block_m, c.block_k]),
                   "w_desc": desc([c.block_k, c.block_n] if w_kn else [c.block_n, c.block_k]),
                   "out_desc": desc([c.block_m, c.block_n]),
                   "p_arg": desc([16, c.block_k] if p_mode == 2 else [c.block_k, 16]),
                   "q_ptr": f"*{dt}", "bias_ptr": f"*{dt}", "h_ptr": f"*{dt}", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
                   "xa_desc": desc([c.block_m, c.block_n]), "hb_ptr": f"*{dt}", "ga_ptr": f"*{dt}",
                   "gb_ptr": f"*{dt}", "wsa_ptr": "*fp32", "wsb_ptr": "*fp32", "cab_ptr": "*i32"}
            sig.update({n: "i32" for n in ("M", "N", "K", "R", "stride_pk", "stride_pr", "stride_qr", "stride_qn",
                                            "stride_hm", "stride_hr", "iters_per_prog")})
            sig["scale"] = "fp32"
            sig.update({n: "i32" for n in ("stride_hbm", "stride_hbr", "stride_gak", "stride_gar", "stride_gbr",
                                            "stride_gbn")})
            const = dict(W_KN=w_kn, HAS_LORA=True, P_MODE=p_mode, HAS_BIAS=bias, WRITE_H=not ab, GRAD_AB=ab,
                         STREAM_K=c.stream_k, FLATTEN=c.flatten and not ab, PRECISION="tf32", BLOCK_M=c.block_m,
                         BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_R=16, GROUP_M=8)
            sig.update({n: "constexpr" for n in const})
            try:
                k = triton.compile(ASTSource(fn=T._lora_tma_kernel, signature=sig, constexprs=const),
                                   target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": c.num_warps, "num_stages": c.num_stages})
            except Exception as exc:
                bad.append(f"{dt} {c.label} w_kn={w_kn} ab={ab}: {type(exc).__name__}: {str(exc)[-300:]}")
                continue
            ptx = k.asm["ptx"]
            if k.metadata.shared > SMEM:
                bad.append(f"{dt} {c.label} w_kn={w_kn} ab={ab}: {k.metadata.shared} B of shared memory")
            if "cp.async.bulk.tensor" not in ptx or (dt == "bf16" and "wgmma.mma_async" not in ptx):
                bad.append(f"{dt} {c.label} w_kn={w_kn} ab={ab}: no TMA or no warp-group MMA in the PTX")
            if ab and "red.global.gpu.relaxed.add.f32" not in ptx:  # the gradients' adds: fire-and-forget reductions
                bad.append(f"{dt} {c.label} fused: no red.global for the gradient adds in the PTX")
print("FAILURES", bad)
'''


@needs_triton
@pytest.mark.slow
def test_every_config_compiles_for_sm90_within_shared_memory():
    """No GPU needed: Triton's NVIDIA backend compiles each config's forward, backward and fused
    backward launch for sm_90 (TMA copies and, in bf16, warp-group MMAs in the PTX; the fused
    backward's gradient adds as fire-and-forget reductions; at most 227 KB of shared memory), so a
    config that cannot build is caught before a GPU run."""
    spec = importlib.util.find_spec("triton.backends.nvidia")
    if spec is None or not (Path(spec.origin).parent / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no NVIDIA backend with ptxas")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", COMPILE_CODE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILURES []" in proc.stdout, proc.stdout[-3000:]
