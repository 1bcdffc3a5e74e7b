"""Markdown tables and summary figures from `warpsplitk bench` JSON files.

    python3 scripts/bench_tables.py BENCH.json [--chain CHAIN.json]

Prints what BENCHMARKS.md shows: the summary line (speedup over cuBLAS,
weight bandwidth of the >= 16 MB cells, plan vs default), a grid of
"ours / cuBLAS (speedup)" per shape and M, the per-cell table, and the
chain table. Nothing is measured here.
"""

import argparse
import json
import statistics

BIG = 16e6  # bytes: the weights the bandwidth target is about


def summary(rows):
    speedups = [r["cublas_us"] / r["ours_us"] for r in rows]
    big = [r["n"] * r["k"] * 2 / r["ours_us"] / 1e6 for r in rows if r["n"] * r["k"] * 2 >= BIG]
    vs_default = [r["ours_us"] / r["default_us"] for r in rows if r.get("default_us")]
    lines = [
        f"{len(rows)} cells; faster than cuBLAS in {sum(s > 1 for s in speedups)}: "
        f"min {min(speedups):.2f}×, median {statistics.median(speedups):.2f}×, "
        f"max {max(speedups):.2f}×; ≥ 1.25× in {sum(s >= 1.25 for s in speedups)}, "
        f"≥ 1.8× in {sum(s >= 1.8 for s in speedups)}",
    ]
    if big:
        lines.append(f"weights ≥ 16 MB ({len(big)} cells): median {statistics.median(big):.2f} TB/s, "
                     f"{min(big):.2f}–{max(big):.2f}; ≥ 4.0 TB/s in {sum(b >= 4.0 for b in big)}")
    if vs_default:
        worst = max(vs_default)
        lines.append(f"plan / default time: median {statistics.median(vs_default):.3f}, "
                     f"worst {worst:.3f} ({sum(v > 1.02 for v in vs_default)} cells over 1.02)")
    return lines


def grid(rows):
    ms = sorted({r["m"] for r in rows})
    shapes = []
    for r in rows:
        if (r["n"], r["k"]) not in shapes:
            shapes.append((r["n"], r["k"]))
    cell = {(r["n"], r["k"], r["m"]): r for r in rows}
    out = ["| N | K | MB | " + " | ".join(f"M={m}" for m in ms) + " |",
           "|---|---|---|" + "---|" * len(ms)]
    for n, k in shapes:
        parts = []
        for m in ms:
            r = cell.get((n, k, m))
            parts.append("" if r is None else
                         f"{r['ours_us']:.2f} / {r['cublas_us']:.2f} ({r['cublas_us'] / r['ours_us']:.2f}×)")
        out.append(f"| {n} | {k} | {n * k * 2 / 1e6:.1f} | " + " | ".join(parts) + " |")
    return out


def cells(rows):
    out = ["| N | K | M | tactic (source) | µs | default µs | cuBLAS µs | speedup | weight TB/s | % of floor |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        default = "" if r.get("default_us") is None else f"{r['default_us']:.2f}"
        out.append(f"| {r['n']} | {r['k']} | {r['m']} | {r['tactic']} ({r['source']}) | "
                   f"{r['ours_us']:.2f} | {default} | {r['cublas_us']:.2f} | "
                   f"{r['cublas_us'] / r['ours_us']:.2f} | {r['n'] * r['k'] * 2 / r['ours_us'] / 1e6:.2f} | "
                   f"{100 * r['floor_measured_us'] / r['ours_us']:.0f}% |")
    return out


def chain(rows):
    out = ["| first → second | M | tactics | warpsplitk µs | cuBLAS µs | speedup | % of floor |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        first = "×".join(str(v) for v in r["first"])
        second = "×".join(str(v) for v in r["second"])
        out.append(f"| {first} → {second} | {r['m']} | {r['tactics']} | {r['ours_us']:.2f} | "
                   f"{r['cublas_us']:.2f} | {r['cublas_us'] / r['ours_us']:.2f}× | "
                   f"{100 * r['floor_us'] / r['ours_us']:.0f}% |")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bench")
    p.add_argument("--chain")
    args = p.parse_args()
    with open(args.bench) as f:
        data = json.load(f)
    rows = data["rows"]
    print("\n".join(summary(rows)), "", *grid(rows), "", *cells(rows), sep="\n")
    if args.chain:
        with open(args.chain) as f:
            chain_rows = json.load(f)["rows"]
        speedups = [r["cublas_us"] / r["ours_us"] for r in chain_rows]
        print("", f"Chains: {sum(s > 1 for s in speedups)}/{len(speedups)} faster than cuBLAS, "
              f"{min(speedups):.2f}–{max(speedups):.2f}×.", "", *chain(chain_rows), sep="\n")


if __name__ == "__main__":
    main()
