"""The benchmark plot: speedup over cuBLAS and share of the HBM speed of light
(weight bytes at the GPU's datasheet bandwidth)."""

from __future__ import annotations

from ..jsonfile import read_json


def _rows(source):
    if isinstance(source, str):
        data = read_json(source, "bench JSON")
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{source}: a bench JSON holds an object with a 'rows' list")
        return data["rows"], data.get("environment", {})
    return source, {}


def plot_rows(rows, env, path):
    """Two panels over shapes (x) with one line per M: speedup vs cuBLAS, and
    % of the floor (weight bytes at the datasheet bandwidth: ``floor_us``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r if isinstance(r, dict) else r.__dict__ | {"speedup": r.speedup} for r in rows]
    shapes = sorted({(r["n"], r["k"]) for r in rows}, key=lambda s: s[0] * s[1])
    ms = sorted({r["m"] for r in rows})
    index = {s: i for i, s in enumerate(shapes)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    for m in ms:
        sel = sorted((r for r in rows if r["m"] == m), key=lambda r: index[(r["n"], r["k"])])
        xs = [index[(r["n"], r["k"])] for r in sel]
        top.plot(xs, [r["cublas_us"] / r["ours_us"] for r in sel], marker="o", label=f"M={m}")
        bottom.plot(xs, [100 * r["floor_us"] / r["ours_us"] for r in sel], marker="o",
                    label=f"M={m}")
    top.axhline(1.0, color="grey", lw=1)
    top.set_ylabel("speedup over torch.matmul")
    bottom.set_ylabel("% of HBM speed of light")
    bottom.set_ylim(0, 105)
    bottom.axhline(100, color="grey", lw=1)
    bottom.set_xticks(range(len(shapes)))
    bottom.set_xticklabels([f"{n}x{k}\n{n * k * 2 / 1e6:.1f} MB" for n, k in shapes],
                           rotation=60, fontsize=7)
    top.legend(ncol=len(ms), fontsize=8)
    title = f"warpsplitk on {env.get('gpu', 'GPU')}"
    if env.get("datasheet_TBps"):
        title += f" (floor: weight bytes at the datasheet's {env['datasheet_TBps']} TB/s)"
    top.set_title(title)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="plot a warpsplitk bench JSON")
    p.add_argument("json")
    p.add_argument("png")
    args = p.parse_args(argv)
    try:
        rows, env = _rows(args.json)
    except ValueError as error:  # a missing, broken or foreign file: one line, no traceback
        p.error(str(error))
    plot_rows(rows, env, args.png)


if __name__ == "__main__":
    main()
