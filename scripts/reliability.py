"""Reliability runs on a GPU: sanitizer cases, soak, determinism across processes.

    python3 scripts/reliability.py cases --subset all|rotate|shipped [--shard I --shards N]
                                         [--json OUT] [--k-split] [--bulk-x] [--tma-x]
                                         [--half-tiles] [--l2-prefetch]
                                         [--deep-rings] [--NAME-only ...] [--progress]
                                         [--swiglu] [--fp8 tensor|channel|block128]
        --subset shipped: every distinct tactic of the built-in H200 plan and
        of the default heuristic over the built-in shape table, each on a
        small weight of its own output tiles whose K is one K tile past what
        its ring (and bounded prefetch) holds per CTA, so every stage is
        refilled. Otherwise every tactic family (output_tile x token_tile x
        k_tile x b_loader_warps; with --k-split also each with k_split 2,
        with --bulk-x each one-warp family also with bulk activation copies, with --tma-x each
        one-warp family also with TMA activation boxes; with --half-tiles
        each case of a 32- or 64-row family also as a mixed grid, three half
        tiles after two full ones; every token tile, the narrow 1-, 2- and
        4-row ones too, where legal) with a one-stage
        ring (K = k_tile), a ring shorter than the K-tile count (with
        --l2-prefetch also with the L2 prefetch) and a ring equal to it (with
        --deep-rings also the deepest ring that fits only with the reduction
        buffer over the rings, and the deepest past 16 stages, one K tile
        more than each); M = 1, token_tile - 1,
        token_tile, token_tile + 1 (where <= 32) and 32; each case launched
        twice back to back on one stream (the PDL path: the second grid's
        weight prologue overlaps the first) and checked against fp64.
        Meant to run under compute-sanitizer (scripts/sanitize.sh); 'rotate'
        takes one ring variant per family, starting at --offset, so that
        tools run with different offsets cover all three between them.
        --NAME-only (NAME in CASE_FILTERS: clusters, x-copies, aliased,
        narrow, past-16) keeps the cases that pass every one given.
        --fp8 KIND: the cases an e4m3 weight with KIND scales takes, each
        with such a weight (with --subset shipped: the FP8 default's tactics;
        with --swiglu: those the epilogue takes, and its FP8 default's).
    python3 scripts/reliability.py soak [--projections 64] [--replays 100000]
        A captured graph of a decode-layer-like chain of projections (each
        output feeds the next input, PDL on), replayed many times; outputs
        checked against a reference at intervals, memory use recorded.
    python3 scripts/reliability.py digest
        SHA-256 of outputs for fixed seeds: run twice in two processes, the
        digests must match (bitwise determinism across processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import sys
import time

import torch

from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic, default_tactic
from warpsplitk.kernel import layout
from warpsplitk.tactics import (B_LOADER_WARPS, BULK, CP_ASYNC, K_TILES, MAX_STAGES, OUTPUT_TILES,
                                PREFETCH_ALL, TMA, TOKEN_TILES, is_legal)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _x_copy(bulk, tma):
    """The activation copy of a case family's two flags."""
    return TMA if tma else BULK if bulk else CP_ASYNC


def _deepest_aliased(o, t, kt, b, c, bulk, tma=False):
    """(stages, K) of the deepest legal ring whose reduction buffer lies over
    the rings (layout.smem_plan), with one K tile past the ring; None if none."""
    for stages in range(MAX_STAGES, 1, -1):
        tactic = WarpSplitKTactic(o, t, kt, stages, b, c, x_copy=_x_copy(bulk, tma))
        k = c * (stages + 1) * kt
        plan = tactic.smem_plan
        if plan.reduction_aliased and is_legal(tactic, 2 * o, k):
            return stages, k
    return None


def _deepest_past_16(o, t, kt, b, c, bulk, tma=False):
    """(stages, K) of the deepest legal ring past 16 stages (narrow token
    tiles and small stages reach up to MAX_STAGES), with one K tile past
    the ring; None if the family's stages are too large for 17."""
    for stages in range(MAX_STAGES, 16, -1):
        tactic = WarpSplitKTactic(o, t, kt, stages, b, c, x_copy=_x_copy(bulk, tma))
        k = c * (stages + 1) * kt
        if is_legal(tactic, 2 * o, k):
            return stages, k
    return None


def shipped_tactics(fp8=False, swiglu=False):
    """Every distinct tactic of the built-in H200 plan and of the default
    heuristic over the built-in shape table, for M 1..32 (``fp8``: the FP8
    default's over the table, for channel and block scales; with ``swiglu``
    also its choice for the epilogue)."""
    from warpsplitk import builtin_plan
    from warpsplitk.shapes import load
    found = set() if fp8 else {tactic for entries in builtin_plan("h200").entries.values()
                               for tactic, _ in entries.values()}
    # the FP8 default's choice depends on the scales' kind (block scales: shorter rings)
    kinds = ("channel", "block128") if fp8 else ("channel",)
    for shape in load()["shapes"]:
        found |= {default_tactic(m, shape["n"], shape["k"], sm_count=132, fp8=fp8,
                                 fp8_scales=kind) for m in range(1, 33) for kind in kinds}
        if fp8 and swiglu:
            found |= {default_tactic(m, shape["n"], shape["k"], sm_count=132, fp8=True,
                                     fp8_scales=kind, swiglu=True)
                      for m in range(1, 33) for kind in kinds}
    return sorted(found)


def shipped_cases(fp8=False, swiglu=False):
    """``shipped_tactics`` on small weights: two output tiles (a mixed
    grid: one full tile and its half tiles), K one K tile per CTA past what
    the ring and a bounded prefetch hold, so every stage is refilled (a
    one-stage ring: one K tile)."""
    cases = []
    for t in shipped_tactics(fp8, swiglu):
        n = (2 * t.output_tile if not t.half_tiles
             else t.output_tile + t.half_tiles * (t.output_tile // 2))
        # a one-stage ring holds exactly one K tile per CTA (check_tactic)
        tiles = 1 if t.stages == 1 else t.stages + max(t.l2_prefetch, 0) + 1
        k = t.k_split * tiles * t.k_tile
        if not is_legal(t, n, k):
            raise ValueError(f"shipped case {t.short()} N={n} K={k} is not legal")
        ms = sorted({1, max(1, t.token_tile - 1), t.token_tile, min(32, t.token_tile + 1), 32})
        cases.append((t, n, k, ms))
    return cases + long_k_cases(fp8)


#: K past two CTAs of 64 tiles: Qwen2.5-72B's and Gemma-2-27B's ``down`` at
#: TP 1 (N, K), which the default splits over four and three CTAs.
LONG_K_SHAPES = ((8192, 29568), (4608, 36864))


def long_k_cases(fp8=False):
    """The default's tactics for the weights of ``LONG_K_SHAPES`` at M 1, 8,
    16 and 32 (with ``fp8``: channel and block scales), each run on two
    output tiles and the whole K."""
    kinds = ("channel", "block128") if fp8 else ("channel",)
    found = {default_tactic(m, n, k, sm_count=132, fp8=fp8, fp8_scales=kind): k
             for n, k in LONG_K_SHAPES for m in (1, 8, 16, 32) for kind in kinds}
    return [(t, 2 * t.output_tile, k, sorted({1, t.token_tile, 32}))
            for t, k in sorted(found.items())]


def family_cases(subset, offset=0, k_splits=(1,), bulk_xs=(False,), l2_prefetch=False,
                 deep_rings=False, tma_xs=(False,), half_tiles=False, fp8=None, swiglu=False):
    """The cases ``(tactic, n, k, ms)`` of a subset; ``fp8`` (a scale kind):
    those an FP8 weight with those scales takes (and the FP8 default's
    shipped tactics), with ``swiglu`` those it takes with the epilogue."""
    if subset == "shipped":
        cases = shipped_cases(fp8 is not None, swiglu)
    else:
        cases = _family_cases(subset, offset, k_splits, bulk_xs, l2_prefetch, deep_rings,
                              tma_xs, half_tiles)
    if fp8 is None:
        return cases
    return [(t, n, k, ms) for t, n, k, ms in cases if is_legal(t, n, k, fp8=True, swiglu=swiglu)
            and not (fp8 == "block128" and t.half_tiles)]


def _family_cases(subset, offset, k_splits, bulk_xs, l2_prefetch, deep_rings, tma_xs,
                  half_tiles):
    cases = []
    families = [f for f in itertools.product(OUTPUT_TILES, TOKEN_TILES, K_TILES, B_LOADER_WARPS,
                                             k_splits, bulk_xs, tma_xs)
                # bulk or TMA copies: one loader warp; not both
                if not (f[5] and (f[3] > 1 or f[6])) and not (f[6] and f[3] > 1)]
    for index, (o, t, kt, b, c, bulk, tma) in enumerate(families):
        # per CTA: one stage; a ring shorter than its K tiles; one equal to them
        rings = [(1, c * kt), (2, 3 * c * kt), (3, 3 * c * kt)]
        if subset == "rotate":
            rings = [rings[(index + offset) % 3]]
        if deep_rings:
            for deepest in (_deepest_aliased(o, t, kt, b, c, bulk, tma),
                            _deepest_past_16(o, t, kt, b, c, bulk, tma)):
                if deepest and deepest not in rings:
                    rings.append(deepest)
        n = 2 * o  # two output tiles
        for stages, k in rings:
            tactic = WarpSplitKTactic(o, t, kt, stages, b, c, x_copy=_x_copy(bulk, tma))
            if not is_legal(tactic, n, k):
                continue  # a combination check_tactic refuses (48/64-row tiles need k_tile 128)
            ms = sorted({1, max(1, t - 1), t, min(32, t + 1), 32})
            cases.append((tactic, n, k, ms))
            prefetching = dataclasses.replace(tactic, l2_prefetch=PREFETCH_ALL)
            if l2_prefetch and is_legal(prefetching, n, k):  # a ring shorter than K
                cases.append((prefetching, n, k, ms))
                # bounded: one tile past the ring, one more K tile left after it
                bounded = dataclasses.replace(prefetching, l2_prefetch=1)
                longer = k + c * kt
                if is_legal(bounded, n, longer):
                    cases.append((bounded, n, longer, ms))
            mixed = dataclasses.replace(tactic, half_tiles=3)
            mixed_n = 2 * o + 3 * (o // 2)  # two full tiles, then three half tiles
            if half_tiles and is_legal(mixed, mixed_n, k):
                cases.append((mixed, mixed_n, k, ms))
    return cases


#: ``--NAME-only``: keep only the cases whose tactic passes (several: all of them).
CASE_FILTERS = {
    "clusters": ("the cases with k_split > 1", lambda t: t.k_split > 1),
    "x-copies": ("the cases with bulk or TMA copies, half tiles or the L2 prefetch",
                 lambda t: t.x_copy != CP_ASYNC or t.l2_prefetch or t.half_tiles),
    "aliased": ("the cases whose reduction buffer lies over the rings",
                lambda t: t.reduction_aliased),
    "narrow": ("the cases with a narrow token tile (1, 2 or 4 rows)",
               lambda t: t.token_tile < layout.MMA_N),
    "past-16": ("the rings deeper than 16 stages (with --deep-rings)", lambda t: t.stages > 16),
}


def swiglu_reference(x, w):
    """``silu(x @ gate^T) * (x @ up^T)`` of a ``[gate; up]`` weight, in float64."""
    i = w.shape[0] // 2
    ref = x.double() @ w.double().t()
    return torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]


def fp8_operands(n, k, kind):
    """A random e4m3 ``[n, k]`` weight (no NaN), FP32 scales of ``kind``, and
    the dequantized weight (float64)."""
    from warpsplitk.contract import fp8_scale_factors
    from warpsplitk.measure.fp8_bench import random_fp8
    (w8,), (scale,) = random_fp8(n, k, 1, seed=n + k, scales=kind)
    return w8, scale, w8.double() * fp8_scale_factors(scale, n, k).double()


def run_cases(subset, offset=0, shard=0, shards=1, k_splits=(1,), only=(), progress=False, bulk_xs=(False,), l2_prefetch=False, deep_rings=False,
              tma_xs=(False,), half_tiles=False, swiglu=False, fp8=None):
    """``only``: names of ``CASE_FILTERS`` every case must pass. ``swiglu``:
    every case (but mixed grids) with the SwiGLU epilogue, its weight read as
    ``[gate; up]``. ``fp8`` (a scale kind): every case an e4m3 weight with
    those scales takes (``family_cases``)."""
    torch.manual_seed(0)
    results = []
    cases = family_cases(subset, offset, k_splits, bulk_xs, l2_prefetch, deep_rings, tma_xs,
                         half_tiles, fp8, swiglu)
    for name in only:
        cases = [case for case in cases if CASE_FILTERS[name][1](case[0])]
    if swiglu:
        cases = [case for case in cases if not case[0].half_tiles]
    for tactic, n, k, ms in cases[shard::shards]:
        if progress:  # under a slow tool, which case a timeout stopped in
            print(f"case {tactic.short()} N={n} K={k} M={ms}", flush=True)
        if fp8 is None:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            prepared = PreparedWarpSplitK(w, {m: tactic for m in ms}, swiglu=swiglu)
        else:
            w8, scale, w = fp8_operands(n, k, fp8)
            prepared = PreparedWarpSplitK(w8, {m: tactic for m in ms}, weight_scale=scale,
                                          swiglu=swiglu)
        columns = n // 2 if swiglu else n
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.full((m, columns), float("nan"), device="cuda", dtype=torch.bfloat16)
            out2 = torch.full((m, columns), float("nan"), device="cuda", dtype=torch.bfloat16)
            prepared.run(x, out)
            prepared.run(x, out2)  # back to back: PDL overlap with the first
            torch.cuda.synchronize()
            ref = swiglu_reference(x, w) if swiglu else x.double() @ w.double().t()
            ok = (not torch.isnan(out).any().item() and rel_err(out, ref) < 1e-2
                  and torch.equal(out, out2))
            results.append({"tactic": tactic.short(), "n": n, "k": k, "m": m, "ok": ok,
                            **({"swiglu": True} if swiglu else {}),
                            **({"fp8": fp8} if fp8 else {})})
            if not ok:
                print(f"FAIL {tactic.short()} N={n} K={k} M={m}", flush=True)
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results)} cases, {len(bad)} wrong", flush=True)
    return results, bad


def soak(projections, replays, check_every):
    """A chain: h_{i+1} = x_i @ W_i^T with N_i = K_{i+1}, like a stack of layers."""
    torch.manual_seed(1)
    dims = [7168, 2304, 1536, 7168, 4224, 1152, 3072, 7168]  # each a legal N and K
    layers = []
    for i in range(projections):
        k, n = dims[i % len(dims)], dims[(i + 1) % len(dims)]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        layers.append((w, n, k))
    m = 8
    x0 = torch.randn(m, layers[0][2], device="cuda", dtype=torch.bfloat16)
    prepared = [PreparedWarpSplitK(w, {m: default_tactic(m, n, k)}) for w, n, k in layers]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _, n, _ in layers]

    def chain():
        h = x0
        for p, out in zip(prepared, outs):
            p.run(h, out)
            h = out

    chain()
    torch.cuda.synchronize()
    expected = [o.clone() for o in outs]
    # the chain's reference: each layer checked against fp64 on its actual input
    h = x0
    worst = 0.0
    for (w, _, _), out in zip(layers, expected):
        worst = max(worst, rel_err(out, h.double() @ w.double().t()))
        h = out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    mem0 = torch.cuda.memory_allocated()
    drift = 0
    checks = 0
    start = time.perf_counter()
    for i in range(1, replays + 1):
        graph.replay()
        if i % check_every == 0 or i == replays:
            torch.cuda.synchronize()
            checks += 1
            drift += sum(not torch.equal(a, b) for a, b in zip(outs, expected))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = {"projections": projections, "replays": replays, "checks": checks,
              "outputs_differing": drift, "worst_rel_err_vs_fp64": worst,
              "memory_allocated_before": mem0, "memory_allocated_after": torch.cuda.memory_allocated(),
              "seconds": round(elapsed, 2), "us_per_replay": round(elapsed / replays * 1e6, 2)}
    print(json.dumps(result), flush=True)
    return result


def soak_failed(result) -> bool:
    """A soak fails on any output that drifted from the first pass, an error
    against fp64 of 1e-2 or more, or allocated memory that changed (a replay
    that allocates, or a leak)."""
    return bool(result["outputs_differing"] or result["worst_rel_err_vs_fp64"] >= 1e-2
                or result["memory_allocated_after"] != result["memory_allocated_before"])


def digest():
    torch.manual_seed(123)
    h = hashlib.sha256()
    for n, k in ((2112, 7168), (4608, 1536), (768, 128)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 9, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            PreparedWarpSplitK(w, {m: default_tactic(m, n, k)}).run(x, out)
            torch.cuda.synchronize()
            h.update(out.view(torch.int16).cpu().numpy().tobytes())
    print(h.hexdigest(), flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases")
    c.add_argument("--subset", default="all", choices=("all", "rotate", "shipped"))
    c.add_argument("--offset", type=int, default=0, help="which ring variant 'rotate' starts at")
    c.add_argument("--shard", type=int, default=0, help="run cases shard, shard+shards, ...")
    c.add_argument("--shards", type=int, default=1)
    c.add_argument("--k-split", action="store_true",
                   help="also the cluster split of K (k_split 2) of every family")
    c.add_argument("--bulk-x", action="store_true",
                   help="also bulk activation copies (x_copy bulk) of every one-warp family")
    c.add_argument("--tma-x", action="store_true",
                   help="also TMA activation boxes (x_copy tma) of every one-warp family")
    c.add_argument("--half-tiles", action="store_true",
                   help="also a mixed grid (half_tiles 3) of every 32- or 64-row case")
    c.add_argument("--l2-prefetch", action="store_true",
                   help="also the L2 prefetch of every case whose ring is shorter than K")
    c.add_argument("--deep-rings", action="store_true",
                   help="also each family's deepest ring that fits only with the reduction "
                        "buffer over the rings, and its deepest past 16 stages")
    for name, (what, _) in CASE_FILTERS.items():
        c.add_argument(f"--{name}-only", action="append_const", const=name, dest="only",
                       default=[], help=f"only {what}")
    c.add_argument("--swiglu", action="store_true",
                   help="every case (but mixed grids) with the SwiGLU epilogue")
    c.add_argument("--fp8", choices=("tensor", "channel", "block128"),
                   help="every case an e4m3 weight with these scales takes")
    c.add_argument("--progress", action="store_true", help="a line per case as it starts")
    c.add_argument("--json")
    s = sub.add_parser("soak")
    s.add_argument("--projections", type=int, default=64)
    s.add_argument("--replays", type=int, default=100_000)
    s.add_argument("--check-every", type=int, default=10_000)
    s.add_argument("--json")
    sub.add_parser("digest")
    args = p.parse_args()
    if args.cmd == "cases" and not 0 <= args.shard < args.shards:
        p.error(f"--shard must be in 0..--shards - 1 with --shards >= 1, got --shard "
                f"{args.shard} --shards {args.shards}")
    if args.cmd == "soak" and min(args.projections, args.replays, args.check_every) < 1:
        p.error("--projections, --replays and --check-every must be at least 1")
    if args.cmd == "cases":
        results, bad = run_cases(args.subset, args.offset, args.shard, args.shards,
                                (1, 2) if args.k_split else (1,), args.only, args.progress,
                                (False, True) if args.bulk_x else (False,), args.l2_prefetch,
                                args.deep_rings, (False, True) if args.tma_x else (False,),
                                args.half_tiles, args.swiglu, args.fp8)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
        return 1 if bad else 0
    if args.cmd == "soak":
        result = soak(args.projections, args.replays, args.check_every)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
        return 1 if soak_failed(result) else 0
    digest()
    return 0


if __name__ == "__main__":
    sys.exit(main())
