"""measure/hf_fp8: a source checkout of kernels-community's finegrained-fp8
found under any of its three folders, imported with the op namespace a Hub
build would generate, and handed to transformers' FP8Linear."""
import sys

import pytest

from warpsplitk.measure import hf_fp8

# a stand-in for the package: the same imports and entry points, no Triton
INIT = "from .matmul import matmul_2d, matmul_batched, matmul_grouped\n"
MATMUL = """from ._ops import add_op_namespace_prefix, ops
NAME = add_op_namespace_prefix("w8a8_block_dynamic_fp8_matmul")
def matmul_2d(a, b, bs, block_size, output_dtype=None, activation_scale=None):
    return ("2d", a, b, bs, tuple(block_size), output_dtype)
def matmul_batched(*args):
    return "batched"
def matmul_grouped(*args):
    return "grouped"
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    package = tmp_path / "kernels-community" / "finegrained-fp8" / "torch-ext" / hf_fp8.PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(INIT)
    (package / "matmul.py").write_text(MATMUL)
    for name in [m for m in sys.modules if m.split(".")[0] == hf_fp8.PACKAGE]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path / "kernels-community"
    for name in [m for m in sys.modules if m.split(".")[0] == hf_fp8.PACKAGE]:
        del sys.modules[name]


def test_the_package_is_found_from_the_checkout_the_kernel_or_itself(checkout):
    package = checkout / "finegrained-fp8" / "torch-ext" / hf_fp8.PACKAGE
    for path in (checkout, checkout / "finegrained-fp8", package):
        assert hf_fp8.package_dir(path) == package


def test_anything_else_is_refused_naming_what_was_given(tmp_path):
    with pytest.raises(ValueError, match="finegrained-fp8.*got '.*nowhere'"):
        hf_fp8.package_dir(tmp_path / "nowhere")
    (tmp_path / "__init__.py").write_text("")  # a package, but not this one
    with pytest.raises(ValueError, match="expected kernels-community"):
        hf_fp8.package_dir(tmp_path)


def test_a_source_checkout_gets_the_op_namespace_a_hub_build_generates(checkout):
    package = hf_fp8.load_package(checkout)
    assert package.matmul.NAME == f"{hf_fp8.LOCAL_OP_NAMESPACE}::w8a8_block_dynamic_fp8_matmul"
    assert hf_fp8.load_package(checkout / "elsewhere") is package  # once a process


def test_transformers_fp8_linear_calls_the_local_kernel(checkout, monkeypatch):
    hf = pytest.importorskip("transformers.integrations.finegrained_fp8")
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(hf, "load_finegrained_fp8_kernel", hf.load_finegrained_fp8_kernel)
    assert "finegrained-fp8" in hf_fp8.use_local_kernel(checkout)
    kernel = hf.load_finegrained_fp8_kernel()
    assert (kernel.matmul, kernel.batched_matmul(), kernel.grouped_matmul()) == (
        sys.modules[hf_fp8.PACKAGE].matmul_2d, "batched", "grouped")
    assert kernel.matmul_2d is kernel.matmul  # the package's own names too
    a, w = torch.ones(2, 128, dtype=torch.bfloat16), torch.ones(128, 128)
    called = hf.finegrained_fp8_linear(a, w, torch.ones(1, 1), [128, 128])
    assert called[0] == "2d" and called[1] is a and called[4] == (128, 128)
