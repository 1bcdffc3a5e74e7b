"""The one timing method, shared by the benchmark and the tuner.

Calls run back to back inside one CUDA graph, each on its own copy of the
weight; the copies together are at least ``L2_MULTIPLE`` times the L2, so
every call streams its weight from HBM as it would in a model (where the
other layers' weights have pushed it out). The graph is replayed several
times, each replay timed by CUDA events; the result is the median per-call
time and the spread of the replays. The benchmark times each configuration
in ``ROUNDS`` graphs, alternating, and reports the median graph
(``time_rounds``); the tuner times each candidate in one graph and ranks
its fastest by the median of ``ROUNDS`` (its confirmations).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from ..contract import fp8_scale_shape

L2_MULTIPLE = 3
MIN_COPIES = 2
REPLAYS = 7
#: enough calls per graph that launch gaps and event resolution vanish
MIN_CALLS = 64


@dataclass
class Timing:
    median_us: float
    min_us: float
    max_us: float
    calls: int

    @property
    def spread(self) -> float:
        return (self.max_us - self.min_us) / self.median_us if self.median_us else 0.0


#: Each configuration of a benchmark cell is timed in this many graphs,
#: alternating with the others, and the median graph counts: on the
#: smallest kernels one graph's time can sit in one of two states ~20%
#: apart (3072x128 M=1, late trigger: 1.24 us in a process's first graph of
#: it, 1.48 in every later one, at constant clocks), and a single graph
#: would let that decide the plan-vs-default verdict.
ROUNDS = 3


def combine(timings: list[Timing]) -> Timing:
    """One timing of several graphs of the same calls: the median of their
    medians, the spread of all their replays."""
    return Timing(statistics.median(t.median_us for t in timings),
                  min(t.min_us for t in timings), max(t.max_us for t in timings),
                  sum(t.calls for t in timings))


def require_cuda(what: str) -> None:
    """``ValueError`` unless torch sees a CUDA GPU for ``what`` to measure on."""
    import torch
    if not torch.cuda.is_available():
        raise ValueError(f"{what} measures on a CUDA GPU, and torch sees none")


def resolve_rounds(rounds: int | None) -> int:
    """``rounds`` (``None``: ``ROUNDS``): an integer of at least 1."""
    rounds = ROUNDS if rounds is None else rounds
    if type(rounds) is not int or rounds < 1:
        raise ValueError(f"rounds must be an integer of at least 1, got {rounds!r}")
    return rounds


def time_rounds(call_lists, rounds: int | None = None, after_first=None) -> list[Timing]:
    """Each list of calls (one configuration) timed in ``rounds`` graphs,
    the configurations alternating round by round; per configuration the
    median graph (``combine``). ``after_first()`` runs right after the first
    configuration's first graph, before another configuration's calls
    overwrite what it wrote (its correctness check)."""
    rounds = resolve_rounds(rounds)
    graphs = [[] for _ in call_lists]
    for round_ in range(rounds):
        for index, calls in enumerate(call_lists):
            graphs[index].append(time_calls(calls))
            if after_first is not None and round_ == 0 and index == 0:
                after_first()
    return [combine(timings) for timings in graphs]


def l2_bytes(device=None) -> int:
    import torch
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20))


def copies_for(weight_bytes: int, device=None) -> int:
    """Weight copies that total at least ``L2_MULTIPLE`` x L2."""
    return max(MIN_COPIES, math.ceil(L2_MULTIPLE * l2_bytes(device) / max(1, weight_bytes)))


def random_weights(n, k, copies, device, seed=0):
    """``copies`` independent random BF16 ``[n, k]`` weights (never zeros)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]


def random_fp8(n, k, copies, seed=0, scales="channel"):
    """``copies`` random e4m3 ``[n, k]`` weights (every finite code but the
    largest magnitudes likely, never NaN) and FP32 scales of that kind."""
    import torch
    shape = fp8_scale_shape(scales, n, k)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights, scale_list = [], []
    for _ in range(copies):
        w = (torch.randn(n, k, device="cuda", generator=gen) * 64).clamp_(-448, 448)
        weights.append(w.to(torch.float8_e4m3fn))
        scale_list.append(torch.rand(shape, device="cuda", generator=gen) * 2e-3 + 1e-3)
    return weights, scale_list


def time_calls(calls, replays: int = REPLAYS, warmup: int = 2) -> Timing:
    """Median per-call time of ``calls`` (zero-argument callables, one kernel
    each, all on the current stream) captured back to back in one graph."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm: module load, lazy init, first-touch
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    reps = max(1, math.ceil(MIN_CALLS / len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for call in calls:
                call()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    del graph
    return Timing(statistics.median(per_call), min(per_call), max(per_call), reps * len(calls))


#: Datasheet peak HBM bandwidth in TB/s, by ``torch.cuda.get_device_name()``.
DATASHEET_TBPS = {"NVIDIA H200": 4.8, "NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H100 PCIe": 2.0,
                  "NVIDIA B200": 8.0, "NVIDIA GB200": 8.0}
#: The datasheet peak assumed for a GPU not in DATASHEET_TBPS (the H200's).
DEFAULT_DATASHEET_TBPS = 4.8


def datasheet_tbps(gpu: str) -> float:
    """``gpu``'s (its device name) datasheet HBM bandwidth, TB/s: the floors' unit."""
    return DATASHEET_TBPS.get(gpu, DEFAULT_DATASHEET_TBPS)


#: No HBM beats its datasheet peak by this much (H200: 6.0 TB/s); a call
#: timed faster than its weight bytes at that rate did not read its weight.
PLAUSIBLE_MARGIN = 1.25
#: The limit on a GPU not in DATASHEET_TBPS: above any HBM shipped (B200: 8 TB/s).
UNKNOWN_GPU_MAX_TBPS = 10.0


def max_plausible_tbps(gpu: str) -> float:
    """The fastest weight read believed on ``gpu`` (its device name), TB/s."""
    if not isinstance(gpu, str):
        raise ValueError(f"gpu must be a device name (torch.cuda.get_device_name()), got {gpu!r}")
    sheet = DATASHEET_TBPS.get(gpu)
    return UNKNOWN_GPU_MAX_TBPS if sheet is None else sheet * PLAUSIBLE_MARGIN


def physical_floor_us(weight_bytes: int, gpu: str) -> float:
    """Microseconds under which a read of ``weight_bytes`` on ``gpu`` is a broken measurement."""
    return weight_bytes / (max_plausible_tbps(gpu) * 1e12) * 1e6


def record_name(gpu: str) -> str:
    """``NVIDIA H200`` -> ``h200``: the GPU model that names its records in bench/results."""
    words = str(gpu).split()
    if words[:1] and words[0].upper() == "NVIDIA":
        words = words[1:]
    return re.sub(r"[^a-z0-9]+", "-", words[0].lower() if words else "").strip("-") or "gpu"


def measured_read_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a large read-only pass (a sum over ``gib`` GiB)."""
    import torch
    n = int(gib * 2**30) // 4
    data = torch.rand(n, device="cuda", dtype=torch.float32)
    out = torch.empty((), device="cuda", dtype=torch.float32)
    timing = time_calls([lambda: torch.sum(data, dim=0, out=out)], replays=5)
    return n * 4 / (timing.median_us * 1e-6)
