"""The CuTe DSL boundary: importing it with an install hint, the pointer
arguments compiled code takes, and ``build``, which traces and compiles one
kernel. The DSL itself is imported on first use, so importing this module
costs nothing on a machine without it.
"""

from __future__ import annotations

import importlib.util

from ..contract import ALIGN_BYTES

#: What compiles the kernels (a dependency of the package; named when missing).
DSL_REQUIREMENT = "nvidia-cutlass-dsl[cu13]==4.8.1"


def _missing_dsl(error) -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"compiling a kernel needs the CuTe DSL, which is not installed ({error}); "
        f"pip install '{DSL_REQUIREMENT}'", name="cutlass")


def require_dsl() -> None:
    """Raise ``ModuleNotFoundError`` naming ``DSL_REQUIREMENT`` unless the
    CuTe DSL can be imported (looked up, not imported: worker processes
    compile, and a missing DSL is said once, before any of them starts)."""
    try:
        found = importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError) as error:  # a broken or stubbed-out entry
        raise _missing_dsl(error) from error
    if not found:
        raise _missing_dsl("No module named 'cutlass'")


def import_dsl():
    """The CuTe DSL modules (cutlass, cutlass.cute); a missing DSL raises
    the install hint (``_missing_dsl``) instead of a bare ImportError."""
    try:
        import cutlass
        import cutlass.cute as cute
    except ImportError as error:  # a source checkout without its dependencies
        raise _missing_dsl(error) from error
    return cutlass, cute


def gmem_pointer(address: int):
    """A CuTe global-memory BF16 pointer argument for compiled code (32 B aligned)."""
    cutlass, cute = import_dsl()
    from cutlass.cute.runtime import make_ptr
    return make_ptr(cutlass.BFloat16, address, cute.AddressSpace.gmem, assumed_align=ALIGN_BYTES)


def fake_args(pointers=4):
    """Stand-ins of the compiled signature: ``pointers`` 32 B aligned
    pointers (5 with FP8 weights: the scales), a run-time M and a stream.
    The addresses are never dereferenced."""
    cutlass, _ = import_dsl()
    from cutlass.cute.runtime import make_fake_stream
    addresses = [gmem_pointer(0x1000 * (i + 1)) for i in range(pointers)]
    return (*addresses, cutlass.Int32(1), make_fake_stream())


def build(n, k, tactic, has_bias, use_pdl, arch, options="", swiglu=False, fp8_scales=None):
    """Trace and compile the kernel for an ``[n, k]`` weight and ``tactic``
    (checked by the caller) for ``arch``, with extra compiler ``options``.
    ``fp8_scales`` "tensor", "channel" or "block128": the kernel for e4m3
    weights with those scales (``WarpSplitKFp8Kernel``)."""
    _, cute = import_dsl()
    from ..kernel.warp_splitk import WarpSplitKFp8Kernel, WarpSplitKKernel  # imports the DSL
    if fp8_scales is None:
        kernel = WarpSplitKKernel(tactic, n, k, has_bias=has_bias, use_pdl=use_pdl, swiglu=swiglu)
        args = fake_args()
    else:
        kernel = WarpSplitKFp8Kernel(tactic, n, k, has_bias=has_bias, use_pdl=use_pdl,
                                     scales=fp8_scales, swiglu=swiglu)
        args = fake_args(5)
    # the target goes in the options: CUTE_DSL_ARCH is read once per process
    return cute.compile(kernel, *args, options=f"--gpu-arch {arch} {options}".strip())


__all__ = ["DSL_REQUIREMENT", "require_dsl", "import_dsl", "gmem_pointer", "fake_args", "build"]
