"""Time a broad sample of tactics on more shapes: calibration data for the cost model.

    python scripts/collect_timings.py LOG.jsonl [--budget SECONDS] N,K [N,K ...]
    python scripts/collect_timings.py LOG.jsonl --model llama-3.1-8b --tp 2
    python scripts/collect_timings.py LOG.jsonl --cells CELLS.json

On a CUDA GPU. For each shape (in the order given, until the budget is
spent) and each M of ``MS``: the tuner's candidates with the late trigger
(``space.base_candidates``), the default's and the reference heuristic's
tactics; once those are timed, the TMA, narrow, L2-prefetch, bounded
prefetch (2 and 4 tiles) and mixed-grid twins of each cell's fastest and the
early-trigger twins of its two fastest, and the option twins
(``measured_options.TWINS``) of the default's three best-ranked tactics and of the
default's choice; then cuBLAS. Each batch is compiled
in parallel first. Every tactic is checked against an fp64 reference and
timed as the tuner times (``timing.time_calls``, weight copies >= 3x L2).
The log is the tuner's format (``scripts/fit_cost_model.py`` reads it); its
first line names the command, date, GPU and versions.

This is the tuner's space minus its confirmations and the early twins of
all but the two fastest, so that a shape costs seconds of measurement
(compiling dominates: ~0.2 s per kernel on 16 cores).

With ``--cells``, exactly the listed tactics of each listed cell, then
cuBLAS: a side-by-side measurement of candidate choices (say, two versions
of the default) that is calibration data too. The file is JSON,
``{"cells": [{"n": N, "k": K, "m": M, "tactics": ["16,8,256,14,2,2", ...]}]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from warpsplitk import models
from warpsplitk.runtime import timing
from warpsplitk.planning import choose, measured_options, space, tune, tune_log  # noqa: E402
from warpsplitk.planning.choose import default_tactic, reference_tactic  # noqa: E402
from warpsplitk.planning.decode_plan import CUBLAS  # noqa: E402
from warpsplitk.tactics import is_legal, shape_refusal  # noqa: E402

MS = (1, 4, 8, 16, 32)


def base_set(m, n, k, sm_count):
    """What a cell times first."""
    found = set(space.base_candidates(m, n, k, sm_count, early_launches=(False,)))
    default = default_tactic(m, n, k, sm_count)
    # the default, and with the late trigger where it takes the early one (a pair)
    found |= {default, dataclasses.replace(default, early_launch=False),
              reference_tactic(m, n, k, sm_count)}
    return sorted(found)


def twin_set(times, m, n, k, sm_count):
    """What a cell times once its base set is timed (``{tactic: us}``)."""
    found = (space.tma_twins(times, n, k) + space.narrow_twins(times, n, k, m, sm_count)
             + space.prefetch_twins(times, n, k)
             + space.bounded_prefetch_twins(times, n, k, depths=(2, 4))
             + space.mixed_twins(times, n, k, m, sm_count))
    fastest = sorted((t for t in times if not t.early_launch), key=times.get)[:2]
    found += [dataclasses.replace(t, early_launch=True) for t in fastest]
    # the option twins of what the default weighs (its pairs: warpsplitk.planning.measured_options)
    parents = [t for t, _ in choose.ranked(m, n, k, sm_count)[:3]]
    parents.append(default_tactic(m, n, k, sm_count))
    found += [twin for t in parents for twin_of in measured_options.TWINS.values()
              if (twin := twin_of(t, m, n, k)) is not None]
    return [t for t in dict.fromkeys(found) if t not in times and is_legal(t, n, k)]


def read_cells(path) -> dict:
    """``--cells`` file -> ``{(n, k): {m: [tactic, ...]}}`` (shapes in file
    order); ``SystemExit`` naming the file and the problem."""
    from warpsplitk.tactics import MAX_M, WarpSplitKTactic, check_tactic
    try:
        with open(path) as f:
            entries = json.load(f)["cells"]
        found = {}
        for entry in entries:
            n, k, m = (entry[key] for key in ("n", "k", "m"))
            if not all(type(v) is int and v > 0 for v in (n, k, m)) or m > MAX_M:
                raise ValueError(f"a cell is positive integers n, k and m <= {MAX_M}, got {entry}")
            if not isinstance(entry["tactics"], list) or not entry["tactics"]:
                raise ValueError(f"a cell's 'tactics' is a non-empty list, got {entry}")
            tactics = [WarpSplitKTactic.parse(text) for text in entry["tactics"]]
            for tactic in tactics:
                check_tactic(tactic, n, k)
            found.setdefault((n, k), {}).setdefault(m, [])
            found[(n, k)][m] += [t for t in tactics if t not in found[(n, k)][m]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"collect_timings: --cells {path}: {type(error).__name__}: {error}") \
            from None
    if not found:
        raise SystemExit(f"collect_timings: --cells {path}: no cells")
    return found


def shapes_of(args) -> list[tuple[int, int]]:
    shapes = []
    if args.model:
        shapes += [(p["n"], p["k"]) for p in models.projections(args.model, args.tp)
                   if shape_refusal(p["n"], p["k"]) is None]
    for text in args.shapes:
        try:
            n, k = (int(v) for v in text.split(","))
        except ValueError:
            raise SystemExit(f"collect_timings: a shape is N,K, got {text!r}") from None
        shapes.append((n, k))
    if not shapes:
        raise SystemExit("collect_timings: give N,K shapes or --model")
    return list(dict.fromkeys(shapes))


def provenance(command: str) -> dict:
    import importlib.metadata as md

    import torch

    import warpsplitk
    return {"meta": {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "cutlass_dsl": md.version("nvidia-cutlass-dsl"),
                     "warpsplitk": warpsplitk.__version__}}


def collect(log_path, shapes, budget_s, jobs, listed=None):  # pragma: no cover - needs a GPU
    import torch

    from warpsplitk.runtime.compile import device_arch, launcher
    from warpsplitk.runtime.precompile import precompile
    from warpsplitk.runtime.prepared import stream_handle

    device = torch.cuda.current_device()
    cuda_device = torch.device("cuda", device)
    arch = device_arch(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    gpu = torch.cuda.get_device_name(device)  # its HBM bounds a believable time
    started = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(json.dumps(provenance(" ".join(sys.argv))) + "\n")

        def time_set(n, k, m, tactics, weights, x, out, ref, cell):
            for tactic in tactics:
                rec = {"key": tune_log.log_key(n, k, m, tactic), "n": n, "k": k, "m": m,
                       "tactic": tactic.short(), "rev": tune_log.KERNEL_REVISION}
                launch = launcher(device, n, k, tactic)
                out.fill_(float("nan"))
                launch(weights[-1].data_ptr(), x.data_ptr(), weights[-1].data_ptr(),
                       out.data_ptr(), m, stream_handle(cuda_device))
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    rec.update(ok=False, error=f"relative error {err:.3g}")
                else:
                    # the stream is looked up per call: the graph captures on its own
                    t = timing.time_calls([
                        lambda w=w.data_ptr(): launch(w, x.data_ptr(), w, out.data_ptr(), m,
                                                      stream_handle(cuda_device))
                        for w in weights])
                    if t.median_us < timing.physical_floor_us(n * k * 2, gpu):
                        raise SystemExit(f"{rec['key']}: {t.median_us} us is under the HBM "
                                         "floor: the measurement is broken")
                    rec.update(ok=True, us=round(t.median_us, 3), spread=round(t.spread, 3),
                               rel_err=err)
                    cell[tactic] = t.median_us
                log.write(json.dumps(rec) + "\n")
            log.flush()

        for index, (n, k) in enumerate(shapes):
            if time.perf_counter() - started > budget_s:
                print(f"budget spent: {len(shapes) - index} shapes left", flush=True)
                break
            ms = sorted(listed[(n, k)]) if listed else MS
            first = listed[(n, k)] if listed else {m: base_set(m, n, k, sm_count) for m in ms}
            precompile(sorted({(n, k, t, False, True) for ts in first.values() for t in ts}),
                       arch, jobs, None)
            weights = timing.random_weights(n, k, timing.copies_for(n * k * 2), "cuda",
                                            seed=n * 7 + k)
            cells, inputs = {}, {}
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                inputs[m] = (x, out, x.double() @ weights[-1].double().t())
                cells[m] = {}
                time_set(n, k, m, first[m], weights, *inputs[m], cells[m])
            second = {m: [] if listed else twin_set(cells[m], m, n, k, sm_count) for m in ms}
            precompile(sorted({(n, k, t, False, True) for ts in second.values() for t in ts}),
                       arch, jobs, None)
            for m in ms:
                x, out, ref = inputs[m]
                time_set(n, k, m, second[m], weights, x, out, ref, cells[m])
                t = timing.time_rounds([[lambda w=w: torch.matmul(x, w.t(), out=out)
                                         for w in weights]], tune.CONFIRM_ROUNDS + 1)[0]
                log.write(json.dumps({"key": tune_log.log_key(n, k, m, CUBLAS), "n": n,
                                      "k": k, "m": m, "tactic": CUBLAS, "ok": True,
                                      "us": round(t.median_us, 3),
                                      "spread": round(t.spread, 3)}) + "\n")
                print(f"N={n} K={k} M={m}: {len(cells[m])} timed, fastest "
                      f"{min(cells[m].values()):.2f} us, cuBLAS {t.median_us:.2f} us", flush=True)
            del weights
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="JSON-lines log to append to")
    parser.add_argument("shapes", nargs="*", help="N,K weights")
    parser.add_argument("--model", help="a model of warpsplitk.models: its shards' shapes")
    parser.add_argument("--tp", type=int, default=1, help="with --model: the TP degree")
    parser.add_argument("--budget", type=float, default=600.0,
                        help="start no new shape after this many seconds (default 600)")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes")
    parser.add_argument("--cells", help="JSON file of cells and the tactics to time in each "
                        "(instead of shapes or --model)")
    args = parser.parse_args(argv)
    if args.cells:
        if args.shapes or args.model:
            raise SystemExit("collect_timings: --cells: not with shapes or --model")
        listed = read_cells(args.cells)
        collect(args.log, list(listed), args.budget, args.jobs, listed)
    else:
        collect(args.log, shapes_of(args), args.budget, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
