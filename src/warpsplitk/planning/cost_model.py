"""The cost model: a tactic's time on a weight, predicted from the tuner's measurements.

The kernel streams its weight from HBM once per call; what it costs on top
is set by how the grid lands on the SMs. The model writes a call's time as
a weighted sum of terms that each measure one such effect
(``FEATURES``, in the order of ``features``):

* ``fixed``: 1 (launch, the PDL wait, the epilogue);
* ``hbm_us``: the weight's bytes at ``BYTES_PER_US`` (the measured read
  bandwidth of the H200): the floor every tactic shares;
* ``busiest_sm_us``: the bytes (weight and activation rows) the busiest SM
  reads, at its fair share of that bandwidth: a grid of 201 CTAs on 132 SMs
  makes 69 SMs read twice what the others do;
* ``latency_us``: the busiest SM's bytes over the bytes (weight and
  activation rows) its rings hold in flight (stages x tile x resident
  CTAs), times one memory round trip (``LATENCY_US``): by Little's law,
  what a shallow ring caps it at;
* ``bound_us``: the largest of the three, the time the slowest side sets;
* ``l2_reads_us``: the bytes the grid reads through L2 (each token tile
  re-reads the weight tile; every CTA reads its activation rows);
* ``k_tile_steps``: K tiles a CTA computes, per wave; ``k_tile_slots``: K
  tiles one SM slot computes in turn (the unrolled loop's barrier round
  trips);
* ``waves``: grid CTAs over what the GPU holds at once, rounded up;
* ``idle_sm_hbm_us``: ``hbm_us`` when the grid leaves SMs idle;
* one flag per option (``early``, ``prefetch_all``, ``prefetch_bounded``,
  ``tma``, ``bulk``, ``k_split``, ``half_tiles``, ``narrow``,
  ``two_activation_warps``, ``k_tile_256``); ``prefetch_depth`` (K tiles
  of a bounded prefetch) and ``prefetch_latency_us`` (``latency_us`` with
  the prefetch, which hides some of it); ``tma_steps``, ``bulk_steps``,
  ``k_split_steps`` and ``narrow_steps`` (``k_tile_slots`` with the
  option: a cost per stage);
* ``activation_copies`` (16-byte copies per activation thread per stage,
  times the K tiles: issued after the dependency wait), ``token_tiles``,
  ``log_stages``;
* ``weight_rereads_us``: ``hbm_us`` for each token tile past the first.
  Every token tile streams the whole weight; the copies after the first
  hit L2 only when the CTAs sharing a weight tile run in step, and the
  weight is loaded evict-first (M = 32 in two 16-token tiles measured
  1.2-1.9x one 32-token tile on 2-50 MB weights).

One effect is a factor instead: a grid whose second wave is nearly empty
(:func:`sparse_tail_factor`).

The coefficients are package data (``data/cost-model-<gpu>.json``), fitted
by ``scripts/fit_cost_model.py`` to the calibration records in
``bench/results`` (never the benchmarks of the default) by least squares on the relative error (each cell's
measurements weighted alike), with a small ridge. The shapes of the
held-out models (``HELD_OUT_MODELS``, a fifth of the model table's shapes)
are never in the fit: they are what the model is judged on.

cuBLAS's time is a second linear model of the shape alone
(``CUBLAS_FEATURES``), fitted to the cuBLAS timings of the same records.
The model's file also holds the measured option pairs
(:func:`warpsplitk.planning.measured_options.pairs`) the default's options
are read off. What the default does with all this:
:mod:`warpsplitk.planning.choose`.

Pure Python (no numpy): importable and usable where the package is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib import resources

from ..jsonfile import loads
from ..kernel import layout
from ..tactics import (
    BULK,
    CP_ASYNC,
    DEFAULT_SM_COUNT,
    PREFETCH_ALL,
    TMA,
    WarpSplitKTactic,
    ctas_per_sm,
    grid_ctas,
)
from . import measured_options

#: The H200's measured HBM read bandwidth, in bytes per microsecond: the
#: unit of the bandwidth terms (the fit scales them).
BYTES_PER_US = 4.4e6

FEATURES = (
    "fixed", "hbm_us", "busiest_sm_us", "latency_us", "bound_us", "l2_reads_us",
    "k_tile_steps", "k_tile_slots", "waves", "idle_sm_hbm_us",
    "early", "prefetch_all", "prefetch_bounded", "prefetch_depth", "prefetch_latency_us",
    "tma", "tma_steps", "bulk", "bulk_steps", "k_split", "k_split_steps",
    "half_tiles", "narrow", "narrow_steps", "two_activation_warps", "activation_copies",
    "k_tile_256", "token_tiles", "log_stages", "weight_rereads_us",
)

CUBLAS_FEATURES = ("fixed", "hbm_us", "m_hbm_us", "activation_us", "flops_us", "small_n")

#: Models whose shapes (every TP degree) never enter the fit: the held-out set.
HELD_OUT_MODELS = ("gemma-2-27b", "gemma-3-12b", "llama-3.2-3b", "qwen3-4b")

#: One memory round trip as the rings see it, in microseconds (the unit of
#: the latency term; the fit scales it).
LATENCY_US = 1.0

#: The cost model shipped for these GPUs (their name as torch reports it,
#: lower case, contains the key).
MODEL_FILES = {"h200": "cost-model-h200.json"}
DEFAULT_MODEL = "h200"
MODEL_FORMAT = "warpsplitk-cost-model"


def features(tactic: WarpSplitKTactic, m: int, n: int, k: int,
             sm_count: int = DEFAULT_SM_COUNT) -> tuple[float, ...]:
    """The terms of ``FEATURES`` for ``tactic`` on an ``[n, k]`` weight at
    M = ``m`` (the tactic is assumed legal)."""
    t = tactic
    weight_bytes = n * k * layout.ELEMENT_BYTES
    full, half = layout.row_tiles(n, t.output_tile, t.half_tiles)
    row_ctas = full + half
    token_tiles = -(-m // t.token_tile)
    grid = row_ctas * token_tiles * t.k_split
    resident = max(1, ctas_per_sm(t))
    busiest = -(-grid // sm_count)
    waves = -(-grid // (sm_count * resident))
    k_cta = k // t.k_split
    rows = n / row_ctas
    tokens = min(m, t.token_tile)
    busiest_bytes = busiest * (rows + tokens) * k_cta * layout.ELEMENT_BYTES
    in_flight = (min(busiest, resident) * t.stages * (rows + tokens) * t.k_tile
                 * layout.ELEMENT_BYTES)
    k_tiles = k_cta / t.k_tile
    hbm = weight_bytes / BYTES_PER_US
    busiest_sm = busiest_bytes / (BYTES_PER_US / sm_count)
    l2_reads = (token_tiles * weight_bytes
                + m * k * layout.ELEMENT_BYTES * row_ctas) / BYTES_PER_US
    narrow = t.token_tile < layout.MMA_N
    copies = 0.0 if t.x_copy != CP_ASYNC else (
        t.token_tile * t.k_tile / layout.CHUNK / (layout.WARP * t.b_loader_warps))
    prefetch_all = t.l2_prefetch == PREFETCH_ALL
    prefetch_tiles = max(t.l2_prefetch, 0)  # of a bounded prefetch
    tma, bulk = t.x_copy == TMA, t.x_copy == BULK
    steps = k_tiles * busiest / min(busiest, resident)  # K tiles an SM slot computes in turn
    # Little's law: an SM whose rings hold in_flight bytes gets in_flight per
    # memory round trip (LATENCY_US), however much bandwidth is left
    latency = busiest_bytes / in_flight * LATENCY_US
    return (
        1.0, hbm, busiest_sm, latency, max(hbm, busiest_sm, latency), l2_reads,
        k_tiles * waves, steps, float(waves), hbm if grid < sm_count else 0.0,
        float(t.early_launch), float(prefetch_all), float(prefetch_tiles > 0),
        float(prefetch_tiles), latency * (t.l2_prefetch != 0),
        float(tma), steps * tma, float(bulk), steps * bulk,
        float(t.k_split > 1), steps * (t.k_split > 1), float(t.half_tiles > 0), float(narrow),
        steps * narrow, float(t.b_loader_warps == 2), copies * k_tiles,
        float(t.k_tile == 256), float(token_tiles), math.log(t.stages),
        (token_tiles - 1) * hbm,
    )


#: A grid of one CTA per SM that spills past the SMs by under
#: ``SPARSE_TAIL_FILL`` of them, at M >= ``SPARSE_TAIL_MIN_M``, measures
#: ``SPARSE_TAIL_FACTOR`` times the linear terms' prediction: the few CTAs of
#: the second wave stream their tiles with the GPU's bandwidth mostly idle,
#: while ``busiest_sm_us`` counts them as if the whole wave streamed (the
#: calibration records' 5 such timings: a median 1.12 of the linear
#: prediction; the same spill with more CTAs per SM: 1.04). It multiplies
#: the linear prediction, a correction of the fit's residual there. Below
#: M = 16 the records show no such gap (the tile's math is short beside its
#: stream).
SPARSE_TAIL_FACTOR = 1.12
SPARSE_TAIL_FILL = 0.25
SPARSE_TAIL_MIN_M = 16


def sparse_tail_factor(tactic: WarpSplitKTactic, m: int, n: int,
                       sm_count: int = DEFAULT_SM_COUNT) -> float:
    """``SPARSE_TAIL_FACTOR`` where ``tactic``'s grid on M = ``m`` rows of
    an N = ``n`` weight ends in a sparse second wave, else 1."""
    if m < SPARSE_TAIL_MIN_M or ctas_per_sm(tactic) > 1:
        return 1.0
    tail = grid_ctas(tactic, m, n) - sm_count
    return SPARSE_TAIL_FACTOR if 0 < tail < SPARSE_TAIL_FILL * sm_count else 1.0


def cublas_features(m: int, n: int, k: int) -> tuple[float, ...]:
    """The terms of ``CUBLAS_FEATURES`` for ``torch.matmul`` of ``[m, k]``
    by an ``[n, k]`` weight: a fixed cost, the weight's stream (also scaled
    by M, cuBLAS's tiles re-reading it), the activations, the math at the
    mma rate of one SM per 8 x 16 output block, and 1 for N below 1024."""
    hbm = n * k * layout.ELEMENT_BYTES / BYTES_PER_US
    return (1.0, hbm, hbm * m / 32, m * k * layout.ELEMENT_BYTES / BYTES_PER_US,
            2.0 * m * n * k / 1e9, float(n < 1024))


@dataclass(frozen=True)
class CostModel:
    """Fitted coefficients of ``FEATURES`` and ``CUBLAS_FEATURES``, and the
    measured option pairs (``measured_options.pairs``) the options are read off."""

    coefficients: tuple[float, ...]
    cublas_coefficients: tuple[float, ...]
    option_pairs: dict = field(default_factory=dict, compare=False, hash=False)
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def predict_us(self, tactic: WarpSplitKTactic, m: int, n: int, k: int,
                   sm_count: int = DEFAULT_SM_COUNT) -> float:
        """Predicted time of one call of ``tactic`` (independent calls, PDL on)."""
        return (_dot(self.coefficients, features(tactic, m, n, k, sm_count))
                * sparse_tail_factor(tactic, m, n, sm_count))

    def predict_cublas_us(self, m: int, n: int, k: int) -> float:
        """Predicted time of one ``torch.matmul`` (cuBLAS) call."""
        return _dot(self.cublas_coefficients, cublas_features(m, n, k))

    def to_json(self) -> dict:
        return {"format": MODEL_FORMAT, "version": 2, "meta": self.meta,
                "features": dict(zip(FEATURES, self.coefficients)),
                "cublas_features": dict(zip(CUBLAS_FEATURES, self.cublas_coefficients)),
                "option_pairs": self.option_pairs}

    @classmethod
    def from_json(cls, data, source="cost model") -> "CostModel":
        if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
            raise ValueError(f"{source}: not a warpsplitk cost model (format must be "
                             f"{MODEL_FORMAT!r})")
        try:
            coefficients = tuple(float(data["features"][name]) for name in FEATURES)
            cublas = tuple(float(data["cublas_features"][name]) for name in CUBLAS_FEATURES)
            width = len(measured_options.describe(WarpSplitKTactic(32, 8, 256, 2, 1), 8,
                                                  1024, 1024)) + 1
            option_pairs = {name: [[float(x) for x in row] for row in rows]
                            for name, rows in data["option_pairs"].items()}
            if any(name not in measured_options.TWINS or any(len(row) != width for row in rows)
                   for name, rows in option_pairs.items()):
                raise ValueError("option_pairs: unknown option or row length")
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source}: needs a number for every feature and option pair of "
                             f"this version ({error!r})") from None
        return cls(coefficients, cublas, option_pairs, dict(data.get("meta", {})))


def _dot(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b))


@functools.cache
def shipped_model(name: str = DEFAULT_MODEL) -> CostModel:
    """The cost model shipped in the package for GPU ``name``."""
    if name not in MODEL_FILES:
        raise ValueError(f"no cost model {name!r}: shipped are {sorted(MODEL_FILES)}")
    file = resources.files("warpsplitk").joinpath("data", MODEL_FILES[name])
    text = file.read_text(encoding="utf-8")
    where = f"cost model {name!r}"
    return CostModel.from_json(loads(text, where), where)


# --------------------------------------------------------------------- fit


def solve_least_squares(rows, targets, weights, ridge=0.0) -> list[float]:
    """``argmin_c sum_i w_i^2 (rows_i . c - t_i)^2 + ridge |c|^2`` by the
    normal equations and Gaussian elimination with partial pivoting."""
    size = len(rows[0])
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    for row, target, weight in zip(rows, targets, weights):
        w2 = weight * weight
        for i, a in enumerate(row):
            if a:
                wa = w2 * a
                rhs[i] += wa * target
                gram_i = gram[i]
                for j in range(size):
                    gram_i[j] += wa * row[j]
    for i in range(size):
        gram[i][i] += ridge
    # augmented elimination
    matrix = [gram[i] + [rhs[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) < 1e-300:
            raise ValueError(f"least squares: feature {col} has no data (singular system)")
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        lead = matrix[col][col]
        for r in range(col + 1, size):
            factor = matrix[r][col] / lead
            if factor:
                row_r, row_c = matrix[r], matrix[col]
                for j in range(col, size + 1):
                    row_r[j] -= factor * row_c[j]
    solution = [0.0] * size
    for i in reversed(range(size)):
        total = matrix[i][size] - sum(matrix[i][j] * solution[j] for j in range(i + 1, size))
        solution[i] = total / matrix[i][i]
    return solution


#: Ridge of the fits, in units of the normalised (relative) system.
RIDGE = 1e-3


def fit(cells, cublas, sm_count: int = DEFAULT_SM_COUNT, meta=None) -> CostModel:
    """A model fitted to ``cells`` (``{(n, k, m): {tactic: us}}``) and
    ``cublas`` (``{(n, k, m): us}``): least squares on the relative error,
    each cell's measurements sharing one cell's weight."""
    rows, targets, weights = [], [], []
    for (n, k, m), timings in sorted(cells.items()):
        share = 1.0 / math.sqrt(len(timings))
        for tactic, us in sorted(timings.items()):
            rows.append(features(tactic, m, n, k, sm_count))
            targets.append(us)
            weights.append(share / us)
    if not rows:
        raise ValueError("cost model fit: no tactic timings")
    coefficients = solve_least_squares(rows, targets, weights, RIDGE)
    cells_c = sorted(cublas.items())
    if not cells_c:
        raise ValueError("cost model fit: no cuBLAS timings")
    cublas_coefficients = solve_least_squares(
        [cublas_features(m, n, k) for (n, k, m), _ in cells_c], [us for _, us in cells_c],
        [1.0 / us for _, us in cells_c], RIDGE)
    return CostModel(tuple(_round(c) for c in coefficients),
                     tuple(_round(c) for c in cublas_coefficients),
                     measured_options.pairs(cells, sm_count), dict(meta or {}))


def _round(value: float) -> float:
    return float(f"{value:.6g}")
