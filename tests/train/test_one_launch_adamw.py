"""optimizer=one-launch (lora_bench.train.one_launch_adamw): AdamW's update, on CUDA in one Triton
launch over every tensor.

- On the CPU its torch ops are AdamW's single-tensor update: parameters and moments equal
  ``torch.optim.AdamW(foreach=False)``'s bit for bit, with two parameter groups, over several
  steps, and after its state is saved and loaded; under bf16-true's master copies likewise the
  float32 path's (``train.master_weights``), masters and bfloat16 parameters.
- Whole tiny runs (LoRA, LoRA+'s two groups; fp32 and bf16-true) with ``optimizer: one-launch``
  train as with torch's AdamW, loss for loss, bit for bit on the CPU.
- The kernel (Triton's CPU interpreter; on CUDA eagerly and replayed from a CUDA graph): every
  tensor's update and moments after several steps of fresh random gradients against float64 AdamW,
  within another rounding order's distance of torch's own AdamW (``numerics.assert_same_function``);
  bfloat16 gradients read as they are; the bfloat16 parameters written are the masters rounded; one
  launch per kind of tensor whatever their number.
"""

from __future__ import annotations

import json

import pytest
import torch
from numerics import assert_same_function, fresh, interpreted_runs

from lora_bench.config import TrainConfig
from lora_bench.train.build import build_model, build_optimizer
from lora_bench.train.master_weights import MasterWeights
from lora_bench.train.one_launch_adamw import OneLaunchAdamW

SHAPES = [(33, 17), (1027,), (3,), (2, 1024), (1,)]  # odd sizes: partly filled blocks, one exactly two blocks
GROUPS = [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0}]  # tensors 0-2, then 3-4
STEPS = 5


def _grouped(params):
    return [{"params": params[:3], **GROUPS[0]}, {"params": params[3:], **GROUPS[1]}]


def _start(device, dtype=torch.float32):
    return [fresh(*s, device=device, dtype=dtype) for s in SHAPES]


def _grads(device, dtype=torch.float32):
    return [[fresh(*s, device=device, dtype=dtype, scale=0.1) for s in SHAPES] for _ in range(STEPS)]


def _train(make, start, grads):
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = make(_grouped(params))
    for step in grads:
        for t, g in zip(params, step):
            t.grad = g.clone()
        opt.step()
    return params, opt


def _results(params, opt) -> dict:
    return {f"{k}{i}": v for i, t in enumerate(params)
            for k, v in (("p", t.detach()), ("m", opt.state[t]["exp_avg"]), ("v", opt.state[t]["exp_avg_sq"]))}


def _float64(start, grads) -> dict:
    """AdamW from its definition in float64 (betas 0.9, 0.999, eps 1e-8), each tensor at its group's rates."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    out = {}
    for i, t in enumerate(start):
        hyper = GROUPS[0] if i < 3 else GROUPS[1]
        lr, wd = hyper["lr"], hyper["weight_decay"]
        x = t.double().clone()
        m, v = torch.zeros_like(x), torch.zeros_like(x)
        for k, step in enumerate(grads, start=1):
            g = step[i].double()
            x = x - lr * wd * x
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            x = x - lr / (1 - b1 ** k) * m / (v.sqrt() / (1 - b2 ** k) ** 0.5 + eps)
        out.update({f"p{i}": x, f"m{i}": m, f"v{i}": v})
    return out


def _updates(results: dict, start) -> dict:
    """Parameters as their change from the start (what the learning rate scales), moments as they are."""
    return {k: (v.double() - start[int(k[1:])].double() if k[0] == "p" else v.double()) for k, v in results.items()}


def test_one_launch_adamw_is_adamw_bit_for_bit_on_the_cpu():
    start, grads = _start("cpu"), _grads("cpu")
    got = _results(*_train(lambda groups: OneLaunchAdamW(groups), start, grads))
    want = _results(*_train(lambda groups: torch.optim.AdamW(groups, foreach=False), start, grads))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_its_state_saved_and_loaded_continues_as_if_never_stopped():
    """Two steps, save, a new optimizer loads the state, three more: the same bits as five in a row,
    with one step count shared by every tensor again."""
    start, grads = _start("cpu"), _grads("cpu")
    whole = _results(*_train(lambda groups: OneLaunchAdamW(groups), start, grads))
    params, opt = _train(lambda groups: OneLaunchAdamW(groups), start, grads[:2])
    resumed = OneLaunchAdamW(_grouped(params))
    resumed.load_state_dict(opt.state_dict())
    steps = {id(s["step"]) for s in resumed.state.values()}
    assert len(steps) == 1 and float(resumed.state[params[0]]["step"]) == 2
    for step in grads[2:]:
        for t, g in zip(params, step):
            t.grad = g.clone()
        resumed.step()
    got = _results(params, resumed)
    for name in whole:
        assert torch.equal(got[name], whole[name]), name


def test_groups_with_other_betas_or_eps_are_refused():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="one betas and eps for all groups"):
        OneLaunchAdamW([{"params": [a]}, {"params": [b], "betas": (0.8, 0.99)}])


def _masters(make, start_bf16, grads_bf16):
    params = [torch.nn.Parameter(t.clone()) for t in start_bf16]
    opt = MasterWeights(params, lambda masters: make(_grouped(masters)))
    for step in grads_bf16:
        for t, g in zip(params, step):
            t.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return params, opt


def test_under_master_copies_it_is_the_float32_path_bit_for_bit_on_the_cpu():
    """bf16-true: the one-launch update reads the bfloat16 gradients and writes the bfloat16
    parameters itself; masters and parameters equal those of the copies around AdamW."""
    start, grads = _start("cpu", torch.bfloat16), _grads("cpu", torch.bfloat16)
    params, opt = _masters(lambda groups: OneLaunchAdamW(groups), start, grads)
    ref_params, ref_opt = _masters(lambda groups: torch.optim.AdamW(groups, foreach=False), start, grads)
    for i, (p, r, m, rm) in enumerate(zip(params, ref_params, opt.masters, ref_opt.masters)):
        assert torch.equal(m, rm), f"master {i}"
        assert p.dtype is torch.bfloat16 and torch.equal(p.detach(), r.detach()), f"parameter {i}"
    assert opt._grads == [None] * len(params)  # no float32 gradient buffers


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
@pytest.mark.parametrize("ratio", [1.0, 16.0], ids=["lora", "loraplus"])
def test_a_tiny_run_trains_as_with_torchs_adamw_bit_for_bit_on_the_cpu(precision, ratio):
    """The run's own model and optimizer (train.build) for optimizer one-launch and book: the same
    losses over several steps, and the same parameters after them."""
    results = {}
    for optimizer in ("book", "one-launch"):
        cfg = TrainConfig(model_size="tiny", weights="random", trainable_layers="lora", device="cpu",
                          precision=precision, optimizer=optimizer, loraplus_lr_ratio=ratio, learning_rate=1e-3)
        model = build_model([cfg], torch.device("cpu"), cache_dir=None, progress=False).model
        opt = build_optimizer(model, [cfg])
        inner = getattr(opt, "inner", opt)
        assert isinstance(inner, OneLaunchAdamW) == (optimizer == "one-launch")
        assert len(inner.param_groups) == (2 if ratio != 1 else 1)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(4):
            idx = torch.randint(0, 1000, (2, 7), generator=gen)
            loss = model(idx).float().logsumexp(-1).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results[optimizer] = (losses, [p.detach().clone() for p in model.parameters() if p.requires_grad])
    assert results["one-launch"][0] == results["book"][0]
    for i, (a, b) in enumerate(zip(results["one-launch"][1], results["book"][1])):
        assert a.dtype == b.dtype and torch.equal(a, b), f"parameter {i}"


# -- the kernel --------------------------------------------------------------------------------------


def _kernel_case(device, *, masters: bool, steps: int = STEPS) -> dict:
    """Train the SHAPES tensors through the kernel path (float32 parameters with float32 gradients,
    or float32 masters with bfloat16 gradients writing bfloat16 parameters); return each tensor's
    error against float64 AdamW beside torch AdamW's own, and the kernel's launches per step."""
    from lora_bench.kernels import adamw_triton
    from lora_bench.kernels.triton_launch import recording

    start = _start(device)
    grads = [[g.to(torch.bfloat16) if masters else g for g in step] for step in _grads(device)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    outs = [t.to(torch.bfloat16) for t in start] if masters else None
    opt = OneLaunchAdamW(_grouped(params))
    launches = []
    for step in grads:
        items = [(p, g, None if outs is None else o, opt.param_groups[0 if i < 3 else 1])
                 for i, (p, g, o) in enumerate(zip(params, step, outs or [None] * len(params)))]
        with recording() as rec:
            if device == "cpu":  # the optimizer takes the torch update on the CPU: drive its kernel path here
                _kernel_step(opt, adamw_triton, items)
            elif masters:
                opt.step_masters(params, step, outs)
            else:
                for p, g in zip(params, step):
                    p.grad = g
                opt.step()
        launches.append(sum(tag == "adamw_tensors" for tag, _, _ in rec))
    ref_params = [torch.nn.Parameter(t.clone()) for t in start]
    ref = torch.optim.AdamW(_grouped(ref_params), foreach=False)
    for step in grads:
        for t, g in zip(ref_params, step):
            t.grad = g.float()
        ref.step()
    f64 = _float64(start, [[g.float() for g in step] for step in grads])
    got = _updates(_results(params, opt), start)
    want = _updates(_results(ref_params, ref), start)
    ref64 = _updates(f64, start)
    out = {"launches": launches, "errors": {}}
    for name in ref64:
        out["errors"][name] = [got[name].tolist(), want[name].tolist(), ref64[name].tolist()]
    if masters:
        out["rounded"] = [[o.float().tolist(), p.detach().tolist()] for o, p in zip(outs, params)]
    return out


def _kernel_step(opt, adamw_triton, items) -> None:
    """One step of OneLaunchAdamW's kernel path on CPU tensors (Triton's interpreter)."""
    step = opt._steps.setdefault(torch.device("cpu"), torch.zeros(()))
    step += 1
    for p, _, _, _ in items:
        if not opt.state[p]:
            opt.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    by_kind = opt._by_kind(items)
    assert len(by_kind) == 1
    for kind, members in by_kind.items():
        table, tiles, hyper = opt._table(adamw_triton, kind, members)
        adamw_triton.adamw_tensors_(table, tiles, hyper, step, grad_bf16=kind[0], write_bf16=kind[1],
                                    beta1=0.9, beta2=0.999, eps=1e-8)


def _interp_main() -> None:
    """Run with TRITON_INTERPRET=1: one JSON line per case."""
    for masters in (False, True):
        print(json.dumps({"masters": masters, **_kernel_case("cpu", masters=masters)}))


def _check(case: dict, *, exact_rounding: bool) -> None:
    assert case["launches"] == [1] * STEPS, case["launches"]
    # each kind (parameter updates, first and second moments) over all tensors against float64: a
    # tensor of one or three values alone says little (its moment may sit near a cancellation);
    # then each tensor against torch's, within 1e-4 relative or a small part of the kind's scale:
    # far above float32 rounding, far below what a wrong tensor's row in the table would give. An
    # update (about 5e-3 here) is read through its parameter's float32 rounding (up to about 4:
    # 2.4e-7), so its part is 1e-3; a moment's is 1e-5
    errors = {name: [torch.tensor(x, dtype=torch.float64).reshape(-1) for x in triple]
              for name, triple in case["errors"].items()}
    for kind in "pmv":
        got, want, ref = (torch.cat([t[i] for name, t in errors.items() if name[0] == kind]) for i in range(3))
        assert_same_function(got, want, ref, what=f"{kind} (masters={case['masters']})")
        scale = want.abs().max()
        for name, (g, w, _) in errors.items():
            if name[0] == kind:
                part = 1e-3 if kind == "p" else 1e-5
                assert torch.allclose(g, w, rtol=1e-4, atol=part * scale), f"{name} (masters={case['masters']})"
    for i, (out, master) in enumerate(case.get("rounded", [])):
        out, master = torch.tensor(out), torch.tensor(master)
        if exact_rounding:  # the GPU rounds to nearest, as torch's copy does
            assert torch.equal(out, master.to(torch.bfloat16).float()), f"tensor {i}"
        else:  # the interpreter's conversion may round toward zero: within one bfloat16 step
            ulp = torch.finfo(torch.bfloat16).eps * master.abs().clamp_min(torch.finfo(torch.float32).tiny)
            assert ((out - master).abs() <= ulp).all(), f"tensor {i}"


def test_the_kernel_in_the_interpreter_against_float64():
    cases = interpreted_runs(__file__)
    assert [c["masters"] for c in cases] == [False, True]
    for case in cases:
        _check(case, exact_rounding=False)


@pytest.mark.gpu
@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "masters"])
def test_the_kernel_on_cuda_against_float64(masters):
    from lora_bench.train.packed_adamw import adamw_kernels

    assert adamw_kernels() is not None, "the Triton update does not load on this CUDA machine"
    _check({"masters": masters, **_kernel_case("cuda", masters=masters)}, exact_rounding=True)


@pytest.mark.gpu
def test_a_captured_step_replays_the_eager_updates():
    """The update captured as a CUDA graph (tables built by before_capture, outside the capture),
    replayed on gradients copied into the captured ones: the same bits as the eager steps."""
    start, grads = _start("cuda"), _grads("cuda")
    eager = _results(*_train(lambda groups: OneLaunchAdamW(groups), start, grads))
    params = [torch.nn.Parameter(t.clone()) for t in start]
    opt = OneLaunchAdamW(_grouped(params))
    for t, g in zip(params, grads[0]):
        t.grad = g.clone()
    opt.step()  # the first step eagerly: moments and tables
    static = [t.grad for t in params]
    opt.before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step in grads[1:]:
        for buf, g in zip(static, step):
            buf.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    got = _results(params, opt)
    for name in eager:
        assert torch.equal(got[name], eager[name]), name


def test_tables_a_capture_may_read_are_kept_while_others_make_way():
    """Gradients at new addresses every step build new tables; the 64 newest stay, and a table
    built for a capture (before_capture) is never dropped. Driven on CPU tensors (no launch)."""
    pytest.importorskip("triton")
    from lora_bench.kernels import adamw_triton

    p = torch.nn.Parameter(torch.zeros(3))
    opt = OneLaunchAdamW([p])
    opt.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3))
    group = opt.param_groups[0]

    def build(grad, **kw):
        return opt._table(adamw_triton, (False, False), [(p, grad, None, group)], **kw)

    grads = [torch.zeros(3) for _ in range(100)]  # kept alive: every one at its own address
    captured = build(grads[0], key_only=True)
    opt._captured.add(captured)
    for g in grads[1:]:
        build(g)
    assert captured in opt._tables
    held = {key[1][0][1] for key in opt._tables}  # each table's gradient address
    assert held == {g.data_ptr() for g in [grads[0], *grads[-64:]]}


# -- where the update ran -----------------------------------------------------------------------------


def test_the_update_notes_where_it_ran_on_the_cpu():
    """On the CPU both AdamW kernels' optimizers take torch's update and say so (``update_paths``),
    also from inside master copies (``update_path``); torch's own AdamW notes nothing."""
    from lora_bench.train.packed_adamw import PackedAdamW, update_path

    start, grads = _start("cpu"), _grads("cpu")
    params, opt = _train(lambda groups: OneLaunchAdamW(groups), start, grads)
    assert opt.update_paths == {"torch: the CPU"} and update_path(opt) == "torch: the CPU"
    packed = torch.nn.Parameter(torch.zeros(2, 3))
    popt = PackedAdamW([packed], lrs=[1e-3, 2e-3], weight_decays=[0.0, 0.1])
    packed.grad = torch.ones(2, 3)
    popt.step()
    assert update_path(popt) == "torch: the CPU"
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    wrapped = MasterWeights(model.parameters(), lambda masters: OneLaunchAdamW(masters))
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    wrapped.step()
    assert update_path(wrapped) == "torch: the CPU"
    assert update_path(torch.optim.AdamW(params)) == ""


def test_a_cuda_update_without_triton_names_the_import_error(monkeypatch):
    """Where the Triton module cannot load, the reason a CUDA device's update took torch's ops is
    the import's error, as the run records it."""
    import sys

    from lora_bench.train import packed_adamw

    monkeypatch.setattr(packed_adamw, "_KERNELS", None)
    monkeypatch.setattr(packed_adamw, "_KERNELS_PROBLEM", "")
    import lora_bench.kernels

    monkeypatch.setitem(sys.modules, "lora_bench.kernels.adamw_triton", None)  # the import fails
    monkeypatch.delattr(lora_bench.kernels, "adamw_triton", raising=False)
    assert packed_adamw.adamw_kernels() is None
    why = packed_adamw.torch_path(torch.device("cuda"))
    assert why.startswith("torch: no Triton (ModuleNotFoundError: ") and "adamw_triton" in why, why
    assert packed_adamw.torch_path(torch.device("cpu")) == "torch: the CPU"


def test_a_run_records_where_its_update_ran(run_cli, tmp_path):
    """``--optimizer one-launch`` trains a tiny run on the CPU and records the update's path
    (``optimizer_update``); with torch's AdamW the column is blank."""
    import pandas as pd
    from tiny import SAMPLE

    args = ["train", "--device", "cpu", "--weights", "random", "--model-size", "tiny", "--data-file", SAMPLE,
            "--trainable-layers", "lora", "--num-epochs", "1", "--max-steps", "2", "--warmup-steps", "1",
            "--eval-freq", "0", "--skip-final-eval"]
    for optimizer, want in (("one-launch", "torch: the CPU"), ("fused", None)):
        out_dir = tmp_path / optimizer
        code, out = run_cli(*args, "--optimizer", optimizer, "--results-dir", out_dir)
        assert code == 0, out
        row = pd.read_csv(out_dir / "runs.csv").iloc[0]
        assert row["status"] == "done" and row["cfg_optimizer"] == optimizer
        if want is None:
            assert pd.isna(row["optimizer_update"]), row["optimizer_update"]
        else:
            assert row["optimizer_update"] == want, row["optimizer_update"]


@pytest.mark.gpu
def test_on_cuda_the_update_notes_the_kernel_and_a_tensor_it_does_not_take():
    """On CUDA the kernel's tensors note ``triton``; a float64 parameter among them takes torch's
    update, noted with its reason, and is updated as AdamW updates it."""
    from lora_bench.train.packed_adamw import FOREIGN, TRITON, update_path

    start, grads = _start("cuda"), _grads("cuda")
    params, opt = _train(lambda groups: OneLaunchAdamW(groups), start, grads)
    assert opt.update_paths == {TRITON}, opt.update_paths
    odd = torch.nn.Parameter(fresh(5, 3, device="cuda", dtype=torch.float64))
    ref, start_odd = torch.nn.Parameter(odd.detach().clone()), odd.detach().clone()
    opt2, ref_opt = OneLaunchAdamW([*params[:2], odd]), torch.optim.AdamW([ref], foreach=False)
    for t, g in zip(params[:2], grads[0][:2]):
        t.grad = g.clone()
    odd.grad = fresh(5, 3, device="cuda", dtype=torch.float64, scale=0.1)
    ref.grad = odd.grad.clone()
    opt2.step()
    ref_opt.step()
    assert opt2.update_paths == {TRITON, FOREIGN} and update_path(opt2) == f"{FOREIGN}; {TRITON}"
    want = ref.detach() - start_odd  # -lr·wd·p - the Adam term (OneLaunchAdamW's defaults: lr 1e-3, wd 1e-2)
    _check_device_step_update(odd.detach() - start_odd, want, (want + 1e-3 * 1e-2 * start_odd).abs())


def _check_device_step_update(got, want, adam):
    """A float64 tensor's update from the step count left on the device against AdamW's from the
    host's: the same but for the bias corrections, formed in float32 as -expm1(t·ln β) (ln β and the
    product rounded, expm1 and the square root within about an ulp each: about 3 float32 roundings
    each), so each step's Adam term lr·m̂/(√v̂+ε) within 6 of its own. ``adam``: the sum over the
    steps of each value's |Adam term|."""
    bound = 6 * torch.finfo(torch.float32).eps * adam
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()


def test_the_torch_update_from_a_device_step_count_is_adamws_within_float32_bias_corrections():
    """The torch update a CUDA device takes where the kernel does not (a step count on the device:
    bias corrections as float32 tensors), run here on the CPU with a float64 tensor over several
    steps against AdamW's single-tensor update: within the corrections' few float32 roundings. In
    float32, 1 - β2ᵗ would be 1.3e-5 off at the first step (6.5e-6 on the update)."""
    from lora_bench.train.packed_adamw import adamw_update_, bias_corrections

    p0 = fresh(7, 5, device="cpu", dtype=torch.float64)
    grads = [fresh(7, 5, device="cpu", dtype=torch.float64, scale=0.1) for _ in range(STEPS)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1, foreach=False)
    p, m, v, step = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), torch.zeros(())
    adam = torch.zeros_like(p0)  # Σ over the steps of |lr·m̂/(√v̂+ε)|, AdamW's own
    for g in grads:
        step += 1
        adamw_update_(p, g, m, v, lr=1e-3, weight_decay=0.1, corrections=bias_corrections(step, 0.9, 0.999,
                      host_step=False), beta1=0.9, beta2=0.999, eps=1e-8)
        before = ref.detach().clone()
        ref.grad = g.clone()
        opt.step()
        adam += (before * (1 - 1e-3 * 0.1) - ref.detach()).abs()
        _check_device_step_update(p - p0, ref.detach() - p0, adam)


def test_bias_corrections_from_a_device_step_count_take_a_beta_of_zero():
    """AdamW allows β = 0: 1 - 0ᵗ is 1 for every step, from the step count on the device as from the
    host's (no log of zero), and the kernels' host arguments are formed for it too."""
    from lora_bench.train.packed_adamw import bias_corrections

    for t in (1.0, 2.0, 50.0):
        step = torch.tensor(t)
        dev = [float(x) for x in bias_corrections(step, 0.0, 0.0, host_step=False)]
        assert dev == [1.0, 1.0] == list(bias_corrections(step, 0.0, 0.0, host_step=True)), (t, dev)
    pytest.importorskip("triton")
    from lora_bench.kernels.adamw_triton import ln_beta

    assert ln_beta(0.0) == float("-inf") and ln_beta(0.9) == pytest.approx(-0.10536051565782628, rel=1e-15)

