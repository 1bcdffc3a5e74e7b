"""The cluster split of K (k_split 2-4) on the GPU.

Its own module so that the GPU check runs it in its own process with its
own time limit: a protocol fault in the cluster hand-over would hang, and
must not take the other kernel tests with it.
"""

import pytest

torch = pytest.importorskip("torch")

from warpsplitk import WarpSplitKTactic  # noqa: E402

from test_gpu_kernel import check_tactic_with_and_without_bias  # noqa: E402

pytestmark = pytest.mark.gpu


# k_split c: the c CTAs of a cluster share K and meet in the first one's
# shared memory. Correctness, a graph, PDL back to back.
K_SPLIT_CASES = [
    (WarpSplitKTactic(16, 8, 256, 8, 1, 2), 1536, 7168),
    (WarpSplitKTactic(32, 8, 256, 6, 1, 2), 2624, 6144),
    (WarpSplitKTactic(16, 32, 256, 4, 2, 2), 3216, 7168),
    (WarpSplitKTactic(64, 16, 128, 4, 2, 2), 1024, 2048),
    (WarpSplitKTactic(16, 8, 128, 1, 1, 2), 256, 256),    # one tile per CTA
    (WarpSplitKTactic(16, 8, 256, 14, 1, 2), 1536, 7168),  # the whole K share in the ring
    (WarpSplitKTactic(32, 8, 256, 4, 2, 2, early_launch=True), 1536, 7168),
    (WarpSplitKTactic(32, 1, 256, 7, 1, 2), 1536, 7168),  # a narrow token tile
    (WarpSplitKTactic(32, 8, 256, 4, 1, 2, x_copy="tma", l2_prefetch=2),
     2112, 7168),
    (WarpSplitKTactic(32, 8, 256, 5, 2, 2), 8192, 28672),  # K past 64 tiles: 56 per CTA
    (WarpSplitKTactic(16, 16, 256, 6, 2, 2), 48, 16896),   # 33 per CTA
    # uneven: K tiles past 64 the split does not divide, the first CTAs one tile more
    (WarpSplitKTactic(64, 8, 128, 11, 2, 2), 4096, 13696),  # GLM-4's down: 54 + 53 tiles
    (WarpSplitKTactic(32, 8, 256, 4, 1, 2, x_copy="tma", l2_prefetch=2), 256, 67 * 256),
    (WarpSplitKTactic(32, 1, 128, 6, 1, 2, x_copy="bulk"), 256, 65 * 128),
    # past two CTAs of 64 tiles: clusters of three and four (the default's)
    (WarpSplitKTactic(16, 8, 256, 8, 2, 3), 4608, 36864),   # Gemma-2-27B's down: 3 x 48 tiles
    (WarpSplitKTactic(48, 8, 128, 6, 2, 4), 4608, 29568),   # Qwen2.5-72B's: 58 + 3 x 57 tiles
]


@pytest.mark.parametrize("tactic,n,k", K_SPLIT_CASES,
                         ids=[f"{t.short()}-{n}x{k}" for t, n, k in K_SPLIT_CASES])
def test_cluster_split_of_k(tactic, n, k):
    check_tactic_with_and_without_bias(tactic, n, k, (1, 8, 9, 32), graph_m=8)
