"""Speed of the compute warps' stage release: lane 0 per warp vs every lane (shipped).

    python3 scripts/arrive_ab.py [--json OUT]

Every lane arriving on the empty barrier is what racecheck can follow
(docs/gpu-runs.md, runs 10-12); this measures what it costs, with the
benchmark's timing (calls back to back in a CUDA graph over weight copies
>= 3x L2), default tactics, both builds in one process, each checked
against fp64 first.
"""

from __future__ import annotations

import argparse
import json

import torch

from warpsplitk import timing
from warpsplitk.compile import _build, device_arch, gmem_pointer
from warpsplitk.prepared import _stream_handle
from cuda.bindings import driver
from warpsplitk.tactics import default_tactic

SHAPES = ((4224, 7168), (2112, 7168), (7168, 768), (2048, 2048), (768, 128))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,32")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    arch = device_arch(0)
    rows = []
    print(f"{'N':>5} {'K':>5} {'M':>2} {'tactic':>15} {'lane0 us':>9} {'all us':>9} {'ratio':>6}")
    for n, k in SHAPES:
        weights = timing.random_weights(n, k, timing.copies_for(n * k * 2), "cuda", seed=3)
        for m in (int(v) for v in args.m.split(",")):
            tactic = default_tactic(m, n, k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ weights[-1].double().t()
            row = {"n": n, "k": k, "m": m, "tactic": tactic.short()}
            for name, arrivals in (("lane0", "lane0"), ("all", "")):
                code = _build(n, k, tactic, False, True, arch, arrivals=arrivals)
                xp, op = gmem_pointer(x.data_ptr()), gmem_pointer(out.data_ptr())
                ptrs = [gmem_pointer(w.data_ptr()) for w in weights]
                out.fill_(float("nan"))
                code(ptrs[-1], xp, ptrs[-1], op, m, driver.CUstream(_stream_handle(device)))
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (name, n, k, m, err)
                # the stream is looked up per call: timing captures on its own
                t = timing.time_calls([lambda w=w, c=code: c(
                    w, xp, ptrs[-1], op, m, driver.CUstream(_stream_handle(device)))
                    for w in ptrs])
                row[f"{name}_us"] = round(t.median_us, 3)
            row["ratio"] = round(row["all_us"] / row["lane0_us"], 4)
            rows.append(row)
            print(f"{n:>5} {k:>5} {m:>2} {row['tactic']:>15} {row['lane0_us']:>9.2f} "
                  f"{row['all_us']:>9.2f} {row['ratio']:>6.3f}", flush=True)
        del weights
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
