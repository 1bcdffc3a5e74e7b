"""Compiling the kernel: for a GPU (cached, thread-safe) and for a target arch on a CPU.

``compile_warp_splitk`` is what :class:`PreparedWarpSplitK` uses: one code per
(device, N, K, tactic, bias), dynamic M, PDL on. ``compile_for_arch`` builds
the same kernel against stand-in pointers for ``sm_90a`` or ``sm_100a`` without a
GPU and reports its PTX, CUBIN and resources; CI uses it to audit every
tactic family.
"""

from __future__ import annotations

import functools
import operator
import re
import tempfile
import threading
from dataclasses import dataclass, field

from ..contract import FP8_SCALE_KINDS, SUPPORTED_ARCHS, as_integer
from ..kernel import layout
from ..tactics import BULK, MAX_M, TMA, WarpSplitKTactic, check_tactic
from . import disk_cache
from .dsl import build
from .elf import read_resources
from .launch import Launcher

_lock = threading.Lock()


#: The scales an FP8-weight kernel takes (``contract.FP8_SCALE_KINDS``).
FP8_SCALES = FP8_SCALE_KINDS


def _checked(tactic, n, k, swiglu, fp8_scales=None):
    """``(n, k)`` as ints (cache and disk keys), once ``check_tactic`` takes
    them and ``fp8_scales`` is None or one of ``FP8_SCALES``."""
    if fp8_scales is not None and fp8_scales not in FP8_SCALES:
        raise ValueError(f"fp8_scales must be one of {FP8_SCALES} or None, got {fp8_scales!r}")
    check_tactic(tactic, n, k, swiglu=swiglu, fp8=fp8_scales is not None)
    if fp8_scales == "block128" and tactic.half_tiles:
        # a half tile's rows would need their own row blocks' scales
        raise ValueError(f"warp split-K: block scales take no mixed grid, got half_tiles "
                         f"{tactic.half_tiles}")
    return operator.index(n), operator.index(k)


@functools.cache
def _compile_cached(device_index, n, k, tactic, has_bias, use_pdl, swiglu=False,
                    fp8_scales=None):
    import torch

    arch = device_arch(device_index)
    stem = disk_cache.key(arch, n, k, tactic, has_bias, use_pdl, swiglu, fp8_scales)
    with torch.cuda.device(device_index):
        compiled = disk_cache.load(stem)
        if compiled is not None and not _initialises(compiled, device_index, stem):
            compiled = None
        if compiled is None:
            compiled = build(n, k, tactic, has_bias, use_pdl, arch, swiglu=swiglu,
                             fp8_scales=fp8_scales)
            disk_cache.store(stem, compiled)
        return compiled


def _initialises(compiled, device_index, stem) -> bool:
    """Whether a kernel loaded from the disk cache sets itself up on the
    device (its module init loads the embedded GPU code): a failure here is
    a failed load, the file is removed and the kernel compiled again, rather
    than an error out of the first ``run``."""
    try:
        compiled.to(device_index)
    except Exception as exc:
        disk_cache.discard(stem, f"the kernel loaded from {disk_cache.path_for(stem)} failed to "
                                 f"initialise ({type(exc).__name__}: {exc})")
        return False
    return True


def _device_index(device_index) -> int:
    """``device_index`` as an int naming a CUDA device torch sees, else
    ``ValueError`` (a CPU build of torch included)."""
    import torch  # the GPU path only: compile_for_arch needs no torch

    index = as_integer(device_index)
    if index is None:
        raise ValueError(f"device_index must be an int (a CUDA device), got {device_index!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"no CUDA GPU: torch {torch.__version__} sees none; compile_for_arch "
                         "compiles for an arch without one")
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device_index must be in 0..{torch.cuda.device_count() - 1}, "
                         f"got {index}")
    return index


def device_arch(device_index: int) -> str:
    """The arch the kernel is built for on a CUDA device: sm_90a or sm_100a."""
    import torch
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"sm_{major}{minor}a"
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"warp split-K runs on {SUPPORTED_ARCHS}, device {device_index} is {arch}")
    return arch


def compile_warp_splitk(device_index: int, n: int, k: int, tactic: WarpSplitKTactic, *,
                        has_bias: bool = False, use_pdl: bool = True, swiglu: bool = False,
                        fp8_scales: str | None = None):
    """Compiled code for an ``[n, k]`` weight on CUDA device ``device_index``.

    Dynamic M (1..32 rows of x and out); PDL on. Cached per argument tuple and
    safe to call from several threads (a shape is compiled once), and kept
    on disk for the next process (:mod:`warpsplitk.runtime.disk_cache`). The
    compiled callable takes ``(weight, x, bias, out, m, stream)``: four
    :func:`gmem_pointer` addresses of packed row-major BF16 tensors, M as an
    int, and a ``CUstream``; it launches on the stream without any check, so
    callers validate first (as :class:`PreparedWarpSplitK` does). With
    ``swiglu`` the ``[n, k]`` weight is ``[gate; up]`` and ``out`` is
    ``[M, n / 2]`` (the SwiGLU epilogue, :class:`~warpsplitk.kernel.warp_splitk.WarpSplitKKernel`).
    With ``fp8_scales`` (``FP8_SCALES``) the weight is e4m3 and the code takes
    ``(weight, x, bias, scale, out, m, stream)``, ``scale`` the FP32 scales
    (:class:`~warpsplitk.kernel.warp_splitk.WarpSplitKFp8Kernel`).
    """
    n, k = _checked(tactic, n, k, swiglu, fp8_scales)
    device_index = _device_index(device_index)
    with _lock:
        return _compile_cached(device_index, n, k, tactic, bool(has_bias), bool(use_pdl),
                               bool(swiglu), fp8_scales)


@functools.cache
def _launcher_cached(device_index, n, k, tactic, has_bias, use_pdl, swiglu, fp8_scales):
    compiled = _compile_cached(device_index, n, k, tactic, has_bias, use_pdl, swiglu, fp8_scales)
    return Launcher(compiled, device_index, pointers=4 if fp8_scales is None else 5)


def launcher(device_index: int, n: int, k: int, tactic: WarpSplitKTactic, *,
             has_bias: bool = False, use_pdl: bool = True, swiglu: bool = False,
             fp8_scales: str | None = None):
    """A :class:`~warpsplitk.runtime.launch.Launcher` of :func:`compile_warp_splitk`'s
    code on ``device_index``: called with plain addresses, M and a stream
    handle, at a few microseconds of host time. Cached like the code."""
    n, k = _checked(tactic, n, k, swiglu, fp8_scales)
    device_index = _device_index(device_index)
    with _lock:
        return _launcher_cached(device_index, n, k, tactic, bool(has_bias), bool(use_pdl),
                                bool(swiglu), fp8_scales)


# ------------------------------------------------------------ CPU path


@dataclass
class CompileReport:
    arch: str
    n: int
    k: int
    tactic: WarpSplitKTactic
    threads: int
    smem_bytes: int
    registers: int | None
    spill_bytes: int | None
    local_bytes: int | None
    ptx: str = field(repr=False)  # ~300 KB: print .summary() or write .ptx out
    cubin: bytes | None = field(repr=False)
    swiglu: bool = False
    #: the scales of an FP8-weight kernel ("tensor", "channel"), None for BF16
    fp8_scales: str | None = None

    def audit(self) -> list[str]:
        t = self.tactic
        tiles = self.k // t.k_tile
        # an uneven split traces one K loop of the longest share
        # (layout.one_loop_split), or one per rank, of its own length
        if t.one_loop_split(self.k, self.fp8_scales is not None):
            k_tiles = layout.k_share(0, tiles, t.k_split)[1]  # rank 0's, the longest
        elif tiles % t.k_split:
            k_tiles = tuple(layout.k_share(r, tiles, t.k_split)[1] for r in range(t.k_split))
        else:
            k_tiles = tiles // t.k_split
        ring_free = t.smem_plan_for(self.fp8_scales is not None).ring_free is not None
        return audit_ptx(self.ptx, k_tiles=k_tiles, k_split=t.k_split,
                         l2_prefetch=bool(t.l2_prefetch), bulk_x=t.x_copy == BULK,
                         tma_x=t.x_copy == TMA,
                         prefetch_bytes=self.prefetch_bytes, stages=t.stages,
                         swiglu=self.swiglu, ring_free=ring_free)

    @property
    def prefetch_bytes(self) -> int | None:
        """Bytes of each row the L2 prefetch asks for (None without one)."""
        t = self.tactic
        if not t.l2_prefetch:
            return None
        k_tiles = self.k // (t.k_tile * t.k_split)
        _, count = layout.l2_prefetch_span(k_tiles, t.stages, t.k_tile, t.l2_prefetch)
        return count * (layout.ELEMENT_BYTES if self.fp8_scales is None else layout.FP8_BYTES)

    def summary(self) -> str:
        t = self.tactic
        return (f"{self.arch} N={self.n} K={self.k} tactic=({t.short()}) threads={self.threads} "
                f"smem={self.smem_bytes} B registers={self.registers} "
                f"spills={self.spill_bytes} local={self.local_bytes}")


def compile_for_arch(n: int, k: int, tactic: WarpSplitKTactic, arch: str = "sm_90a", *,
                     has_bias: bool = False, use_pdl: bool = True,
                     swiglu: bool = False, fp8_scales: str | None = None) -> CompileReport:
    """Compile for ``arch`` with no GPU; returns PTX, CUBIN and the resource
    usage. ``fp8_scales`` (``FP8_SCALES``): the kernel for e4m3 weights."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    n, k = _checked(tactic, n, k, swiglu, fp8_scales)
    with _lock:
        # the DSL writes the kept PTX/CUBIN files too: keep them out of the cwd
        with tempfile.TemporaryDirectory(prefix="warpsplitk-") as dump:
            compiled = build(n, k, tactic, has_bias, use_pdl, arch,
                              options=f"--keep-ptx --keep-cubin --dump-dir={dump}", swiglu=swiglu,
                              fp8_scales=fp8_scales)
    ptx_text = compiled.artifacts.PTX
    if isinstance(ptx_text, bytes):
        ptx_text = ptx_text.decode()
    cubin = compiled.artifacts.CUBIN
    registers, spills, local = cubin_resources(cubin) if cubin else (None, None, None)
    smem = tactic.smem_plan_for(fp8_scales is not None).total
    return CompileReport(arch, n, k, tactic, tactic.threads, smem, registers, spills,
                         local, ptx_text, cubin, swiglu, fp8_scales)


def arch_resources(n: int, k: int, tactic, arch: str = "sm_90a", has_bias: bool = False,
                   use_pdl: bool = True, fp8_scales: str | None = None) -> dict:
    """Registers per thread, spilled and local bytes of the kernel for
    ``[n, k]`` with ``tactic`` (``fp8_scales``: the FP8-weight kernel),
    compiled for ``arch`` (no GPU needed): ``{"registers", "spill_bytes",
    "local_bytes"}``. From the disk cache when it has the record (the CuTe
    DSL is then not imported), else compiled with :func:`compile_for_arch`
    and stored."""
    stem = disk_cache.key(arch, n, k, tactic, has_bias, use_pdl, fp8_scales=fp8_scales)
    found = disk_cache.load_resources(stem)
    if found is not None:
        return found
    report = compile_for_arch(n, k, tactic, arch, has_bias=has_bias, use_pdl=use_pdl,
                              fp8_scales=fp8_scales)
    found = {"registers": report.registers, "spill_bytes": report.spill_bytes,
             "local_bytes": report.local_bytes}
    disk_cache.store_resources(stem, found, describe=(n, k, tactic, arch))
    return found


def cubin_resources(cubin: bytes):
    """(registers per thread, local frame bytes, stack bytes) of the kernel in ``cubin``.

    Read from the ELF: registers from the ``.nv.info.<kernel>`` attribute
    EIATTR_REGCOUNT, local memory from the ``.nv.local`` section size and
    the stack-size attributes (spills land there).
    """
    return read_resources(cubin)


#: The SwiGLU epilogue's math (regex, why): required with it, forbidden without.
PTX_AUDIT_SWIGLU = (
    (r"ex2\.approx\.ftz\.f32", "SwiGLU exp(-gate) by ex2"),
    (r"rcp\.approx\.ftz\.f32", "SwiGLU 1 / (1 + exp(-gate))"),
)

#: What the PTX of every tactic must contain (regex, why).
PTX_AUDIT = (
    (r"cp\.async\.cg\.shared\.global\.L2::cache_hint", "hinted weight copies"),
    (r"createpolicy\.fractional\.L2::evict_first", "run-time evict_first policy"),
    (r"ldmatrix\.sync\.aligned\.m8n8\.x4", "ldmatrix x4 fragment loads"),
    (r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", "BF16 tensor-core MMA"),
    (r"mbarrier\.try_wait\.parity", "ring waits"),
    (r"cp\.async\.mbarrier\.arrive\.noinc", "copy completion on the ring"),
    (r"griddepcontrol\.wait", "PDL wait before reading x"),
    (r"griddepcontrol\.launch_dependents", "PDL early launch of the next kernel"),
)
PTX_FORBIDDEN = (
    (r"\bld\.local|\bst\.local", "local memory (a register array indexed at run time)"),
    # no kernel shares activation stages across a cluster
    (r"\.multicast::cluster", "a copy multicast into a cluster"),
    # (the one remote arrival, a wide cluster's ring_free, releases:
    # PTX_AUDIT_RING_FREE)
    (r"mbarrier\.arrive\.shared::cluster\.b64", "an unordered arrival on another CTA's barrier"),
)


#: With one K tile the only weight tile is the pre-barrier prologue, which
#: is issued unhinted (see ptx.l2_policy_evict_first), so no policy is made.
HINT_PATTERNS = (PTX_AUDIT[0][0], PTX_AUDIT[1][0])


#: What a cluster split of K (k_split > 1) adds: the cluster barrier's
#: phase 0 and the mapping of the first CTA, and its hand-over of the
#: partials (PTX_AUDIT_SPLIT).
PTX_AUDIT_CLUSTER = (
    (r"barrier\.cluster\.arrive\.relaxed", "cluster barrier phase 0 (CTAs running)"),
    (r"barrier\.cluster\.wait\.acquire", "cluster barrier phase 0 waited on"),
    (r"mapa\.shared::cluster", "the first CTA's reduction buffer mapped"),
)
PTX_SPLIT_STORES = (r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes(\.v4)?\.f32",
                    "partials stored into the first CTA, completing its barrier")
PTX_AUDIT_SPLIT = (
    PTX_SPLIT_STORES,
    (r"mbarrier\.arrive\.expect_tx\.shared::cta", "the partials' bytes expected"),
    (r"mbarrier\.try_wait\.parity\.acquire\.cluster", "the first CTA waits for them"),
)
#: A cluster whose reduction buffer lies over the rings
#: (``layout.split_over_rings``): the first CTA's remote arrival
#: on each other CTA's ``ring_free`` barrier, which they wait for.
PTX_AUDIT_RING_FREE = (
    (r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64",
     "the first CTA frees the others' partials (its ring read)"),
)
#: No cluster barrier after the partials (only the first CTA of a K split
#: waits, on its mbarrier) and no plain remote stores.
PTX_FORBIDDEN_CLUSTER = (
    (r"barrier\.cluster\.arrive\.release", "a cluster barrier after the partials"),
    (r"st\.shared::cluster\.f32", "plain remote stores of partials"),
)


#: What bulk activation copies (bulk_x) add.
PTX_AUDIT_BULK_X = (
    (r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes \[",
     "activation rows by bulk copy"),
    (r"mbarrier\.arrive\.expect_tx\.shared::cta", "the stage's bytes expected on its full barrier"),
)


#: What TMA activation copies (tma_x) add.
PTX_AUDIT_TMA_X = (
    (r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global\.tile\.mbarrier::complete_tx::bytes",
     "activation boxes by TMA"),
    (r"prefetch\.tensormap", "the tensor map of x prefetched"),
    (r"mbarrier\.arrive\.expect_tx\.shared::cta", "the stage's bytes expected on its full barrier"),
)
#: Activation copies of 16 bytes with a source size (rows past M zero-filled).
PTX_X_ZFILL = (r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16, %r",
               "16-byte activation copies")


#: What the L2 prefetch (l2_prefetch) adds.
PTX_AUDIT_PREFETCH = (
    (r"cp\.async\.bulk\.prefetch\.L2\.global", "weight past the ring prefetched into L2"),
)


#: The L2 prefetch: its byte count is a register set from a constant
#: before it (the span is static, ``layout.l2_prefetch_span``).
PTX_PREFETCH = re.compile(r"cp\.async\.bulk\.prefetch\.L2\.global \[[^\]]+\], (%r\d+);")


def prefetch_sizes(ptx_text: str) -> list[int | None]:
    """The byte count of each L2 prefetch in ``ptx_text``: the constant last
    moved into its size register before it (None where none was)."""
    sizes = []
    for found in PTX_PREFETCH.finditer(ptx_text):
        register = re.escape(found.group(1))
        moves = re.findall(rf"mov\.b32\s+{register},\s*(\d+);", ptx_text[:found.start()])
        sizes.append(int(moves[-1]) if moves else None)
    return sizes


def audit_ptx(ptx_text: str, k_tiles: int | None = None, k_split: int = 1,
              l2_prefetch: bool = False, bulk_x: bool = False, tma_x: bool = False,
              prefetch_bytes: int | None = None, stages: int | None = None,
              swiglu: bool = False, ring_free: bool = False) -> list[str]:
    """Problems with a kernel's PTX: required instructions missing, forbidden ones
    present. ``k_tiles`` (per CTA) ``== 1`` waives the L2 hint (a one-tile
    weight has only the unhinted prologue copy); ``k_split > 1`` requires the
    cluster reduction, ``l2_prefetch`` the bulk L2 prefetch, ``bulk_x`` the
    bulk activation copies, ``tma_x`` TMA boxes of x; each is forbidden
    without its tactic. With
    ``prefetch_bytes``, every L2 prefetch must ask for that many bytes per
    row (the bound of ``prefetch_tiles``, or the whole remainder). With
    ``k_tiles`` and ``stages``, the release fences of an async activation
    ring (``release_fence_problems``) are checked tile by tile. ``swiglu``
    requires the SwiGLU epilogue's exponential and division, forbidden
    without it. ``ring_free`` (a split over the rings,
    ``layout.split_over_rings``) requires the first CTA's remote arrivals,
    forbidden without it."""
    required = _required_patterns(k_tiles, k_split, l2_prefetch, bulk_x, tma_x, swiglu,
                                  ring_free)
    problems = [f"missing {why} ({pattern})" for pattern, why in required
                if not re.search(pattern, ptx_text)]
    problems += [f"found {why} ({pattern})" for pattern, why in PTX_FORBIDDEN
                 if re.search(pattern, ptx_text)]
    problems += _features_absent(ptx_text, {p for p, _ in required}, k_split, l2_prefetch,
                                 bulk_x, tma_x, swiglu)
    problems += release_fence_problems(ptx_text, async_ring=bulk_x or tma_x,
                                       k_tiles=k_tiles, stages=stages)
    if l2_prefetch and prefetch_bytes is not None:
        sizes = prefetch_sizes(ptx_text)
        if set(sizes) != {prefetch_bytes}:
            problems.append(f"the L2 prefetch asks for {sizes} bytes per row, "
                            f"expected {prefetch_bytes}")
    return problems


def _required_patterns(k_tiles, k_split, l2_prefetch, bulk_x, tma_x, swiglu, ring_free):
    """``(pattern, why)`` the PTX must contain: the base audit and each feature's."""
    required = [(p, why) for p, why in PTX_AUDIT if not (k_tiles == 1 and p in HINT_PATTERNS)]
    for on, patterns in ((k_split > 1, PTX_AUDIT_CLUSTER + PTX_AUDIT_SPLIT),
                         (ring_free, PTX_AUDIT_RING_FREE),
                         (tma_x, PTX_AUDIT_TMA_X), (l2_prefetch, PTX_AUDIT_PREFETCH),
                         (bulk_x, PTX_AUDIT_BULK_X), (swiglu, PTX_AUDIT_SWIGLU)):
        if on:
            required += list(patterns)
    return required


def _features_absent(ptx_text, allowed, k_split, l2_prefetch, bulk_x, tma_x, swiglu):
    """Problems: a feature's instructions in a kernel whose tactic lacks it."""
    def found(patterns, without=""):
        return [f"found {why} ({pattern}){without}" for pattern, why in patterns
                if pattern not in allowed and re.search(pattern, ptx_text)]

    problems = []
    if k_split == 1:
        # (the split's expect_tx and cluster-scoped wait serve other features
        # too: only its st.async stores are its own)
        problems += found(PTX_AUDIT_CLUSTER + (PTX_SPLIT_STORES,), " without k_split")
    problems += found(PTX_AUDIT_RING_FREE, " without a split over the rings")
    problems += [f"found {why} ({pattern})"
                 for pattern, why in PTX_FORBIDDEN_CLUSTER if re.search(pattern, ptx_text)]
    if tma_x:  # the boxes replace every other way activations arrive
        problems += [f"found {why} ({pattern}) with tma_x"
                     for pattern, why in (PTX_AUDIT_BULK_X[0], PTX_X_ZFILL)
                     if re.search(pattern, ptx_text)]
    else:
        problems += found(PTX_AUDIT_TMA_X[:2], " without tma_x")
    if not bulk_x:
        problems += found(PTX_AUDIT_BULK_X, " without bulk_x")
    if not swiglu:
        problems += found(PTX_AUDIT_SWIGLU, " without swiglu")
    if not l2_prefetch:
        problems += found(PTX_AUDIT_PREFETCH, " without l2_prefetch")
    return problems


#: a compute thread's release of a ring stage (not a loader's expect_tx arrival)
_STAGE_RELEASE = re.compile(r"mbarrier\.arrive\.shared::cta\.b64\s+_,\s*\[")
_RELEASE_FENCE = "fence.proxy.async.shared::cta"
#: any cross-proxy fence (only the bidirectional shared::cta one belongs)
_ANY_RELEASE_FENCE = re.compile(r"fence\.proxy\.async[.:\w]*;")


def release_fence_problems(ptx_text: str, async_ring: bool, k_tiles: int | None = None,
                           stages: int | None = None) -> list[str]:
    """With an activation ring refilled by the async proxy (TMA or bulk
    copies), each release of a stage that a copy refills must follow a
    cross-proxy fence issued after the stage's last ldmatrix read (else the
    refill can land before the reads: kernel/warp_splitk.py, mma_mainloop). The K loop is
    unrolled, so the releases appear in K tile order (a mixed grid traces it
    twice); given ``k_tiles`` and ``stages``, the last ``stages`` tiles of
    each loop, never refilled, must come without a fence (it only costs).
    Without an async ring there must be no fence at all. ``k_tiles`` a
    tuple: one loop of each length in turn (an uneven split's ranks)."""
    if not async_ring:
        return ([f"found the release fence ({_RELEASE_FENCE}) with a cp.async activation ring"]
                if _ANY_RELEASE_FENCE.search(ptx_text) else [])
    # one group per K tile: its release after its reads, and whether a
    # fence came between
    groups, read, fenced = [], False, False
    for number, line in enumerate(ptx_text.splitlines(), 1):
        if "ldmatrix" in line:
            read, fenced = True, False
        elif _ANY_RELEASE_FENCE.search(line):
            fenced = True
        elif _STAGE_RELEASE.search(line) and read:
            groups.append((number, fenced))
            read = False
    if not groups:
        return ["no stage release found to check the release fence against"]
    if isinstance(k_tiles, tuple):
        if len(groups) != sum(k_tiles):
            return [f"{len(groups)} stage releases, not the {sum(k_tiles)} K tiles of the "
                    f"loops {k_tiles}"]
        if stages is None:
            return []
        return _fence_mismatches(groups, [layout.stage_refilled(i, stages, n)
                                          for n in k_tiles for i in range(n)])
    if k_tiles is not None and len(groups) % k_tiles:
        return [f"{len(groups)} stage releases, not a multiple of the {k_tiles} K tiles"]
    problems = []
    if k_tiles is None or stages is None:
        # the tiles a copy refills are unknown: each loop fenced, then not
        loop = k_tiles or len(groups)
        for start in range(0, len(groups), loop):
            fences = [fenced for _, fenced in groups[start:start + loop]]
            if fences != sorted(fences, reverse=True):
                problems.append(f"PTX line {groups[start][0]}: a fenced release after an "
                                "unfenced one in the same K loop")
        return problems
    wanted = [layout.stage_refilled(i % k_tiles, stages, k_tiles) for i in range(len(groups))]
    return problems + _fence_mismatches(groups, wanted)


def _fence_mismatches(groups, wanted) -> list[str]:
    """Each release (``(PTX line, fenced)``) against whether its stage is refilled."""
    problems = []
    for (number, fenced), want in zip(groups, wanted):
        if want and not fenced:
            problems.append(f"PTX line {number}: a stage released after ldmatrix reads "
                            f"with no {_RELEASE_FENCE} between them")
        elif fenced and not want:
            problems.append(f"PTX line {number}: a fence before releasing a stage no copy "
                            "refills (it only costs)")
    return problems


__all__ = ["compile_warp_splitk", "compile_for_arch", "arch_resources", "CompileReport", "audit_ptx", "MAX_M"]
