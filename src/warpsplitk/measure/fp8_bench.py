"""Benchmark of FP8 weights (``bench --dtype fp8``): our e4m3 kernel against
our BF16 kernel and cuBLAS on the same shape, ``torch._scaled_mm`` (cuBLASLt
FP8 with row-wise scales, the activation quantization included),
transformers' fine-grained FP8 linear (with block scales, where it runs) and
the FP8 floor.

Every configuration runs in the same process by the method of ``timing.py``
(rotating copies at least 3x L2, CUDA-graph replays, ``ROUNDS`` graphs
alternating, the median one counting). The weights are random e4m3 codes
(no NaN) with FP32 scales (per channel, one, or per 128 x 128 block); the
BF16 kernel and cuBLAS read the dequantized weight in BF16, so all compute
the same product (``_scaled_mm`` with the weight's per-row scales).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..contract import fp8_scale_factors
from ..planning.plans import CUBLAS, DecodePlan, prepare, prepare_choices
from ..runtime import timing
from ..runtime.timing import random_fp8
from ..runtime.compile import device_arch
from ..runtime.precompile import precompile
from .bench import DEFAULT_MS, environment

#: e4m3's largest finite value: the activation scale of ``torch._scaled_mm``
#: maps each row's largest magnitude to it.
E4M3_MAX = 448.0


@dataclass
class Fp8Row:
    n: int
    k: int
    m: int
    tactic: str          # our FP8 tactic (the plan's FP8 entry, else the FP8 default)
    fp8_us: float
    fp8_spread: float
    bf16_tactic: str     # our BF16 kernel's choice (the plan's, else default_choice), or "cublas"
    bf16_us: float
    cublas_us: float     # torch.matmul on the BF16 weight
    scaled_mm_us: float  # torch._scaled_mm, row-wise scales, x quantized in the call
    scaled_mm_pad: int   # rows of x padded for it (0: none needed)
    floor_us: float      # FP8 weight bytes at the datasheet bandwidth
    floor_measured_us: float  # ... at the read bandwidth measured in the run
    fp8_rel_err: float   # ours against float64 of the dequantized weight
    scaled_mm_rel_err: float
    scales: str = "channel"  # the FP8 weight's scales (contract.FP8_SCALE_KINDS)
    #: transformers' FP8Linear on the same weight and block scales (None: not
    #: installed, or its kernel does not run here; only with block scales)
    hf_fp8_us: float | None = None

    @property
    def over_bf16(self):
        return self.bf16_us / self.fp8_us

    @property
    def over_scaled_mm(self):
        return self.scaled_mm_us / self.fp8_us

    @property
    def weight_tbps(self):
        return self.n * self.k / (self.fp8_us * 1e-6) / 1e12


def row_scales(scale, n, k):
    """What ``torch._scaled_mm`` takes of the weight's scales: one per row
    ``[1, n]`` (block scales: each row's largest, as a row-wise checkpoint
    would hold; its result then differs from the others' product)."""
    if scale.dim() == 2:
        return fp8_scale_factors(scale, n, k).amax(dim=1).view(1, n).contiguous()
    return scale.reshape(-1).expand(n).reshape(1, n).contiguous()


def hf_fp8_linears(weights, scales):
    """transformers' fine-grained ``FP8Linear`` on each weight and its block
    scales (the tensors themselves, no copy), or None where transformers or
    its FP8 kernel is not available here."""
    import torch
    try:
        from transformers.integrations.finegrained_fp8 import FP8Linear
    except ImportError:
        return None
    layers = []
    for w, s in zip(weights, scales):
        n, k = w.shape
        layer = FP8Linear(k, n, block_size=(128, 128)).to(w.device)
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        layers.append(layer)
    try:
        with torch.no_grad():
            layers[0](torch.randn(1, weights[0].shape[1], device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    except Exception:  # its kernel does not run here (none installed, no network to fetch one)
        return None
    return layers


def scaled_mm_call(x, w8, w_scale_row, out, pad):
    """One W8A8 call as ``torch._scaled_mm`` takes it: each row of x scaled
    into e4m3 by its own FP32 scale (absmax / 448) and quantized, then the
    FP8 GEMM with row-wise scales into ``out`` (x padded with ``pad`` zero
    rows where cuBLASLt needs it; the padding is part of the call)."""
    import torch

    def call():
        xs = x if not pad else torch.nn.functional.pad(x, (0, 0, 0, pad))
        amax = xs.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12)
        x_scale = amax / E4M3_MAX
        xq = (xs.float() / x_scale).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=w_scale_row,
                             out_dtype=torch.bfloat16)
        out.copy_(y[:x.shape[0]] if pad else y)
    return call


def scaled_mm_pad(m, k, w8, w_scale_row):
    """Rows to pad an M-row x with for ``torch._scaled_mm``: 0 if it takes M
    as is, else up to the next multiple of 16."""
    import torch
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, w8.shape[0], device="cuda", dtype=torch.bfloat16)
    try:
        scaled_mm_call(x, w8, w_scale_row, out, 0)()
        torch.cuda.synchronize()
        return 0
    except RuntimeError:
        return -m % 16


def bench_fp8_shape(n, k, ms, read_tbps, sheet_tbps, rounds=None, progress=print,
                    scales_kind="channel", plan=None):
    """``Fp8Row``s of one ``[n, k]`` e4m3 weight with ``scales_kind`` scales:
    ``plan``'s FP8 and BF16 entries (its defaults where it has none)."""
    plan = plan if plan is not None else DecodePlan()
    import torch
    rounds = timing.resolve_rounds(rounds)
    w8s, scales = random_fp8(n, k, timing.copies_for(n * k), seed=n + k, scales=scales_kind)
    # the same products in BF16 (half as many copies fill the same bytes)
    bf16s = [(w.float() * fp8_scale_factors(s, n, k)).to(torch.bfloat16)
             for w, s in list(zip(w8s, scales))[:timing.copies_for(n * k * 2)]]
    ours = [prepare(w, plan, ms, weight_scale=s) for w, s in zip(w8s, scales)]
    bf16_choice = {m: plan.tactic_for(n, k, m) for m in ms}
    bf16 = [prepare_choices(w, bf16_choice) for w in bf16s]
    rows_scale = [row_scales(s, n, k) for s in scales]
    hf = hf_fp8_linears(w8s, scales) if scales_kind == "block128" else None
    reference = w8s[0].double() * fp8_scale_factors(scales[0], n, k).double()
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ reference.t()
        errors = {}

        def rel_err(what):
            def check():
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if what == "fp8" and (not err < 1e-2 or torch.isnan(out).any()):
                    raise RuntimeError(f"FP8 N={n} K={k} M={m}: relative error {err:.3g}")
                errors[what] = err
            return check
        ours[0].run(x, out)
        rel_err("fp8")()
        pad = scaled_mm_pad(m, k, w8s[0], rows_scale[0])
        out.fill_(float("nan"))
        scaled_mm_call(x, w8s[0], rows_scale[0], out, pad)()
        rel_err("scaled_mm")()
        calls = [[lambda p=p: p.run(x, out) for p in ours],
                 [lambda p=p: p.run(x, out) for p in bf16],
                 [lambda w=w: torch.matmul(x, w.t(), out=out) for w in bf16s],
                 [scaled_mm_call(x, w, s, out, pad) for w, s in zip(w8s, rows_scale)]]
        fp8, ours_bf16, cublas, scaled = timing.time_rounds(calls, rounds)
        hf_timing = _time_hf(hf, x, out, rounds) if hf is not None else None
        choice = bf16_choice[m]
        row = Fp8Row(n, k, m, ours[0].tactics[m].short(), round(fp8.median_us, 3),
                     round(fp8.spread, 3), choice if choice == CUBLAS else choice.short(),
                     round(ours_bf16.median_us, 3), round(cublas.median_us, 3),
                     round(scaled.median_us, 3), pad,
                     round(n * k / (sheet_tbps * 1e12) * 1e6, 3),
                     round(n * k / (read_tbps * 1e12) * 1e6, 3),
                     round(errors["fp8"], 5), round(errors["scaled_mm"], 5), scales_kind,
                     None if hf_timing is None else round(hf_timing.median_us, 3))
        rows.append(row)
        progress(format_row(row))
    del ours, bf16, w8s, bf16s
    torch.cuda.empty_cache()
    return rows


def _time_hf(layers, x, out, rounds):
    """transformers' FP8Linear calls timed as the others (None where its
    kernel cannot be captured in a CUDA graph)."""
    import torch
    try:
        with torch.no_grad():
            return timing.time_rounds([[lambda layer=layer: out.copy_(layer(x))
                                        for layer in layers]], rounds)[0]
    except Exception:  # not capturable here
        torch.cuda.synchronize()
        return None


HEADER = (f"{'N':>6} {'K':>6} {'M':>3} {'FP8 tactic':>22} {'FP8 us':>8} {'BF16 us':>8} "
          f"{'cuBLAS':>8} {'scaledmm':>8} {'HF fp8':>8} {'xBF16':>6} {'xscmm':>6} {'xHF':>6} "
          f"{'TB/s':>5} {'%floor':>6}")


def format_row(r: Fp8Row) -> str:
    hf_us, over_hf = (("-", "-") if r.hf_fp8_us is None
                      else (f"{r.hf_fp8_us:.2f}", f"{r.hf_fp8_us / r.fp8_us:.2f}"))
    return (f"{r.n:>6} {r.k:>6} {r.m:>3} {r.tactic:>22} {r.fp8_us:8.2f} {r.bf16_us:8.2f} "
            f"{r.cublas_us:8.2f} {r.scaled_mm_us:8.2f} {hf_us:>8} {r.over_bf16:6.2f} "
            f"{r.over_scaled_mm:6.2f} {over_hf:>6} {r.weight_tbps:5.2f} "
            f"{100 * r.floor_us / r.fp8_us:5.0f}%")


def run_fp8_bench(shapes, ms=DEFAULT_MS, *, read_tbps=None, progress=print, rounds=None,
                  scales="channel", plan=None):
    """Benchmark FP8 weights with ``scales`` on every (shape, M), on
    ``plan``'s FP8 and BF16 entries (None: the defaults); returns
    (environment, rows)."""
    plan = plan if plan is not None else DecodePlan()
    import torch
    rounds = timing.resolve_rounds(rounds)
    timing.require_cuda("run_fp8_bench")
    env = environment()
    env["rounds"] = rounds
    if read_tbps is None:
        read_tbps = timing.measured_read_bandwidth() / 1e12
    env["read_TBps"] = round(read_tbps, 3)
    arch = device_arch(torch.cuda.current_device())
    kernels = [(n, k, plan.tactic_for(n, k, m, fp8_scales=scales), False, True, False, scales)
               for n, k in shapes for m in ms]
    kernels += [(n, k, t, False, True) for n, k in shapes for m in ms
                for t in (plan.tactic_for(n, k, m),) if t != CUBLAS]
    precompile(kernels, arch, progress=progress)
    rows = []
    for n, k in shapes:
        rows += bench_fp8_shape(n, k, ms, read_tbps, env["datasheet_TBps"], rounds, progress,
                                scales, plan)
    return env, rows


def write_json(path, env, rows):
    with open(path, "w") as f:
        json.dump({"environment": env, "mode": "fp8", "method": timing.__doc__.strip(),
                   "rows": [asdict(r) | {"fp8_over_bf16": round(r.over_bf16, 3),
                                         "fp8_over_scaled_mm": round(r.over_scaled_mm, 3),
                                         "weight_TBps": round(r.weight_tbps, 3)}
                            | ({"fp8_over_hf_fp8": round(r.hf_fp8_us / r.fp8_us, 3)}
                               if r.hf_fp8_us else {}) for r in rows]},
                  f, indent=1)


__all__ = ["Fp8Row", "run_fp8_bench", "bench_fp8_shape", "scaled_mm_call", "random_fp8",
           "row_scales", "hf_fp8_linears",
           "HEADER", "format_row", "write_json", "E4M3_MAX"]
