"""Host time of one eager call: PreparedWarpSplitK.run, DecodeLinear and cuBLAS.

Also run() with the same tactic's TMA twin (``tma_x``), whose compiled host
code builds a tensor map of x at every call.

Inside a CUDA graph host time is zero; in eager decode it is paid per
projection, and when it exceeds the kernel time the GPU idles between
kernels. This enqueues many calls without synchronising and divides the
wall time by the count (the queue never drains: the host is the bottleneck
when the per-call figure exceeds the kernel time), then reports the GPU time
of the same calls from CUDA events for comparison.

    python3 scripts/host_overhead.py [--shape 4096,4096] [--m 1,8,32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from warpsplitk import DecodeLinear, PreparedWarpSplitK, default_tactic
from warpsplitk.tactics import is_legal
from warpsplitk.tune import with_tma_boxes


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096,4096")
    parser.add_argument("--m", default="1,8,32")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split(","))
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(weight, {m: default_tactic(m, n, k) for m in ms})
    twins = {m: with_tma_boxes(default_tactic(m, n, k)) for m in ms}
    legal = {m: t for m, t in twins.items() if is_legal(t, n, k)}
    boxes = PreparedWarpSplitK(weight, legal) if legal else None
    linear = DecodeLinear(weight, ms=ms)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ weight.double().t()
        prepared.run(x, out)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        row = {
            "n": n, "k": k, "m": m, "rel_err": err,
            "run_us": per_call_us(lambda: prepared.run(x, out), args.calls),
            "run_tma_us": (per_call_us(lambda: boxes.run(x, out), args.calls)
                           if boxes is not None and m in boxes.tactics else None),
            "decode_linear_us": per_call_us(lambda: linear(x), args.calls),
            "cublas_us": per_call_us(lambda: torch.matmul(x, weight.t(), out=out), args.calls),
        }
        rows.append(row)
    print(f"{'N':>6} {'K':>6} {'M':>3} {'run us':>8} {'run +tma us':>11} {'DecodeLinear us':>16} "
          f"{'matmul us':>10}  rel err")
    for r in rows:
        tma = "-" if r["run_tma_us"] is None else f"{r['run_tma_us']:.1f}"
        print(f"{r['n']:>6} {r['k']:>6} {r['m']:>3} {r['run_us']:>8.1f} {tma:>11} "
              f"{r['decode_linear_us']:>16.1f} {r['cublas_us']:>10.1f}  {r['rel_err']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "calls": args.calls, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
