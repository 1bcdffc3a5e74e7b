"""The quick tune, the FP8 tune, the cost model's cuBLAS fallback and a
model's layer chain on a real GPU."""

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


def _fp8_runs_match_float64(prepared, w8, scale, ms):
    """``prepared`` (an e4m3 ``w8`` with ``scale``) at each M of fresh x,
    ``out`` NaN-poisoned first, within 1e-2 of float64."""
    from warpsplitk.contract import fp8_scale_factors
    n, k = w8.shape
    dequant = w8.double() * fp8_scale_factors(scale, n, k).double()
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.run(x, out)
        torch.cuda.synchronize()
        ref = x.double() @ dequant.t()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert not out.isnan().any() and err < 1e-2, (m, err)


def test_fp8_tune_writes_fp8_entries_that_prepare_runs(tmp_path):
    """`warpsplitk tune --dtype fp8 --scales block128` on one small shape: a
    plan of block-scale FP8 entries only, each the fastest of the FP8
    candidates its M measured; prepare runs them on an e4m3 weight with
    block scales, within 1e-2 of float64."""
    from warpsplitk.cli import main
    from warpsplitk.planning.plans import load_plan
    from warpsplitk.planning.tune import candidates
    from warpsplitk.runtime import timing
    n, k = 512, 1024
    out, log = tmp_path / "plan.json", tmp_path / "log.jsonl"
    assert main(["tune", "--dtype", "fp8", "--scales", "block128", "--shapes", f"{n},{k}",
                 "--m", "1,8", "-o", str(out), "--log", str(log)]) == 0
    plan = load_plan(out)
    assert json.loads(out.read_text())["version"] == 2
    assert plan.entries == {} and list(plan.fp8_entries) == ["block128"]
    assert sorted(plan.fp8_entries["block128"][(n, k)]) == [1, 5, 6, 7, 8]
    records = [r for r in map(json.loads, log.read_text().splitlines()) if "key" in r]
    assert records and all(r["fp8"] == "block128" for r in records)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 8):
        timed = {r["tactic"] for r in records
                 if r["m"] == m and r.get("ok") and not r.get("confirm")}
        assert timed and timed <= {t.short() for t in candidates(m, n, k, sms,
                                                                 fp8_scales="block128")}
        assert plan.lookup(n, k, m, fp8_scales="block128").short() in timed
    (w8,), (scale,) = timing.random_fp8(n, k, 1, seed=7, scales="block128")
    prepared = prepare(w8, plan, (1, 5, 8), weight_scale=scale)
    assert prepared.tactics == {m: plan.lookup(n, k, m, fp8_scales="block128")
                                for m in (1, 5, 8)}
    _fp8_runs_match_float64(prepared, w8, scale, (1, 5, 8))


def test_auto_tunes_an_fp8_weight_as_fp8_and_keeps_it(tmp_path, monkeypatch):
    """plan="auto" for an e4m3 weight: its shape tuned as FP8 into this
    GPU's cached plan, whose FP8 entry prepare then runs."""
    from warpsplitk.planning import plan_cache
    from warpsplitk.runtime import timing
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path / "cache"))
    n, k = 256, 512
    (w8,), (scale,) = timing.random_fp8(n, k, 1, seed=3, scales="tensor")
    prepared = prepare(w8, "auto", (1,), weight_scale=scale)
    properties = torch.cuda.get_device_properties(0)
    key = plan_cache.gpu_key(properties.name, properties.multi_processor_count)
    cached = plan_cache.load(key)
    assert prepared.tactics == {1: cached.lookup(n, k, 1, fp8_scales="tensor")}
    assert cached.lookup(n, k, 1) is None  # no BF16 entry came of it
    assert cached.lookup(n, k, 1, fp8_scales="channel") is None  # nor another kind's
    _fp8_runs_match_float64(prepared, w8, scale, (1,))


@pytest.mark.parametrize("n,k,ms,expected", [
    (48, 16384, (1, 8, 32), ()),          # K past CUBLAS_MAX_K: the kernel at every M
    (64, 29568, (1, 8, 9, 32), (9, 32)),  # K that needs four CTAs: cuBLAS past M = 8
], ids=["model", "four-ctas"])
def test_default_choice_runs_cublas_where_the_default_says_so(n, k, ms, expected):
    cublas_ms = [m for m in ms if default_choice(m, n, k) == CUBLAS]
    assert tuple(cublas_ms) == expected
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prepared = prepare(w, DecodePlan(), ms)
    for m in ms:
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
