"""Where a call's time goes: per-CTA timestamps from a diagnostic build.

    python3 scripts/stamps.py [--cells N,K,M[@TACTIC];...] [--json OUT] [--raw OUT.pt]

Each cell's tactic (the built-in H200 plan's, unless given) is built twice: as shipped, and with ``stamps``
(kernel.py: every CTA stores ``{%globaltimer, %clock64}`` at STAMP_SLOTS
through the bias pointer). Both are timed as the benchmark times them
(independent calls back to back in one CUDA graph over weight copies >= 3x
L2; the ratio says what the stamps themselves cost), and the stamps of the
stamped graph's last replay are read back. Per call (each but the graph's
first, whose predecessor is another repetition's):

  period     the last store of this call minus the previous call's
  release    the first dependency-wait release of this call minus the
             previous call's last store (grid completion, memory flush,
             the wait's release)
  early      CTAs of this call resident before the previous call's last store
and for the CTA that stores last (the one that sets the call's end), in
its own SM's cycles (converted at the clock the stamps themselves measure):

  wait       start -> dependency wait released
  x1         released -> first activation stage ready (x from L2)
  stages     first -> last stage ready (the ring walk after the wait)
  last       last stage ready -> partial sums in shared memory
  reduce     -> the split-K reduction's barrier passed
  store      -> the output stored (issued)
  weight     the weight loader's last copy landed, minus the release

Medians over the calls. The JSON also has, for the CTA that stores last and
for a median one, when each of the first K tiles was ready (ns after the
release; ``tiles_last``, ``tiles_median``). Diagnostic only: nothing in the library builds
the stamps kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from cuda.bindings import driver

from warpsplitk import timing
from warpsplitk.compile import _build, build_variant, device_arch, gmem_pointer
from warpsplitk.decode import builtin_plan
from warpsplitk.kernel import STAMP_BYTES, STAMP_SLOTS, STAMP_STAGE_SLOT, STAMP_STAGES
from warpsplitk.prepared import _stream_handle
from warpsplitk.tactics import WarpSplitKTactic, grid_ctas

#: the cells around issue #3's median (1536x7168 M<=4, 2304x1536 M=32,
#: 4608x1536 M=1, 7168x768 M=1, 2624x6144 M=4), a large weight, a tiny one
CELLS = ((1536, 7168, 1), (1536, 7168, 4), (2304, 1536, 32), (4608, 1536, 1), (7168, 768, 1),
         (2624, 6144, 4), (4224, 7168, 1), (768, 128, 1))
SLOT = {name: index for index, name in enumerate(STAMP_SLOTS)}
#: 16-byte slots per CTA in the buffer: {globaltimer, clock64} each
SLOTS_PER_CTA = STAMP_BYTES // 16


def analyse(stamps: torch.Tensor, k_tiles: int) -> dict:
    """``stamps``: int64 ``[calls, ctas, SLOTS_PER_CTA, 2]`` of one replay."""
    gt, clk = stamps[..., 0].double(), stamps[..., 1].double()
    missing = int((stamps[:, :, :len(STAMP_SLOTS) - 1, 0] == 0).sum())
    # cycles per ns, from each CTA's start -> stored span (both on one SM)
    span_ns = gt[:, :, SLOT["stored"]] - gt[:, :, SLOT["start"]]
    span_cy = clk[:, :, SLOT["stored"]] - clk[:, :, SLOT["start"]]
    long = span_ns > 500
    ghz = float((span_cy[long] / span_ns[long]).median()) if long.any() else float("nan")
    times = torch.sort(gt[:, :, :len(STAMP_SLOTS) - 1].flatten()).values
    steps = torch.diff(times)
    resolution = float(steps[steps > 0].min()) if (steps > 0).any() else float("nan")

    def cycles(c, cta, a, b):
        return float(clk[c, cta, SLOT[b]] - clk[c, cta, SLOT[a]]) / ghz

    tiles = min(k_tiles, STAMP_STAGES)

    def tile_times(c, cta):
        released = clk[c, cta, SLOT["x_wait_released"]]
        return [round(float(clk[c, cta, STAMP_STAGE_SLOT + i] - released) / ghz)
                for i in range(tiles)]

    rows, last_tiles, median_tiles = [], [], []
    for c in range(1, stamps.shape[0]):
        prev_end = float(gt[c - 1, :, SLOT["stored"]].max())
        end = gt[c, :, SLOT["stored"]]
        last = int(end.argmax())
        middle = int(end.argsort()[end.numel() // 2])
        last_tiles.append(tile_times(c, last))
        median_tiles.append(tile_times(c, middle))
        rows.append({
            "period": float(end.max()) - prev_end,
            "release": float(gt[c, :, SLOT["x_wait_released"]].min()) - prev_end,
            "release_spread": float(gt[c, :, SLOT["x_wait_released"]].max()
                                    - gt[c, :, SLOT["x_wait_released"]].min()),
            "early": int((gt[c, :, SLOT["start"]] < prev_end).sum()),
            "wait": cycles(c, last, "start", "x_wait_released"),
            "x1": cycles(c, last, "x_wait_released", "first_stage_ready"),
            "stages": cycles(c, last, "first_stage_ready", "last_stage_ready"),
            "last": cycles(c, last, "last_stage_ready", "partials_stored"),
            "reduce": cycles(c, last, "partials_stored", "reduced"),
            "store": cycles(c, last, "reduced", "stored"),
            "weight": cycles(c, last, "x_wait_released", "weight_landed"),
            "post_wait": cycles(c, last, "x_wait_released", "stored"),
        })
    summary = {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
    summary.update(ghz=round(ghz, 3), timer_resolution_ns=resolution, missing_stamps=missing,
                   sms=int(stamps[:, :, SLOT["smid"], 0].unique().numel()),
                   tiles_last=[statistics.median(t) for t in zip(*last_tiles)],
                   tiles_median=[statistics.median(t) for t in zip(*median_tiles)])
    return summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cells", help="N,K,M;N,K,M... (default: CELLS)")
    p.add_argument("--json")
    p.add_argument("--raw", help="save every cell's stamps (torch.save)")
    args = p.parse_args()
    cells = [f"{n},{k},{m}" for n, k, m in CELLS] if not args.cells else args.cells.split(";")
    device = torch.device("cuda", 0)
    arch = device_arch(0)
    plan = builtin_plan("h200")

    def stream():
        return driver.CUstream(_stream_handle(device))

    results, raw = [], {}
    for cell in cells:
        shape, _, text = cell.partition("@")
        n, k, m = (int(v) for v in shape.split(","))
        tactic = WarpSplitKTactic.parse(text) if text else plan.tactic_for(n, k, m)
        weights = timing.random_weights(n, k, timing.copies_for(n * k * 2), "cuda", seed=7)
        ptrs = [gmem_pointer(w.data_ptr()) for w in weights]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        xp, op = gmem_pointer(x.data_ptr()), gmem_pointer(out.data_ptr())
        ctas = grid_ctas(tactic, m, n)
        buffers = torch.zeros(len(ptrs), ctas, SLOTS_PER_CTA, 2, device="cuda", dtype=torch.int64)
        bps = [gmem_pointer(b.data_ptr()) for b in buffers]
        variant = build_variant()  # this process's build (WARPSPLITK_* switches)
        shipped = _build(n, k, tactic, False, True, arch, **variant)
        stamped = _build(n, k, tactic, False, True, arch, stamps=True, **variant)
        ref = x.double() @ weights[0].double().t()
        for name, code, bias in (("shipped", shipped, ptrs[0]), ("stamped", stamped, bps[0])):
            out.fill_(float("nan"))
            code(ptrs[0], xp, bias, op, m, stream())
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, n, k, m, err)
        plain_calls = [lambda w=w: shipped(w, xp, ptrs[0], op, m, stream()) for w in ptrs]
        stamp_calls = [lambda w=w, b=b: stamped(w, xp, b, op, m, stream())
                       for w, b in zip(ptrs, bps)]
        plain_t, stamp_t = timing.time_rounds([plain_calls, stamp_calls], rounds=1)
        stamps = buffers.cpu()
        row = {"n": n, "k": k, "m": m, "tactic": tactic.short(), "ctas": ctas,
               "calls": len(ptrs), "us": round(plain_t.median_us, 3),
               "stamped_us": round(stamp_t.median_us, 3),
               **analyse(stamps, k // (tactic.k_tile * tactic.k_split))}
        results.append(row)
        # the last 64 calls (enough to look at), by cell and tactic: one
        # shape may be stamped with several tactics
        raw[f"{n}x{k}x{m}@{tactic.short()}"] = stamps[-64:].clone()
        print(json.dumps({key: value for key, value in row.items()
                          if not key.startswith("tiles_")}), flush=True)
        print(f"  tiles ready (ns after the release), last CTA: {row['tiles_last']}\n"
              f"  median CTA: {row['tiles_median']}", flush=True)
        del weights, buffers
    keys = ("period", "release", "early", "wait", "x1", "stages", "last", "reduce", "store",
            "weight", "post_wait")
    print(f"\n{'cell':>14} {'tactic':>34} {'us':>6} {'stmp':>6} "
          + " ".join(f"{key:>8}" for key in keys))
    for r in results:
        print(f"{r['n']:>5}x{r['k']:<5}M{r['m']:<2} {r['tactic']:>34} {r['us']:>6.2f} "
              f"{r['stamped_us']:>6.2f} " + " ".join(f"{r[key]:>8.0f}" for key in keys))
    print("(ns; period/release/early over the whole grid, the rest for the CTA that "
          "stores last; clock "
          + ", ".join(f"{r['ghz']:.2f}" for r in results) + " GHz; timer resolution "
          + ", ".join(f"{r['timer_resolution_ns']:.0f}" for r in results) + " ns)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"slots": STAMP_SLOTS, "rows": results}, f, indent=1)
    if args.raw:
        torch.save(raw, args.raw)


if __name__ == "__main__":
    main()
