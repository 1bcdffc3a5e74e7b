"""One decode layer's GEMM path, timed three ways (``warpsplitk bench --layer``).

A Llama-family layer at decode runs, per token row: q, k and v from the
hidden state, attention, o, then gate and up from the result, SiLU and a
product, and down. Here attention is a stand-in that keeps the dependency
(a copy of the q columns, a small non-PDL kernel as attention is) and the
residual adds are left out; every step reads what the one before wrote, and
the layer's last output is the next layer's input:

* ``fused``: warpsplitk with q/k/v merged into one weight (one launch), and
  gate/up merged and run with the SwiGLU epilogue (one launch writes
  ``silu(gate) * up``);
* ``unmerged``: warpsplitk with q, k, v, gate and up as separate launches and
  PyTorch's SiLU and product between them, as an unpatched model runs them;
* ``cublas``: ``torch.matmul`` on the merged weights, then PyTorch's SiLU and
  product (what an engine without this library runs).

Each is checked against float64 (relative error < 2e-2 on the layer's
output) and timed as every benchmark is (``timing``: one CUDA graph over
copies of the layer's weights totalling >= 3x L2). The MLP block alone
(gate/up with the activation, then down, chained layer to layer) is timed
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime import timing
from ..tactics import shape_refusal


@dataclass(frozen=True)
class LayerShape:
    """One rank's projection sizes of a grouped-query-attention layer."""

    model: str
    tp: int
    hidden: int
    q: int  # query columns (heads x head_dim) on this rank
    kv: int  # key (and value) columns on this rank
    inter: int  # MLP intermediate columns on this rank

    @property
    def qkv(self):
        return self.q + 2 * self.kv


def layer_shape(name: str, tp: int = 1) -> LayerShape:
    """The sizes of one rank's layer of ``name`` (``warpsplitk.models``) at
    tensor-parallel degree ``tp``; ``ValueError`` for models without a dense
    grouped-query layer (MLA attention, no MLP) or shapes the kernel refuses."""
    from .. import models
    c = models.config(name)
    if c["attention"] != "gqa" or "intermediate" not in c:
        raise ValueError(f"{c['name']}: --layer times grouped-query attention layers with a "
                         f"dense MLP; this model has {c['attention']} attention"
                         + ("" if "intermediate" in c else " and no dense MLP"))
    chain = {p["projection"]: p for p in models.layer_chain(name, tp)}
    q = chain["o"]["k"]
    shape = LayerShape(c["name"], tp, c["hidden"], q, (chain["qkv"]["n"] - q) // 2,
                       chain["down"]["k"])
    for what, n, k in (("q", shape.q, shape.hidden), ("k/v", shape.kv, shape.hidden),
                       ("o", shape.hidden, shape.q), ("gate/up", 2 * shape.inter, shape.hidden),
                       ("down", shape.hidden, shape.inter)):
        reason = shape_refusal(n, k)
        if reason is not None:
            raise ValueError(f"{c['name']} TP{tp}: the {what} projection [{n}, {k}]: {reason}")
    return shape


@dataclass
class LayerPathRow:
    model: str
    tp: int
    m: int
    fused_us: float  # per layer
    unmerged_us: float
    cublas_us: float
    mlp_fused_us: float  # the MLP block alone, per layer
    mlp_unmerged_us: float
    mlp_cublas_us: float


def bench_layer_path(name, tp=1, ms=(1, 8, 32), plan=None, *, progress=print,
                     rounds=None) -> list[LayerPathRow]:  # pragma: no cover - needs a GPU
    import torch
    import torch.nn.functional as F

    from ..planning.plans import DecodePlan, precompile_for, prepare
    rounds = timing.resolve_rounds(rounds)
    plan = plan if plan is not None else DecodePlan()
    s = layer_shape(name, tp)
    timing.require_cuda("bench_layer_path")
    h, q, kv, inter = s.hidden, s.q, s.kv, s.inter
    shapes = [(s.qkv, h), (h, q), (2 * inter, h), (h, inter)]
    layer_bytes = 2 * sum(n * k for n, k in shapes)
    copies = timing.copies_for(layer_bytes)
    weights = [[w.mul_(w.shape[1] ** -0.5) for w in
                (timing.random_weights(n, k, 1, "cuda", seed=100 * c + i)[0]
                 for i, (n, k) in enumerate(shapes))] for c in range(copies)]
    ms = tuple(ms)
    # every kernel compiled first, in parallel worker processes
    layer = weights[0]
    parts = [layer[0][:q], layer[0][q:q + kv], layer[2][:inter]]
    precompile_for([layer[0], layer[1], layer[3], *parts], plan, ms, progress=progress)
    precompile_for([layer[2]], plan, ms, progress=progress, swiglu=True)

    def kernels(w_qkv, w_o, w_gu, w_d):
        fused = [prepare(w_qkv, plan, ms), prepare(w_o, plan, ms),
                 prepare(w_gu, plan, ms, swiglu=True), prepare(w_d, plan, ms)]
        parts = [w_qkv[:q], w_qkv[q:q + kv], w_qkv[q + kv:], w_gu[:inter], w_gu[inter:]]
        unmerged = [prepare(w, plan, ms) for w in parts]
        return fused, unmerged

    progress(f"{s.model} TP{tp}: preparing {copies} copies of the layer's weights")
    prepared = [kernels(*layer) for layer in weights]
    rows = []
    for m in ms:
        def empty(columns):
            return torch.empty(m, columns, device="cuda", dtype=torch.bfloat16)
        hidden = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        qkv_out, attn, o_out = empty(s.qkv), empty(q), empty(h)
        q_out, k_out, v_out = empty(q), empty(kv), empty(kv)
        act, gate_out, up_out, gate_up = empty(inter), empty(inter), empty(inter), empty(2 * inter)

        def fused_layer(c, mlp_only=False):
            (p_qkv, p_o, p_gu, p_d), _ = prepared[c]
            calls = [] if mlp_only else [
                lambda: p_qkv.run(hidden, qkv_out), lambda: attn.copy_(qkv_out[:, :q]),
                lambda: p_o.run(attn, o_out)]
            source = hidden if mlp_only else o_out
            return calls + [lambda: p_gu.run(source, act), lambda: p_d.run(act, hidden)]

        def unmerged_layer(c, mlp_only=False):
            (_, p_o, _, p_d), (p_q, p_k, p_v, p_g, p_u) = prepared[c]
            calls = [] if mlp_only else [
                lambda: p_q.run(hidden, q_out), lambda: p_k.run(hidden, k_out),
                lambda: p_v.run(hidden, v_out), lambda: attn.copy_(q_out),
                lambda: p_o.run(attn, o_out)]
            source = hidden if mlp_only else o_out
            return calls + [lambda: p_g.run(source, gate_out), lambda: p_u.run(source, up_out),
                            lambda: torch.mul(F.silu(gate_out), up_out, out=act),
                            lambda: p_d.run(act, hidden)]

        def cublas_layer(c, mlp_only=False):
            w_qkv, w_o, w_gu, w_d = weights[c]
            calls = [] if mlp_only else [
                lambda: torch.matmul(hidden, w_qkv.t(), out=qkv_out),
                lambda: attn.copy_(qkv_out[:, :q]),
                lambda: torch.matmul(attn, w_o.t(), out=o_out)]
            source = hidden if mlp_only else o_out
            return calls + [
                lambda: torch.matmul(source, w_gu.t(), out=gate_up),
                lambda: torch.mul(F.silu(gate_up[:, :inter]), gate_up[:, inter:], out=act),
                lambda: torch.matmul(act, w_d.t(), out=hidden)]

        start = hidden.clone()
        expected = _reference(start, weights[0], s)
        for label, layer in (("fused", fused_layer), ("unmerged", unmerged_layer),
                             ("cublas", cublas_layer)):
            hidden.copy_(start)
            act.fill_(float("nan"))
            for call in layer(0):
                call()
            torch.cuda.synchronize()
            err = ((hidden.double() - expected).norm() / expected.norm()).item()
            if not err < 2e-2 or torch.isnan(hidden).any():
                raise RuntimeError(f"{s.model} TP{tp} layer M={m} ({label}): relative error "
                                   f"{err:.3g} against float64")
        lists = [[call for c in range(copies) for call in layer(c, mlp_only)]
                 for mlp_only in (False, True)
                 for layer in (fused_layer, unmerged_layer, cublas_layer)]
        timed = timing.time_rounds(lists, rounds)
        # time_calls gives a median per call: a layer is its calls over the copies
        per_layer = [round(t.median_us * len(calls) / copies, 3)
                     for t, calls in zip(timed, lists)]
        row = LayerPathRow(s.model, tp, m, *per_layer)
        rows.append(row)
        progress(f"{s.model} TP{tp} M={m:>2}: layer fused {row.fused_us:8.2f}  unmerged "
                 f"{row.unmerged_us:8.2f}  cuBLAS {row.cublas_us:8.2f} us;  MLP fused "
                 f"{row.mlp_fused_us:8.2f}  unmerged {row.mlp_unmerged_us:8.2f}  cuBLAS "
                 f"{row.mlp_cublas_us:8.2f} us")
    return rows


def _reference(hidden, weights, s):  # pragma: no cover - needs a GPU
    """The layer in float64, each GEMM's output rounded to BF16 as stored."""
    import torch
    import torch.nn.functional as F

    def gemm(x, w):
        return (x @ w.double().t()).to(torch.bfloat16).double()
    w_qkv, w_o, w_gu, w_d = weights
    x = hidden.double()
    attn = gemm(x, w_qkv)[:, :s.q]
    o = gemm(attn, w_o)
    gate_up = o @ w_gu.double().t()
    act = (F.silu(gate_up[:, :s.inter]) * gate_up[:, s.inter:]).to(torch.bfloat16).double()
    return gemm(act, w_d)
