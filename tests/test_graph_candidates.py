"""benchmarks/lora_graph_candidates.py: the candidates' math against float64 (CPU: torch ops; the
Triton candidates under Triton's interpreter when Triton is installed), the checker itself (it
must fail wrong math and unwritten outputs), the graph-dump parser, the round-ratio statistics,
the command line; on a GPU, the study's checks and graph node counts."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from numerics import run_interpreted

from lora_bench.train.graph_nodes import parse_graph_dot

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "lora_graph_candidates.py"


def _load():
    spec = importlib.util.spec_from_file_location("lora_graph_candidates", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


lgc = _load()
TORCH_ONLY = [name for name, c in lgc.CANDIDATES.items() if not c.triton]
TRITON = [name for name, c in lgc.CANDIDATES.items() if c.triton]
TMA = ["tma+ab", "tma-fused", "tma-frozen"]  # Hopper TMA kernels: skipped where they cannot run
CASES = [  # (N, k, n, r, bias): odd sizes, ranks 1..64, with and without bias, square and not
    (37, 70, 53, 1, True),
    (41, 96, 130, 4, False),
    (45, 33, 45, 16, True),
    (64, 48, 96, 16, False),
    (150, 128, 192, 64, True),
]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())


def _reference_autograd(x, w, b, a, bm, g, s, *, lora: bool):
    """float64 reference through autograd on the plain formula (independent of the script's)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (x, a, bm)]
    xr, ar, bmr = leaves
    y = xr @ w.double().t() + (b.double() if b is not None else 0)
    if lora:
        y = y + s * ((xr @ ar) @ bmr)
    grads = torch.autograd.grad(y, leaves, g.double(), allow_unused=True)
    return y.detach(), grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}->{c[2]}r{c[3]}{'b' if c[4] else ''}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", TORCH_ONLY)
def test_candidate_matches_float64(name, dtype, case):
    N, k, n, r, bias = case
    cand = lgc.CANDIDATES[name]
    op = lgc.make_operands((N, k, n, r), dtype=dtype, device=torch.device("cpu"), bias=bias)
    p = cand.prepare(op)
    with lgc.poisoned():  # buffers the candidate allocates itself start as NaN
        y = cand.call(op.x, p)
        got = torch.autograd.grad(y, [op.x, *p.leaves], op.g)
    y_ref, (gx_ref, ga_ref, gb_ref) = _reference_autograd(op.x, op.w, op.b, op.a, op.bm, op.g, op.s,
                                                          lora=cand.adapters)
    assert y.dtype == dtype and y.shape == (N, n)
    assert _rel(y, y_ref) <= TOL[dtype]
    assert got[0].shape == (N, k) and _rel(got[0], gx_ref) <= TOL[dtype]
    if cand.adapters:
        ga, gb = got[1:]
        assert ga.shape == (k, r) and gb.shape == (r, n) and ga.dtype == gb.dtype == dtype
        assert _rel(ga, ga_ref) <= TOL[dtype]
        assert _rel(gb, gb_ref) <= TOL[dtype]
    else:
        assert len(got) == 1


def test_check_matches_for_every_torch_candidate_and_the_frozen_reference_has_no_lora_term():
    op = lgc.make_operands((29, 40, 24, 4), dtype=torch.float32, device=torch.device("cpu"))
    full, base = lgc.reference(op), lgc.reference(op, adapters=False)
    assert lgc.rel_err(base["y"], full["y"]) > 0.1  # the operands make the LoRA term matter
    for name in TORCH_ONLY:
        cand = lgc.CANDIDATES[name]
        errs = lgc.check_eager(cand, op, full if cand.adapters else base)
        assert lgc._verdict(errs, lgc.tolerance(torch.float32)) == "ok", (name, errs)
        assert math.isnan(errs["grad_A"]) == (not cand.adapters)


class _ForgetsScaleInGradB(torch.autograd.Function):
    """The minimal LoRA backward with grad_B missing its scale: wrong by a factor s."""

    @staticmethod
    def forward(ctx, x, w, b, a, bm, s):
        ctx.save_for_backward(x, w, a, bm)
        ctx.s = s
        return torch.addmm(b, x, w.t()) + s * (x @ a) @ bm

    @staticmethod
    def backward(ctx, g):
        x, w, a, bm = ctx.saved_tensors
        s = ctx.s
        u = g @ bm.t()
        return g @ w + s * u @ a.t(), None, None, s * x.t() @ u, (x @ a).t() @ g, None


class _LeavesLastRowUnwritten(torch.autograd.Function):
    """Writes y into a buffer from ``_alloc`` but forgets its last row."""

    @staticmethod
    def forward(ctx, x, w, b, a, bm, s):
        y = lgc._alloc((x.shape[0], w.shape[0]), x)
        y[:-1] = torch.addmm(b, x[:-1], w.t()) + s * (x[:-1] @ a) @ bm
        ctx.save_for_backward(x, w, a, bm)
        ctx.s = s
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, a, bm = ctx.saved_tensors
        s = ctx.s
        u = g @ bm.t()
        return g @ w + s * u @ a.t(), None, None, s * x.t() @ u, s * (x @ a).t() @ g, None


@pytest.mark.parametrize("fn, bad", [(_ForgetsScaleInGradB, "grad_B"), (_LeavesLastRowUnwritten, "y")])
def test_checker_fails_wrong_math_and_unwritten_outputs(fn, bad):
    op = lgc.make_operands((33, 40, 24, 4), dtype=torch.float32, device=torch.device("cpu"))
    cand = lgc.Candidate("broken", lgc.prepare_plain, lambda x, p: fn.apply(x, p.w, p.b, p.a, p.bm, p.s))
    errs = lgc.check_eager(cand, op, lgc.reference(op))
    verdict = lgc._verdict(errs, lgc.tolerance(torch.float32))
    assert verdict.startswith("FAIL") and bad in verdict, (verdict, errs)


# ncat-copy+ab's copies without its Triton launch: the same Function with torch's grad_A/grad_B
NCAT_COPY = lgc.Candidate("ncat-copy", lgc.prepare_concat_copy,
                          lambda x, p: lgc.NCat.apply(x, p.a, p.bm, p, False, True))


@pytest.mark.parametrize("cand", [lgc.CANDIDATES["ncat"], lgc.CANDIDATES["kcat"], lgc.CANDIDATES["kcat-cat"], NCAT_COPY],
                         ids=lambda c: c.name)
def test_adapters_updated_in_place_are_what_the_next_call_uses(cand):
    """ncat/kcat read A and B through the concatenated buffer: an optimizer's in-place update of the
    adapters (views of the buffer, or copied into it on every call) must reach the next call."""
    op = lgc.make_operands((21, 30, 26, 4), dtype=torch.float64, device=torch.device("cpu"))
    p = cand.prepare(op)
    a, bm = p.leaves
    before = cand.call(op.x, p).detach()
    with torch.no_grad():
        a.mul_(-1.5).add_(0.25)
        bm.add_(torch.randn_like(bm))
    y = cand.call(op.x, p)
    x = op.x.detach()
    y_ref = x @ op.w.t() + op.b + op.s * (x @ a.detach()) @ bm.detach()
    assert _rel(y, y_ref) <= 1e-12 and _rel(before, y_ref) > 0.1
    shares = a.untyped_storage().data_ptr() == p.buf.untyped_storage().data_ptr()
    assert shares == (cand is not NCAT_COPY)  # views of the buffer itself: no copy per call


def test_ncat_outputs_are_row_strided_views_and_still_view_as_heads():
    """ncat's y and grad_x carry the r extra columns of its GEMMs (leading dimension n+r, k+r);
    splitting the last dimension into attention heads still works without a copy."""
    N, k, n, r = 12, 16, 24, 4
    op = lgc.make_operands((N, k, n, r), dtype=torch.float32, device=torch.device("cpu"))
    p = lgc.CANDIDATES["ncat"].prepare(op)
    y = lgc.CANDIDATES["ncat"].call(op.x, p)
    gx, *_ = torch.autograd.grad(y, [op.x, *p.leaves], op.g)
    assert y.stride() == (n + r, 1) and gx.stride() == (k + r, 1)
    heads = y.view(3, 4, 6, 4)  # (batch, seq, heads, head dim): no copy
    assert heads.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


DOT = r'''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="solid" shape="record" label="{MEMSET
| {{ID | node handle | dptr | value} | {0 (topoId: 3) | 0x1 | 0x7F00 | 0}}}"];

"graph_1_node_1"[style="bold" shape="record" label="{KERNEL
| {ID | 1 (topoId: 2) | nvjet_tst_128x64_64x4_1x2_h_bz_TNT\<\<\<\{13,15,1\},384,0\>\>\>}
| {{node handle | func handle} | {0x2 | 0x3}}
| {cooperative | 0}
}"];

"graph_1_node_2"[style="bold" shape="record" label="{KERNEL
| {ID | 2 (topoId: 1) | _lora_ugb_kernel\<\<\<160,128,18432\>\>\>}
| {cooperative | 0}
}"];

"graph_1_node_0" -> "graph_1_node_1" [style="solid"];
"graph_1_node_1" -> "graph_1_node_2";
}
}
'''


def test_parse_graph_dot_counts_nodes_by_type_with_kernel_names():
    nodes = parse_graph_dot(DOT)
    assert nodes == {"MEMSET": [""], "KERNEL": ["nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "_lora_ugb_kernel"]}
    assert parse_graph_dot("digraph dot {\n}\n") is None


def test_minus_is_a_multiset_difference():
    assert lgc._minus(["a", "b", "a", "c"], ["a", "c"]) == ["b", "a"]


def test_ratio_to_frozen_is_the_median_of_per_round_ratios():
    # the clock halves in the second round: per-round ratios 1.5, 1.5, 0.5 -> 1.5; the ratio of overall medians would be 1.0
    ms = {"frozen": [[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]], "cand": [[1.5, 1.5], [3.0, 3.0], [2.0, 2.0]]}
    stats = lgc.summarize(ms, "frozen")
    assert stats["cand"]["x"] == pytest.approx(1.5)
    assert stats["frozen"]["x"] == pytest.approx(1.0)
    assert stats["frozen"]["us"] == pytest.approx(2000.0)  # milliseconds in, microseconds out
    assert "x" not in lgc.summarize(ms, None)["cand"]


def test_blocks_sum_to_the_repeats():
    for repeats in (1, 19, 20, 21, 200, 203):
        blocks = lgc._blocks(repeats)
        assert sum(blocks) == repeats and max(blocks) <= lgc.ROUND and min(blocks) >= 1


@pytest.mark.parametrize("group", ["124m", "1558m"])
def test_rotated_sets_exceed_twice_the_l2(group):
    for shape in lgc.resolve_shapes([group]):
        N, k, n, r = shape.tokens, shape.d_in, shape.d_out, shape.rank
        sets = lgc.n_sets((N, k, n, r), torch.bfloat16, 60 << 20)
        per_set = 2 * (n * k + N * (k + n) + r * (k + n))
        assert sets * per_set >= 2 * (60 << 20) and sets <= lgc.MAX_SETS


def test_cli_cpu_check_writes_a_csv_and_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "c.csv"
    rc = lgc.main(["--cpu-check", "--shapes", "19:24->20:r2", "--dtypes", "fp32", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["candidate"] for r in rows} == set(lgc.CANDIDATES)
    assert len(rows) == 2 * len(lgc.CANDIDATES)  # with and without bias
    for r in rows:
        if r["candidate"] in TORCH_ONLY or lgc.triton_usable(torch.device("cpu")):
            assert r["check"] == "ok" and float(r["err_y"]) <= 1e-5, r
        else:
            assert r["check"] == "skip"
    assert "19:24->20:r2" in text.splitlines()[1] and "kcat-cat" in text


@pytest.mark.parametrize("argv, words", [
    (["--cpu-check", "--candidates", "nope"], ["--candidates", "'nope'", "kcat"]),
    (["--cpu-check", "--dtypes", "int8"], ["--dtypes", "'int8'", "bf16"]),
    (["--cpu-check", "--shapes", "12:34"], ["'12:34'"]),
    (["--cpu-check", "--repeats", "0"], ["--repeats 0"]),
])
def test_cli_usage_errors_exit_2_with_one_clear_line(argv, words, capsys):
    assert lgc.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for w in words:
        assert w in err


def test_cli_candidates_take_commas_and_spaces(tmp_path):
    out = tmp_path / "c.csv"
    assert lgc.main(["--cpu-check", "--candidates", "frozen,lora", "ncat", "--shapes", "19:24->20:r2",
                     "--dtypes", "fp32", "--out", str(out)]) == 0
    assert [r["candidate"] for r in csv.DictReader(out.open())] == ["frozen", "lora", "ncat"] * 2


def test_a_candidate_whose_preflight_refuses_is_skipped_with_its_reason(tmp_path, capsys, monkeypatch):
    """A preflight's reason goes to the row's note and, once per candidate, to stderr; the other
    candidates are checked as usual and the run passes."""
    calls = []

    def preflight(op, log):
        calls.append(op.dims)
        return ("needs a machine this is not", "") if op.dims[0] == 19 else (None, "chose something")

    picky = lgc.Candidate("picky", lgc.prepare_plain, lgc.CANDIDATES["lora"].call, preflight=preflight)
    monkeypatch.setitem(lgc.CANDIDATES, "picky", picky)
    out = tmp_path / "c.csv"
    rc = lgc.main(["--cpu-check", "--candidates", "frozen,picky", "--shapes", "19:24->20:r2", "21:16->24:r4",
                   "--dtypes", "fp32", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and len(calls) == 4  # two shapes, with and without a bias
    rows = [r for r in csv.DictReader(out.open()) if r["candidate"] == "picky"]
    assert [r["check"] for r in rows] == ["skip", "skip", "ok", "ok"], rows
    assert "needs a machine this is not" in rows[0]["note"] and "chose something" in rows[2]["note"]
    assert err.count("picky skipped: needs a machine this is not") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cli_without_cuda_points_to_cpu_check(capsys):
    assert lgc.main(["--out", "x.csv"]) == 2
    assert "--cpu-check" in capsys.readouterr().err


# ------------------------------------------------------------- Triton under the interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

UGB_CODE = r'''
import torch
from lora_bench.kernels import lora_ugb
lora_ugb.POISON_OUTPUTS = True
bad = []
for dt, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
    for M, N, R, copy in ((37, 53, 1, False), (32, 48, 16, True), (45, 70, 33, True), (20, 16, 64, False)):
        g = torch.randn(M, N).to(dt)
        b = (torch.randn(R, N) * R ** -0.5).to(dt)
        h = torch.randn(M, R).to(dt)
        gu = torch.full((M, N + R), float("nan"), dtype=dt)  # [g | u] buffer: strided outputs
        u, gb = lora_ugb.lora_u_gb(g, b, h, u_scale=0.7, gb_scale=1.9, u_out=gu[:, N:],
                                   g_copy=gu[:, :N] if copy else None)
        U = 0.7 * g.double() @ b.double().t()
        GB = 1.9 * h.double().t() @ g.double()
        for name, out, ref in (("u", u, U), ("grad_B", gb, GB)):
            e = float((out.double() - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")
            if not e <= tol:
                bad.append(f"{dt} {(M, N, R, copy)} {name} {e:.2e}")
        if copy and not torch.equal(gu[:, :N], g):
            bad.append(f"{dt} {(M, N, R)} g copy differs")
        if not copy and not gu[:, :N].isnan().all():
            bad.append(f"{dt} {(M, N, R)} wrote the copy region without g_copy")
print("FAILURES", bad)
'''




@needs_triton
@pytest.mark.slow
def test_u_gb_kernel_under_triton_interpreter():
    """lora_u_gb against float64: odd sizes, ranks 1-64, u into the strided right part of a
    [g | u] buffer, the g copy into its left part (and nothing there without it), NaN-poisoned."""
    proc = run_interpreted(["-c", UGB_CODE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILURES []" in proc.stdout, proc.stdout[-3000:]


@needs_triton
@pytest.mark.slow
def test_triton_candidates_under_triton_interpreter(tmp_path):
    """Every Triton candidate against float64 on the CPU; the TMA candidates run where d_in and
    d_out make 16-byte rows (an odd token count included) and are skipped, with the reason
    printed, where they do not."""
    out = tmp_path / "t.csv"
    proc = run_interpreted([str(SCRIPT), "--cpu-check", "--dtypes", "fp32", "fp16", "--candidates", *TRITON,
                         "--shapes", "37:70->53:r1", "64:48->96:r16", "45:33->45:r64", "45:40->56:r4",
                         "--out", str(out)])
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(TRITON) * 4 * 2 * 2, rows
    unaligned = {"37:70->53:r1", "45:33->45:r64"}
    for r in rows:
        if r["candidate"] in TMA and r["shape"] in unaligned:
            assert r["check"] == "skip" and "16-byte rows" in r["note"], r
        else:
            assert r["check"] == "ok", r
    assert "tma+ab skipped: TMA needs 16-byte rows" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_tma_candidates_are_listed_and_skipped_with_a_reason_on_the_cpu(tmp_path, capsys, monkeypatch):
    """Without Triton's interpreter the TMA candidates cannot run on the CPU: each row says why,
    the reason is printed once per candidate, the summary still lists them, and the check passes."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "c.csv"
    rc = lgc.main(["--cpu-check", "--candidates", "frozen,tma+ab", "tma-fused,tma-frozen", "--shapes", "19:24->32:r2",
                   "21:32->16:r4", "--dtypes", "fp32", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["candidate"] for r in rows[:4]] == ["frozen", "tma+ab", "tma-fused", "tma-frozen"] and len(rows) == 16
    for r in rows:
        assert r["check"] == ("ok" if r["candidate"] == "frozen" else "skip"), r
        if r["candidate"] in TMA:
            assert ("TRITON_INTERPRET=1" in r["note"] or "compute capability 9.0" in r["note"]
                    or "lora_tma unavailable" in r["note"]), r
    for name in TMA:
        assert captured.err.count(f"{name} skipped:") == 1, captured.err
    table = captured.out.splitlines()
    assert any(line.startswith("tma+ab ") and "skip" in line for line in table), captured.out
    assert any(line.startswith("tma-fused ") and "skip" in line for line in table), captured.out
    assert any(line.startswith("tma-frozen ") for line in table), captured.out


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_checks_and_graph_counts(tmp_path):
    """Checks (eager, poisoned allocator; graph replay, NaN-filled outputs) and node counts at a
    GPT-2 124M shape; every LoRA candidate launches at least the frozen layer's kernels."""
    out = tmp_path / "g.csv"
    rc = lgc.main(["--count-only", "--shapes", "960:768->768:r16", "--dtypes", "bf16", "fp32", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert rc == 0, [(r["candidate"], r["dtype"], r["check"]) for r in rows if r["check"] != "ok"]
    ran = [r for r in rows if r["check"] != "skip"]  # e.g. the TMA candidates on GPUs before Hopper
    assert all(r["note"] for r in rows if r["check"] == "skip"), rows
    for dt in ("bf16", "fp32"):
        frozen = next(r for r in rows if r["candidate"] == "frozen" and r["dtype"] == dt)
        assert int(frozen["kernels_fwd"]) >= 1 and int(frozen["kernels_bwd"]) >= 1
        for r in ran:
            if r["dtype"] == dt:
                assert int(r["kernels_fwd"]) >= int(frozen["kernels_fwd"]), r
                adapters = lgc.CANDIDATES[r["candidate"]].adapters
                # tma-fused does the whole LoRA layer in one launch each way, as the frozen layer does
                assert int(r["kernels_fwd"]) + int(r["kernels_bwd"]) > 2 or not adapters or r["candidate"] == "tma-fused", r
    assert Path(str(out) + ".kernels.txt").read_text().count(" fwd: ") == len(ran)
    # the folder's manifest names this command and both files it wrote
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest["invocations"][-1]
    assert entry["command"] and entry["environment"] and {"g.csv", "g.csv.kernels.txt"} <= set(entry["outputs"])


@pytest.mark.gpu
def test_gpu_tma_candidates_at_an_odd_token_count(tmp_path):
    """The TMA candidates checked (eager and replayed, against float64) and counted at an odd token
    count, where the last row tile is partly outside x: ok on Hopper-class GPUs, a skip with its
    reason elsewhere; one kernel each way for tma-frozen and tma-fused, one forward and two backward
    for tma+ab."""
    out = tmp_path / "t.csv"
    rc = lgc.main(["--count-only", "--shapes", "333:768->1536:r16", "--dtypes", "bf16", "--candidates",
                   "frozen,tma+ab,tma-fused,tma-frozen", "--out", str(out)])
    rows = {r["candidate"]: r for r in csv.DictReader(out.open())}
    assert rc == 0, rows
    if torch.cuda.get_device_capability()[0] < 9:
        assert rows["tma+ab"]["check"] == "skip" and "9.0" in rows["tma+ab"]["note"]
        assert rows["tma-fused"]["check"] == "skip" and "9.0" in rows["tma-fused"]["note"]
        return
    assert all(rows[c]["check"] == "ok" for c in ("tma+ab", "tma-fused", "tma-frozen")), rows
    assert (rows["tma+ab"]["kernels_fwd"], rows["tma+ab"]["kernels_bwd"]) == ("1", "2"), rows["tma+ab"]
    assert (rows["tma-fused"]["kernels_fwd"], rows["tma-fused"]["kernels_bwd"]) == ("1", "1"), rows["tma-fused"]
    assert (rows["tma-frozen"]["kernels_fwd"], rows["tma-frozen"]["kernels_bwd"]) == ("1", "1"), rows["tma-frozen"]
    assert "fwd " in rows["tma+ab"]["note"] and "bwd " in rows["tma+ab"]["note"]
    assert "bwd+ab " in rows["tma-fused"]["note"], rows["tma-fused"]
    assert rows["tma-fused"]["other_nodes_bwd"] in ("0", ""), rows["tma-fused"]  # no memset or copy either
