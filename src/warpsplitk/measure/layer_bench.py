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

from .. import models
from ..planning.plans import DecodePlan, precompile_for, prepare
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
    rounds = timing.resolve_rounds(rounds)
    plan = plan if plan is not None else DecodePlan()
    s = layer_shape(name, tp)
    timing.require_cuda("bench_layer_path")
    shapes = [(s.qkv, s.hidden), (s.hidden, s.q), (2 * s.inter, s.hidden), (s.hidden, s.inter)]
    copies = timing.copies_for(2 * sum(n * k for n, k in shapes))
    weights = [[w.mul_(w.shape[1] ** -0.5) for w in
                (timing.random_weights(n, k, 1, "cuda", seed=100 * c + i)[0]
                 for i, (n, k) in enumerate(shapes))] for c in range(copies)]
    ms = tuple(ms)
    _precompile_path(weights[0], s, plan, ms, progress)
    progress(f"{s.model} TP{tp}: preparing {copies} copies of the layer's weights")
    prepared = [_prepare_path(layer, s, plan, ms) for layer in weights]
    return [_path_row(_LayerPath(s, m, weights, prepared), rounds, progress) for m in ms]


def _precompile_path(layer, s, plan, ms, progress):  # pragma: no cover - needs a GPU
    """Every kernel of the path compiled first, in parallel worker processes."""
    w_qkv, w_o, w_gu, w_d = layer
    parts = [w_qkv[:s.q], w_qkv[s.q:s.q + s.kv], w_gu[:s.inter]]
    precompile_for([w_qkv, w_o, w_d, *parts], plan, ms, progress=progress)
    precompile_for([w_gu], plan, ms, progress=progress, swiglu=True)


def _prepare_path(layer, s, plan, ms):  # pragma: no cover - needs a GPU
    """One copy of the layer's weights prepared both ways: ``fused`` (q/k/v
    merged; gate/up merged with the SwiGLU epilogue) and ``unmerged`` (q, k,
    v, gate and up apart)."""
    w_qkv, w_o, w_gu, w_d = layer
    q, kv, inter = s.q, s.kv, s.inter
    fused = [prepare(w_qkv, plan, ms), prepare(w_o, plan, ms),
             prepare(w_gu, plan, ms, swiglu=True), prepare(w_d, plan, ms)]
    parts = [w_qkv[:q], w_qkv[q:q + kv], w_qkv[q + kv:], w_gu[:inter], w_gu[inter:]]
    unmerged = [prepare(w, plan, ms) for w in parts]
    return fused, unmerged


class _LayerPath:  # pragma: no cover - needs a GPU
    """One M's activations of the layer path, and its three ways as lists of
    calls on one copy of the weights (``c``), the whole layer or its MLP
    block alone (``mlp_only``): each reads ``hidden`` and writes it last."""

    def __init__(self, s, m, weights, prepared):
        import torch  # torch loads only when measuring
        self.s, self.m, self.weights, self.prepared = s, m, weights, prepared

        def empty(columns):
            return torch.empty(m, columns, device="cuda", dtype=torch.bfloat16)
        self.hidden = torch.randn(m, s.hidden, device="cuda", dtype=torch.bfloat16)
        self.qkv_out, self.attn, self.o_out = empty(s.qkv), empty(s.q), empty(s.hidden)
        self.q_out, self.k_out, self.v_out = empty(s.q), empty(s.kv), empty(s.kv)
        self.act, self.gate_out, self.up_out = empty(s.inter), empty(s.inter), empty(s.inter)
        self.gate_up = empty(2 * s.inter)

    def fused(self, c, mlp_only=False):
        (p_qkv, p_o, p_gu, p_d), _ = self.prepared[c]
        hidden, qkv_out, attn, o_out, act = (self.hidden, self.qkv_out, self.attn, self.o_out,
                                             self.act)
        q = self.s.q
        calls = [] if mlp_only else [
            lambda: p_qkv.run(hidden, qkv_out), lambda: attn.copy_(qkv_out[:, :q]),
            lambda: p_o.run(attn, o_out)]
        source = hidden if mlp_only else o_out
        return calls + [lambda: p_gu.run(source, act), lambda: p_d.run(act, hidden)]

    def unmerged(self, c, mlp_only=False):
        import torch  # torch loads only when measuring
        import torch.nn.functional as F
        (_, p_o, _, p_d), (p_q, p_k, p_v, p_g, p_u) = self.prepared[c]
        hidden, attn, o_out, act = self.hidden, self.attn, self.o_out, self.act
        q_out, k_out, v_out, gate_out, up_out = (self.q_out, self.k_out, self.v_out,
                                                 self.gate_out, self.up_out)
        calls = [] if mlp_only else [
            lambda: p_q.run(hidden, q_out), lambda: p_k.run(hidden, k_out),
            lambda: p_v.run(hidden, v_out), lambda: attn.copy_(q_out),
            lambda: p_o.run(attn, o_out)]
        source = hidden if mlp_only else o_out
        return calls + [lambda: p_g.run(source, gate_out), lambda: p_u.run(source, up_out),
                        lambda: torch.mul(F.silu(gate_out), up_out, out=act),
                        lambda: p_d.run(act, hidden)]

    def cublas(self, c, mlp_only=False):
        import torch  # torch loads only when measuring
        import torch.nn.functional as F
        w_qkv, w_o, w_gu, w_d = self.weights[c]
        hidden, qkv_out, attn, o_out, act = (self.hidden, self.qkv_out, self.attn, self.o_out,
                                             self.act)
        gate_up, q, inter = self.gate_up, self.s.q, self.s.inter
        calls = [] if mlp_only else [
            lambda: torch.matmul(hidden, w_qkv.t(), out=qkv_out),
            lambda: attn.copy_(qkv_out[:, :q]),
            lambda: torch.matmul(attn, w_o.t(), out=o_out)]
        source = hidden if mlp_only else o_out
        return calls + [
            lambda: torch.matmul(source, w_gu.t(), out=gate_up),
            lambda: torch.mul(F.silu(gate_up[:, :inter]), gate_up[:, inter:], out=act),
            lambda: torch.matmul(act, w_d.t(), out=hidden)]

    def ways(self):
        return (("fused", self.fused), ("unmerged", self.unmerged), ("cublas", self.cublas))


def _path_row(path, rounds, progress) -> LayerPathRow:  # pragma: no cover - needs a GPU
    """The row at ``path.m``: each way checked, then the six lists timed (the
    three ways, the layer then its MLP block), each over every copy."""
    _check_path(path)
    s, m, copies = path.s, path.m, len(path.weights)
    lists = [[call for c in range(copies) for call in way(c, mlp_only)]
             for mlp_only in (False, True) for _, way in path.ways()]
    timed = timing.time_rounds(lists, rounds)
    # time_calls gives a median per call: a layer is its calls over the copies
    per_layer = [round(t.median_us * len(calls) / copies, 3)
                 for t, calls in zip(timed, lists)]
    row = LayerPathRow(s.model, s.tp, m, *per_layer)
    progress(f"{s.model} TP{s.tp} M={m:>2}: layer fused {row.fused_us:8.2f}  unmerged "
             f"{row.unmerged_us:8.2f}  cuBLAS {row.cublas_us:8.2f} us;  MLP fused "
             f"{row.mlp_fused_us:8.2f}  unmerged {row.mlp_unmerged_us:8.2f}  cuBLAS "
             f"{row.mlp_cublas_us:8.2f} us")
    return row


def _check_path(path):  # pragma: no cover - needs a GPU
    """Each way's layer on the first copy, from the same input with the
    activation NaN-poisoned, against float64 (relative error < 2e-2)."""
    import torch  # torch loads only when measuring
    s, hidden = path.s, path.hidden
    start = hidden.clone()
    expected = _reference(start, path.weights[0], s)
    for label, layer in path.ways():
        hidden.copy_(start)
        path.act.fill_(float("nan"))
        for call in layer(0):
            call()
        torch.cuda.synchronize()
        err = ((hidden.double() - expected).norm() / expected.norm()).item()
        if not err < 2e-2 or torch.isnan(hidden).any():
            raise RuntimeError(f"{s.model} TP{s.tp} layer M={path.m} ({label}): relative error "
                               f"{err:.3g} against float64")


def _reference(hidden, weights, s):  # pragma: no cover - needs a GPU
    """The layer in float64, each GEMM's output rounded to BF16 as stored."""
    import torch  # torch loads only when measuring
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
