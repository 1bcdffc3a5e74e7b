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


# -------------------------------------------------- FP8 weights (W8A16), no GPU

E4M3 = torch.float8_e4m3fn


def fp8_weight(n=N, k=K):
    """A packed e4m3 ``[n, k]`` of small finite values (no NaN code)."""
    return (aligned(n, k, dtype=torch.float32) * 0.5).to(E4M3)


@pytest.fixture
def fp8_world(monkeypatch):
    """PreparedWarpSplitK's whole __init__ on CPU tensors: the contract takes
    the CPU, the compile and launcher are recorded stand-ins."""
    from warpsplitk import contract
    import warpsplitk.runtime.prepared as module
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(module, "stream_handle", lambda device: 0x5EED)
    compiled, launches = [], []

    def compile_(index, n, k, tactic, **options):
        compiled.append((n, k, tactic, options))
        return object()

    def launcher(index, n, k, tactic, **options):
        return lambda *args: launches.append(args)
    monkeypatch.setattr(module, "compile_warp_splitk", compile_)
    monkeypatch.setattr(module, "launcher", launcher)
    return compiled, launches


@pytest.mark.parametrize("scale, kind", [
    (aligned(1, dtype=torch.float32), "tensor"),
    (aligned(1, dtype=torch.float32).view(()), "tensor"),
    (aligned(N, dtype=torch.float32), "channel"),
    (aligned(N, 1, dtype=torch.float32), "channel"),
    (aligned(1, K // 128, dtype=torch.float32), "block128"),
])
def test_fp8_weight_compiles_its_scale_kind_and_launches_the_scale_fifth(fp8_world, scale, kind):
    compiled, launches = fp8_world
    weight, bias = fp8_weight(), aligned(N)
    prepared = PreparedWarpSplitK(weight, {8: T128}, bias=bias, weight_scale=scale)
    assert prepared.fp8_scales == kind and prepared.weight_scale is scale
    assert compiled == [(N, K, T128, dict(has_bias=True, swiglu=False, fp8_scales=kind))]
    x, out = aligned(8, K), aligned(8, N)
    assert prepared.run(x, out) is out
    assert launches == [(weight.data_ptr(), x.data_ptr(), bias.data_ptr(), scale.data_ptr(),
                         out.data_ptr(), 8, 0x5EED)]
    assert "fp8 " + kind in repr(prepared)


def test_fp8_scale_kind_given_must_match_the_scale(fp8_world):
    scale = aligned(N, dtype=torch.float32)
    PreparedWarpSplitK(fp8_weight(), {8: T128}, weight_scale=scale, scale_kind="channel")
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(\) or \(1,\), got \(64,\)"):
        PreparedWarpSplitK(fp8_weight(), {8: T128}, weight_scale=scale, scale_kind="tensor")
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(1, 2\), got \(64,\)"):
        PreparedWarpSplitK(fp8_weight(), {8: T128}, weight_scale=scale, scale_kind="block128")
    with pytest.raises(ValueError, match=r"scale_kind must be one of \('tensor', 'channel', "
                                         r"'block128'\) or None, got 'block'"):
        PreparedWarpSplitK(fp8_weight(), {8: T128}, weight_scale=scale, scale_kind="block")


def nan_weight():
    weight = fp8_weight()
    weight.view(torch.uint8)[3, 5] = 0xFF
    weight.view(torch.uint8)[7, 0] = 0x7F
    return weight


@pytest.mark.parametrize("make, message", [
    (lambda: (fp8_weight(), None), r"an FP8 \(float8_e4m3fn\) weight needs weight_scale"),
    (lambda: (fp8_weight(), 2.0), "weight_scale must be a float32 torch.Tensor, got float"),
    (lambda: (fp8_weight(), aligned(N // 2, dtype=torch.float32)),
     r"weight_scale must have shape \(\) or \(1,\) \(one scale\), \(64,\) or \(64, 1\) \(one "
     r"per row\) or \(1, 2\) \(one per 128 x 128 block\)"),
    (lambda: (fp8_weight(), aligned(N, dtype=torch.bfloat16)), "weight_scale must be float32"),
    (lambda: (fp8_weight(), aligned(N, 2, dtype=torch.float32)[:, :1]),
     "weight_scale must be contiguous"),
    (lambda: (fp8_weight(), aligned(N + 1, dtype=torch.float32)[1:]),
     "weight_scale must be 32-byte aligned"),
    (lambda: (fp8_weight(), torch.tensor([float("inf")])), "weight_scale must be finite"),
    (lambda: (nan_weight(), aligned(1, dtype=torch.float32)),
     r"weight holds 2 NaN code\(s\) \(0x7F or 0xFF\)"),
    (lambda: (fp8_weight(K, N).t(), aligned(1, dtype=torch.float32)),
     "weight must be packed row-major"),
    (lambda: (aligned(N, K), aligned(1, dtype=torch.float32)),
     "weight_scale and scale_kind are for float8_e4m3fn weights, got a torch.bfloat16 weight"),
])
def test_fp8_operands_are_refused_before_any_compile(fp8_world, make, message):
    compiled, _ = fp8_world
    weight, scale = make()
    with pytest.raises(ValueError, match=message):
        PreparedWarpSplitK(weight, {8: T128}, weight_scale=scale)
    assert compiled == []


def test_block_scales_refuse_a_mixed_grid(fp8_world, monkeypatch):
    import warpsplitk.runtime.prepared as module
    from warpsplitk.runtime.compile import _checked
    # the real tactic checks of the compile (the stand-in records only)
    monkeypatch.setattr(module, "compile_warp_splitk",
                        lambda index, n, k, tactic, **o: _checked(tactic, n, k, o["swiglu"],
                                                                  o["fp8_scales"]))
    weight = fp8_weight(48, 512)
    with pytest.raises(ValueError, match="block scales take no mixed grid"):
        PreparedWarpSplitK(weight, {1: WarpSplitKTactic(32, 1, 256, 2, 1, half_tiles=1)},
                           weight_scale=aligned(1, 4, dtype=torch.float32))


@pytest.mark.parametrize("tactic, swiglu, message", [
    (WarpSplitKTactic(16, 8, 128, 2, 1, x_copy="tma"), False, "FP8 weights take x_copy 'cp.async'"),
    (T128, True, "FP8 weights with the SwiGLU epilogue take output_tile 32 or more, got 16"),
])
def test_fp8_tactics_follow_the_fp8_rules(fp8_world, tactic, swiglu, message):
    with pytest.raises(ValueError, match=message):
        PreparedWarpSplitK(fp8_weight(), {8: tactic}, weight_scale=aligned(1, dtype=torch.float32),
                           swiglu=swiglu)


def test_fp8_run_refuses_out_over_the_scale(fp8_world):
    scale = aligned(8 * N, dtype=torch.float32)
    prepared = PreparedWarpSplitK(fp8_weight(), {8: T128}, weight_scale=scale[:N])
    with pytest.raises(ValueError, match="out must not overlap the weight scale"):
        prepared.run(aligned(8, K), scale.view(torch.bfloat16)[:8 * N].view(8, N))


def test_prepare_runs_an_fp8_weight_on_the_fp8_default(fp8_world):
    from warpsplitk.planning import plans
    from warpsplitk.planning.choose import default_tactic
    compiled, _ = fp8_world
    weight, scale = fp8_weight(), aligned(N, dtype=torch.float32)
    plan = plans.DecodePlan()
    plan.set(N, K, 1, WarpSplitKTactic(16, 8, 128, 2, 1, x_copy="tma"))  # a BF16 entry
    prepared = plans.prepare(weight, plan, ms=(1, 32), weight_scale=scale)
    assert prepared.tactics == {m: default_tactic(m, N, K, fp8=True) for m in (1, 32)}
    assert {options["fp8_scales"] for *_, options in compiled} == {"channel"}
    with pytest.raises(ValueError, match="needs weight_scale"):
        plans.prepare(weight, None, ms=(1,))
    swiglu = plans.prepare(weight, None, ms=(1, 32), weight_scale=scale, swiglu=True)
    assert swiglu.swiglu and swiglu.tactics == {
        m: default_tactic(m, N, K, fp8=True, swiglu=True) for m in (1, 32)}
    with pytest.raises(ValueError, match="are for float8_e4m3fn weights"):
        plans.prepare(aligned(N, K), None, ms=(1,), weight_scale=scale)


def test_prepare_runs_the_plans_fp8_entries_where_it_has_them(fp8_world):
    from warpsplitk.planning import plans
    from warpsplitk.planning.choose import default_tactic
    compiled, _ = fp8_world
    weight, scale = fp8_weight(), aligned(1, K // 128, dtype=torch.float32)
    plan = plans.DecodePlan()
    tuned = WarpSplitKTactic(32, 8, 128, 2, 1, early_launch=True)
    block = dict(fp8=True, fp8_scales="block128")
    assert tuned != default_tactic(8, N, K, **block)
    plan.set(N, K, 8, tuned, 3.0, fp8_scales="block128")
    plan.set(N, K, 1, T128)  # a BF16 entry: not for an FP8 weight
    plan.set(N, K, 1, T128, fp8_scales="channel")  # nor another kind's
    with pytest.warns(UserWarning, match=r"no FP8 \(block128 scales\) entry for M=1 for N=64"):
        prepared = plans.prepare(weight, plan, ms=(1, 8), weight_scale=scale)
    assert prepared.tactics == {1: default_tactic(1, N, K, **block), 8: tuned}
    assert {options["fp8_scales"] for *_, options in compiled} == {"block128"}
    channel = plans.prepare(weight, plan, ms=(1,), weight_scale=aligned(N, dtype=torch.float32))
    assert channel.tactics == {1: T128}


def test_prepare_auto_tunes_an_fp8_weight_as_fp8(fp8_world, monkeypatch):
    """plan="auto" for an FP8 weight asks this GPU's plan for its shape as
    FP8, with its scales' kind; a weight it refuses asks for nothing."""
    from warpsplitk.planning import plan_cache, plans
    asked, tuned = [], WarpSplitKTactic(32, 8, 128, 2, 1, early_launch=True)

    def auto_plan(shapes, ms, **kwargs):
        asked.append((list(shapes), tuple(ms), kwargs["fp8_shapes"]))
        plan = plans.DecodePlan()
        for m in ms:
            plan.set(N, K, m, tuned, fp8_scales="channel")
        return plan
    monkeypatch.setattr(plan_cache, "auto_plan", auto_plan)
    scale = aligned(N, dtype=torch.float32)
    prepared = plans.prepare(fp8_weight(), "auto", ms=(1, 8), weight_scale=scale)
    assert asked == [([], (1, 8), [(N, K, "channel")])]
    assert prepared.tactics == {1: tuned, 8: tuned}
    with pytest.raises(ValueError, match="weight_scale must be finite"):
        plans.prepare(fp8_weight(), "auto", ms=(1,), weight_scale=torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="needs weight_scale"):
        plans.prepare(fp8_weight(), "auto", ms=(1,))
    assert len(asked) == 1


def test_prepare_model_mixes_bf16_and_fp8_weights_on_their_own_entries(fp8_world, monkeypatch):
    from warpsplitk.planning import plans
    from warpsplitk.planning.choose import default_tactic
    monkeypatch.setattr(plans, "precompile_for", lambda *args, **kwargs: {})
    precompiled = []
    monkeypatch.setattr(plans, "precompile_fp8",
                        lambda weights, ms, jobs, progress, plan: precompiled.append(plan))
    bf16_tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    fp8_tactic = WarpSplitKTactic(32, 8, 128, 2, 1, early_launch=True)
    plan = plans.DecodePlan()
    for m in (1, 8):
        plan.set(N, K, m, bf16_tactic)
        plan.set(N, K, m, fp8_tactic, fp8_scales="tensor")
    prepared = plans.prepare_model({"q": fp8_weight(), "o": aligned(N, K)}, plan, ms=(1, 8),
                                   progress=None,
                                   weight_scales={"q": aligned(1, dtype=torch.float32)})
    assert prepared["q"].tactics == {1: fp8_tactic, 8: fp8_tactic}
    assert prepared["o"].tactics == {1: bf16_tactic, 8: bf16_tactic}
    assert precompiled == [plan]  # the FP8 kernels compiled first are the plan's
    assert default_tactic(8, N, K, fp8=True) != fp8_tactic


def test_prepare_model_takes_fp8_weights_with_their_scales(fp8_world, monkeypatch):
    from warpsplitk.planning import plans
    monkeypatch.setattr(plans, "precompile_for", lambda *args, **kwargs: {})
    monkeypatch.setattr(plans, "precompile_fp8", lambda *args, **kwargs: None)
    weight, scale = fp8_weight(), aligned(1, dtype=torch.float32)
    prepared = plans.prepare_model({"q": weight}, ms=(1, 8), progress=None,
                                   weight_scales={"q": scale})
    assert prepared["q"].fp8_scales == "tensor"
    with pytest.raises(ValueError, match=r"weights\['q'\]: an FP8 .* needs weight_scale"):
        plans.prepare_model({"q": weight}, ms=(1,), progress=None)
    with pytest.raises(ValueError, match=r"weight_scales names weights not in weights: \['k'\]"):
        plans.prepare_model({"q": weight}, ms=(1,), progress=None, weight_scales={"k": scale})


def test_precompile_fp8_lists_each_weights_kernels_with_bias_and_epilogue(monkeypatch):
    """The worker compiles ``precompile_fp8`` asks for: per weight and M its
    plan's (or default's) tactic with its scales' kind and its bias; with
    ``swiglu``, the epilogue's FP8 choice."""
    from warpsplitk.planning import plans
    from warpsplitk.planning.choose import default_tactic
    asked = []
    monkeypatch.setattr(plans, "precompile", lambda kernels, arch, jobs, progress:
                        asked.append((arch, kernels)))
    monkeypatch.setattr(plans, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    n, k = 512, 1024
    weight = torch.zeros(n, k).to(torch.float8_e4m3fn)
    blocks = torch.ones(n // 128, k // 128)
    plans.precompile_fp8({"a": (weight, blocks, torch.zeros(n, dtype=torch.bfloat16)),
                          "b": (weight, torch.ones(n))}, ms=(1, 32))
    assert asked == [("sm_90a", [
        (n, k, default_tactic(m, n, k, fp8=True, fp8_scales="block128"), True, True, False,
         "block128") for m in (1, 32)] + [
        (n, k, default_tactic(m, n, k, fp8=True), False, True, False, "channel")
        for m in (1, 32)])]
    asked.clear()
    plans.precompile_fp8({"gate_up": (weight, blocks, None)}, ms=(8,), swiglu=True)
    tactic = default_tactic(8, n, k, fp8=True, fp8_scales="block128", swiglu=True)
    assert asked == [("sm_90a", [(n, k, tactic, False, True, True, "block128")])]
    assert tactic.output_tile >= 32
