"""Builds of the same kernel, timed side by side.

    python3 scripts/build_ab.py --compare release|pdl-trigger|pdl|mc-release|x-copies|tma|x-smem|
                                          split-reduce
                                [--m 1,32]
                                [--chain-only]
                                [--tactics default|plan] [--json OUT]

Comparisons (the first build of each is the reference, the ratios are the
others' times over its):
  release      the compute warps' stage release: lane 0 per warp after
               bar.warp.sync vs every lane itself (shipped since run 16;
               racecheck follows only the latter)
  pdl-trigger  where the next kernel may launch under PDL: after the last
               activation tile is issued (shipped) vs before this kernel's
               griddepcontrol.wait (early_launch)
  pdl          what the PDL dependency costs independent calls: the
               tactic as built (the wait before reading x), the same
               without griddepcontrol.wait (diagnostic only: correct here
               because no call reads another's output), and without PDL
               at all (plain stream order); independent mode only
  mc-release   the activation multicast's stage release: every compute
               lane arriving on every member's empty barrier (the default)
               vs lane 0 of each warp after bar.warp.sync; the multicast
               tactics of MULTICAST_CELLS, independent mode only
  x-copies     what follows the dependency wait, on SHAPES and LONG_K_SHAPES:
               the tactic as is; with its activations by bulk copy (bulk_x,
               one activation warp); and that with the L2 prefetch of the
               weight past the ring's first fill too (l2_prefetch; cells
               whose ring holds all of K repeat the bulk time)
  tma          the same cells: the tactic as is; with its activations as TMA
               boxes (tma_x, one activation warp); and, for 16- and 32-token
               tiles, that with the boxes multicast over the smallest legal
               cluster along N (x_multicast 2-4; cells where none is legal
               repeat the tma time)
  x-smem       how much of a call is the activations' shared-memory traffic
               (diagnostic builds with wrong results, not checked): the
               tactic with 16-byte activation copies; the same without the
               compute warps' ldmatrix reads of x (constant B fragments);
               and without the loader's copies of x too; independent mode,
               at every M asked (the question is M >= 16)
  split-reduce what a K split over a cluster pays for its reduction: the
               protocol before session 14 (remote stores, then a cluster
               barrier all wait on); the shipped one (st.async completing
               the first CTA's mbarrier, only it waits); the experimental
               vector hand-over (each CTA's warps summed first, one
               vector per output vector sent); then diagnostic
               builds with wrong results, not checked: the first with its
               partials stored locally; a cluster launch with no barrier;
               no cluster at all (each CTA sums its own warps). On
               SPLIT_CELLS, each cell's plan tactic beside it

Default tactics (or the built-in H200 plan's, --tactics plan), all builds in one process, each checked against fp64
first, timed as the benchmark times: independent calls back to back in a
CUDA graph over weight copies >= 3x L2, then a dependent chain of one
square shape (each output the next input).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from cuda.bindings import driver

from warpsplitk import timing
from warpsplitk.compile import _build, device_arch, gmem_pointer
from warpsplitk.prepared import _stream_handle
from warpsplitk.tactics import WarpSplitKTactic, default_tactic, is_legal

SHAPES = ((4224, 7168), (2112, 7168), (7168, 768), (2304, 1536), (7168, 384), (2048, 2048),
          (1152, 1536), (768, 128))
CHAIN_SHAPE = (2048, 2048)
#: x-copies: long-K weights too (rings that do not hold all of K)
LONG_K_SHAPES = ((4608, 1536), (2624, 6144), (3216, 7168), (2112, 7168), (768, 7168))
#: (name, _build keyword arguments) of the two builds of each comparison
COMPARISONS = {
    "release": (("lane0", {"arrivals": "lane0"}), ("all", {"arrivals": ""})),
    "pdl-trigger": (("shipped", {"early_launch": False}), ("early", {"early_launch": True})),
    "pdl": (("wait", {}), ("no-wait", {"dependency_wait": False}), ("no-pdl", {"use_pdl": False})),
    "mc-release": (("lanes", {"arrivals": ""}), ("lane0", {"arrivals": "lane0"})),
    # tactic fields, not build switches: main() applies them (TACTIC_FIELDS)
    "x-copies": (("cp.async", {}), ("bulk", {"bulk_x": True}),
                 ("bulk+pf", {"bulk_x": True, "l2_prefetch": True})),
    "tma": (("as-is", {}), ("tma", {"tma_x": True}),
            ("tma+mc", {"tma_x": True, "x_multicast": "smallest"})),
    # diagnostic builds with wrong results (WRONG_BUILDS); the reference is
    # the tactic with 16-byte activation copies (X_SMEM_FIELDS)
    "x-smem": (("full", {}), ("no-read", {"x_smem": "no-read"}), ("none", {"x_smem": "none"})),
    "split-reduce": (("barrier", {"split_reduce": "barrier"}),
                     ("mbarrier", {"split_reduce": "mbarrier"}),
                     ("vector", {"split_reduce": "vector"}),
                     ("no-remote", {"split_reduce": "no-remote"}),
                     ("no-barrier", {"split_reduce": "no-barrier"}),
                     ("none", {"split_reduce": "none"})),
}
#: builds whose results are wrong by design: timed, not checked
WRONG_BUILDS = {"x-smem": {"no-read", "none"},
                "split-reduce": {"no-remote", "no-barrier", "none"}}
#: x-smem: every build takes 16-byte activation copies (the diagnostic's path)
X_SMEM_FIELDS = {"bulk_x": False, "tma_x": False, "x_multicast": 1}
#: build "keywords" that change the tactic instead
TACTIC_FIELDS = ("bulk_x", "l2_prefetch", "tma_x", "x_multicast")
#: comparisons whose builds are wrong for dependent calls: no chain part
INDEPENDENT_ONLY = {"pdl", "mc-release", "x-smem", "split-reduce"}
#: mc-release: the activation multicast's fastest tactic per cell in the tune
#: log (runs 21-22), each cell's best tactic without it noted for reference
MULTICAST_CELLS = (
    (4224, 7168, 32, "32,32,256,6,1,1,2"),   # best without: 14.84 us
    (3216, 7168, 32, "16,32,256,8,1,1,3"),   # 14.41
    (2048, 2048, 32, "32,32,256,6,1,1,2"),   # 3.87
    (7168, 768, 32, "64,32,128,6,1,1,2"),    # 4.26
    (1152, 1536, 16, "32,16,256,6,1,1,2"),   # 2.27
    (768, 128, 16, "32,16,128,1,1,1,2"),     # 1.28
)

#: split-reduce: per cell, the fastest K-split tactics of the tune log
#: (session 14) and the shipped plan's (the reference beside them; a
#: tactic without a split times its one build)
SPLIT_CELLS = (
    (1536, 7168, 1, ("32,1,256,13,1,2+early", "32,8,256,4,1,4+bulk")),
    (1536, 7168, 8, ("32,8,256,10,1,2+early+prefetch2+tma", "32,8,256,4,2,4")),
    (2112, 7168, 4, ("32,4,256,12,2,2+early+prefetch1", "48,8,128,6,2,4")),
    (768, 7168, 8, ("32,8,256,10,2,2+early+prefetch", "48,8,128,14,1,4+early")),
    (768, 7168, 32, ("16,32,256,8,1,2+tma", "32,32,256,4,2,4")),
    (2304, 1536, 32, ("48,32,128,6,2,2+early", "48,32,128,3,2,4")),
    (2048, 2048, 32, ("32,32,256,4,2,2+early", "32,32,256,2,2,4")),
    (4608, 1536, 32, ("48,32,128,3,2,2",)),
)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compare", choices=sorted(COMPARISONS), required=True)
    p.add_argument("--m", default="1,32")
    p.add_argument("--chain-only", action="store_true")
    p.add_argument("--tactics", choices=("default", "plan"), default="default")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda", 0)
    arch = device_arch(0)
    builds = COMPARISONS[args.compare]
    names = [name for name, _ in builds]
    plan = None
    if args.tactics == "plan":
        from warpsplitk.decode import builtin_plan
        plan = builtin_plan("h200")

    def stream():
        return driver.CUstream(_stream_handle(device))

    rows = []
    print(f"{'mode':>5} {'N':>5} {'K':>5} {'M':>2} {'tactic':>22} "
          + " ".join(f"{name:>8}" for name in names)
          + " " + " ".join(f"{'/' + names[0]:>8}" for _ in names[1:]))
    shapes = [(s, False) for s in SHAPES if not args.chain_only]
    if args.compare in ("x-copies", "tma", "x-smem") and not args.chain_only:
        shapes += [(s, False) for s in LONG_K_SHAPES if s not in SHAPES]
    fixed = {}  # (n, k) -> {m: [tactic, ...]}: cells with their own tactics
    if args.compare == "mc-release":
        for n, k, m, text in MULTICAST_CELLS:
            fixed.setdefault((n, k), {})[m] = [WarpSplitKTactic.parse(text)]
        shapes = [(s, False) for s in fixed]
    if args.compare == "split-reduce":
        from warpsplitk.decode import builtin_plan
        shipped = builtin_plan("h200")
        for n, k, m, texts in SPLIT_CELLS:
            tactics = [shipped.tactic_for(n, k, m)] + [WarpSplitKTactic.parse(t) for t in texts]
            fixed.setdefault((n, k), {})[m] = list(dict.fromkeys(tactics))
        shapes = [(s, False) for s in fixed]
    if args.compare not in INDEPENDENT_ONLY:
        shapes.append((CHAIN_SHAPE, True))
    for (n, k), chain in shapes:
        weights = timing.random_weights(n, k, timing.copies_for(n * k * 2), "cuda", seed=5)
        if chain:
            for w in weights:
                w.mul_(k ** -0.5)  # keep the chained activations O(1)
        ptrs = [gmem_pointer(w.data_ptr()) for w in weights]
        ms = sorted(fixed[(n, k)]) if (n, k) in fixed else [int(v) for v in args.m.split(",")]
        cells = [(m, tactic) for m in ms for tactic in (
            fixed[(n, k)][m] if (n, k) in fixed
            else [plan.tactic_for(n, k, m) if plan is not None else default_tactic(m, n, k)])]
        for m, tactic in cells:
            x0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x = x0.clone()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = x0.double() @ weights[-1].double().t()
            xp, op = gmem_pointer(x.data_ptr()), gmem_pointer(out.data_ptr())
            row = {"mode": "chain" if chain else "indep", "n": n, "k": k, "m": m,
                   "tactic": tactic.short()}
            if args.compare == "x-smem":
                tactic = dataclasses.replace(tactic, **X_SMEM_FIELDS)
                if not is_legal(tactic, n, k):
                    print(f"{n}x{k} M={m}: {tactic.short()} is not legal, skipped", flush=True)
                    continue
                row["tactic"] = tactic.short()
            for name, kwargs in builds:
                kwargs = dict(kwargs)
                if args.compare == "split-reduce" and tactic.k_split == 1:
                    if name != names[0]:  # no split: one build
                        row[f"{name}_us"] = row[f"{names[0]}_us"]
                        continue
                    kwargs.pop("split_reduce")
                fields = {f: kwargs.pop(f) for f in TACTIC_FIELDS if f in kwargs}
                if fields.get("bulk_x") or fields.get("tma_x"):
                    fields["b_loader_warps"] = 1  # one lane issues the copies
                if fields.get("tma_x"):
                    fields["bulk_x"] = False
                if fields.get("x_multicast") == "smallest":
                    fields["x_multicast"] = next(
                        (c for c in (2, 3, 4) if tactic.token_tile >= 16 and is_legal(
                            dataclasses.replace(tactic, **{**fields, "x_multicast": c}), n, k)),
                        None)
                    if fields["x_multicast"] is None:  # none legal: the build before it
                        row[f"{name}_us"] = row[f"{names[-2]}_us"]
                        continue
                built = dataclasses.replace(tactic, **fields)
                if fields.get("l2_prefetch") and not is_legal(built, n, k):
                    # the ring holds all of K: the build without the prefetch
                    row[f"{name}_us"] = row[f"{names[-2]}_us"]
                    continue
                code = _build(n, k, built, False, kwargs.pop("use_pdl", True), arch, **kwargs)
                x.copy_(x0)  # a chain before this one overwrote x
                out.fill_(float("nan"))
                code(ptrs[-1], xp, ptrs[-1], op, m, stream())
                torch.cuda.synchronize()
                if name not in WRONG_BUILDS.get(args.compare, ()):
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (name, n, k, m, err)
                if chain:  # x -> out -> x -> ...: every call reads the previous output
                    calls = [lambda w=w, c=code, i=i: c(w, (xp, op)[i % 2], ptrs[-1],
                                                        (op, xp)[i % 2], m, stream())
                             for i, w in enumerate(ptrs)]
                else:
                    calls = [lambda w=w, c=code: c(w, xp, ptrs[-1], op, m, stream()) for w in ptrs]
                row[f"{name}_us"] = round(timing.time_calls(calls).median_us, 3)
            for name in names[1:]:
                row[f"ratio_{name}"] = round(row[f"{name}_us"] / row[f"{names[0]}_us"], 4)
            if len(names) == 2:
                row["ratio"] = row[f"ratio_{names[1]}"]
            rows.append(row)
            print(f"{row['mode']:>5} {n:>5} {k:>5} {m:>2} {row['tactic']:>22} "
                  + " ".join(f"{row[f'{name}_us']:>8.2f}" for name in names) + " "
                  + " ".join(f"{row[f'ratio_{name}']:>8.3f}" for name in names[1:]), flush=True)
        del weights
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compare": args.compare, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
