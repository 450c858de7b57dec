"""Per-run summaries of the per-step table: medians and spread per phase, analytic FLOPs, achieved
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


def flops_per_step(mcfg: GPTConfig, *, trainable_layers: str, tokens: float, rank: int = 0,
                   n_classes: int = 2, implementation: str = "book") -> float:
    """Analytic matmul FLOPs of one step: forward 2·P·T; backward input gradients 2·P·T for the
    blocks at and above the lowest trainable block, plus weight gradients 2·P_w·T for trainable
    matrices; LoRA adds its rank-r products (forward, input- and adapter-gradient).

    LoRA's adapters per block: the book's 6 linears, (in + out)·r each, 18·e·r, and the head's
    (e + classes)·r; PEFT's (``implementation="hf"``) 4 Conv1D layers, one adapter on the fused
    query/key/value (e + 3e)·r, 16·e·r, and a fully trained head instead of an adapted one."""
    L, e = mcfg.n_layers, mcfg.emb_dim
    per_block = matmul_params(mcfg) / max(L, 1)
    P = matmul_params(mcfg)
    head = e * n_classes
    fwd = 2 * (P + head) * tokens
    if trainable_layers == "all":
        return fwd + 4 * (P + head) * tokens
    if trainable_layers in ("lora", "lora-merged", "lora-kernel"):
        # every adapted linear gets (in + out)·r adapter params: forward 2·(in+out)·r, backward 4·(in+out)·r
        if implementation == "hf":  # c_attn (e -> 3e), attention c_proj, c_fc, MLP c_proj; the head trains
            adapter = L * ((e + 3 * e) + (e + e) + (e + 4 * e) + (4 * e + e)) * rank
            return fwd + 2 * P * tokens + 4 * head * tokens + 6 * adapter * tokens
        adapter = L * (4 * (e + e) + (e + 4 * e) + (4 * e + e)) * rank + (e + n_classes) * rank
        return fwd + 2 * P * tokens + 2 * head * tokens + 6 * adapter * tokens
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
