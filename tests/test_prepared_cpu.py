"""PreparedWarpSplitK's argument checks that need no GPU.

Construction refuses anything but a CUDA weight before compiling. ``run``'s
checks are reached on an instance made without ``__init__`` (so without a
GPU or a compile) whose device is the CPU; each must raise before a launch.
"""

import pytest

torch = pytest.importorskip("torch")

from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic  # noqa: E402

TACTICS = {1: WarpSplitKTactic(16, 8, 128, 2, 1)}


@pytest.mark.parametrize("weight", [None, [[1.0, 2.0]], 3.0, "weight"])
def test_refuses_a_non_tensor_weight(weight):
    with pytest.raises(ValueError, match=r"weight must be a 2-D torch\.Tensor \[N, K\], got "):
        PreparedWarpSplitK(weight, TACTICS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_refuses_a_cpu_weight(dtype):
    weight = torch.zeros(256, 256, dtype=dtype)
    with pytest.raises(ValueError, match=r"weight must be on a CUDA device, got cpu"):
        PreparedWarpSplitK(weight, TACTICS)


def test_refuses_a_cpu_weight_with_bias():
    weight = torch.zeros(256, 256, dtype=torch.bfloat16)
    bias = torch.zeros(256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be on a CUDA device"):
        PreparedWarpSplitK(weight, TACTICS, bias=bias)


# ------------------------------------------------------- run's argument checks


N, K = 64, 256


def _launch(*args):
    raise AssertionError("launched despite a bad argument")


@pytest.fixture
def prepared():
    """An instance as __init__ would leave it, on the CPU, whose code must not run."""
    p = PreparedWarpSplitK.__new__(PreparedWarpSplitK)
    p.weight = torch.zeros(N, K, dtype=torch.bfloat16)
    p.bias = None
    p.n, p.k, p.out_columns = N, K, N
    p.device = torch.device("cpu")
    p.tactics = {1: TACTICS[1], 8: TACTICS[1]}
    p._launchers = {1: _launch, 8: _launch}
    return p


def aligned(*shape, dtype=torch.bfloat16):
    t = torch.zeros(*shape, dtype=dtype)
    assert t.data_ptr() % 32 == 0
    return t


def test_run_refuses_non_tensor_x(prepared):
    with pytest.raises(ValueError, match=r"x must be a 2-D torch\.Tensor \[M, K\], got list"):
        prepared.run([[0.0] * K], aligned(1, N))
    with pytest.raises(ValueError, match=r"x must be a 2-D torch\.Tensor"):
        prepared.run(aligned(K), aligned(1, N))


def test_run_unprepared_m_is_a_key_error(prepared):
    with pytest.raises(KeyError, match=r"no tactic prepared for M=4; prepared Ms: \[1, 8\]"):
        prepared.run(aligned(4, K), aligned(4, N))


@pytest.mark.parametrize("make_x,message", [
    (lambda: aligned(8, K, dtype=torch.float16), r"x must be bfloat16, got torch\.float16"),
    (lambda: aligned(8, K + 8), r"x must have shape \(8, 256\), got \(8, 264\)"),
    (lambda: aligned(K, 8).t(), r"x must be packed row-major"),
    (lambda: aligned(8, 2 * K)[:, :K], r"x must be packed row-major"),
    (lambda: aligned(8 * K + 8).narrow(0, 1, 8 * K).view(8, K), r"x must be 32-byte aligned"),
])
def test_run_refuses_bad_x(prepared, make_x, message):
    with pytest.raises(ValueError, match=message):
        prepared.run(make_x(), aligned(8, N))


@pytest.mark.parametrize("make_out,message", [
    (lambda: 3, r"out must be a torch\.Tensor, got int"),
    (lambda: aligned(8, N, dtype=torch.float32), r"out must be bfloat16"),
    (lambda: aligned(8, N - 16), r"out must have shape \(8, 64\), got \(8, 48\)"),
    (lambda: aligned(N, 8).t(), r"out must be packed row-major"),
])
def test_run_refuses_bad_out(prepared, make_out, message):
    with pytest.raises(ValueError, match=message):
        prepared.run(aligned(8, K), make_out())


def test_run_refuses_tensors_on_another_device(prepared):
    prepared.device = torch.device("cuda", 0)  # the weight's device, as on a GPU
    with pytest.raises(ValueError, match=r"x must be on cuda:0, got cpu"):
        prepared.run(aligned(8, K), aligned(8, N))


def test_run_refuses_out_overlapping_x_or_weight(prepared):
    buffer = aligned(8 * K)
    x = buffer.view(8, K)
    out = buffer[:8 * N].view(8, N)
    with pytest.raises(ValueError, match="out must not overlap x"):
        prepared.run(x, out)
    with pytest.raises(ValueError, match="out must not overlap the weight"):
        prepared.run(aligned(8, K), prepared.weight.view(-1)[:8 * N].view(8, N))


def test_run_single_row_x_may_have_any_row_stride(prepared, monkeypatch):
    """M = 1 from a wider buffer passes the checks and reaches the launch, with
    x and out in the compiled code's argument order (the launcher stubbed
    out: importing the DSL here would fix the process's compile arch)."""
    import warpsplitk.runtime.prepared as module
    monkeypatch.setattr(module, "stream_handle", lambda device: 0x5EED)
    prepared._weight_address, prepared._bias_address = 0x1000, 0x2000
    calls = []
    prepared._launchers[1] = lambda *args: calls.append(args)
    x = aligned(2, 2 * K)[:1, :K]
    assert x.stride() == (2 * K, 1)
    out = aligned(1, N)
    assert prepared.run(x, out) is out
    assert len(calls) == 1
    assert calls[0] == (0x1000, x.data_ptr(), 0x2000, out.data_ptr(), 1, 0x5EED)


def test_unchecked_launch_passes_what_run_passes(prepared, monkeypatch):
    """DecodeLinear's eager path (launch_unchecked) launches exactly as run() does."""
    import warpsplitk.runtime.prepared as module
    monkeypatch.setattr(module, "stream_handle", lambda device: 0x5EED)
    prepared._weight_address, prepared._bias_address = 0x1000, 0x2000
    calls = []
    prepared._launchers[8] = lambda *args: calls.append(args)
    x, out = aligned(8, K), aligned(8, N)
    assert prepared.run(x, out) is out and prepared.launch_unchecked(x, out) is out
    assert calls[0] == calls[1] == (0x1000, x.data_ptr(), 0x2000, out.data_ptr(), 8, 0x5EED)


def test_stream_handle_prefers_the_raw_current_stream(monkeypatch):
    import warpsplitk.runtime.prepared as module
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: calls.append(index) or 0xABC, raising=False)
    assert module.stream_handle(torch.device("cuda", 3)) == 0xABC and calls == [3]
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")

    class Stream:
        cuda_stream = 0xDEF
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    assert module.stream_handle(torch.device("cuda", 0)) == 0xDEF


# ------------------------------------------- the tactics mapping, no GPU needed

T128 = WarpSplitKTactic(16, 8, 128, 2, 1)


@pytest.mark.parametrize("tactics,match", [
    ({}, r"tactics must be a non-empty mapping \{M: WarpSplitKTactic\}, got \{\}$"),
    (None, "tactics must be a non-empty mapping .*, got None$"),
    ([(1, T128)], "tactics must be a non-empty mapping"),
    ({0: T128}, r"tactics are keyed by M in 1\.\.32, got key 0$"),
    ({1: T128, 33: T128}, "got key 33$"),
    ({"1": T128}, "got key '1'$"),
    ({True: T128}, "got key True$"),
    ({1.0: T128}, "got key 1.0$"),
    ({8: "16,8,128,2,1"}, "tactic for M=8: expected a WarpSplitKTactic, got str "
                          r"\(WarpSplitKTactic.parse\('16,8,128,2,1'\) reads a short form\)$"),
    ({8: WarpSplitKTactic(16, 8, 128, 4, 1)}, "tactic for M=8: .*stages=4 exceeds the 2 K tiles"),
    ({8: WarpSplitKTactic(16.0, 8, 128, 2, 1)}, "tactic for M=8: .*output_tile must be one of"),
])
def test_the_tactics_mapping_is_checked_whole(tactics, match):
    from warpsplitk.runtime.prepared import _check_tactics
    with pytest.raises(ValueError, match=match):
        _check_tactics(tactics, 256, 256)
    _check_tactics({1: T128, 32: WarpSplitKTactic(16, 32, 128, 2, 2)}, 256, 256)


def test_the_tactics_mapping_takes_ms_of_any_integer_type_as_ints():
    import numpy as np
    from warpsplitk.runtime.prepared import _check_tactics
    checked = _check_tactics({np.int64(32): WarpSplitKTactic(16, 32, 128, 2, 2),
                              np.int8(1): T128}, 256, 256)
    assert checked == {1: T128, 32: WarpSplitKTactic(16, 32, 128, 2, 2)}
    assert [type(m) for m in checked] == [int, int]
