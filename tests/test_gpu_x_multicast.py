"""The experimental activation multicast (x_multicast 2 to 4) on the GPU.

Its own module so that the device session runs it in its own process with a
short time limit: a fault in the cluster protocol would hang, and must not
take the other kernel tests with it.
"""

import pytest

torch = pytest.importorskip("torch")

from warpsplitk import PreparedWarpSplitK, WarpSplitKTactic  # noqa: E402

from test_gpu_kernel import check_tactic_with_and_without_bias  # noqa: E402

pytestmark = pytest.mark.gpu


# A cluster of x_multicast CTAs along N loads each activation stage once and
# multicasts it to all. Ms across the token-tile boundaries: rows past M are
# never copied, and a member may own no row inside M (M = 1 with 4 members).
MULTICAST_CASES = [
    (WarpSplitKTactic(16, 16, 256, 4, 1, 1, 2), 1536, 7168),
    (WarpSplitKTactic(32, 32, 256, 4, 1, 1, 2), 2624, 6144),
    (WarpSplitKTactic(16, 32, 256, 4, 1, 1, 4), 4224, 7168),
    (WarpSplitKTactic(16, 32, 256, 4, 1, 1, 3), 3216, 7168),    # 201 tiles = 3 x 67
    (WarpSplitKTactic(48, 32, 128, 6, 1, 1, 2), 2304, 1536),
    (WarpSplitKTactic(64, 16, 128, 4, 1, 1, 4), 1024, 2048),
    (WarpSplitKTactic(16, 8, 128, 1, 1, 1, 4), 256, 128),     # one tile per CTA
]


# The TMA multicast (tma_x): each member issues its boxes of a stage
# (layout.tma_owned_boxes) into every member's ring; rows past M are zeros.
MULTICAST_CASES += [
    (WarpSplitKTactic(16, 32, 256, 4, 1, 1, 2, tma_x=True), 1536, 7168),
    (WarpSplitKTactic(16, 32, 256, 4, 1, 1, 3, tma_x=True), 3216, 7168),   # 4 boxes, 3 members
    (WarpSplitKTactic(16, 32, 256, 4, 1, 1, 4, early_launch=True, tma_x=True), 4224, 7168),
    (WarpSplitKTactic(32, 16, 256, 6, 1, 1, 2, l2_prefetch=True, tma_x=True), 2624, 6144),
    (WarpSplitKTactic(48, 32, 128, 6, 1, 1, 2, tma_x=True), 2304, 1536),    # 2 boxes, 2 members
    (WarpSplitKTactic(16, 8, 128, 1, 1, 1, 2, tma_x=True), 256, 128),      # one tile per CTA
]


@pytest.mark.parametrize("tactic,n,k", MULTICAST_CASES,
                         ids=[f"{t.short()}-{n}x{k}" for t, n, k in MULTICAST_CASES])
def test_activation_multicast(tactic, n, k):
    check_tactic_with_and_without_bias(tactic, n, k, (1, 2, 8, 9, 17, 31, 32), graph_m=9)


def test_multicast_matches_the_plain_kernel_bitwise():
    """The same rows, the same fixed-order reduction: only where x comes from differs."""
    n, k = 1024, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    plain = PreparedWarpSplitK(w, {32: WarpSplitKTactic(16, 32, 256, 4, 1)})
    shared = PreparedWarpSplitK(w, {32: WarpSplitKTactic(16, 32, 256, 4, 1, 1, 4)})
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    a, b = plain.run(x, torch.empty(32, n, device="cuda", dtype=torch.bfloat16)), \
        shared.run(x, torch.empty(32, n, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert torch.equal(a, b)


def test_tma_multicast_matches_the_plain_kernel_bitwise():
    n, k = 1536, 7168
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    plain = PreparedWarpSplitK(w, {32: WarpSplitKTactic(16, 32, 256, 4, 1)})
    shared = PreparedWarpSplitK(w, {32: WarpSplitKTactic(16, 32, 256, 4, 1, 1, 3, tma_x=True)})
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    a, b = plain.run(x, torch.empty(32, n, device="cuda", dtype=torch.bfloat16)), \
        shared.run(x, torch.empty(32, n, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert torch.equal(a, b)
