"""scripts/stress_tactics.py's diagnosis, on made-up wrong outputs (no GPU)."""

import pytest

torch = pytest.importorskip("torch")

from script_loader import load_script
from warpsplitk import WarpSplitKTactic


def _script():
    return load_script("stress_tactics")


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(17, 384, generator=gen).bfloat16()
    before = torch.randn(17, 384, generator=gen).bfloat16()
    w = torch.randn(64, 384, generator=gen).bfloat16()
    return x, before, w


def _out(x_seen, w):
    return (x_seen.double() @ w.double().t()).bfloat16()


def test_a_stage_read_after_its_refill_is_named(inputs):
    """Tile 0's first K quarter read from tile 2 (the unfenced race): token 16's
    outputs, chunk #0 of 32 read as chunk #8."""
    x, before, w = inputs
    seen = x.clone()
    seen[16, 0:32] = x[16, 256:288]
    text = _script().where_wrong(_out(seen, w), x.double() @ w.double().t(),
                                 WarpSplitKTactic.parse("16,8,128,2,1+tma"), x, w, before)
    assert "token rows [16] (token tiles [2])" in text
    assert text.count("chunk #0 of 32 K read x chunk #8") == 3


def test_stale_and_dropped_chunks_are_named(inputs):
    x, before, w = inputs
    script = _script()
    for r, c in ((3, 10), (9, 40)):
        d_stale = ((before[r, 80:96].double() - x[r, 80:96].double())
                   * w[c, 80:96].double()).sum().item()
        assert "chunk #5 of 16 K stale (leaves 0.00)" in script._best_chunk_story(
            d_stale, x[r].double(), before[r].double(), w[c].double())
        d_drop = -(x[r, 160:176].double() * w[c, 160:176].double()).sum().item()
        assert "chunk #10 of 16 K dropped (leaves 0.00)" in script._best_chunk_story(
            d_drop, x[r].double(), before[r].double(), w[c].double())
