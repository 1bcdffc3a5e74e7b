"""Tensor-parallel decode projections on several GPUs: check, graph-capture, time.

    torchrun --standalone --nproc-per-node 2 scripts/tp_launch.py \\
        [--shapes N,K ...] [--ms 1,8,32] [--json OUT.json] [--plan 'plan-rank{rank}.json'] \\
        [--tune [--tune-budget S] [--out DIR]]
    # CPU smoke test (F.linear for the local matmuls, no graphs, no timing):
    torchrun --standalone --nproc-per-node 2 scripts/tp_launch.py --backend gloo --device cpu ...

Each rank uses ``cuda:<LOCAL_RANK>``. NVLink multicast is turned off (or a
setting that turns it on refused) before ``init_process_group``.

For every shape of the table (or ``--shapes``) and both splits the kernel can
run at this world size (others are skipped with the reason), and every M:

* the full weight, bias and x come from fixed seeds (the same on every rank);
  each rank checks, against an fp64 reference from the full weight, the
  column-parallel local output and the gathered ``[M, N]``, and the
  row-parallel output for a full x and for an already-sharded x
  (relative error < ``--tol``), and that the kernel ran (no fallback);
* CUDA only: each of those forwards is captured in a CUDA graph (NCCL calls
  included), replayed with new x values copied into the static input, and
  re-checked;
* CUDA only: per rank, with the benchmark's method (``warpsplitk.runtime.timing``:
  calls back to back in one graph over weight copies, median of replays):
  the local kernel alone, the collective alone (all-gather or all-reduce of
  the same sizes) and the whole forward.

Rank 0 prints a table and writes ``--json``. Exit status 1 if a check failed.
``--tune`` first tunes each rank's shard shapes on its own GPU
(``warpsplitk.planning.tune``) and writes ``plan-rank{r}.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from warpsplitk import shapes as shape_table
from warpsplitk.nn.parallel import (
    ColumnParallelDecodeLinear,
    RowParallelDecodeLinear,
    all_gather,
    ensure_no_multicast,
    multicast_problems,
    shard_plan,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", help="N,K pairs or .json tables (default: the built-in table)")
    # --ms: torchrun takes "--m" for an abbreviation of its own options
    p.add_argument("--ms", "--m", dest="m", default="1,8,32",
                   help="Ms to check and time (default 1,8,32)")
    p.add_argument("--json", help="rank 0 writes the results here")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--plan", help="plan file; '{rank}' in the path is replaced by the rank")
    p.add_argument("--tune", action="store_true", help="tune each rank's shard shapes first")
    p.add_argument("--tune-budget", type=float, help="seconds of tuning per rank")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="where --tune writes plan-rank{r}.json and its logs")
    p.add_argument("--tol", type=float, default=1e-2, help="relative error bound vs fp64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph checks")
    p.add_argument("--no-timing", action="store_true", help="skip the timings")
    p.add_argument("--max-copies", type=int, default=64,
                   help="weight copies per timed graph at most (the bench uses >= 3x L2)")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective may wait before the process group aborts")
    return p.parse_args(argv)


def log(rank, *parts):
    if rank == 0:
        print(*parts, flush=True)


def rel_err(out, ref):
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def seeded(seed, *shape, dtype, device, key):
    """Random values from a CPU generator (identical on every rank and device)."""
    gen = torch.Generator().manual_seed(hash((seed,) + key) & 0x7FFFFFFF)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def stable_key(*key):
    # hash() of ints is deterministic across processes (no string hashing)
    return tuple(int(v) for v in key)


# ------------------------------------------------------------------ setup


def init(args):
    # before init_process_group: NCCL reads these when it builds communicators
    set_now = ensure_no_multicast()
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device (use --backend gloo --device cpu for a CPU run)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if args.backend == "nccl":
            sys.exit("--device cpu needs --backend gloo")
    timeout = args.timeout + (args.tune_budget or (1800 if args.tune else 0))
    kwargs = dict(backend=args.backend, timeout=datetime.timedelta(seconds=timeout))
    if args.backend == "nccl":
        kwargs["device_id"] = device  # build the communicator now, with the env above
    try:
        dist.init_process_group(**kwargs)
    except TypeError:  # an older torch without device_id
        kwargs.pop("device_id", None)
        dist.init_process_group(**kwargs)
    assert dist.get_rank() == rank and dist.get_world_size() == world
    return rank, world, device, set_now


def table_shapes(args):
    if args.shapes:
        return [(n, k, "") for n, k in shape_table.parse_shapes(args.shapes)]
    return [(s["n"], s["k"], f"{s.get('model', '')} {s.get('projection', '')}".strip())
            for s in shape_table.load()["shapes"]]


def get_plan(args, rank, world, table, ms):
    from warpsplitk.planning.plans import load_plan
    if args.tune:
        if args.device != "cuda":
            sys.exit("--tune needs --device cuda")
        from warpsplitk.planning.tune import tune
        shard_shapes = []
        for n, k, _ in table:
            for shard in shard_plan(n, k, world, ms).values():
                if isinstance(shard, tuple) and shard not in shard_shapes:
                    shard_shapes.append(shard)
        shard_shapes.sort(key=lambda s: -s[0] * s[1])  # with a budget, the largest first
        os.makedirs(args.out, exist_ok=True)
        start = time.perf_counter()
        plan = tune(shard_shapes, ms, log_path=os.path.join(args.out, f"tune-log-rank{rank}.jsonl"),
                    progress=lambda line: print(f"[rank {rank}] {line}", flush=True),
                    time_budget_s=args.tune_budget)
        plan.meta["tensor_parallel"] = {"rank": rank, "world": world}
        path = os.path.join(args.out, f"plan-rank{rank}.json")
        plan.save(path)
        print(f"[rank {rank}] tuned {len(shard_shapes)} shard shapes in "
              f"{time.perf_counter() - start:.0f} s -> {path}", flush=True)
        dist.barrier()
        return plan, path
    if args.plan:
        path = args.plan.format(rank=rank)
        return load_plan(path), path
    return None, None


# ------------------------------------------------------------------ checks


def graph_check(forward, static_x, new_x, ref_of):
    """Capture ``forward(static_x)``, copy ``new_x`` in, replay: relative error
    of the static output against ``ref_of(new_x)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture wants
        forward(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward(static_x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(static_out, ref_of(new_x))
    del graph
    return err


def timed(calls, replays):
    from warpsplitk.runtime import timing
    return round(timing.time_calls(calls, replays=replays).median_us, 3)


def run_case(args, mode, module, copies, n, k, m, rank, world, device, weight, bias, x_key):
    """Check (eager, graph) and time one (shape, split, M) on this rank."""
    dtype = weight.dtype
    x = seeded(args.seed, m, k, dtype=dtype, device=device, key=x_key)
    x2 = seeded(args.seed + 1, m, k, dtype=dtype, device=device, key=x_key)
    w64 = weight.double()
    b64 = None if bias is None else bias.double()

    def ref(xv):
        r = xv.double() @ w64.t()
        return r if b64 is None else r + b64

    cuda = device.type == "cuda"
    row = {"n": n, "k": k, "mode": mode, "m": m, "rank": rank, "world": world,
           "shard": list(module.weight.shape), "device": str(device)}
    kernel_before, fallback_before = module.kernel_calls, module.fallback_calls
    errs = {}
    if mode == "column":
        cols = module.output_slice
        # (name, forward, input from the full x, reference from the full reference)
        variants = [
            ("local", lambda xv: module(xv, gather_output=False), lambda xv: xv,
             lambda r: r[:, cols]),
            ("gather", lambda xv: module(xv, gather_output=True), lambda xv: xv, lambda r: r),
        ]
    else:
        ks = module.input_slice
        variants = [
            ("full_x", lambda xv: module(xv, input_is_parallel=False), lambda xv: xv,
             lambda r: r),
            ("parallel_x", lambda xv: module(xv, input_is_parallel=True),
             lambda xv: xv[:, ks].contiguous(), lambda r: r),
        ]
    for name, forward, take, pick in variants:
        errs[name] = rel_err(forward(take(x)), pick(ref(x)))
    row["path"] = ("kernel" if module.fallback_calls == fallback_before
                   and module.kernel_calls > kernel_before else "F.linear")
    if cuda and not args.no_graph:
        for name, forward, take, pick in variants:
            errs[f"graph_{name}"] = graph_check(forward, take(x).clone(), take(x2),
                                                lambda xv, pick=pick: pick(ref(xv)))
    row["rel_err"] = {key: float(f"{v:.3g}") for key, v in errs.items()}
    row["ok"] = all(v < args.tol for v in errs.values()) and (not cuda or row["path"] == "kernel")
    if cuda and not args.no_timing:
        part = module.weight.shape
        if mode == "column":
            x_local = x
            send = torch.zeros(m, part[0], dtype=dtype, device=device)
            recv = torch.empty(world, m, part[0], dtype=dtype, device=device)
            comm = lambda: all_gather(recv, send, None)  # noqa: E731
            fwd = [lambda c=c: c(x, gather_output=True) for c in copies]
            alt = [lambda c=c: c(x, gather_output=False) for c in copies]
            names = ("all_gather", "forward (gather)", "forward (no gather)")
        else:
            x_local = x[:, module.input_slice].contiguous()
            buf = torch.zeros(m, n, dtype=dtype, device=device)  # zeros: sums stay zero
            comm = lambda: dist.all_reduce(buf)  # noqa: E731
            fwd = [lambda c=c: c(x_local, input_is_parallel=True) for c in copies]
            alt = [lambda c=c: c(x, input_is_parallel=False) for c in copies]
            names = ("all_reduce", "forward (x sharded)", "forward (x full)")
        from warpsplitk.runtime import timing
        weight_bytes = part[0] * part[1] * weight.element_size()
        row["timing"] = {
            "kernel_us": timed([lambda c=c: c.local(x_local) for c in copies], args.replays),
            "comm_us": timed([comm], args.replays),
            "forward_us": timed(fwd, args.replays),
            "forward_alt_us": timed(alt, args.replays),
            "comm": names[0], "forward": names[1], "forward_alt": names[2],
            "weight_copies": len(copies),
            "streams_from_hbm": len(copies) * weight_bytes >= timing.L2_MULTIPLE * timing.l2_bytes(),
        }
    return row


def build(mode, weight, bias, plan, ms, device, copies_wanted):
    """The module from the full weight, and weight-copy modules for timing
    (the first of which is the module itself)."""
    cls = ColumnParallelDecodeLinear if mode == "column" else RowParallelDecodeLinear
    module = cls.from_full_weight(weight, plan=plan, ms=ms, bias=bias, device=device)
    copies = [module]
    for _ in range(copies_wanted - 1):
        w = module.weight.detach().clone()
        if mode == "column":
            b = None if module.local.bias is None else module.local.bias.detach().clone()
        else:
            b = bias  # the full bias; rank 0 adds it
        copies.append(cls(w, b, plan=plan, ms=ms, device=device))
    return module, copies


def copies_for(mode, n, k, world, element_size, args, cuda):
    if not cuda or args.no_timing:
        return 1
    from warpsplitk.runtime import timing
    sn, sk = (n // world, k) if mode == "column" else (n, k // world)
    return max(1, min(args.max_copies, timing.copies_for(sn * sk * element_size)))


# ------------------------------------------------------------------ report


def print_table(rows, skipped, world):
    print(f"\n# tensor-parallel decode linears, world size {world} "
          "(times in us per call, median; one value per rank r0/r1/...)")
    head = (f"{'split':<7} {'N':>6} {'K':>6} {'shard':>11} {'M':>3} {'ok':>3} {'max err':>8} "
            f"{'kernel':>15} {'comm':>15} {'forward':>15} {'fwd alt':>15}")
    print(head)
    by_case = {}
    for r in rows:
        by_case.setdefault((r["mode"], r["n"], r["k"], r["m"]), []).append(r)
    for (mode, n, k, m), rs in by_case.items():
        rs.sort(key=lambda r: r["rank"])
        shard = "x".join(map(str, rs[0]["shard"]))
        ok = "yes" if all(r["ok"] for r in rs) else "NO"
        err = max(max(r["rel_err"].values()) for r in rs)

        def per_rank(key):
            vals = [r.get("timing", {}).get(key) for r in rs]
            return "/".join("-" if v is None else f"{v:.2f}" for v in vals)

        print(f"{mode:<7} {n:>6} {k:>6} {shard:>11} {m:>3} {ok:>3} {err:>8.2e} "
              f"{per_rank('kernel_us'):>15} {per_rank('comm_us'):>15} "
              f"{per_rank('forward_us'):>15} {per_rank('forward_alt_us'):>15}")
    print("comm: column all_gather, row all_reduce. forward: column with gather, row with x "
          "sharded; fwd alt: column without gather, row with the full x (slice + copy).")
    for s in skipped:
        print(f"skipped {s['mode']}-parallel N={s['n']} K={s['k']}: {s['reason']}")


def environment(rank, device, plan_path, set_now):
    env = {"rank": rank, "device": str(device), "torch": torch.__version__,
           "multicast_env": {k: os.environ.get(k) for k in
                             ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                              "NVSHMEM_DISABLE_NVLS")},
           "multicast_env_set_by_launcher": set_now, "plan": plan_path}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # pragma: no cover
            env["nccl"] = None
    return env


def main(argv=None):
    args = parse_args(argv)
    rank, world, device, set_now = init(args)
    assert not multicast_problems(), multicast_problems()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    ms = shape_table.parse_ms(args.m)
    table = table_shapes(args)
    plan, plan_path = get_plan(args, rank, world, table, ms)
    if plan is None:  # the default heuristic is the choice here, not a gap in a plan
        warnings.filterwarnings("ignore", message="decode plan has no entry")
    log(rank, f"world {world}, backend {args.backend}, device {args.device}, M {ms}, "
              f"{len(table)} shapes, plan {plan_path or 'default heuristic'}")
    rows, skipped = [], []
    started = time.perf_counter()
    for index, (n, k, label) in enumerate(table):
        splits = shard_plan(n, k, world, ms)
        weight = bias = None
        for mode in ("column", "row"):
            if isinstance(splits[mode], str):
                skipped.append({"n": n, "k": k, "mode": mode, "reason": splits[mode]})
                continue
            if weight is None:  # the same full weight on every rank: fixed seeds
                weight = seeded(args.seed, n, k, dtype=dtype, device=device, key=stable_key(n, k))
                bias = seeded(args.seed, n, dtype=dtype, device=device, key=stable_key(n, k, 0))
            t0 = time.perf_counter()
            module, copies = build(mode, weight, bias, plan, ms, device,
                                   copies_for(mode, n, k, world, 2, args, cuda))
            for m in ms:
                row = run_case(args, mode, module, copies, n, k, m, rank, world, device, weight,
                               bias, stable_key(n, k, m))
                row["label"] = label
                rows.append(row)
                if not row["ok"]:
                    print(f"[rank {rank}] FAILED {mode} N={n} K={k} M={m}: {row['rel_err']} "
                          f"path {row['path']}", flush=True)
            log(rank, f"[{index + 1}/{len(table)}] {mode:<6} N={n} K={k}: "
                      f"{time.perf_counter() - t0:.1f} s")
            del module, copies
        if cuda:
            torch.cuda.empty_cache()
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rows": rows, "env": environment(rank, device, plan_path,
                                                                         set_now)})
    failed = sum(not r["ok"] for g in gathered for r in g["rows"])
    if rank == 0:
        all_rows = [r for g in gathered for r in g["rows"]]
        print_table(all_rows, skipped, world)
        print(f"{len(all_rows)} rank-cases, {failed} failed, {len(skipped)} splits skipped, "
              f"{time.perf_counter() - started:.0f} s")
        if args.json:
            result = {"format": "warpsplitk-tp", "world": world, "backend": args.backend,
                      "ms": ms, "tol": args.tol, "env": [g["env"] for g in gathered],
                      "rows": all_rows, "skipped": skipped,
                      "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
