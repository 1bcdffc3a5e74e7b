"""Tensor parallelism (warpsplitk.nn.parallel, scripts/tp_launch.py) on CPUs.

Sharding arithmetic and its refusals; the NVLink-multicast guard; the
modules in one process (world of one) and in two processes over gloo, where
the local matmul is F.linear; the launcher's CPU smoke run under torchrun.
The tests marked gpu need CUDA (one GPU; the launcher test two).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
import torch.nn.functional as F

from warpsplitk import shapes
from warpsplitk.nn import parallel
from warpsplitk.nn.parallel import (
    MULTICAST_OFF,
    ColumnParallelDecodeLinear,
    MulticastEnabledError,
    RowParallelDecodeLinear,
    check_backend_multicast,
    column_shard,
    ensure_no_multicast,
    kernel_shape_reason,
    multicast_problems,
    row_shard,
    shard_plan,
    shard_range,
)

ROOT = Path(__file__).resolve().parents[1]
TABLE = [(s["n"], s["k"]) for s in shapes.load()["shapes"]]


# --------------------------------------------------------- sharding arithmetic


@pytest.mark.parametrize("size,world", [(64, 1), (64, 2), (768, 4), (7168, 8), (48, 3)])
def test_shard_range_covers_once_in_order(size, world):
    slices = [shard_range(size, r, world) for r in range(world)]
    covered = [i for s in slices for i in range(size)[s]]
    assert covered == list(range(size))
    assert {s.stop - s.start for s in slices} == {size // world}


@pytest.mark.parametrize("n,k", TABLE)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_table_shards_rebuild_the_weight(n, k, world):
    """Wherever a split is legal, the shards put back together are the weight."""
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    splits = shard_plan(n, k, world)
    if isinstance(splits["column"], tuple):
        parts = [w[column_shard(n, k, r, world)] for r in range(world)]
        assert all(tuple(p.shape) == splits["column"] for p in parts)
        assert torch.equal(torch.cat(parts, 0), w)
    if isinstance(splits["row"], tuple):
        parts = [w[:, row_shard(n, k, r, world)] for r in range(world)]
        assert all(tuple(p.shape) == splits["row"] for p in parts)
        assert torch.equal(torch.cat(parts, 1), w)


def test_table_splits_over_two_ranks():
    """Which table shapes split over 2 GPUs: the launcher skips exactly these."""
    refused = {(n, k, mode) for n, k in TABLE
               for mode, shard in shard_plan(n, k, 2).items() if isinstance(shard, str)}
    assert refused == {(3216, 7168, "column"),  # 1608 rows: not a multiple of 16
                       (768, 128, "row"), (1536, 128, "row"), (3072, 128, "row"),  # K/2 = 64
                       (7168, 384, "row")}  # K/2 = 192


@pytest.mark.parametrize("call,words", [
    (lambda: column_shard(100, 256, 0, 3), ["N=100", "not divisible", "world size 3"]),
    (lambda: row_shard(64, 384, 0, 5), ["K=384", "not divisible", "world size 5"]),
    (lambda: column_shard(3216, 7168, 1, 2),
     ["column-parallel", "N/2=1608", "multiple of 16", "1608"]),
    (lambda: row_shard(768, 128, 0, 2), ["row-parallel", "K/2=64", "multiple of 128"]),
    (lambda: row_shard(7168, 384, 1, 2), ["K/2=192", "multiple of 128"]),
    (lambda: column_shard(64, 65792, 0, 2), ["K must be", "up to"]),  # full K too long
    (lambda: row_shard(40, 512, 0, 2), ["N must be a positive multiple of 16", "40"]),
    (lambda: column_shard(64, 256, 2, 2), ["rank must be in 0..1"]),
    (lambda: column_shard(64, 256, 0, 0), ["world size must be a positive integer"]),
    (lambda: column_shard(64, 256, 0, 2, ms=[33]), ["M must be in 1..32"]),
])
def test_refusals_name_the_rule(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_kernel_rules_can_be_skipped():
    assert column_shard(3216, 7168, 1, 2, check_kernel=False) == slice(1608, 3216)
    with pytest.raises(ValueError, match="not divisible"):  # divisibility is never skipped
        column_shard(3217, 7168, 0, 2, check_kernel=False)


def test_kernel_shape_reason_is_the_tactic_rules():
    assert kernel_shape_reason(1024, 2048) is None
    assert "multiple of 16" in kernel_shape_reason(1000, 2048)
    assert kernel_shape_reason(1024, 2048, ms=()) == "no Ms to prepare"


def test_shard_plan_raises_for_bad_arguments_and_returns_shape_refusals():
    np = pytest.importorskip("numpy")
    for args, kwargs, message in (
            ((None, 4096, 2), {}, "N must be a positive integer, got None$"),
            ((4096, 4096.0, 2), {}, r"K must be a positive integer, got 4096\.0$"),
            ((4096, 4096, 0), {}, "world size must be a positive integer, got 0$"),
            ((4096, 4096, True), {}, "world size must be a positive integer, got True$"),
            ((4096, 4096, 2), {"ms": [0]}, r"M must be in 1\.\.32, got 0$"),
            ((4096, 4096, 2), {"ms": 8}, r"ms must be an iterable of Ms in 1\.\.32, got 8$")):
        with pytest.raises(ValueError, match=message):
            shard_plan(*args, **kwargs)
    with pytest.raises(ValueError, match=r"^warp split-K: M must be in 1\.\.32, got 33$"):
        column_shard(64, 256, 0, 2, ms=[33])  # the M itself, not the kernel refusing the shard
    with pytest.raises(ValueError, match=r"M must be in 1\.\.32, got 0$"):
        kernel_shape_reason(1024, 2048, ms=[0])
    # what a shape cannot do is still an answer, for any integer type
    splits = shard_plan(np.int64(4096), np.int64(4096), np.int64(3))
    assert all("not divisible by the world size 3" in splits[mode] for mode in ("column", "row"))
    assert shard_plan(np.int64(4096), np.int32(4096), np.int8(2)) == shard_plan(4096, 4096, 2) \
        == {"column": (2048, 4096), "row": (4096, 2048)}
    assert shard_range(np.int64(64), np.int64(1), np.int64(2)) == slice(32, 64)


def test_constructors_take_no_private_arguments():
    import inspect
    for cls in (ColumnParallelDecodeLinear, RowParallelDecodeLinear):
        assert not any(p.startswith("_") for p in inspect.signature(cls).parameters), cls
    w, b = full()
    # a shard given directly is used in place; one sliced from the full weight is a copy
    assert ColumnParallelDecodeLinear(w, b).weight.data_ptr() == w.data_ptr()
    for cls in (ColumnParallelDecodeLinear, RowParallelDecodeLinear):
        module = cls.from_full_weight(w, bias=b)
        assert module.weight.data_ptr() != w.data_ptr()
        assert "_copy_shards" not in module.__dict__


# ---------------------------------------------------------- multicast guard


def test_guard_sets_unset_variables():
    env = {}
    assert ensure_no_multicast(env) == MULTICAST_OFF
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}
    assert multicast_problems(env) == []
    assert ensure_no_multicast(env) == {}  # already safe: nothing to do


@pytest.mark.parametrize("name,value", [("NCCL_NVLS_ENABLE", "1"),
                                        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0"),
                                        ("NVSHMEM_DISABLE_NVLS", "0")])
def test_guard_refuses_multicast_turned_on(name, value):
    env = {name: value}
    with pytest.raises(MulticastEnabledError, match=f"{name}='{value}'"):
        ensure_no_multicast(env)
    assert env == {name: value}  # refused, not overridden


def test_guard_on_os_environ(monkeypatch):
    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    ensure_no_multicast()
    assert all(os.environ[n] == v for n, v in MULTICAST_OFF.items())
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(MulticastEnabledError, match="NCCL_NVLS_ENABLE"):
        parallel.nccl_env_guard()


def test_backend_check():
    check_backend_multicast("gloo", {"NCCL_NVLS_ENABLE": "1"})  # not NCCL: nothing to check
    with pytest.raises(MulticastEnabledError, match="NCCL_NVLS_ENABLE='1' \\(needs '0'\\)"):
        check_backend_multicast("nccl", {"NCCL_NVLS_ENABLE": "1"})
    with pytest.raises(MulticastEnabledError, match="NVSHMEM_DISABLE_NVLS='0' \\(needs '1'\\)"):
        check_backend_multicast("cpu:gloo,cuda:nccl", dict(MULTICAST_OFF, NVSHMEM_DISABLE_NVLS="0"))
    env = {}
    with pytest.warns(RuntimeWarning, match="before init_process_group"):
        check_backend_multicast("nccl", env)
    assert env == MULTICAST_OFF
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_backend_multicast("nccl", env)  # safe already: silent


# ------------------------------------------------- modules, one process


def full(n=64, k=256, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype))


def test_world_of_one_on_cpu_falls_back_observably():
    w, b = full()
    col = ColumnParallelDecodeLinear.from_full_weight(w, bias=b, gather_output=True)
    row = RowParallelDecodeLinear.from_full_weight(w, bias=b)
    x = torch.randn(3, 256)
    for module in (col, row):
        assert (module.rank, module.world, module.use_kernel) == (0, 1, False)
        torch.testing.assert_close(module(x), F.linear(x, w, b))
        assert (module.kernel_calls, module.fallback_calls) == (0, 1)
        assert "F.linear" in repr(module)
    assert row.adds_bias and row.weight.data_ptr() != w.data_ptr()  # a copy, not a view


def test_module_refusals():
    w, b = full(n=1608, k=256)  # a shard of 3216 rows over 2 ranks
    with pytest.raises(ValueError, match="needs an initialized torch.distributed"):
        ColumnParallelDecodeLinear.from_full_weight(full()[0], rank=0, world=2)
    with pytest.raises(ValueError, match="use_kernel=True needs a CUDA device"):
        ColumnParallelDecodeLinear(full()[0], use_kernel=True)
    with pytest.raises(ValueError, match="multiple of 16"):  # a shard the kernel cannot take
        ColumnParallelDecodeLinear(w)
    ColumnParallelDecodeLinear(w, use_kernel=False)  # F.linear on purpose: no kernel rules
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(64,\), got \(32,\)"):
        ColumnParallelDecodeLinear(full()[0], torch.zeros(32))
    with pytest.raises(ValueError, match="full"):
        RowParallelDecodeLinear(full()[0], torch.zeros(32))
    row = RowParallelDecodeLinear(full()[0])
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 256\]"):
        row(torch.randn(2, 128))
    # what is not a tensor of the right kind is refused by name, not by a stray error
    column = ColumnParallelDecodeLinear(full()[0])
    for module, mode in ((row, "row"), (column, "column")):
        with pytest.raises(ValueError, match=rf"^{mode}-parallel rank 0: x must be a tensor "
                                             r"\[\.\.\., K\], got torch\.Size\(\[\]\)$"):
            module(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \(64,\), got list$"):
        ColumnParallelDecodeLinear(full()[0], [0.0] * 64)
    with pytest.raises(ValueError, match=r"row-parallel bias must be the full \[N=64\], got list$"):
        RowParallelDecodeLinear(full()[0], [0.0] * 64)
    with pytest.raises(ValueError, match=r"full weight must be a 2-D torch\.Tensor \[N, K\]"):
        ColumnParallelDecodeLinear.from_full_weight(torch.zeros(64), rank=0, world=1)
    with pytest.raises(ValueError, match="plan must be a DecodePlan, None or 'auto', got 'h200'"):
        ColumnParallelDecodeLinear(full()[0], plan="h200")
    with pytest.raises(ValueError, match=r"M must be in 1\.\.32, got 0$"):
        RowParallelDecodeLinear(full()[0], ms=[0, 8])


# ------------------------------------------------- two processes over gloo


def _worker(rank, world, store, dtype_name, out_dir):
    os.environ.update(MULTICAST_OFF)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dtype = getattr(torch, dtype_name)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.5, rtol=2e-2)
        n, k = 64, 512
        w, b = full(n, k, dtype, seed=1)
        col = ColumnParallelDecodeLinear.from_full_weight(w, bias=b, ms=range(1, 17))
        colg = ColumnParallelDecodeLinear.from_full_weight(w, bias=b, gather_output=True)
        row = RowParallelDecodeLinear.from_full_weight(w, bias=b, ms=range(1, 17))
        rowp = RowParallelDecodeLinear.from_full_weight(w, bias=b, input_is_parallel=True)
        assert (col.rank, col.world, col.backend) == (rank, world, "gloo")
        assert row.adds_bias == (rank == 0) and (row.local.bias is None) == (rank != 0)
        assert col.output_slice == slice(rank * n // world, (rank + 1) * n // world)
        ks = row.input_slice
        assert ks == slice(rank * k // world, (rank + 1) * k // world)
        # M = 1 (gather in place, x slice without a copy), 5 and 16 (buffers),
        # 24 (more rows than the buffers: allocated), and leading dims
        for shape in [(1, k), (5, k), (16, k), (24, k), (2, 3, k)]:
            gen = torch.Generator().manual_seed(sum(shape))
            x = torch.randn(*shape, generator=gen).to(dtype)
            ref = F.linear(x.double(), w.double(), b.double()).to(dtype)
            torch.testing.assert_close(col(x), ref[..., col.output_slice], **tol)
            torch.testing.assert_close(colg(x), ref, **tol)
            torch.testing.assert_close(col(x, gather_output=True), ref, **tol)
            torch.testing.assert_close(row(x), ref, **tol)
            xp = x[..., ks].contiguous()
            torch.testing.assert_close(rowp(xp), ref, **tol)
            torch.testing.assert_close(row(xp, input_is_parallel=True), ref, **tol)
        for module in (col, colg, row, rowp):
            assert not module.use_kernel and module.kernel_calls == 0
            assert module.fallback_calls > 0
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"fallback_calls": col.fallback_calls, "repr": repr(row)}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_two_ranks_over_gloo_match_f_linear(tmp_path, dtype_name):
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), dtype_name, str(tmp_path)), nprocs=2,
             join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["fallback_calls"] for r in reports] == [10, 10]
    assert "rank=1/2" in reports[1]["repr"] and "bias=no" in reports[1]["repr"]


def _launch_env():
    env = dict(os.environ, **MULTICAST_OFF)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_launcher_cpu_smoke(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "tp_launch.py"), "--backend", "gloo", "--device", "cpu",
           "--shapes", "64,256", "768,128", "--ms", "1,8", "--json", str(out)]
    done = subprocess.run(cmd, env=_launch_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["backend"] == "gloo"
    cases = {(r["mode"], r["n"], r["m"], r["rank"]) for r in result["rows"]}
    # 64x256: both splits; 768x128: column only (K/2 = 64 refused for row)
    assert cases == {(mode, n, m, rank) for mode, n in
                     [("column", 64), ("row", 64), ("column", 768)]
                     for m in (1, 8) for rank in (0, 1)}
    assert all(r["ok"] and r["path"] == "F.linear" for r in result["rows"])
    assert [(s["n"], s["mode"]) for s in result["skipped"]] == [(768, "row")]
    assert "multiple of 128" in result["skipped"][0]["reason"]
    assert all(e["multicast_env"] == MULTICAST_OFF for e in result["env"])
    assert "skipped row-parallel N=768 K=128" in done.stdout


def test_launcher_refuses_multicast(tmp_path):
    env = _launch_env()
    env["NCCL_NVLS_ENABLE"] = "1"
    cmd = [sys.executable, str(ROOT / "scripts" / "tp_launch.py"), "--backend", "gloo",
           "--device", "cpu", "--shapes", "64,256"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "MulticastEnabledError" in done.stderr and "NCCL_NVLS_ENABLE='1'" in done.stderr


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["column", "row"])
def test_world_of_one_kernel_and_graph(mode):
    """One GPU, no process group: the kernel path, captured in a graph."""
    n, k = 1024, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    cls = ColumnParallelDecodeLinear if mode == "column" else RowParallelDecodeLinear
    module = cls.from_full_weight(w, bias=b, ms=(1, 8))
    assert module.use_kernel and module.device == w.device

    def err(out, x):
        ref = x.double() @ w.double().t() + b.double()
        return ((out.double() - ref).norm() / ref.norm()).item()

    for m in (1, 8):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert err(module(x), x) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(x)
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert err(out, x) < 1e-2
    assert module.fallback_calls == 0 and module.kernel_calls == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_two_gpu_launcher(tmp_path):
    """NCCL, 2 GPUs: a few table shapes, every check, quick timings."""
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "tp_launch.py"), "--shapes", "2048,2048", "768,7168",
           "1536,128", "--ms", "1,8,32", "--replays", "3", "--max-copies", "8",
           "--json", str(out)]
    done = subprocess.run(cmd, env=_launch_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["ok"] and r["path"] == "kernel" for r in rows)
    assert all(any(key.startswith("graph_") for key in r["rel_err"]) for r in rows)
    assert all(r["timing"]["kernel_us"] > 0 and r["timing"]["comm_us"] > 0 for r in rows)
