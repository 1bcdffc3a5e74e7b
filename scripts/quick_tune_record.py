"""Record the quick tune against the exhaustive one, and plan="auto" start times.

    python scripts/quick_tune_record.py OUT.json

On a CUDA GPU. Each step runs in its own process with its own, initially
empty, cache folder (nothing compiled or tuned before):

1. ``warpsplitk tune`` (quick) of ``SHAPES`` x M 1..32: its wall time;
2. ``warpsplitk bench`` of that plan and of the built-in plan (an exhaustive
   tune of the same shapes) over M 1, 4, 8, 16, 32, one after the other;
3. ``prepare_model(weights, plan="auto")`` on a Llama-3-8B-shaped model's
   eight weights, twice: the first start tunes and compiles, the second
   finds the plan in the cache folder.

Writes one JSON record (command, date, GPU, versions inside): the rows of
quick against exhaustive per cell, the tune's wall time and both starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Five shapes of the built-in table (whose built-in plan is an exhaustive tune).
SHAPES = ("4224,7168", "1536,7168", "2048,2048", "4608,1536", "7168,384")
#: Llama-3-8B's linears as transformers holds them (q, k, v, gate, up apart).
LLAMA_8B = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096),
            "o_proj": (4096, 4096), "gate_proj": (14336, 4096), "up_proj": (14336, 4096),
            "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
START = """
import json, sys, time
t0 = time.perf_counter()
import torch
from warpsplitk.planning.plans import prepare_model
shapes = json.loads(sys.argv[1])
weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
           for name, (n, k) in shapes.items()}
t1 = time.perf_counter()
prepare_model(weights, plan="auto", progress=None)
torch.cuda.synchronize()
t2 = time.perf_counter()
print("START " + json.dumps({"prepare_s": round(t2 - t1, 1), "process_s": round(t2 - t0, 1)}))
"""


def run(argv, cache, **kwargs):
    env = {**os.environ, "WARPSPLITK_CACHE_DIR": cache,
           "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(argv, env=env, check=True, text=True, capture_output=True, **kwargs)


def main(argv=None) -> int:  # pragma: no cover - needs a GPU
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python scripts/quick_tune_record.py OUT.json", file=sys.stderr)
        return 2
    out_path = Path(args[0])
    cli = [sys.executable, "-m", "warpsplitk.cli"]
    with tempfile.TemporaryDirectory() as scratch:
        cache, plan = os.path.join(scratch, "cache"), os.path.join(scratch, "quick-plan.json")
        started = time.perf_counter()
        run([*cli, "tune", "--shapes", *SHAPES, "-o", plan, "--log",
             os.path.join(scratch, "log.jsonl")], cache)
        wall = time.perf_counter() - started
        benches = {}
        for name, which in (("quick", plan), ("exhaustive", "h200")):
            path = os.path.join(scratch, f"bench-{name}.json")
            run([*cli, "bench", "--plan", which, "--shapes", *SHAPES, "--m", "1,4,8,16,32",
                 "--json", path], cache)
            benches[name] = json.loads(Path(path).read_text())
        starts = []
        auto_cache = os.path.join(scratch, "auto-cache")
        for _ in range(2):
            done = run([sys.executable, "-c", START, json.dumps(LLAMA_8B)], auto_cache)
            line = next(x for x in done.stdout.splitlines() if x.startswith("START "))
            starts.append(json.loads(line[len("START "):]))
    exhaustive = {(r["n"], r["k"], r["m"]): r for r in benches["exhaustive"]["rows"]}
    rows = [{"n": r["n"], "k": r["k"], "m": r["m"], "quick_tactic": r["tactic"],
             "quick_us": r["ours_us"], "exhaustive_tactic": exhaustive[key]["tactic"],
             "exhaustive_us": exhaustive[key]["ours_us"], "cublas_us": r["cublas_us"]}
            for r in benches["quick"]["rows"]
            for key in [(r["n"], r["k"], r["m"])]]
    environment = dict(benches["quick"]["environment"])
    environment["command"] = "python scripts/quick_tune_record.py " + " ".join(args)
    shapes = ", ".join(f"{name.split('_')[0]} {n}x{k}" for name, (n, k) in LLAMA_8B.items())
    record = {"environment": environment,
              "quick_tune": {"shapes": list(SHAPES), "ms": "1-32 (measured at 1, 4, 8, 16, 24, 32)",
                             "wall_s": round(wall, 1), "kernel_cache": "empty at start"},
              "plan_auto": {"model": f"Llama-3-8B-shaped model ({shapes})",
                            "first_start_prepare_s": starts[0]["prepare_s"],
                            "first_start_process_s": starts[0]["process_s"],
                            "second_start_prepare_s": starts[1]["prepare_s"],
                            "second_start_process_s": starts[1]["process_s"]},
              "rows": rows}
    out_path.write_text(json.dumps(record, indent=1) + "\n")
    ratios = sorted(r["quick_us"] / r["exhaustive_us"] for r in rows)
    print(f"quick tune {wall:.1f} s; quick/exhaustive median {ratios[len(ratios) // 2]:.3f}, "
          f"worst {ratios[-1]:.3f}; plan='auto' starts {starts[0]['prepare_s']} s, "
          f"then {starts[1]['prepare_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
