"""Why the tuner and the benchmark disagree on small kernels: one cell's
tactics timed by both paths in one process, alternating, several rounds.

The tuner calls the compiled code through the DSL's generic call with a
weight copy per call; the benchmark calls ``PreparedWarpSplitK.run`` (its
launcher) per weight copy. Both capture the calls into one CUDA graph
(``timing.time_calls``), so the kernels launched should be the same; on
3072x128 at M = 1 the late-trigger default measured 1.47 µs in the tuner
and 1.23-1.25 µs in every benchmark since run 28.

    python3 scripts/timing_paths.py [--shape 3072,128] [--m 1] [--tactics T1 T2 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch

from warpsplitk import PreparedWarpSplitK, builtin_plan, default_tactic, timing
from warpsplitk.compile import compile_warp_splitk, gmem_pointer
from warpsplitk.prepared import _stream_handle
from warpsplitk.tactics import WarpSplitKTactic


def gpu_state() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,pstate,power.draw",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="3072,128")
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--tactics", nargs="*")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    from cuda.bindings import driver

    n, k = (int(v) for v in args.shape.split(","))
    m = args.m
    tactics = ([WarpSplitKTactic.parse(t) for t in args.tactics] if args.tactics else
               list(dict.fromkeys([default_tactic(m, n, k),
                                   builtin_plan("h200").tactic_for(n, k, m)])))
    device = torch.cuda.current_device()
    weights = timing.random_weights(n, k, timing.copies_for(n * k * 2), "cuda", seed=n * 7 + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ptrs = [gmem_pointer(w.data_ptr()) for w in weights]
    x_ptr, out_ptr = gmem_pointer(x.data_ptr()), gmem_pointer(out.data_ptr())

    def stream():
        return driver.CUstream(_stream_handle(torch.device("cuda", device)))

    paths = {}
    for t in tactics:
        code = compile_warp_splitk(device, n, k, t)
        prepared = [PreparedWarpSplitK(w, {m: t}) for w in weights]
        paths[(t.short(), "tuner")] = [
            lambda wp=wp, c=code: c(wp, x_ptr, ptrs[-1], out_ptr, m, stream()) for wp in ptrs]
        paths[(t.short(), "bench")] = [lambda p=p: p.run(x, out) for p in prepared]
    samples = {key: [] for key in paths}
    states = []  # the GPU's clocks and power state before each timing
    for round_ in range(args.rounds):
        order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
        for key in order:
            states.append(gpu_state())
            samples[key].append(timing.time_calls(paths[key]).median_us)
            states[-1] += f" -> {samples[key][-1]:.3f} us {key[0]} {key[1]}"
    print(f"{n}x{k} M={m}: median µs per call over {args.rounds} rounds (each a graph median)")
    rows = []
    for (tactic, path), us in samples.items():
        rows.append({"tactic": tactic, "path": path, "us": us})
        print(f"  {tactic:>28} {path:>5}  median {statistics.median(us):6.3f}  "
              f"rounds {' '.join(f'{u:.3f}' for u in us)}")
    print("GPU state (SM MHz, memory MHz, power state, W) before each timing:")
    for line in states:
        print("  " + line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": n, "k": k, "m": m, "rows": rows, "states": states}, f, indent=1)


if __name__ == "__main__":
    main()
