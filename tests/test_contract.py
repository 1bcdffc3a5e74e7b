"""contract.py: the one statement of what the kernel takes, on CPU tensors."""

import pytest

torch = pytest.importorskip("torch")

from warpsplitk import contract  # noqa: E402
from warpsplitk.contract import operand_refusal, shape_refusal, weight_refusal  # noqa: E402


@pytest.fixture
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")


def aligned(*shape, dtype=torch.bfloat16):
    """A packed tensor whose address is a multiple of ALIGN_BYTES."""
    numel = 1
    for size in shape:
        numel *= size
    pad = contract.ALIGN_BYTES
    flat = torch.empty(numel + pad, dtype=dtype)
    skip = (-flat.data_ptr() % contract.ALIGN_BYTES) // flat.element_size()
    return flat[skip:skip + numel].view(*shape).normal_()


def test_a_good_operand_has_no_refusal(cpu_kernel):
    assert operand_refusal("x", aligned(8, 256), (8, 256)) is None
    assert operand_refusal("weight", aligned(64, 256)) is None
    assert operand_refusal("bias", aligned(64), (64,)) is None
    assert weight_refusal(aligned(64, 256), aligned(64)) is None


@pytest.mark.parametrize("make, expected", [
    (lambda: [[1.0]], "weight must be a 2-D torch.Tensor [N, K], got list"),
    (lambda: aligned(4, 64, 256), "weight must be a 2-D torch.Tensor [N, K], got shape (4, 64, 256)"),
    (lambda: aligned(64, 256, dtype=torch.float16), "weight must be bfloat16, got torch.float16"),
    (lambda: aligned(256, 64).t(), "weight must be packed row-major (strides (256, 1))"),
    (lambda: aligned(64, 257)[:, 1:], "weight must be packed row-major"),
    (lambda: aligned(64 * 256 + 1)[1:].view(64, 256), "weight must be 32-byte aligned, its address "
                                                      "is 2 bytes past a boundary"),
])
def test_each_weight_rule_names_itself(cpu_kernel, make, expected):
    reason = operand_refusal("weight", make())
    assert reason is not None and reason.startswith(expected), reason


def test_the_device_is_checked_first():
    # on this machine the kernel's device type (cuda) is absent: a CPU
    # tensor is refused for its device before its shape or dtype
    assert operand_refusal("weight", torch.zeros(3, dtype=torch.float32)) == (
        "weight must be on a CUDA device, got cpu")


def test_x_and_out_are_checked_against_the_expected_shape_and_device(cpu_kernel):
    cpu = torch.device("cpu")
    assert operand_refusal("x", aligned(8, 128), (8, 256), cpu) == (
        "x must have shape (8, 256), got (8, 128)")
    assert operand_refusal("out", aligned(8, 256), (8, 256), torch.device("meta")) == (
        "out must be on meta, got cpu")
    # one row: its row stride does not matter
    assert operand_refusal("x", aligned(4, 512)[:1, :256], (1, 256), cpu) is None


def test_weight_refusal_adds_the_bias_and_the_shape_rules(cpu_kernel):
    assert weight_refusal(aligned(64, 256), aligned(32)) == "bias must have shape (64,), got (32,)"
    assert weight_refusal(aligned(24, 256)) == shape_refusal(24, 256)
    assert weight_refusal(aligned(64, 200)).startswith("K must be a positive multiple of 128")


@pytest.mark.parametrize("n, k, ok", [(16, 128, True), (17, 128, False), (0, 128, False),
                                      (16, 100, False), (16, 64 * 128, True),
                                      (16, 64 * 128 + 128, True), (16, 64 * 256, True),
                                      (16, 64 * 256 + 256, True), (16, 128 * 128 + 128, True),
                                      (16, 256 * 128, True), (16, 256 * 128 + 128, False),
                                      (16, 256 * 256, True), (16, 256 * 256 + 256, False),
                                      (2 ** 30, 128, False),
                                      (True, 128, False)])
def test_shape_rules(n, k, ok):
    assert (shape_refusal(n, k) is None) == ok


def test_fp8_scale_kinds_by_shape():
    from warpsplitk.contract import fp8_scale_kind
    assert fp8_scale_kind(torch.ones(()), 64) == fp8_scale_kind(torch.ones(1), 64) == "tensor"
    assert fp8_scale_kind(torch.ones(64), 64) == fp8_scale_kind(torch.ones(64, 1), 64) == "channel"
    for shape in [(2,), (64, 2), (1, 64), (1, 1, 1)]:
        assert fp8_scale_kind(torch.ones(shape), 64) is None
    # 128 x 128 blocks, partial ones at the edges: [ceil(N / 128), ceil(K / 128)]
    assert fp8_scale_kind(torch.ones(17, 56), 2112, 7168) == "block128"
    assert fp8_scale_kind(torch.ones(17, 56), 2112) is None  # K unknown: no block scales
    assert fp8_scale_kind(torch.ones(16, 56), 2112, 7168) is None


def test_fp8_operands(cpu_kernel):
    from warpsplitk.contract import fp8_refusal, fp8_value_refusal
    weight = aligned(64, 256, dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = aligned(64, dtype=torch.float32)
    assert fp8_refusal(weight, scale) is None and fp8_value_refusal(weight, scale) is None
    assert fp8_refusal(weight, scale, aligned(64)) is None
    assert fp8_refusal(aligned(64, 256), scale) == (
        "weight must be float8_e4m3fn, got torch.bfloat16")
    assert fp8_refusal(weight, scale, aligned(32)) == "bias must have shape (64,), got (32,)"
    assert fp8_refusal(weight, scale, scale_kind="tensor") == (
        "weight_scale must have shape () or (1,), got (64,)")
    # every NaN code, either sign, and nothing else is refused
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    nan = codes.float().isnan()
    assert int(nan.sum()) == 2
    for code in range(256):
        one = weight.clone()
        one.view(torch.uint8)[0, 0] = code
        assert (fp8_value_refusal(one, scale) is not None) == bool(nan[code])


def test_block_scales_are_bounded_for_the_bf16_fold():
    """Block scales become BF16 multipliers of ``scale * 2 ** 120``: below
    ``FP8_BLOCK_SCALE_BOUND`` in magnitude, either sign; per-channel and
    tensor scales (applied in FP32) are not bounded."""
    from warpsplitk.contract import FP8_BLOCK_SCALE_BOUND, fp8_value_refusal
    weight = torch.ones(256, 256).to(torch.float8_e4m3fn)
    blocks = torch.full((2, 2), 0.5)
    assert fp8_value_refusal(weight, blocks) is None
    blocks[1, 0] = -FP8_BLOCK_SCALE_BOUND * 0.99
    assert fp8_value_refusal(weight, blocks) is None
    blocks[1, 0] = -FP8_BLOCK_SCALE_BOUND
    assert fp8_value_refusal(weight, blocks) == (
        "block scales must be below 128 in magnitude (the kernel folds them into BF16 "
        "weights), got 128")
    assert fp8_value_refusal(weight, torch.full((256,), 1e6)) is None
    assert fp8_value_refusal(weight, torch.tensor(1e6)) is None


def test_fp8_scale_factors_expand_as_the_kernel_reads_them():
    from warpsplitk.contract import fp8_scale_factors
    blocks = torch.arange(6, dtype=torch.float32).view(2, 3) + 1  # 160 x 300: partial edges
    full = fp8_scale_factors(blocks, 160, 300)
    assert full.shape == (160, 300) and full[0, 0] == 1 and full[127, 255] == 2
    assert full[128, 0] == 4 and full[159, 299] == 6
    channel = torch.rand(4)
    assert torch.equal(fp8_scale_factors(channel, 4, 8)[:, 5], channel)
