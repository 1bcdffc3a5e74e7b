"""The quick tune, the cost model's cuBLAS fallback and a model's layer chain on a real GPU."""

import json

import pytest

torch = pytest.importorskip("torch")

from warpsplitk.measure import bench
from warpsplitk.planning import choose  # noqa: E402
from warpsplitk.planning.plans import CUBLAS, DecodePlan, default_choice, prepare  # noqa: E402
from warpsplitk.tactics import check_tactic  # noqa: E402
from warpsplitk.planning.tune import tune  # noqa: E402

pytestmark = pytest.mark.gpu


def test_quick_tune_measures_the_shortlist_and_plans_every_m(tmp_path):
    n, k = 1024, 2048
    log = tmp_path / "log.jsonl"
    plan = tune([(n, k)], [1, 2, 8], log_path=str(log), progress=lambda line: None)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # the run's provenance line names the GPU (`tune --from-log` reads it)
    assert records[0]["meta"]["gpu"] == torch.cuda.get_device_name()
    assert records[0]["meta"]["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
    timed = {(r["m"], r["tactic"]) for r in records if r.get("ok") and not r.get("confirm")}
    # every kernel timing is of the shortlist of its measured M (4 serves 2..4)
    for m in (1, 4, 8):
        shortlist = {t.short() for t in choose.shortlist(m, n, k)}
        mine = {t for mm, t in timed if mm == m and t != CUBLAS}
        assert mine and mine <= shortlist, (m, mine - shortlist)
        assert (m, CUBLAS) in timed
    for m in (1, 2, 8):
        choice = plan.lookup(n, k, m)
        assert choice == CUBLAS or check_tactic(choice, n, k) is None


def test_default_choice_runs_cublas_where_the_model_says_so():
    # a 48-row weight over K = 16384: three CTAs of the kernel; the model
    # predicts cuBLAS faster at small M
    n, k = 48, 16384
    cublas_ms = [m for m in (1, 8, 32) if default_choice(m, n, k) == CUBLAS]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = prepare(w, DecodePlan(), (1, 8, 32))
    for m in (1, 8, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)
        ref = x.double() @ w.double().t()
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
        assert (prepared.tactics[m] == CUBLAS) == (m in cublas_ms)


def test_layer_chain_of_a_small_model_is_checked_and_timed():
    rows = bench.bench_layer("qwen3-0.6b", 8, (1, 8), progress=lambda line: None, rounds=1)
    assert [r.m for r in rows] == [1, 8]
    for r in rows:
        assert r.projections.count("->") == 3  # qkv -> o -> gate_up -> down
        assert r.ours_us > 0 and r.reference_us > 0 and r.cublas_us > 0
        assert r.floor_us < r.ours_us


def test_a_chain_runs_the_kernel_where_an_independent_call_runs_cublas():
    # 9728 x 2560 at M = 32: cuBLAS on its own, the kernel between kernel calls
    first, second = (9728, 2560), (2560, 9728)
    assert default_choice(32, *first) == CUBLAS
    rows = bench.bench_chain([(first, second)], (1, 32), progress=lambda line: None, rounds=1)
    assert [r.m for r in rows] == [1, 32]
    for r in rows:
        assert CUBLAS not in r.tactics.split(" -> ")
        assert r.ours_us > 0 and r.cublas_us > 0 and r.floor_us < r.ours_us
