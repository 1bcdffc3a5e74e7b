"""Compiling the kernel on a CPU for sm_90a and sm_100a: PTX audit, resources, CLI.

Every (output_tile, token_tile, k_tile, b_loader_warps) family is compiled
once, half for each arch, with each value of every field on both archs. The
sm_90a half runs in this process; the sm_100a half runs in one fresh
interpreter (``compile_facts.py``), since the CuTe DSL keeps the arch of a
process's first compile.
"""

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compile_facts import facts
from warpsplitk.kernel import layout
from warpsplitk.planning.choose import default_tactic
from warpsplitk.runtime.compile import audit_ptx, compile_for_arch
from warpsplitk.tactics import (
    B_LOADER_WARPS,
    K_TILES,
    OUTPUT_TILES,
    PREFETCH_ALL,
    TOKEN_TILES,
    WarpSplitKTactic,
    check_tactic,
    is_legal,
)

# not importorskip: importing cutlass before compile_for_arch sets CUTE_DSL_ARCH
# fixes the process's arch at the DSL's default (sm_100a without a GPU)
if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the CuTe DSL (nvidia-cutlass-dsl)", allow_module_level=True)

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"

FIELDS = (("output_tile", OUTPUT_TILES), ("token_tile", TOKEN_TILES), ("k_tile", K_TILES),
          ("b_loader_warps", B_LOADER_WARPS))
FAMILIES = [f for f in itertools.product(*(values for _, values in FIELDS))
            if is_legal(WarpSplitKTactic(f[0], f[1], f[2], 2, f[3]), 4 * f[0], 2 * f[2])]


def _arch_of(family):
    """sm_90a or sm_100a by the parity of the family's value indices."""
    parity = sum(values.index(v) for v, (_, values) in zip(family, FIELDS)) % 2
    return "sm_90a" if parity else "sm_100a"


def _case(i, family):
    """A small K (1 to 6 tiles) and a ring of 1 to 4 stages, varied over the families."""
    o, t, kt, b = family
    tiles = (1, 2, 3, 4, 6, 5)[i % 6]
    stages = 1 if tiles == 1 else min(tiles, 2 + i % 3)
    n = o * (2 + i % 3)
    tactic = WarpSplitKTactic(o, t, kt, stages, b)
    check_tactic(tactic, n, tiles * kt)
    return _arch_of(family), n, tiles * kt, tactic


# wide and narrow token tiles numbered apart, so the narrow families (added
# later) leave each wide family the case it always had
CASES = ([_case(i, f) for i, f in enumerate(f for f in FAMILIES if f[1] >= layout.MMA_N)]
         + [_case(i, f) for i, f in enumerate(f for f in FAMILIES if f[1] < layout.MMA_N)])
CASE_IDS = [f"{arch}-{t.short().replace(',', '_')}-N{n}-K{k}" for arch, n, k, t in CASES]


def test_the_spread_covers_every_family_and_value_on_both_archs():
    for arch in ("sm_90a", "sm_100a"):
        mine = [t for a, _, _, t in CASES if a == arch]
        assert abs(2 * len(mine) - len(FAMILIES)) <= len(FAMILIES) // 4
        for field, values in FIELDS:
            assert {getattr(t, field) for t in mine} == set(values), (arch, field)
    assert {(t.output_tile, t.token_tile, t.k_tile, t.b_loader_warps)
            for _, _, _, t in CASES} == set(FAMILIES)
    assert len(FAMILIES) >= 24


def check_facts(f, arch, n, k, tactic):
    assert f["audit"] == [], f["audit"]
    assert f["target"] == arch
    assert f["registers"] > 0
    assert not f["local_memory"], "ld.local/st.local in the PTX"
    assert f["spill_bytes"] == 0 and f["local_bytes"] == 0
    assert f["cubin_elf"]
    assert f["entries"] == 1
    assert f["threads"] == tactic.threads == f["reqntid"]
    assert f["smem_bytes"] == tactic.smem_bytes
    # the compute loop is unrolled over the CTA's K tiles: one MMA per (m, n, k) step
    m_iters = tactic.output_tile // layout.MMA_M
    n_iters = layout.mma_token_blocks(tactic.token_tile)
    tiles = k // tactic.k_tile
    # an uneven split traces each rank's K loop: every tile once in all
    traced = tiles if tiles % tactic.k_split else tiles // tactic.k_split
    steps = layout.k_steps(tactic.k_tile) * traced
    assert f["mma"] == m_iters * n_iters * steps
    assert f["ldmatrix"] == (m_iters + n_iters / 2) * steps


_REPORTS = {}


def report_for(n, k, tactic, has_bias=False):
    key = (n, k, tactic, has_bias)
    if key not in _REPORTS:
        _REPORTS[key] = compile_for_arch(n, k, tactic, "sm_90a", has_bias=has_bias)
    return _REPORTS[key]


SM90 = [pytest.param(*c, id=i) for c, i in zip(CASES, CASE_IDS) if c[0] == "sm_90a"]
SM100 = [pytest.param(*c, id=i) for c, i in zip(CASES, CASE_IDS) if c[0] == "sm_100a"]


@pytest.mark.parametrize("arch,n,k,tactic", SM90)
def test_compile_sm90a(arch, n, k, tactic):
    report = report_for(n, k, tactic)
    assert report.arch == "sm_90a" and (report.n, report.k, report.tactic) == (n, k, tactic)
    check_facts(facts(report), arch, n, k, tactic)


def test_compile_sm90a_bias():
    # an sm_90a case of the spread, compiled again with the bias epilogue
    _, n, k, tactic = next(c for c in CASES if c[0] == "sm_90a" and c[2] > c[3].k_tile)
    plain, biased = report_for(n, k, tactic), report_for(n, k, tactic, has_bias=True)
    check_facts(facts(biased), "sm_90a", n, k, tactic)
    assert biased.ptx != plain.ptx  # the bias epilogue is compiled in


def test_compile_sm90a_longest_k():
    tactic = WarpSplitKTactic(16, 8, 256, 8, 1)
    report = report_for(256, 16384, tactic)
    check_facts(facts(report), "sm_90a", 256, 16384, tactic)


def test_compile_sm90a_long_k_split_over_two_ctas():
    """K = 28672 (a 70B model's down at TP 1): two CTAs of 56 unrolled tiles
    of 256 each; audited, no spills (``check_facts``)."""
    tactic = default_tactic(1, 8192, 28672, sm_count=132)
    assert tactic.k_split == 2
    report = report_for(8192, 28672, tactic)
    check_facts(facts(report), "sm_90a", 8192, 28672, tactic)


@pytest.mark.parametrize("n,k,tactic", [
    (256, 65 * 128, WarpSplitKTactic(16, 8, 128, 5, 2, 2)),                  # 33 + 32 tiles
    (256, 67 * 256, WarpSplitKTactic(32, 8, 256, 4, 1, 2, x_copy="tma")),    # 34 + 33, TMA
    (256, 231 * 128, WarpSplitKTactic(16, 8, 128, 2, 1, 4)),                 # 58 + 3 x 57
], ids=["65x128", "67x256-tma", "231x128-four"])
def test_compile_sm90a_uneven_split_of_k(n, k, tactic):
    """K tiles that the split's CTAs cannot share evenly: each rank's K loop
    traced with its own share (the first ones one tile more); audited (the
    TMA ring's release fences loop by loop), no spills, every tile's MMAs
    once (so no rank runs another's share). (FP8 weights run one loop:
    below.)"""
    report = report_for(n, k, tactic)
    check_facts(facts(report), "sm_90a", n, k, tactic)
    assert _zero_filled_weight_copies(report.ptx) == 0


def _zero_filled_weight_copies(ptx):
    """Hinted weight copies with a run-time source size: [dst], [src], 16, size, policy."""
    return len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint "
                          r"\[%r\d+\], \[%rd\d+\], 16, %r\d+, %rd\d+;", ptx))


def _hand_over_order(ptx):
    """The cluster hand-over's instructions in PTX order, one letter each:
    M an MMA, B the compute warps' barrier, F a remote ring_free arrival,
    W a cluster-scoped wait, S a partial sent by st.async."""
    import re
    kinds = (("M", r"mma\.sync\.aligned"), ("B", r"bar\.sync\s+1,\s*128;"),
             ("F", r"mbarrier\.arrive\.release\.cluster\.shared::cluster"),
             ("W", r"try_wait\.parity\.acquire\.cluster"), ("S", r"st\.async\.shared::cluster"))
    found = sorted((m.start(), letter) for letter, pattern in kinds
                   for m in re.finditer(pattern, ptx))
    return re.sub(r"(.)\1+", r"\1", "".join(letter for _, letter in found))


def test_a_wide_fp8_cluster_sends_only_once_cta_0_has_read_its_ring():
    """FP8 on k_split 4 (the reduction buffer over the rings,
    ``layout.split_over_rings``): each rank's traced K loop, then the compute
    warps' barrier, CTA 0's arrival on each other CTA's ``ring_free``
    (predicated: one thread of CTA 0), their wait, and only then the
    partials; the audit requires the arrival there and refuses it in a
    kernel without that layout (BF16 on four CTAs, a split in two)."""
    n, k, tactic = 256, 231 * 128, WarpSplitKTactic(16, 8, 128, 2, 1, 4)
    report = compile_for_arch(n, k, tactic, "sm_90a", fp8_scales="channel")
    assert tactic.smem_plan_for(fp8=True).ring_free is not None
    # one K loop for every rank (an uneven split, layout.one_loop_split):
    # three arrivals; the last tile's weight copies (16 rows x 128 bytes,
    # 2 per loader thread) read 16 bytes or, past a rank's share, none
    assert _hand_over_order(report.ptx) == "MBFWSBW"
    assert report.ptx.count("mbarrier.arrive.release.cluster.shared::cluster") == 3
    assert _zero_filled_weight_copies(report.ptx) == layout.copies_per_thread(
        16, 128, layout.A_LOADER_WARPS * layout.WARP, layout.FP8_CHUNK)
    assert report.audit() == []
    tiles = 231 // 4 + 1
    assert any("without a split over the rings" in p
               for p in audit_ptx(report.ptx, k_tiles=tiles, k_split=4))
    unfreed = report.ptx.replace("mbarrier.arrive.release.cluster.shared::cluster",
                                 "mbarrier.arrive.shared::cluster")
    problems = audit_ptx(unfreed, k_tiles=tiles, k_split=4, ring_free=True)
    assert any("missing the first CTA frees" in p for p in problems)
    assert any("unordered arrival" in p for p in problems)
    # BF16 on the same four CTAs keeps its buffer beside the rings: no hand-over
    bf16 = report_for(n, k, tactic)
    assert tactic.smem_plan.ring_free is None
    assert "mbarrier.arrive.release.cluster" not in bf16.ptx and bf16.audit() == []
    assert any("missing the first CTA frees" in p
               for p in audit_ptx(bf16.ptx, k_tiles=tiles, k_split=4, ring_free=True))


def test_fp8_block_scales_on_an_uneven_split():
    tactic = WarpSplitKTactic(16, 8, 128, 3, 2, 2)
    report = compile_for_arch(256, 65 * 128, tactic, "sm_90a", fp8_scales="block128")
    assert report.audit() == [] and report.spill_bytes == 0
    # one multiplier per tile of the one loop (33 of the longest share) and
    # 16 rows (scale * 2 ** 120 to BF16x2), folded into the tile's
    # conversions: no FP32 rescale of the partial sums
    assert report.ptx.count("0f7B800000") == 33 and "fma.rn.f32" not in report.ptx
    assert report.ptx.count("mul.rn.bf16x2") == 33 * 8


def test_compile_rejects_illegal_tactic_and_arch():
    with pytest.raises(ValueError, match="N must be a positive multiple"):
        compile_for_arch(40, 1024, WarpSplitKTactic(16, 8, 128, 4, 1), "sm_90a")
    with pytest.raises(ValueError, match="arch must be one of"):
        compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 128, 4, 1), "sm_80")


def _run_facts(jobs, timeout=900, import_cutlass=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]))
    env.pop("CUTE_DSL_ARCH", None)
    command = [sys.executable, str(TESTS / "compile_facts.py")]
    if import_cutlass:
        command.append("--import-cutlass")
    proc = subprocess.run(command,
                          input=json.dumps(jobs), capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    assert len(lines) == 1, proc.stdout[-4000:]
    return json.loads(lines[0][len("FACTS "):])


#: each feature, compiled for Blackwell in the same process
SM100_K_SPLIT = (1536, 7168, WarpSplitKTactic(16, 8, 256, 8, 1, 2))
SM100_X_COPIES = (768, 7168, WarpSplitKTactic(32, 8, 256, 10, 1, 2, early_launch=True,
                                              l2_prefetch=PREFETCH_ALL, x_copy="bulk"))
SM100_TMA = (3216, 7168, WarpSplitKTactic(16, 32, 256, 4, 1, early_launch=True, x_copy="tma"))
SM100_MIXED = (3216, 7168, WarpSplitKTactic(32, 32, 256, 7, 1, x_copy="tma", half_tiles=63))
#: the SwiGLU epilogue (gate/up of a TP-8 Llama-3-70B MLP shard), with a bias
SM100_SWIGLU = (7168, 8192, WarpSplitKTactic(32, 8, 256, 11, 2, l2_prefetch=2))


@pytest.fixture(scope="module")
def sm100_facts():
    jobs = [["sm_100a", n, k, t.short(), False] for _, n, k, t in
            (c for c in CASES if c[0] == "sm_100a")]
    for n, k, t in (SM100_K_SPLIT, SM100_X_COPIES, SM100_TMA, SM100_MIXED):
        jobs.append(["sm_100a", n, k, t.short(), False])
    n, k, t = SM100_SWIGLU
    jobs.append(["sm_100a", n, k, t.short(), True, True])
    results = _run_facts(jobs)
    return {(job[1], job[2], WarpSplitKTactic.parse(job[3])): f for job, f in zip(jobs, results)}


@pytest.mark.parametrize("arch,n,k,tactic", SM100)
def test_compile_sm100a(sm100_facts, arch, n, k, tactic):
    check_facts(sm100_facts[(n, k, tactic)], arch, n, k, tactic)


@pytest.mark.parametrize("case", [SM100_K_SPLIT, SM100_X_COPIES, SM100_TMA, SM100_MIXED,
                                  SM100_SWIGLU],
                         ids=["k_split", "bulk_x+prefetch", "tma", "mixed", "swiglu+bias"])
def test_compile_sm100a_features(sm100_facts, case):
    """The cluster split of K, bulk copies with the L2 prefetch, TMA boxes,
    a mixed grid and the SwiGLU epilogue, on Blackwell: the audit
    (which requires each feature's instructions) passes, nothing spills."""
    n, k, tactic = case
    f = sm100_facts[(n, k, tactic)]
    assert f["target"] == "sm_100a" and f["audit"] == []
    assert f["spill_bytes"] == 0 and not f["local_memory"]


def test_two_archs_in_one_process():
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    results = _run_facts([["sm_90a", 32, 256, tactic.short(), False],
                          ["sm_100a", 32, 256, tactic.short(), False]])
    assert [r["target"] for r in results] == ["sm_90a", "sm_100a"]


def test_arch_after_importing_cutlass():
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    results = _run_facts([["sm_90a", 32, 256, tactic.short(), False]], import_cutlass=True)
    assert results[0]["target"] == "sm_90a"


def test_single_k_tile_kernel_passes_audit():
    # one K tile: the only weight tile is the unhinted pre-barrier prologue, so
    # the audit waives the hint and policy there, and only there
    tactic = WarpSplitKTactic(16, 8, 128, 1, 1)
    report = report_for(768, 128, tactic)
    assert report.audit() == []
    assert "createpolicy" not in report.ptx
    assert len(audit_ptx(report.ptx)) == 2


# --------------------------------------------------------------- audit_ptx


def test_audit_flags_missing_and_forbidden_instructions():
    report = report_for(*next(c for c in CASES if c[2] > c[3].k_tile)[1:])
    ptx = report.ptx
    assert audit_ptx(ptx) == []
    without_mma = ptx.replace("mma.sync.aligned.m16n8k16", "mma.removed")
    problems = audit_ptx(without_mma)
    assert len(problems) == 1 and "BF16 tensor-core MMA" in problems[0]
    without_pdl = ptx.replace("griddepcontrol.wait", "nop")
    assert any("PDL wait" in p for p in audit_ptx(without_pdl))
    with_local = ptx + "\n\tld.local.u32 %r1, [%rd1];\n"
    assert any("local memory" in p for p in audit_ptx(with_local))
    assert len(audit_ptx("")) == 8  # every required instruction is missing


# --------------------------------------------------------------------- CLI


def test_cli_compile(tmp_path, capsys):
    from warpsplitk.cli import main
    path = tmp_path / "kernel.ptx"
    code = main(["compile", "--n", "256", "--k", "1024", "--m", "8", "--arch", "sm_90a",
                 "--emit-ptx", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    tactic = default_tactic(8, 256, 1024, sm_count=132)
    fields = dict(line.split(None, 1) for line in out.splitlines() if line.strip()
                  and not line.startswith(("shared", "ptx written", "ptx audit")))
    assert fields["tactic"].split()[0] == tactic.short()
    assert fields["threads"] == str(tactic.threads)
    assert int(fields["registers"]) > 0
    assert f"shared memory {tactic.smem_bytes} B" in out
    assert "ptx audit     ok" in out
    assert f"ptx written to {path}" in out
    text = path.read_text()
    assert ".target sm_90a" in text
    assert audit_ptx(text, k_tiles=1024 // tactic.k_tile, bulk_x=tactic.x_copy == "bulk",
                     tma_x=tactic.x_copy == "tma") == []


def test_cli_compile_error_exit_code():
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.run([sys.executable, "-m", "warpsplitk.cli", "compile", "--n", "40",
                           "--k", "1024", "--tactic", "16,8,128,4,1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "warpsplitk compile: error:" in proc.stderr and "N must be" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_launcher_slots_match_the_compiled_signature():
    """The fast launch path (warpsplitk.runtime.launch) is taken with this DSL: its
    argument marshalling is what the launcher writes into its slots."""
    from warpsplitk.runtime.dsl import build as _build
    from warpsplitk.runtime.launch import marshals_as_slots
    compiled = _build(64, 256, WarpSplitKTactic(16, 8, 128, 2, 1), False, True, "sm_90a")
    assert marshals_as_slots(compiled)


def test_early_launch_moves_only_the_pdl_trigger():
    """Late trigger: the next kernel may launch after the last activation
    tile is issued (after griddepcontrol.wait); ``early_launch`` triggers
    before the wait. Nothing else moves."""
    from dataclasses import replace
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    late = compile_for_arch(64, 512, tactic).ptx
    early = compile_for_arch(64, 512, replace(tactic, early_launch=True)).ptx
    for text in (late, early):
        assert text.count("griddepcontrol.launch_dependents") == 1
        assert text.count("griddepcontrol.wait") == 1
        assert audit_ptx(text, k_tiles=4) == []
    assert late.index("griddepcontrol.wait") < late.index("griddepcontrol.launch_dependents")
    assert early.index("griddepcontrol.launch_dependents") < early.index("griddepcontrol.wait")
    assert sorted(late.splitlines()) == sorted(early.splitlines())  # the same instructions


def test_stage_release_is_one_arrival_per_compute_lane():
    """Loaders' arrivals are completed by their copies
    (cp.async.mbarrier.arrive.noinc); each compute lane releases a stage with
    its own arrival, no warp sync (racecheck follows per-lane arrivals)."""
    import re
    ptx = compile_for_arch(64, 512, WarpSplitKTactic(16, 8, 128, 2, 1)).ptx
    assert re.search(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)
    assert not re.search(r"bar\.warp\.sync", ptx)
    # one release per K tile of the compute loop
    assert len(re.findall(r"mbarrier\.arrive\.shared::cta\.b64\s+_,", ptx)) == 4


@pytest.mark.parametrize("tactic,n,k", [
    (WarpSplitKTactic(16, 8, 256, 8, 1, 2), 1536, 7168),
    (WarpSplitKTactic(32, 32, 256, 4, 2, 2), 2624, 6144),
    (WarpSplitKTactic(64, 16, 128, 4, 2, 2), 1024, 2048),
    (WarpSplitKTactic(16, 8, 128, 1, 1, 2), 256, 256),     # one tile per CTA
    (WarpSplitKTactic(32, 1, 256, 7, 1, 2), 1536, 7168),   # a narrow token tile
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_cluster_split_of_k_compiles_with_its_reduction(tactic, n, k):
    """k_split 2: cluster barrier phase 0, the mapped first-CTA buffer
    and barrier, one st.async per partial sum, the first CTA's expect_tx and
    wait are in the PTX (the audit); no phase 1 and no spills."""
    import re
    report = compile_for_arch(n, k, tactic, "sm_90a")
    assert report.audit() == []
    assert report.spill_bytes == 0 and report.local_bytes == 0
    assert len(re.findall(r"st\.async\.shared::cluster", report.ptx)) == \
        4 * (tactic.output_tile // 16) * layout.mma_token_blocks(tactic.token_tile)
    assert not re.search(r"barrier\.cluster\.arrive\.release", report.ptx)


def test_audit_requires_the_cluster_reduction_only_with_k_split():
    shipped = compile_for_arch(256, 512, WarpSplitKTactic(16, 8, 128, 2, 1), "sm_90a")
    assert audit_ptx(shipped.ptx, k_tiles=4, k_split=2)  # missing cluster reduction
    split = compile_for_arch(256, 512, WarpSplitKTactic(16, 8, 128, 2, 1, 2), "sm_90a")
    assert any("without k_split" in p for p in audit_ptx(split.ptx, k_tiles=2, k_split=1))
    # the split's hand-over, each part missing in turn, or the protocol before it
    assert audit_ptx(split.ptx, k_tiles=2, k_split=2) == []
    for old, new in (("st.async.shared::cluster", "st.shared::cluster"),
                     ("mbarrier.arrive.expect_tx", "mbarrier.arrive"),
                     ("try_wait.parity.acquire.cluster", "try_wait.parity"),
                     ("barrier.cluster.arrive.relaxed", "barrier.cluster.arrive.release")):
        assert old in split.ptx
        assert audit_ptx(split.ptx.replace(old, new), k_tiles=2, k_split=2), old


@pytest.mark.parametrize("tactic,n,k", [
    (WarpSplitKTactic(32, 8, 256, 8, 1, x_copy="bulk"), 2048, 2048),
    (WarpSplitKTactic(16, 32, 128, 3, 1, x_copy="bulk"), 512, 1024),
    (WarpSplitKTactic(32, 8, 256, 10, 1, 2, x_copy="bulk", l2_prefetch=PREFETCH_ALL), 768,
     7168),
    (WarpSplitKTactic(16, 1, 256, 12, 1, x_copy="bulk", early_launch=True), 2112, 7168),
    (WarpSplitKTactic(64, 1, 128, 13, 1, x_copy="bulk", l2_prefetch=PREFETCH_ALL), 768, 7168),
    (WarpSplitKTactic(64, 16, 128, 4, 2, l2_prefetch=PREFETCH_ALL, early_launch=True), 7168,
     768),
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_bulk_copies_and_l2_prefetch_compile_with_their_instructions(tactic, n, k):
    """Bulk copies: per stage one armed full barrier and one bulk copy (predicated
    by lane), no thread-issued activation copies; l2_prefetch: one bulk L2
    prefetch (predicated by thread), once, before any ring wait; no spills."""
    import re
    report = compile_for_arch(n, k, tactic, "sm_90a")
    assert report.audit() == []
    assert report.spill_bytes == 0 and report.local_bytes == 0
    ptx = report.ptx
    k_tiles = k // (tactic.k_tile * tactic.k_split)
    bulk = re.findall(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes \[",
                      ptx)
    assert len(bulk) == (k_tiles if tactic.x_copy == "bulk" else 0)
    # (a K split adds one: the first CTA expects the others' partials)
    assert len(re.findall(r"mbarrier\.arrive\.expect_tx", ptx)) == \
        (k_tiles if tactic.x_copy == "bulk" else 0) + (tactic.k_split > 1)
    zfill = re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 16, %r", ptx)
    assert bool(zfill) == (not tactic.x_copy == "bulk")
    prefetches = re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)
    assert len(prefetches) == (1 if tactic.l2_prefetch else 0)
    assert not re.search(r"multicast::cluster|mbarrier\.arrive\.release\.cluster", ptx)


def test_audit_requires_bulk_x_and_the_prefetch_only_with_their_fields():
    plain = compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 256, 2, 1), "sm_90a")
    assert any("missing activation rows by bulk copy" in p
               for p in audit_ptx(plain.ptx, k_tiles=4, bulk_x=True))
    assert any("missing weight past the ring prefetched" in p
               for p in audit_ptx(plain.ptx, k_tiles=4, l2_prefetch=True))
    both = compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 256, 2, 1, x_copy="bulk",
                                                        l2_prefetch=PREFETCH_ALL), "sm_90a")
    problems = audit_ptx(both.ptx, k_tiles=4)
    assert any("without bulk_x" in p for p in problems)
    assert any("without l2_prefetch" in p for p in problems)
    assert audit_ptx(both.ptx, k_tiles=4, bulk_x=True, l2_prefetch=True) == []


@pytest.mark.parametrize("text,n,k,span_tiles", [
    ("32,8,256,10,1,2+early+prefetch2+tma", 1536, 7168, 2),      # k_split: the CTA's share
    ("16,8,256,16,1+early+prefetch4+bulk", 2112, 7168, 4),
    ("32,16,256,9,1+early+prefetch3+tma+half63", 3216, 7168, 3),  # both tile paths
    ("32,8,256,10,1,2+early+prefetch+bulk", 768, 7168, 4),       # whole: 14 - 10 tiles
])
def test_l2_prefetch_asks_for_its_span(text, n, k, span_tiles):
    """The PTX asks L2 for exactly the prefetch's span per row: its bound,
    or the whole remainder; the audit refuses any other."""
    tactic = WarpSplitKTactic.parse(text)
    report = compile_for_arch(n, k, tactic, "sm_90a")
    assert report.audit() == []
    assert report.prefetch_bytes == span_tiles * tactic.k_tile * 2
    from warpsplitk.runtime.compile import prefetch_sizes
    assert set(prefetch_sizes(report.ptx)) == {report.prefetch_bytes}
    k_tiles = k // (tactic.k_tile * tactic.k_split)
    wrong = audit_ptx(report.ptx, k_tiles=k_tiles, k_split=tactic.k_split, l2_prefetch=True,
                      bulk_x=tactic.x_copy == "bulk", tma_x=tactic.x_copy == "tma",
                      prefetch_bytes=report.prefetch_bytes + 512)
    assert any("the L2 prefetch asks for" in p for p in wrong)


@pytest.mark.parametrize("tactic,n,k,aliased", [
    (WarpSplitKTactic(32, 32, 256, 7, 2), 2624, 6144, True),
    (WarpSplitKTactic(48, 32, 128, 11, 2), 3216, 7168, True),
    (WarpSplitKTactic(32, 32, 256, 6, 2), 2624, 6144, False),
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_reduction_over_the_rings_waits_for_every_compute_warp(tactic, n, k, aliased):
    """With the buffer over the rings the compute warps meet at a named
    barrier before storing partials, as well as after; never otherwise."""
    import re
    report = compile_for_arch(n, k, tactic, "sm_90a")
    assert report.audit() == [] and report.spill_bytes == 0
    assert len(re.findall(r"\bbar\.sync\s+1,\s*128;", report.ptx)) == (2 if aliased else 1)


@pytest.mark.parametrize("tactic,n,k", [
    (WarpSplitKTactic(32, 8, 256, 4, 1, x_copy="tma"), 2048, 2048),
    (WarpSplitKTactic(64, 8, 128, 3, 1, early_launch=True, x_copy="tma"), 7168, 384),
    (WarpSplitKTactic(32, 16, 256, 3, 1, 2, l2_prefetch=PREFETCH_ALL, x_copy="tma"), 2048,
     2048),
    (WarpSplitKTactic(16, 32, 256, 4, 1, x_copy="tma"), 3216, 7168),
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_tma_copies_compile_with_their_instructions(tactic, n, k):
    """TMA copies: per stage one armed full barrier and k_tile / 64 box copies,
    each entered by the whole warp and issued by one elected lane, the tensor map prefetched
    once; no 16-byte or per-row activation copies; no spills."""
    import re
    report = compile_for_arch(n, k, tactic, "sm_90a")
    assert report.audit() == []
    assert report.spill_bytes == 0 and report.local_bytes == 0
    ptx = report.ptx
    k_tiles = k // (tactic.k_tile * tactic.k_split)
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global\.tile"
                       r"\.mbarrier::complete_tx::bytes(\.multicast::cluster)?", ptx)
    assert len(boxes) == k_tiles * layout.tma_boxes(tactic.k_tile)
    assert not any(boxes)  # no multicast
    assert len(re.findall(r"elect\.sync", ptx)) == len(boxes)
    assert len(re.findall(r"mbarrier\.arrive\.expect_tx", ptx)) == k_tiles + (tactic.k_split > 1)
    assert len(re.findall(r"prefetch\.tensormap", ptx)) == 1
    assert not re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 16, %r", ptx)
    assert not re.search(r"cp\.async\.bulk\.shared::cluster\.global", ptx)


def test_audit_requires_tma_x_only_with_its_field():
    plain = compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 256, 2, 1), "sm_90a")
    assert any("missing activation boxes by TMA" in p
               for p in audit_ptx(plain.ptx, k_tiles=4, tma_x=True))
    boxes = compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 256, 2, 1, x_copy="tma"), "sm_90a")
    assert any("without tma_x" in p for p in audit_ptx(boxes.ptx, k_tiles=4))
    assert audit_ptx(boxes.ptx, k_tiles=4, tma_x=True) == []
    # nothing is multicast into a cluster
    multicast = boxes.ptx + ("\ncp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier"
                             "::complete_tx::bytes.multicast::cluster [%r1, {%r2, %r3}], [%r4];")
    assert any("multicast" in p for p in audit_ptx(multicast, k_tiles=4, tma_x=True))


@pytest.mark.parametrize("tactic,n,k", [
    (WarpSplitKTactic(16, 32, 256, 4, 1, x_copy="tma"), 3216, 7168),
    (WarpSplitKTactic(64, 32, 128, 4, 1, x_copy="tma"), 4608, 1536),
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_tma_register_table_is_what_ptxas_allots(tactic, n, k):
    """The residency model's registers for TMA tactics (tactics.MEASURED_REGISTERS_TMA)
    are what the compiler gives them: far fewer than the one-warp 16-byte
    loader's (196 for 16,32,256), so more CTAs per SM."""
    from warpsplitk.tactics import MEASURED_REGISTERS, register_estimate
    report = compile_for_arch(n, k, tactic, "sm_90a")
    assert report.registers <= register_estimate(tactic) < report.registers + 8 + 4
    copies = MEASURED_REGISTERS[(tactic.output_tile, tactic.token_tile, tactic.k_tile, 1)]
    assert register_estimate(tactic) < copies


def test_mixed_grid_traces_both_tile_paths():
    """half_tiles: one kernel, both tile sizes' code; the audit passes and
    the compute warps' MMAs are the two paths' together (32 rows: 2 m-blocks,
    16 rows: 1)."""
    import re
    n, k = 3216, 7168
    mixed = compile_for_arch(n, k, WarpSplitKTactic(32, 8, 256, 4, 1, half_tiles=63), "sm_90a")
    plain = compile_for_arch(n, k, WarpSplitKTactic(16, 8, 256, 4, 1), "sm_90a")
    assert mixed.audit() == [] and mixed.spill_bytes == 0 and mixed.local_bytes == 0

    def mmas(text):
        return len(re.findall(r"mma\.sync\.aligned\.m16n8k16", text))
    assert mmas(mixed.ptx) == 3 * mmas(plain.ptx)


@pytest.mark.parametrize("narrow,n,k", [
    (WarpSplitKTactic(16, 1, 256, 4, 1), 2112, 1024),
    (WarpSplitKTactic(32, 2, 256, 3, 2), 1024, 768),
    (WarpSplitKTactic(48, 4, 128, 4, 1), 96, 512),
], ids=lambda v: v.short() if isinstance(v, WarpSplitKTactic) else str(v))
def test_narrow_token_tile_is_the_8_row_kernel_with_smaller_stages(narrow, n, k):
    """A narrow token tile compiles to the 8-row tile's mma and ldmatrix
    sequence (one mma block of 8 columns), with token_tile / 8 of its
    activation copies per stage and smaller activation stages."""
    import dataclasses
    import re
    wide = dataclasses.replace(narrow, token_tile=8)
    reports = {t: compile_for_arch(n, k, t, "sm_90a") for t in (narrow, wide)}
    got = {t: facts(r) for t, r in reports.items()}
    for t, f in got.items():
        assert f["audit"] == [] and f["spill_bytes"] == 0 and f["smem_bytes"] == t.smem_bytes
    assert got[narrow]["mma"] == got[wide]["mma"]
    assert got[narrow]["ldmatrix"] == got[wide]["ldmatrix"]

    def zero_fill_copies(report):  # the 16-byte activation copies (src-size operand)
        return len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, %",
                              report.ptx))
    tiles = k // narrow.k_tile
    assert zero_fill_copies(reports[wide]) == tiles * layout.copies_per_thread(
        8, narrow.k_tile, 32 * narrow.b_loader_warps)
    assert zero_fill_copies(reports[narrow]) * 8 == \
        zero_fill_copies(reports[wide]) * narrow.token_tile
    plan_n, plan_w = narrow.smem_plan, wide.smem_plan
    assert plan_w.b_stage_bytes == plan_n.b_stage_bytes * 8 // narrow.token_tile


def test_async_activation_rings_fence_each_refilled_release():
    """A stage refilled by TMA boxes or bulk copies (async proxy) is released
    only after a cross-proxy fence that follows its last ldmatrix: both pass
    the audit, with one fence per K tile whose stage a copy refills (none
    for the last ``stages`` tiles, nor for a ring as deep as K); the same
    PTX with the fence taken out is flagged; a cp.async ring has none."""
    from warpsplitk.runtime.compile import release_fence_problems
    n, k = 7168, 384
    for text, fences in (("16,8,128,2,1+tma", 1), ("16,8,128,2,1+bulk", 1),
                         ("64,8,128,3,1+early+bulk", 0), ("32,8,128,2,1+tma+half40", 2)):
        tactic = WarpSplitKTactic.parse(text)
        report = compile_for_arch(n, k, tactic)
        assert report.audit() == [], text
        assert report.ptx.count("fence.proxy.async.shared::cta") == fences, text
    assert "fence.proxy.async" not in compile_for_arch(
        n, k, WarpSplitKTactic.parse("16,8,128,2,1")).ptx
    fenced = compile_for_arch(n, k, WarpSplitKTactic.parse("16,8,128,2,1+tma")).ptx
    unfenced = fenced.replace("fence.proxy.async.shared::cta;", "")
    problems = release_fence_problems(unfenced, async_ring=True, k_tiles=3, stages=2)
    assert len(problems) == 1 and "no fence.proxy.async.shared::cta" in problems[0]


def test_release_fence_check_reads_the_order_of_reads_fence_and_release():
    from warpsplitk.runtime.compile import release_fence_problems
    read = "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];"
    fence = "fence.proxy.async.shared::cta;"
    release = "mbarrier.arrive.shared::cta.b64 _, [%r6];"
    arm = "@P1 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r8], %r9;"

    def problems(lines, **kw):
        return release_fence_problems("\n".join(lines), async_ring=True, **kw)
    # three K tiles, two stages: only the first tile's stage is refilled
    assert problems([arm, read, fence, release, read, release, read, release],
                    k_tiles=3, stages=2) == []
    assert "no fence" in problems([read, release, read, release, read, release],
                                  k_tiles=3, stages=2)[0]
    assert "never" not in " ".join(problems([read, fence, release, read, fence, release, read,
                                             release], k_tiles=3, stages=2))
    assert "only costs" in problems([read, fence, release, read, fence, release, read, release],
                                    k_tiles=3, stages=2)[0]
    assert "not a multiple" in problems([read, fence, release], k_tiles=2, stages=1)[0]
    # a read after the fence: that tile's release is unfenced
    assert "no fence" in problems([read, fence, release, read, fence, read, release, read,
                                   release], k_tiles=3, stages=1)[0]
    # stages unknown: fenced releases, then unfenced ones, per K loop
    assert problems([read, fence, release, read, fence, release, read, release]) == []
    assert problems([read, release, read, fence, release])
    assert problems([read, fence, release, read, release] * 2, k_tiles=2) == []
    assert problems([read]) == ["no stage release found to check the release fence against"]
    assert release_fence_problems("\n".join([read, fence, release]), async_ring=False)
    assert release_fence_problems("\n".join([read, release]), async_ring=False) == []


#: sha256 (first 16 hex digits) of the sm_90a PTX of shipped kernels, one per
#: feature family of the built-in plan: a refactor of the kernel's Python
#: must leave what ships byte-identical, and a change of what ships updates
#: these on purpose (with the GPU tests, the sanitizer and a benchmark of the
#: affected cells on the GPU). Tied to the pinned CuTe DSL 4.8.1.
SHIPPED_PTX = {
    ("16,8,128,1,1+early+bulk", 768, 128): "abd5c37faf7060a7",
    ("32,1,256,8,1+early", 2048, 2048): "ee6df5467e80e070",
    ("32,8,256,10,1,2+early+prefetch2", 2112, 7168): "95c6cb92c9cb3002",
    ("32,32,256,7,1+early+prefetch4+tma+half100", 2624, 6144): "c999d6a0f333bbca",
}


@pytest.mark.parametrize("text,n,k", list(SHIPPED_PTX), ids=[t for t, _, _ in SHIPPED_PTX])
def test_shipped_kernels_ptx_is_pinned(text, n, k):
    import hashlib
    ptx = compile_for_arch(n, k, WarpSplitKTactic.parse(text), "sm_90a").ptx
    assert hashlib.sha256(ptx.encode()).hexdigest()[:16] == SHIPPED_PTX[(text, n, k)]


def test_compiling_for_a_device_without_a_gpu_is_a_value_error():
    """A CPU build of torch (or no GPU): the promised one-line ValueError
    pointing at compile_for_arch, not torch's AssertionError."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    from warpsplitk import compile_warp_splitk
    from warpsplitk.runtime.compile import launcher
    tactic = WarpSplitKTactic(16, 8, 128, 2, 1)
    for call in (compile_warp_splitk, launcher):
        with pytest.raises(ValueError, match=r"^no CUDA GPU: torch .* sees none; compile_for_arch"):
            call(0, 256, 1024, tactic)
    with pytest.raises(ValueError, match=r"^device_index must be an int"):
        compile_warp_splitk("cuda:0", 256, 1024, tactic)


def test_a_compile_report_prints_in_one_short_line():
    report = compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 128, 2, 1), "sm_90a")
    assert len(repr(report)) < 400 and "ptx=" not in repr(report)
    assert len(report.ptx) > 10_000


FP8_COMPILES = [
    (WarpSplitKTactic(16, 8, 128, 4, 1), 4096, 4096, "channel", False),
    (WarpSplitKTactic(32, 8, 256, 6, 2), 4096, 4096, "tensor", True),
    (WarpSplitKTactic(32, 1, 256, 4, 1, early_launch=True, l2_prefetch=2), 2048, 2048, "channel",
     True),
    (WarpSplitKTactic(32, 8, 256, 5, 2, 2), 8192, 28672, "channel", False),  # K past 64 tiles
    (WarpSplitKTactic(32, 1, 256, 2, 1, half_tiles=1), 48, 512, "tensor", True),
    # the FP8 default's families (choose.fp8_tactic), at a few K tiles per CTA
    (WarpSplitKTactic(32, 1, 256, 13, 1, 2), 1024, 8192, "channel", False),
    (WarpSplitKTactic(64, 8, 128, 12, 2, 2), 1024, 4096, "channel", False),
    (WarpSplitKTactic(32, 32, 256, 2, 2, 2), 1024, 4096, "tensor", True),
    (WarpSplitKTactic(16, 16, 256, 8, 2, 2), 1024, 4096, "channel", False),
    # 128 x 128 block scales: per tile and 16 rows a scale load, folded into the conversion
    (WarpSplitKTactic(16, 8, 128, 4, 1), 4096, 4096, "block128", False),
    (WarpSplitKTactic(32, 8, 256, 5, 2, 2), 1024, 8192, "block128", True),
    (WarpSplitKTactic(32, 32, 256, 2, 2), 2048, 4096, "block128", False),
    (WarpSplitKTactic(16, 32, 128, 4, 2), 1024, 4096, "block128", False),  # its default's
]


@pytest.mark.parametrize("tactic,n,k,scales,bias", FP8_COMPILES,
                         ids=[f"{c[0].short()}-{c[1]}x{c[2]}-{c[3]}" for c in FP8_COMPILES])
def test_fp8_kernel_compiles_audited_with_its_conversion(tactic, n, k, scales, bias):
    """The FP8-weight kernel: audit clean, no spills, and per CTA K tile and
    warp one weight ``ldmatrix.x4`` per 16 rows and K pair, its four
    registers converted by two BF16x2 multiplies each, two 8-byte activation
    loads per 8 tokens and K pair, one mma per step and block."""
    import re
    report = compile_for_arch(n, k, tactic, "sm_90a", fp8_scales=scales, has_bias=bias)
    assert report.audit() == []
    assert report.spill_bytes == 0 and report.local_bytes == 0
    assert report.smem_bytes < tactic.smem_bytes  # half the weight bytes per stage
    tiles = k // (tactic.k_tile * tactic.k_split)
    pairs = layout.k_steps(tactic.k_tile) // 2
    paths = 2 if tactic.half_tiles else 1  # a mixed grid traces both tile sizes
    m_iters = sum(o // layout.MMA_M for o in (tactic.output_tile, tactic.output_tile // 2)[:paths])
    n_iters = layout.mma_token_blocks(tactic.token_tile)
    count = lambda pattern: len(re.findall(pattern, report.ptx))  # noqa: E731
    assert count(r"ldmatrix\.sync") == m_iters * pairs * tiles
    assert count(r"mul\.rn\.bf16x2") == 8 * m_iters * pairs * tiles
    assert count(r"ld\.shared\.v2\.b32") == paths * 2 * n_iters * pairs * tiles
    assert count(r"mma\.sync") == m_iters * n_iters * 2 * pairs * tiles
    # per epilogue round: the bias's 16-byte load, and the scales' (two for
    # channel scales, one 4-byte load of the tensor's)
    rounds = sum(layout.epilogue_rounds(o, tactic.token_tile)
                 for o in (tactic.output_tile, tactic.output_tile // 2)[:paths])
    channel, blocks = scales == "channel", scales == "block128"
    assert count(r"ld\.global\.nc\.v4\.b32") == rounds * (2 * channel + bias)
    # block scales: one load per tile and 16 rows, in the K loop, made the
    # multiplier of that tile's conversions (scale * 2 ** 120 to BF16x2)
    assert count(r"ld\.global\.nc\.f32") == (m_iters * tiles if blocks
                                              else 0 if channel else rounds)
    assert count(r"0f7B800000") == (m_iters * tiles if blocks else 0)
    # the epilogue's scale-then-bias per output, contracted (block scales:
    # nothing to scale there)
    assert count(r"fma\.rn\.f32") == (0 if blocks else layout.CHUNK * rounds * bias)


def test_block_scales_take_no_mixed_grid():
    with pytest.raises(ValueError, match="block scales take no mixed grid"):
        compile_for_arch(48, 512, WarpSplitKTactic(32, 1, 256, 2, 1, half_tiles=1),
                         fp8_scales="block128")


def test_fp8_compile_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="fp8_scales must be one of"):
        compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 128, 4, 1), fp8_scales="block")
    with pytest.raises(ValueError, match="FP8 weights take x_copy 'cp.async'"):
        compile_for_arch(256, 1024, WarpSplitKTactic(16, 8, 128, 4, 1, x_copy="tma"),
                         fp8_scales="tensor")
    assert "mul.rn.bf16x2" not in report_for(256, 1024, WarpSplitKTactic(16, 8, 128, 4, 1)).ptx
