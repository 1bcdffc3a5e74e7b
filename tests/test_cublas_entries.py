"""Plan entries that run cuBLAS (plans.CUBLAS): plans, prepare, PreparedDecode,
the plan view (CPU)."""

import json

import pytest
import torch
import torch.nn.functional as F

from warpsplitk import contract
from warpsplitk.runtime import prepared as prepared_module
from warpsplitk.cli import main
from warpsplitk.planning.plans import CUBLAS, DecodePlan, load_plan, plan_from_json, prepare
from warpsplitk.runtime.prepared import PreparedDecode
from warpsplitk.tactics import WarpSplitKTactic

N, K = 256, 512
TACTIC = WarpSplitKTactic(16, 8, 128, 2, 1)


@pytest.fixture(autouse=True)
def cpu_weights(monkeypatch):
    """cuBLAS entries and the fake kernel run on CPU tensors here."""
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cpu")


def mixed_plan():
    plan = DecodePlan(meta={"gpu": "test"})
    plan.set(N, K, 1, TACTIC, 3.0)
    plan.set(N, K, 8, CUBLAS, 2.5)
    return plan


def test_cublas_entries_round_trip_through_the_file(tmp_path):
    path = tmp_path / "plan.json"
    mixed_plan().save(path)
    text = json.loads(path.read_text())
    assert text["shapes"][0]["entries"]["8"] == {"tactic": "cublas", "us": 2.5}
    plan = load_plan(path)
    assert plan.lookup(N, K, 8) == CUBLAS and plan.lookup(N, K, 1) == TACTIC
    assert plan.tactic_for(N, K, 8) == CUBLAS
    with pytest.raises(ValueError, match=r"N=256 K=512 M=2: .*tactic is five integers"):
        plan_from_json({"format": "warpsplitk-plan", "version": 1, "shapes": [
            {"n": N, "k": K, "entries": {"2": {"tactic": "cuBLAS"}}}]})


def _weights(bias=False):
    torch.manual_seed(0)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    b = torch.randn(N, dtype=torch.bfloat16) if bias else None
    return w, b

def test_a_chained_lookup_keeps_the_plans_cublas_and_falls_back_to_the_chained_default():
    from warpsplitk.planning.plans import default_choice
    plan = mixed_plan()
    # a plan entry is a measurement: kept in a chain too
    assert plan.tactic_for(N, K, 8, chained=True) == CUBLAS
    # 9728 x 2560 at M = 32: cuBLAS without a plan, the kernel between kernel calls
    assert DecodePlan().tactic_for(9728, 2560, 32, 132) == CUBLAS
    chained = DecodePlan().tactic_for(9728, 2560, 32, 132, chained=True)
    assert chained != CUBLAS and chained == default_choice(32, 9728, 2560, 132, chained=True)



@pytest.mark.parametrize("bias", [False, True])
def test_all_cublas_plan_prepares_without_a_kernel(bias):
    w, b = _weights(bias)
    plan = DecodePlan()
    for m in (1, 8):
        plan.set(N, K, m, CUBLAS)
    prepared = prepare(w, plan, ms=(1, 8), bias=b)
    assert isinstance(prepared, PreparedDecode) and prepared.kernel is None
    assert prepared.ms == (1, 8) and prepared.tactics == {1: "cublas", 8: "cublas"}
    x = torch.randn(8, K, dtype=torch.bfloat16)
    out = torch.full((8, N), float("nan"), dtype=torch.bfloat16)
    assert prepared.run(x, out) is out
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=2e-2, atol=2e-2)
    with pytest.raises(KeyError, match="no tactic prepared for M=4"):
        prepared.run(torch.randn(4, K, dtype=torch.bfloat16),
                     torch.empty(4, N, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must not overlap x"):
        both = torch.empty(8 * (K + N), dtype=torch.bfloat16)
        prepared.run(both[:8 * K].view(8, K), both[:8 * N].view(8, N))


class FakeKernel:
    """A PreparedWarpSplitK stand-in (no GPU): records which Ms reach the kernel."""

    def __init__(self, weight, tactics, bias=None):
        self.weight, self.tactics, self.bias, self.seen = weight, dict(tactics), bias, []

    def launch_unchecked(self, x, out):
        self.seen.append(x.shape[0])
        return out.copy_(F.linear(x, self.weight, self.bias))


def test_mixed_plan_sends_each_m_to_its_path(monkeypatch):
    monkeypatch.setattr(prepared_module, "PreparedWarpSplitK", FakeKernel)
    w, b = _weights(bias=True)
    prepared = prepare(w, mixed_plan(), ms=(1, 8), bias=b)
    assert isinstance(prepared, PreparedDecode)
    assert prepared.kernel.tactics == {1: TACTIC} and prepared.cublas_ms == (8,)
    for m in (1, 8, 8, 1):
        x = torch.randn(m, K, dtype=torch.bfloat16)
        out = torch.empty(m, N, dtype=torch.bfloat16)
        torch.testing.assert_close(prepared.run(x, out), F.linear(x, w, b), rtol=2e-2,
                                   atol=2e-2)
    assert prepared.kernel.seen == [1, 1]  # M = 8 never reached the kernel
    assert "8: (cublas)" in repr(prepared) and "1: (16,8,128,2,1)" in repr(prepared)


def test_prepared_decode_refuses_what_it_cannot_run():
    w, _ = _weights()
    with pytest.raises(ValueError, match="M=1 has both a tactic and cuBLAS"):
        PreparedDecode(w, {1: TACTIC}, [1])
    with pytest.raises(ValueError, match="at least one cuBLAS M"):
        PreparedDecode(w, {1: TACTIC}, [])
    with pytest.raises(ValueError, match="cuBLAS Ms are in 1..32, got 33"):
        PreparedDecode(w, {}, [33])
    with pytest.raises(ValueError, match="weight must be bfloat16"):
        PreparedDecode(w.float(), {}, [1])


def test_prepared_decode_needs_a_weight_the_kernel_could_take(monkeypatch):
    # cuBLAS alone would run on the CPU; a prepared weight still lives on the GPU
    monkeypatch.setattr(contract, "DEVICE_TYPE", "cuda")
    w, _ = _weights()
    with pytest.raises(ValueError, match="weight must be on a CUDA device, got cpu"):
        PreparedDecode(w, {}, [1])
    plan = DecodePlan()
    plan.set(N, K, 1, CUBLAS)
    with pytest.raises(ValueError, match="weight must be on a CUDA device, got cpu"):
        prepare(w, plan, ms=(1,))


def test_plan_view_shows_cublas_entries(tmp_path, capsys):
    path = tmp_path / "plan.json"
    mixed_plan().save(path)
    assert main(["plan", "--plan", str(path), "--shapes", f"{N},{K}", "--m", "1,8",
                 "--no-compile"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if f" {N}   {K} " in line]
    assert len(rows) == 2
    assert "16,8,128,2,1" in rows[0] and rows[0].split()[:2] == [f"{N}×{K}", "plan"]
    assert rows[1].split()[1:6] == ["plan", str(N), str(K), "8", "cublas"]
    assert rows[1].split()[-1] == "2.50"


# ------------------------------------------------------ the tuner's cuBLAS timings


def _log(path, records):
    with open(path, "w") as f:
        for n, k, m, tactic, us in records:
            f.write(json.dumps({"key": f"{n},{k},{m},{tactic}", "n": n, "k": k, "m": m,
                                "tactic": tactic, "ok": True, "us": us, "rev": 3}) + "\n")


def test_plan_from_log_takes_cublas_only_where_it_wins_by_the_margin(tmp_path):
    from warpsplitk.planning.selection import REPRESENTATIVE_MS, plan_from_log
    a = "16,8,256,4,1"
    records = [(1024, 4096, r, a, 5.0) for r in REPRESENTATIVE_MS]
    records += [(1024, 4096, 1, "cublas", 5.5),    # slower: the kernel stays
                (1024, 4096, 8, "cublas", 4.95),   # within 2%: a tie stays with the kernel
                (1024, 4096, 32, "cublas", 4.0)]   # faster by 25%: cuBLAS
    _log(tmp_path / "log.jsonl", records)
    plan, partial = plan_from_log(str(tmp_path / "log.jsonl"), meta={"gpu": "test"})
    assert partial == {}
    by_m = plan.entries[(1024, 4096)]
    assert by_m[1][0].short() == a and by_m[8][0].short() == a
    assert by_m[32] == (CUBLAS, 4.0) and by_m[25] == (CUBLAS, None)  # the bucket's choice
    assert by_m[24][0].short() == a
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path).lookup(1024, 4096, 30) == CUBLAS


def test_cublas_records_are_current_and_never_stale():
    from warpsplitk.planning.selection import prefer_cublas
    from warpsplitk.planning.tune_log import _current, is_stale, log_key
    rec = {"tactic": "cublas", "n": 1, "k": 1, "m": 1, "rev": 1}
    assert _current(rec) and not is_stale(rec)
    assert log_key(4096, 4096, 8, CUBLAS) == "4096,4096,8,cublas"
    best = {(1, 1, 1): (TACTIC, 10.0), (1, 1, 8): (TACTIC, 10.0), (1, 1, 16): (TACTIC, None)}
    chosen = prefer_cublas(best, {(1, 1, 1): 9.0, (1, 1, 8): 9.9, (1, 1, 16): 1.0})
    assert chosen == {(1, 1, 1): (CUBLAS, 9.0), (1, 1, 8): (TACTIC, 10.0),
                      (1, 1, 16): (TACTIC, None)}


def test_a_k_that_needs_four_ctas_runs_cublas_past_m_8_without_a_plan():
    """8192x29568 (K past 128 tiles of 128) measured the default slower than
    cuBLAS at M = 16 and 32, faster at M <= 8; a K split over three CTAs
    (4608x36864) measured faster at every M and stays on the kernel."""
    from warpsplitk.planning.choose import FOUR_CTA_CUBLAS_MIN_M
    from warpsplitk.planning.plans import default_choice
    assert FOUR_CTA_CUBLAS_MIN_M == 8
    assert [default_choice(m, 8192, 29568, 132) == CUBLAS for m in (1, 8, 9, 16, 32)] \
        == [False, False, True, True, True]
    assert default_choice(32, 8192, 29568, 132, chained=True) == CUBLAS
    assert all(default_choice(m, 4608, 36864, 132) != CUBLAS for m in (1, 8, 16, 32))
