"""Validation in prepared.py that needs no GPU: the pure helpers and the order of checks.

``_check_packed``, ``_span`` and ``_overlap`` are exercised directly on CPU
tensors (``device=cpu``; the meta device stands in for "another device").
``run``'s checks are reached on an instance made without ``__init__`` whose
device is the CPU and whose compiled code only records its calls (the CuTe
views are stubbed: importing the DSL here would fix the process's compile
arch), so every refusal can also assert that nothing was launched. Cases
already in tests/test_prepared_cpu.py are not repeated.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import warpsplitk.runtime.prepared as prepared_module  # noqa: E402
from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic  # noqa: E402
from warpsplitk.contract import ALIGN_BYTES  # noqa: E402
from warpsplitk.runtime.prepared import _check_packed, _overlap, _span  # noqa: E402

CPU = torch.device("cpu")
BF16 = torch.bfloat16
TACTIC = WarpSplitKTactic(16, 8, 128, 2, 1)


def aligned(*shape, dtype=BF16, fill=0.0):
    """A fresh packed CPU tensor whose address is on a 32-byte boundary."""
    t = torch.full(shape, fill, dtype=dtype)
    assert t.data_ptr() % ALIGN_BYTES == 0
    return t


def shifted(shape, elements, dtype=BF16):
    """A packed tensor of ``shape`` starting ``elements`` elements past a 32-byte
    boundary, cut from a larger aligned buffer."""
    numel = 1
    for s in shape:
        numel *= s
    buffer = aligned(numel + 64, dtype=dtype)
    t = buffer[elements:elements + numel].view(*shape)
    assert tuple(t.shape) == tuple(shape) and t.is_contiguous()
    assert t.data_ptr() % ALIGN_BYTES == elements * t.element_size() % ALIGN_BYTES
    return t


# ------------------------------------------------------------------ _span


def test_span_is_the_byte_range_of_the_elements():
    buffer = aligned(100)
    base = buffer.data_ptr()
    assert _span(buffer) == (base, base + 200)
    assert _span(buffer[10:30]) == (base + 20, base + 60)
    wide = aligned(10, dtype=torch.float32)
    assert _span(wide) == (wide.data_ptr(), wide.data_ptr() + 40)


def test_span_of_a_single_strided_row_is_that_row():
    """A one-row view of a wider matrix (what _check_packed lets through for
    M = 1) spans exactly its own K elements."""
    matrix = aligned(4, 512)
    row = matrix[2:3, :256]
    start = matrix.data_ptr() + 2 * 512 * 2
    assert _span(row) == (start, start + 256 * 2)


# --------------------------------------------------------------- _overlap

_BUF = 256


@pytest.mark.parametrize("a,b,expected", [
    (slice(0, 64), slice(0, 64), True),        # the same elements
    (slice(0, 64), slice(32, 96), True),       # partial overlap
    (slice(0, 64), slice(63, 128), True),      # one shared element
    (slice(0, 256), slice(100, 110), True),    # one inside the other
    (slice(0, 64), slice(64, 128), False),     # adjacent: b starts where a ends
    (slice(0, 64), slice(128, 192), False),    # a gap between them
])
def test_overlap_of_slices_of_one_buffer(a, b, expected):
    buffer = aligned(_BUF)
    x, y = buffer[a], buffer[b]
    assert _overlap(x, y) is expected
    assert _overlap(y, x) is expected  # symmetric


def test_separate_tensors_do_not_overlap():
    a, b = aligned(8, 256), aligned(8, 256)
    assert not _overlap(a, b)
    assert _overlap(a, a)


def test_overlap_is_by_address_not_by_tensor_or_dtype():
    buffer = aligned(8, 256)
    # another tensor object, another dtype, another shape: the same bytes
    assert _overlap(buffer, buffer.view(torch.int16).view(256, 8))
    assert _overlap(buffer[1:2], buffer.view(-1)[300:400])
    assert not _overlap(buffer[1:2], buffer.view(-1)[512:600])


def test_overlap_of_2d_views_sharing_rows():
    buffer = aligned(16 * 256)
    x = buffer[:8 * 256].view(8, 256)
    out = buffer[7 * 256:15 * 256].view(8, 256)  # x's last row is out's first
    assert _overlap(x, out)
    out = buffer[8 * 256:].view(8, 256)
    assert not _overlap(x, out)


# ----------------------------------------------------------- _check_packed


@pytest.mark.parametrize("name", ["x", "out", "weight", "bias"])
def test_check_packed_accepts_packed_tensors(name):
    assert _check_packed(name, aligned(8, 256), (8, 256), CPU) is None
    assert _check_packed(name, aligned(256), (256,), CPU) is None


def test_check_packed_single_row_may_have_any_row_stride():
    row = aligned(3, 1024)[1:2, 256:512]
    assert row.stride() == (1024, 1) and row.data_ptr() % ALIGN_BYTES == 0
    _check_packed("x", row, (1, 256), CPU)
    expanded = aligned(1, 256).expand(1, 256)
    _check_packed("x", expanded, (1, 256), CPU)


def test_check_packed_single_row_still_needs_unit_column_stride():
    row = aligned(512)[::2].unsqueeze(0)  # (1, 256) with column stride 2
    assert row.shape == (1, 256) and row.stride()[1] == 2
    with pytest.raises(ValueError, match=r"x must be packed row-major \(strides \(256, 1\)\)"):
        _check_packed("x", row, (1, 256), CPU)


def test_check_packed_two_rows_need_the_packed_row_stride():
    rows = aligned(3, 1024)[:2, :256]
    with pytest.raises(ValueError, match=r"out must be packed row-major \(strides \(256, 1\)\), "
                                         r"got \(2, 256\) bfloat16 on cpu strides \(1024, 1\)"):
        _check_packed("out", rows, (2, 256), CPU)


@pytest.mark.parametrize("value,kind", [(None, "NoneType"), ([[0.0]], "list"), (3.0, "float")])
def test_check_packed_refuses_non_tensors(value, kind):
    with pytest.raises(ValueError, match=rf"^bias must be a torch\.Tensor, got {kind}$"):
        _check_packed("bias", value, (256,), CPU)


def test_check_packed_refuses_another_device():
    t = torch.zeros(8, 256, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=r"^x must be on cpu, got meta$"):
        _check_packed("x", t, (8, 256), CPU)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int16, torch.uint8])
def test_check_packed_refuses_other_dtypes(dtype):
    with pytest.raises(ValueError, match=rf"^weight must be bfloat16, got {dtype}$"):
        _check_packed("weight", aligned(16, 128, dtype=dtype), (16, 128), CPU)


@pytest.mark.parametrize("shape", [(8,), (8, 255), (7, 256), (256, 8), (1, 8, 256), (8 * 256,)])
def test_check_packed_refuses_other_shapes(shape):
    with pytest.raises(ValueError) as info:
        _check_packed("out", aligned(*shape), (8, 256), CPU)
    assert str(info.value) == f"out must have shape (8, 256), got {tuple(shape)}"


def test_check_packed_one_d_needs_unit_stride():
    with pytest.raises(ValueError, match=r"bias must be packed row-major \(strides \(1,\)\)"):
        _check_packed("bias", aligned(512)[::2], (256,), CPU)


@pytest.mark.parametrize("make", [
    lambda: aligned(256, 8).t(),                  # transposed
    lambda: aligned(8, 512)[:, :256],             # columns of a wider matrix
    lambda: aligned(16, 256)[::2],                # every other row
    lambda: aligned(1, 256).expand(8, 256),       # one row repeated (stride 0)
])
def test_check_packed_refuses_non_packed_views(make):
    t = make()
    assert t.shape == (8, 256)
    with pytest.raises(ValueError, match=r"^x must be packed row-major \(strides \(256, 1\)\), "
                                         r"got \(8, 256\) bfloat16 on cpu strides "):
        _check_packed("x", t, (8, 256), CPU)


@pytest.mark.parametrize("elements", [1, 8, 15])
@pytest.mark.parametrize("shape", [(8, 256), (1, 256), (256,)])
def test_check_packed_refuses_misaligned_tensors_with_the_byte_offset(shape, elements):
    t = shifted(shape, elements)
    with pytest.raises(ValueError) as info:
        _check_packed("x", t, shape, CPU)
    assert str(info.value) == (f"x must be 32-byte aligned, its address is {2 * elements} "
                               "bytes past a boundary")


def test_check_packed_accepts_every_32_byte_boundary():
    for elements in (16, 32, 48):  # 32, 64, 96 bytes past an aligned base
        t = shifted((8, 256), elements)
        assert t.data_ptr() % ALIGN_BYTES == 0
        _check_packed("x", t, (8, 256), CPU)


@pytest.mark.parametrize("make,device,message", [
    # device before dtype
    (lambda: torch.zeros(8, 256, dtype=torch.float32, device="meta"), CPU,
     r"^x must be on cpu, got meta$"),
    # dtype before shape
    (lambda: aligned(4, 4, dtype=torch.float32), CPU, r"^x must be bfloat16"),
    # shape before strides
    (lambda: aligned(256, 4).t(), CPU, r"^x must have shape \(8, 256\), got \(4, 256\)$"),
    # strides before alignment
    (lambda: shifted((256, 8), 1).t(), CPU, r"^x must be packed row-major"),
])
def test_check_packed_reports_the_first_rule_broken(make, device, message):
    with pytest.raises(ValueError, match=message):
        _check_packed("x", make(), (8, 256), device)


# ------------------------------------------------------------- construction


@pytest.fixture
def no_compile(monkeypatch):
    """Construction must refuse before compiling anything."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled despite a bad weight")
    monkeypatch.setattr(prepared_module, "compile_warp_splitk", refuse)


@pytest.mark.parametrize("weight", [
    torch.zeros(256, 256, dtype=BF16),
    torch.zeros(256 * 256, dtype=BF16),          # also the wrong rank
    torch.zeros(2, 128, 256, dtype=BF16),        # also the wrong rank
    torch.zeros(256, 256, dtype=torch.float16),  # also the wrong dtype
    torch.zeros(256, 512, dtype=BF16).t(),       # also not packed
    torch.zeros(40, 1000, dtype=BF16),           # also N and K break the tactic rules
], ids=["packed", "1-D", "3-D", "float16", "transposed", "bad-N-and-K"])
@pytest.mark.parametrize("tactics", [{1: TACTIC}, {}, {0: TACTIC}, {1: "tactic"}],
                         ids=["good", "empty", "key-0", "not-a-tactic"])
def test_cpu_weight_is_refused_first(no_compile, weight, tactics):
    """The device is checked before rank, dtype, packing and the tactics."""
    with pytest.raises(ValueError, match=r"^weight must be on a CUDA device, got cpu$") as info:
        PreparedWarpSplitK(weight, tactics)
    assert "weight" in str(info.value) and "CUDA" in str(info.value)


def test_meta_weight_is_refused(no_compile):
    weight = torch.zeros(256, 256, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=r"^weight must be on a CUDA device, got meta$"):
        PreparedWarpSplitK(weight, {1: TACTIC})


def test_cpu_weight_with_a_bad_bias_reports_the_weight(no_compile):
    with pytest.raises(ValueError, match=r"^weight must be on a CUDA device"):
        PreparedWarpSplitK(torch.zeros(256, 256, dtype=BF16), {1: TACTIC}, bias="bias")


# ------------------------------------------------------------ run's checks

N, K = 64, 256


@pytest.fixture
def prepared(monkeypatch):
    """An instance as __init__ would leave it, on the CPU, whose code records launches."""
    monkeypatch.setattr(prepared_module, "stream_handle", lambda device: 0x5EED)
    p = PreparedWarpSplitK.__new__(PreparedWarpSplitK)
    p.weight = aligned(N, K)
    p.bias = None
    p.n, p.k, p.out_columns = N, K, N
    p.device = CPU
    p.tactics = {1: TACTIC, 8: TACTIC}
    p.launches = []

    def code(*args):
        p.launches.append(args)

    p._launchers = {1: code, 8: code}
    p._weight_address = 0x1000
    p._bias_address = 0x2000
    return p


def _adjacent_x_then_out(p):
    buffer = aligned(8 * K + 8 * N)
    return buffer[:8 * K].view(8, K), buffer[8 * K:].view(8, N)


def _out_over_x_tail(p):
    buffer = aligned(8 * K + 8 * N)
    start = 8 * K - 16  # out's first 16 elements are x's last 16
    return buffer[:8 * K].view(8, K), buffer[start:start + 8 * N].view(8, N)


def _x_over_out_tail(p):
    buffer = aligned(8 * K + 8 * N)
    out = buffer[:8 * N].view(8, N)
    start = 8 * N - 16  # x starts inside out
    return buffer[start:start + 8 * K].view(8, K), out


def _out_over_weight_tail(p):
    return aligned(8, K), p.weight.view(-1)[N * K - 8 * N:].view(8, N)


RUN_REFUSALS = [
    # (id, build(p) -> (x, out), exception, regex)
    ("x 3-D", lambda p: (aligned(1, 8, K), aligned(8, N)), ValueError,
     r"^x must be a 2-D torch\.Tensor \[M, K\], got \(1, 8, 256\) bfloat16 on cpu strides"),
    ("x 0-D", lambda p: (torch.tensor(1.0, dtype=BF16), aligned(8, N)), ValueError,
     r"^x must be a 2-D torch\.Tensor"),
    ("M = 0", lambda p: (aligned(0, K), aligned(0, N)), ValueError,
     r"^x must have 1\.\.32 rows \(M tokens\), got \(0, 256\) bfloat16"),
    ("M = 33", lambda p: (aligned(33, K), aligned(33, N)), ValueError,
     r"^x must have 1\.\.32 rows \(M tokens\), got \(33, 256\) bfloat16"),
    # M is looked up before x is checked: an unprepared M wins over a bad dtype
    ("M = 4 and float32 x", lambda p: (aligned(4, K, dtype=torch.float32), aligned(4, N)),
     KeyError, r"M=4; prepared Ms: \[1, 8\]"),
    ("x float32", lambda p: (aligned(8, K, dtype=torch.float32), aligned(8, N)), ValueError,
     r"^x must be bfloat16, got torch\.float32$"),
    ("x rows repeated (stride 0)", lambda p: (aligned(1, K).expand(8, K), aligned(8, N)),
     ValueError, r"^x must be packed row-major \(strides \(256, 1\)\)"),
    ("x misaligned by 16 bytes", lambda p: (shifted((8, K), 8), aligned(8, N)), ValueError,
     r"^x must be 32-byte aligned, its address is 16 bytes past a boundary$"),
    ("x misaligned by 30 bytes", lambda p: (shifted((8, K), 15), aligned(8, N)), ValueError,
     r"^x must be 32-byte aligned, its address is 30 bytes past a boundary$"),
    # x is checked before out
    ("x and out both bad", lambda p: (aligned(8, K, dtype=torch.float16),
                                      aligned(8, N, dtype=torch.float16)), ValueError,
     r"^x must be bfloat16"),
    ("out None", lambda p: (aligned(8, K), None), ValueError,
     r"^out must be a torch\.Tensor, got NoneType$"),
    ("out float16", lambda p: (aligned(8, K), aligned(8, N, dtype=torch.float16)), ValueError,
     r"^out must be bfloat16, got torch\.float16$"),
    ("out 1-D", lambda p: (aligned(8, K), aligned(8 * N)), ValueError,
     r"^out must have shape \(8, 64\), got \(512,\)$"),
    ("out 3-D", lambda p: (aligned(8, K), aligned(1, 8, N)), ValueError,
     r"^out must have shape \(8, 64\), got \(1, 8, 64\)$"),
    ("out with fewer rows than x", lambda p: (aligned(8, K), aligned(1, N)), ValueError,
     r"^out must have shape \(8, 64\), got \(1, 64\)$"),
    ("out with more rows than x", lambda p: (aligned(1, K), aligned(8, N)), ValueError,
     r"^out must have shape \(1, 64\), got \(8, 64\)$"),
    ("out sliced columns", lambda p: (aligned(8, K), aligned(8, 2 * N)[:, :N]), ValueError,
     r"^out must be packed row-major \(strides \(64, 1\)\), got \(8, 64\) bfloat16 on cpu "
     r"strides \(128, 1\)$"),
    ("out rows repeated (stride 0)", lambda p: (aligned(8, K), aligned(1, N).expand(8, N)),
     ValueError, r"^out must be packed row-major"),
    ("out misaligned by 2 bytes", lambda p: (aligned(8, K), shifted((8, N), 1)), ValueError,
     r"^out must be 32-byte aligned, its address is 2 bytes past a boundary$"),
    ("out misaligned by 16 bytes", lambda p: (aligned(8, K), shifted((8, N), 8)), ValueError,
     r"^out must be 32-byte aligned, its address is 16 bytes past a boundary$"),
    ("out misaligned by 30 bytes", lambda p: (aligned(8, K), shifted((8, N), 15)), ValueError,
     r"^out must be 32-byte aligned, its address is 30 bytes past a boundary$"),
    ("out over the tail of x", _out_over_x_tail, ValueError, r"^out must not overlap x$"),
    ("x over the tail of out", _x_over_out_tail, ValueError, r"^out must not overlap x$"),
    ("out over the tail of the weight", _out_over_weight_tail, ValueError,
     r"^out must not overlap the weight$"),
    ("single-row out over the weight", lambda p: (aligned(1, K), p.weight[5:6, :N]), ValueError,
     r"^out must not overlap the weight$"),
]


@pytest.mark.parametrize("build,error,message", [c[1:] for c in RUN_REFUSALS],
                         ids=[c[0] for c in RUN_REFUSALS])
def test_run_refuses_before_launch(prepared, build, error, message):
    x, out = build(prepared)
    with pytest.raises(error) as info:
        prepared.run(x, out)
    # a KeyError's str() is the repr of its message: search, do not anchor
    text = info.value.args[0] if error is KeyError else str(info.value)
    assert re.search(message, text), text
    assert prepared.launches == []


def test_run_adjacent_x_and_out_in_one_buffer_launch(prepared):
    x, out = _adjacent_x_then_out(prepared)
    assert prepared.run(x, out) is out
    assert len(prepared.launches) == 1
    assert prepared.launches[0] == (0x1000, x.data_ptr(), 0x2000, out.data_ptr(), 8, 0x5EED)


def test_run_single_row_out_may_have_any_row_stride(prepared):
    out = aligned(3, 2 * N)[1:2, N:]
    assert out.stride() == (2 * N, 1) and out.data_ptr() % ALIGN_BYTES == 0
    x = aligned(1, K)
    assert prepared.run(x, out) is out
    assert len(prepared.launches) == 1 and prepared.launches[0][3] == out.data_ptr()


def test_run_x_may_overlap_the_weight(prepared):
    """Both are only read: x aliasing the weight is allowed."""
    x = prepared.weight[:8]
    out = aligned(8, N)
    prepared.run(x, out)
    assert len(prepared.launches) == 1


def test_run_refuses_out_overlapping_the_bias(prepared):
    bias = aligned(N)
    prepared.bias = bias
    with pytest.raises(ValueError, match="^out must not overlap the bias$"):
        prepared.run(aligned(1, K), bias.view(1, N))
    assert prepared.launches == []


# ------------------------------------------ the CuTe pointers run() passes on

SRC = Path(__file__).resolve().parent.parent / "src"

# Run in a fresh interpreter: importing the DSL here would fix this process's
# compile arch (see tests/test_compile.py).
_POINTER_PROBE = r"""
import json, torch
from warpsplitk.runtime.dsl import gmem_pointer
bf16 = torch.bfloat16
cases = {
    "packed rows": torch.zeros(8, 256, dtype=bf16),
    "single row of a taller matrix": torch.zeros(4, 256, dtype=bf16)[2:3],
    "single row of a wider matrix": torch.zeros(3, 512, dtype=bf16)[1:2, 256:],
}
result = {}
for name, t in cases.items():
    p = gmem_pointer(t.data_ptr())
    result[name] = [p._pointer == t.data_ptr(), str(p.memspace), p._assumed_align, str(p.dtype)]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def pointers():
    """What ``gmem_pointer`` (x's and out's argument in run) makes of each case."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the CuTe DSL (nvidia-cutlass-dsl)")
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", _POINTER_PROBE], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["packed rows", "single row of a taller matrix",
                                  "single row of a wider matrix"])
def test_pointer_is_the_tensors_address_in_global_memory(pointers, case):
    assert pointers[case] == [True, "gmem", 32, "BFloat16"]


def test_a_single_row_the_checks_accept_needs_only_its_address():
    row = aligned(3, 512)[1:2, 256:]
    _check_packed("x", row, (1, 256), CPU)  # accepted by run's checks...
    assert row.is_contiguous()  # ...and by ops.decode_linear's re-pack test
    assert row.data_ptr() % ALIGN_BYTES == 0  # the kernel uses its address and M only
