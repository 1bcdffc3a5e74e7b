import os
import shutil
import tempfile

import pytest

_cache_dir = None


def pytest_configure(config):
    # Hermetic runs: compiled kernels go to a fresh folder, not the user's
    # disk cache (tests count compiles; a kernel left by an earlier run or a
    # different checkout must not be loaded instead).
    global _cache_dir
    _cache_dir = tempfile.mkdtemp(prefix="warpsplitk-test-cache-")
    os.environ["WARPSPLITK_CACHE_DIR"] = _cache_dir
    # The CuTe DSL fixes its process's arch when first imported (without a GPU
    # its default is sm_100a): set before any test module imports it, so a
    # kernel compiled for sm_90a in this process can be stored whatever test
    # ran first (test_disk_cache after test_precompile failed to export one).
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_unconfigure(config):
    if _cache_dir:
        shutil.rmtree(_cache_dir, ignore_errors=True)


def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
