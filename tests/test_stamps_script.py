"""scripts/stamps.py's analysis, on made-up stamps (no GPU)."""

import pytest

torch = pytest.importorskip("torch")

from script_loader import load_script

GHZ = 2.0


def _stamps(calls=4, ctas=3, tiles=4):
    """Call c's CTA j starts at 1000 c + 10 j ns (CTA 2 700 ns earlier, 80 ns
    before the previous call's last store); each later slot follows 100 ns
    after the one before, tiles 30 ns apart; the cycle counter runs at GHZ."""
    script = load_script("stamps")
    slot = script.SLOT
    stamps = torch.zeros(calls, ctas, script.SLOTS_PER_CTA, 2, dtype=torch.int64)
    for c in range(calls):
        for j in range(ctas):
            base = 10_000 + 1000 * c + 10 * j  # a zero stamp would read as missing
            times = {"start": base - (700 if j == 2 else 0)}
            for name in ("x_wait_released", "first_stage_ready", "last_stage_ready",
                         "partials_stored", "reduced", "stored"):
                times[name] = base + 100 * slot[name]
            times["weight_landed"] = times["x_wait_released"] + 250
            for name, ns in times.items():
                stamps[c, j, slot[name]] = torch.tensor([ns, int(ns * GHZ)])
            stamps[c, j, slot["smid"], 0] = j
            for i in range(tiles):
                ns = times["first_stage_ready"] + 30 * i
                stamps[c, j, script.STAMP_STAGE_SLOT + i] = torch.tensor([ns, int(ns * GHZ)])
    return script, stamps


def test_intervals_of_the_cta_that_stores_last():
    script, stamps = _stamps()
    got = script.analyse(stamps, k_tiles=4)
    assert got["ghz"] == pytest.approx(GHZ)
    assert got["period"] == 1000  # last store to last store
    # first release of call c (CTA 0: 1000 c + 100) after call c-1's last store (1000 (c-1) + 620)
    assert got["release"] == 480
    assert got["early"] == 1  # CTA 2 started before the previous call's last store
    assert got["wait"] == 800  # CTA 2 (the last to store): its start to its release
    assert got["x1"] == got["stages"] == got["last"] == got["reduce"] == got["store"] == 100
    assert got["weight"] == 250 and got["post_wait"] == 500
    assert got["tiles_last"] == [100, 130, 160, 190]  # ns after the release
    assert got["sms"] == 3 and got["missing_stamps"] == 0


def test_missing_stamps_are_counted():
    script, stamps = _stamps()
    stamps[1, 0, script.SLOT["reduced"]] = 0
    assert script.analyse(stamps, k_tiles=4)["missing_stamps"] == 1
