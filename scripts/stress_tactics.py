"""Run a few tactics many times and count wrong or differing results.

    python3 scripts/stress_tactics.py N,K M[,M...] TACTIC [TACTIC ...] [--rounds R] [--where]

For chasing an intermittent GPU failure: each round draws fresh inputs,
poisons the outputs with NaN, and launches the tactic several times back
to back (PDL lets them overlap) into separate outputs, both eagerly and
replayed from a CUDA graph; every output must match the fp64 reference
(relative error < 1e-2) and all must be bitwise equal. Prints one line
per tactic and writes nothing else. With ``--where``, also where the
first wrong output is wrong: which token rows, and which output tiles
(for a race, the pattern says which CTAs lost it). Needs a CUDA GPU.
"""

import argparse
import sys

import torch

from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic, check_tactic

LAUNCHES = 4
SHOWN = 3  # wrong outputs described, with --where


def where_wrong(out, ref, tactic, x, w, x_before):
    """Where a wrong output is wrong: its token rows and output tiles, and
    for its three worst elements the K chunk story that explains each best
    (``_best_chunk_story``: a race on one ring stage shows up as one)."""
    diff = out.double() - ref
    bad = diff.abs() > 0.05 * ref.abs().amax() + 0.02 * ref.abs()
    rows = bad.any(dim=1).nonzero().flatten().tolist()
    tiles = sorted({c // tactic.output_tile for c in bad.any(dim=0).nonzero().flatten().tolist()})
    token_tiles = sorted({r // tactic.token_tile for r in rows})
    shown = ",".join(str(t) for t in tiles[:12]) + (",..." if len(tiles) > 12 else "")
    text = (f"{int(bad.sum())} elements; token rows {rows} (token tiles {token_tiles}); "
            f"{len(tiles)} output tiles: {shown}")
    for flat in torch.topk(diff.abs().flatten(), min(3, int(bad.sum()))).indices.tolist():
        r, c = divmod(flat, out.shape[1])
        text += f"\n    token {r} col {c}: off by {diff[r, c].item():+.2f}; " + _best_chunk_story(
            diff[r, c].item(), x[r].double(), x_before[r].double(), w[c].double())
    return text


def _best_chunk_story(d, x_row, before_row, w_row):
    """The one K chunk (16 or 32 wide) whose contribution, dropped, taken
    from the previous round's x, or taken from another chunk of this x at
    the same weight columns (a stage read before its copy landed, or after
    the next one did), best explains an error ``d``."""
    best = None
    for width in (16, 32):
        xs, bs, ws = (v.view(-1, width) for v in (x_row, before_row, w_row))
        parts = (xs * ws).sum(dim=1)
        cross = ws @ xs.t()  # [j, j']: chunk j's weights times chunk j' of x
        for j in range(parts.numel()):
            stories = [("dropped", d + parts[j].item()),
                       ("stale", d + parts[j].item() - (bs[j] * ws[j]).sum().item())]
            left = (d + parts[j] - cross[j]).abs()
            left[j] = float("inf")
            j2 = int(left.argmin())
            stories.append((f"read x chunk #{j2}", left[j2].item()))
            for story, rest in stories:
                if best is None or abs(rest) < best[0]:
                    best = (abs(rest), f"chunk #{j} of {width} K {story}")
    return f"best: {best[1]} (leaves {best[0]:.2f})"


def stress(tactic, n, k, m, rounds, where=False):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = PreparedWarpSplitK(w, {m: tactic})
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAUNCHES)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            prepared.run(x, out)
    wrong = differing = unwritten = 0
    worst = 0.0
    x_before = torch.zeros_like(x)
    for round_ in range(rounds):
        x_before.copy_(x)
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        for out in outs:
            out.fill_(float("nan"))
        if round_ % 2:
            graph.replay()
        else:
            for out in outs:
                prepared.run(x, out)
        torch.cuda.synchronize()
        ref = x.double() @ w.double().t()
        for out in outs:
            if torch.isnan(out).any():
                unwritten += 1
                continue
            err = ((out.double() - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            if where and not err < 1e-2 and wrong < SHOWN:
                print(f"  round {round_} ({'graph' if round_ % 2 else 'eager'}): "
                      f"{where_wrong(out, ref, tactic, x, w, x_before)}", flush=True)
            wrong += not err < 1e-2
        differing += any(not torch.equal(outs[0], out) for out in outs[1:])
    return wrong, differing, unwritten, worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="N,K")
    parser.add_argument("m", help="M, or several: 7,17")
    parser.add_argument("tactics", nargs="+")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--where", action="store_true",
                        help="say where the first wrong outputs are wrong")
    args = parser.parse_args(argv)
    try:  # every argument checked before the first launch
        n, k = (int(v) for v in args.shape.split(","))
        ms = [int(v) for v in args.m.split(",")]
        tactics = [WarpSplitKTactic.parse(text) for text in args.tactics]
        for tactic in tactics:
            check_tactic(tactic, n, k)
        for m in ms:
            if not 1 <= m <= 32:
                raise ValueError(f"M must be in 1..32, got {m}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    except ValueError as error:
        parser.error(str(error))
    failed = False
    for text, tactic in zip(args.tactics, tactics):
        for m in ms:
            wrong, differing, unwritten, worst = stress(tactic, n, k, m, args.rounds, args.where)
            failed |= bool(wrong or differing or unwritten)
            print(f"{n}x{k} M={m} {text}: {args.rounds} rounds x {LAUNCHES} launches, "
                  f"{wrong} wrong, {differing} rounds differing, {unwritten} unwritten, "
                  f"worst rel err {worst:.2e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
