"""Per-run summaries of the per-step table: medians and spread per phase, analytic FLOPs (the
model's products and each adapted layer's work, per LoRA variant: ``adapter_flops``), achieved
throughput and model-FLOPs utilisation against a table of GPU peaks."""

from __future__ import annotations

import statistics

from lora_bench.model.sizes import GPTConfig, matmul_params
from lora_bench.timing import PHASES

# Dense datasheet peaks in TFLOP/s by precision; looked up by a substring of the device name.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
    "H100": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2},
    "A10G": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0},
    "T4": {"fp32": 8.1, "tf32": 8.1, "bf16": 65.0},
}


def peak_tflops(gpu_name: str, precision: str) -> float | None:
    for key, peaks in GPU_PEAKS.items():
        if key.lower() in (gpu_name or "").lower():
            return peaks.get("bf16" if precision == "bf16-true" else precision)
    return None


def adapted_layers(mcfg: GPTConfig, *, n_classes: int = 2, implementation: str = "book") -> list[tuple[int, int, bool]]:
    """(in, out, weight trained) of every linear layer an adapter wraps: the book's six per block
    (query, key, value, the attention's output projection, the MLP's two) and the new head, whose
    own weight trains too; PEFT's four Conv1D per block (the fused query/key/value, the attention's
    projection, the MLP's two), its head trained whole and not adapted."""
    e = mcfg.emb_dim
    if implementation == "hf":
        return [(e, 3 * e, False), (e, e, False), (e, 4 * e, False), (4 * e, e, False)] * mcfg.n_layers
    return [(e, e, False)] * 4 * mcfg.n_layers + [(e, 4 * e, False), (4 * e, e, False)] * mcfg.n_layers \
        + [(e, n_classes, True)]


def adapter_flops(k: int, n: int, *, rank: int, tokens: float, trainable_layers: str = "lora",
                  lora_variant: str = "lora", dora_norm: str = "exact", weight_trained: bool = False,
                  implementation: str = "book") -> tuple[float, float]:
    """(matrix-product FLOPs, elementwise FLOPs) one adapted layer (in ``k``, out ``n``, rank r, N
    ``tokens``) adds per step to its frozen product and that product's input gradient.

    Products count 2 per multiply-add. LoRA unmerged (``lora``, ``lora-kernel``): x·A·B forward,
    and its input and adapter gradients, 6·N·(k+n)·r. Merged (``lora-merged``): A·B (k·n·r, twice
    more in backward, 6·k·n·r) and the merged weight's gradient, 2·N·k·n (a trained W's own
    gradient, which the model's count holds).
    DoRA unmerged adds its norm: W·A (2·n·k·r), A's Gram AᵀA (2·k·r²), B's rows times it
    (2·n·r²); the exact norm's backward Wᵀ times an n×r gradient (2·n·k·r, twice with a trained W),
    the Gram's and its product's (4·k·r² + 4·n·r²); the detached norm none. PEFT's DoRA forms B·A
    from an identity (2·k²·r + 2·k·r·n) for a detached norm: no backward product.

    Elementwise: one FLOP per element of each pass a variant adds to LoRA's layer over an N×out or
    out×in tensor (LoRA's own, like the base's norms and activations, are left out). DoRA unmerged:
    the scale m/‖·‖ and the bias added after it, forward 2·N·n, backward 3·N·n (the scaled
    gradient, z times it and its sum over the rows); a trained W's squared norms, 2·k·n forward
    and, exact, 5·k·n backward. DoRA merged: the norm, the division and m's product over the merged
    weight, 3·k·n forward; backward 12·k·n exact, 4·k·n detached. PEFT's DoRA: the merged weight
    and its norm (3·k·n) and its output's combination (4·N·n) forward, 7·N·n backward."""
    r, t = rank, tokens
    dora, exact = lora_variant == "dora", dora_norm == "exact"
    if trainable_layers == "lora-merged":  # a trained W's gradient is the merged weight's, counted with the model's
        matmul = 6 * k * n * r + (0 if weight_trained else 2 * t * k * n)
        return matmul, (3 * k * n + (12 if exact else 4) * k * n if dora else 0)
    matmul = 6 * t * (k + n) * r
    if not dora:
        return matmul, 0
    if implementation == "hf":
        return matmul + 2 * k * k * r + 2 * k * r * n, 3 * k * n + 11 * t * n
    norm_fwd = 2 * n * k * r + 2 * k * r * r + 2 * n * r * r
    norm_bwd = (2 * n * k * r * (2 if weight_trained else 1) + 4 * k * r * r + 4 * n * r * r) if exact else 0
    own_norms = (2 + (5 if exact else 0)) * k * n if weight_trained else 0
    return matmul + norm_fwd + norm_bwd, 5 * t * n + own_norms


def flops_per_step(mcfg: GPTConfig, *, trainable_layers: str, tokens: float, rank: int = 0,
                   n_classes: int = 2, implementation: str = "book", lora_variant: str = "lora",
                   dora_norm: str = "exact") -> float:
    """Analytic FLOPs of one step: forward 2·P·T; backward input gradients 2·P·T for the
    blocks at and above the lowest trainable block, plus weight gradients 2·P_w·T for trainable
    matrices; each adapted layer adds its adapter's work (``adapter_flops``: LoRA's rank-r
    products, or the merged weight's; DoRA's norm and scale, per its layer and ``dora_norm``).

    rsLoRA's scale, LoRA+'s learning rates and PiSSA's initial values change no per-step work: they
    are no argument here. PEFT (``implementation="hf"``) adapts 4 Conv1D layers per block and
    trains the head whole instead of adapting it (``adapted_layers``)."""
    L, e = mcfg.n_layers, mcfg.emb_dim
    per_block = matmul_params(mcfg) / max(L, 1)
    P = matmul_params(mcfg)
    head = e * n_classes
    fwd = 2 * (P + head) * tokens
    if trainable_layers == "all":
        return fwd + 4 * (P + head) * tokens
    if trainable_layers in ("lora", "lora-merged", "lora-kernel"):
        adapters = sum(sum(adapter_flops(k, n, rank=rank, tokens=tokens, trainable_layers=trainable_layers,
                                         lora_variant=lora_variant, dora_norm=dora_norm, weight_trained=trained,
                                         implementation=implementation))
                       for k, n, trained in adapted_layers(mcfg, n_classes=n_classes, implementation=implementation))
        head_grads = 4 if implementation == "hf" else 2  # the hf head's weight gradient: it trains unadapted
        return fwd + 2 * P * tokens + head_grads * head * tokens + adapters
    if trainable_layers == "frozen":  # input gradients through every block; only the head's weight gradient
        return fwd + 2 * P * tokens + 4 * head * tokens
    blocks = {"last_layer": 0, "last_block": 1, "last_two_blocks": 2}.get(trainable_layers, 0)
    # input gradients and weight gradients cost the same for the trainable blocks and the head
    return fwd + 2 * (2 * per_block * blocks * tokens + 2 * head * tokens)


def median_p10_p90(values: list[float]) -> tuple[float, float, float]:
    """The summary every timing table uses: median, 10th and 90th percentile (inclusive method)."""
    return statistics.median(values), _pct(values, 10), _pct(values, 90)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if 1 <= q <= 99 else values[0]


def summarise_steps(step_rows: list[dict]) -> dict:
    """Median / p10 / p90 per phase (device and host) over steps not marked warm-up. No cause is
    written here: host time as long as device time holds for a GPU-bound phase too (the host waits
    on a full launch queue), so a phase's cause is measured by a profiled repeat, at read time
    (lora_bench.report.study_model.cause_of)."""
    rows = [r for r in step_rows if not r["warmup"]]
    out: dict = {"measured_steps": len(rows)}
    if not rows:
        return out
    for ph in (*PHASES, "step"):
        for prefix in ("", "host_"):
            vals = [r[f"{prefix}{ph}_ms"] for r in rows]
            stats = median_p10_p90(vals)
            out[f"{prefix}{ph}_ms_median"], out[f"{prefix}{ph}_ms_p10"], out[f"{prefix}{ph}_ms_p90"] = stats
    if out["step_ms_median"] > 0:  # each step's phases add up exactly; their medians need not
        out["phase_sum_pct"] = 100 * (sum(out[f"{ph}_ms_median"] for ph in PHASES) / out["step_ms_median"] - 1)
    out["tokens_per_step"] = statistics.median(r["tokens"] for r in rows)
    return out
