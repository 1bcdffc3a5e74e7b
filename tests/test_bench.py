"""Benchmark plumbing that needs no GPU: chain pairs, rows, JSON, the plot."""

import json
import re

import pytest

from warpsplitk import shapes
from warpsplitk.measure import bench
from warpsplitk.runtime import timing
from warpsplitk.measure.plot import main as plot_main


def test_chain_pairs_chain_and_come_from_the_table():
    table = {(s["n"], s["k"]) for s in shapes.load()["shapes"]}
    assert len(bench.DEFAULT_CHAINS) >= 4
    for first, second in bench.DEFAULT_CHAINS:
        assert first in table and second in table
        assert first[0] == second[1]


def _row(n=4224, k=7168, m=8, ours=13.7, cublas=21.1):
    floor = n * k * 2 / 4.4e12 * 1e6
    return bench.BenchRow(n, k, m, "32,8,256,11,1", "plan", ours, 0.01, 14.4, cublas, 0.01,
                          n * k * 2 / 4.8e12 * 1e6, floor)


def test_row_metrics_and_format():
    r = _row()
    assert r.speedup == pytest.approx(21.1 / 13.7)
    assert r.weight_tbps == pytest.approx(4224 * 7168 * 2 / 13.7e-6 / 1e12)
    line = bench.format_row(r)
    assert "32,8,256,11,1" in line and "1.54" in line


def test_json_and_plot(tmp_path):
    rows = [_row(m=m, ours=13 + m / 10) for m in (1, 8, 32)] + [_row(768, 128, 1, 1.4, 2.8)]
    env = {"gpu": "NVIDIA H200", "read_TBps": 4.4}
    path = tmp_path / "b.json"
    bench.write_json(path, env, rows)
    data = json.loads(path.read_text())
    assert data["environment"] == env and len(data["rows"]) == 4
    assert data["rows"][0]["speedup"] == pytest.approx(rows[0].speedup, abs=1e-3)
    png = tmp_path / "b.png"
    plot_main([str(path), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chain_floor_counts_both_weights():
    from warpsplitk.measure.bench import chain_floor_us
    # 768x7168 then 7168x768: two 11 MB weights, 22 MB at 4.4 TB/s
    assert chain_floor_us((768, 7168), (7168, 768), 4.4) == pytest.approx(2 * 2 * 768 * 7168 / 4.4e6)
    assert chain_floor_us((768, 7168), (7168, 768), 4.4) == pytest.approx(5.005, abs=1e-3)


def test_benchmarks_page_from_bench_records(tmp_path):
    """scripts/make_benchmarks.py renders BENCHMARKS.md's figures and tables
    from a bench record and a chain record."""
    from script_loader import load_script
    make = load_script("make_benchmarks")
    rows = [_row(m=1, ours=13.7, cublas=21.1), _row(m=32, ours=16.0, cublas=19.0),
            _row(768, 128, 1, 1.4, 2.8)]
    path = tmp_path / "b.json"
    bench.write_json(path, {"gpu": "NVIDIA H200", "command": "warpsplitk bench"}, rows)
    chain = {"environment": {"gpu": "NVIDIA H200"}, "mode": "chain", "rows": [
        {"first": [768, 7168], "second": [7168, 768], "m": 1, "tactics": "a -> b",
         "ours_us": 7.0, "cublas_us": 14.0, "floor_us": 5.0}]}
    page = make.benchmarks_md(make.load(path), chain, 1234)
    assert "Faster than cuBLAS in 3 of 3 cells: median 1.54×, min 1.19× (4224×7168 M=32), " \
        "max 2.00×" in page
    assert "Weights ≥ 16 MB (2 cells): median" in page  # 4224x7168 only
    assert "| 4224 | 7168 | 60.6 | 13.70/21.10 (1.54×) | 16.00/19.00 (1.19×) |" in page
    assert "Dependent chains: 1 of 1 pair × M cells faster than cuBLAS, 2.00–2.00×." in page
    # the floor: both weights' bytes at the H200's datasheet 4.8 TB/s (4.59 µs)
    assert "| 768×7168 → 7168×768 | 7.00 (2.00×, 66%) |" in page
    assert "the 1234 records of" in page
    layers = {"environment": {"gpu": "NVIDIA H200", "command": "bash scripts/gpu_check.sh"},
              "rows": [{"model": "qwen3-4b", "tp": 2, "m": 8, "projections": "a -> b",
                        "ours_us": 10.0, "reference_us": 11.0, "cublas_us": 15.0}]}
    page = make.benchmarks_md(make.load(path), chain, 1234, layers=layers)
    assert "| qwen3-4b | 2 | a → b | 10.0/11.0/15.0 |" in page
    assert "faster than cuBLAS in 1 of 1 layers (1.50–1.50×) and at least as fast as the " \
        "reference heuristic in 1." in page


def test_environment_names_the_versions_and_no_build_variant(monkeypatch):
    """A benchmark's JSON says what it ran on and which warpsplitk timed it;
    there is one build (the retired switches' environment variables change
    nothing and no ``build_variant`` is recorded)."""
    import torch

    from warpsplitk import __version__
    from warpsplitk.measure import bench
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    env = bench.environment()
    assert env["gpu"] == "test GPU" and env["warpsplitk"] == __version__
    assert env["datasheet_TBps"] == 4.8  # the floors' unit (a GPU the table lacks: the H200's)
    assert env["torch"] == torch.__version__
    assert {"cuda", "python", "date", "cutlass_dsl"} <= set(env)
    assert "build_variant" not in env
    for name in ("WARPSPLITK_RELEASE_FENCE", "WARPSPLITK_EARLY_LAUNCH", "WARPSPLITK_THREAD_ARRIVE",
                 "WARPSPLITK_REMOTE_RELEASE", "WARPSPLITK_SPLIT_REDUCE"):
        monkeypatch.setenv(name, "0")
    again = bench.environment()
    assert set(again) == set(env) and "build_variant" not in again


def test_rounds_combine_to_the_median_graph():
    from warpsplitk.runtime import timing
    graphs = [timing.Timing(1.24, 1.23, 1.26, 64), timing.Timing(1.48, 1.47, 1.50, 64),
              timing.Timing(1.47, 1.46, 1.49, 64)]
    combined = timing.combine(graphs)
    # one graph in the fast state does not decide: the median graph counts
    assert combined.median_us == 1.47
    assert (combined.min_us, combined.max_us, combined.calls) == (1.23, 1.50, 192)
    assert combined.spread == pytest.approx((1.50 - 1.23) / 1.47)
    assert timing.combine(graphs[:1]) == graphs[0]
    assert timing.ROUNDS >= 3  # odd and > 1: a median of graphs, not one graph


def test_bench_refuses_fewer_than_one_round(capsys):
    from warpsplitk.cli import main
    assert main(["bench", "--rounds", "0", "--shapes", "768,128"]) == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rounds must be an integer of at least 1, got 0"):
        bench.bench_shape(768, 128, [1], None, rounds=0)


def test_chain_bench_refuses_fewer_than_one_round(capsys):
    from warpsplitk.cli import main
    assert main(["bench", "--chain", "--rounds", "-1"]) == 2
    assert "--rounds must be at least 1, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rounds must be an integer of at least 1, got 0"):
        bench.bench_chain(rounds=0)


@pytest.mark.parametrize("rounds", [2.5, float("nan"), float("inf"), True, "3"])
def test_rounds_is_an_integer(rounds):
    with pytest.raises(ValueError, match=f"rounds must be an integer of at least 1, got "
                                         f"{re.escape(repr(rounds))}$"):
        timing.resolve_rounds(rounds)


def test_time_rounds_alternates_and_checks_after_the_first_graph(monkeypatch):
    """Configurations timed round by round; the check runs right after the
    first configuration's first graph, before any other's calls."""
    from warpsplitk.runtime import timing
    order = []

    def fake_time_calls(calls):
        order.append(calls[0]())
        graph = len(order)
        return timing.Timing(float(graph), float(graph), float(graph), 64)

    monkeypatch.setattr(timing, "time_calls", fake_time_calls)
    ours, cublas = timing.time_rounds([[lambda: "ours"], [lambda: "cublas"]], 3,
                                      after_first=lambda: order.append("check"))
    assert order == ["ours", "check", "cublas", "ours", "cublas", "ours", "cublas"]
    # graphs 1, 4, 6 were ours and 3, 5, 7 cuBLAS's: the median graph of each
    assert (ours.median_us, ours.min_us, ours.max_us, ours.calls) == (4.0, 1.0, 6.0, 192)
    assert cublas.median_us == 5.0
    with pytest.raises(ValueError, match="rounds must be an integer of at least 1, got 0"):
        timing.time_rounds([[lambda: None]], 0)
    assert timing.resolve_rounds(None) == timing.ROUNDS and timing.resolve_rounds(1) == 1


# ------------------------------------------------------------ a model's layer


def test_layer_buffers_alternate_and_hold_every_step():
    steps = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    size, order = bench.layer_buffers(steps, 8)
    assert size == 8 * 28672
    for j, ((src, reads), (dst, writes)) in enumerate(order):
        n, k = steps[j]
        assert (src, dst) == (j % 2, 1 - j % 2)  # each step reads what the last one wrote
        assert reads == 8 * k <= size and writes == 8 * n <= size
    # step j + 1 reads the buffer step j wrote
    assert all(order[j][1][0] == order[j + 1][0][0] for j in range(len(steps) - 1))


def test_layer_reference_is_the_chain_when_shapes_chain():
    import torch
    g = torch.Generator().manual_seed(0)
    m, steps = 3, [(48, 32), (16, 48), (32, 16)]
    weights = [torch.randn(n, k, generator=g, dtype=torch.float64) * k ** -0.5 for n, k in steps]
    size, _ = bench.layer_buffers(steps, m)
    buffers = [torch.randn(size, generator=g, dtype=torch.float64) for _ in range(2)]
    state, last = bench.layer_reference(buffers, weights, m)
    x = buffers[0][:m * 32].view(m, 32)
    for w in weights:  # N of each = K of the next: plain chaining
        x = (x @ w.t()).to(torch.bfloat16).double()
    assert torch.equal(last, x)
    assert last.shape == (m, 32)
    # three steps: the last output is in the second buffer; the inputs are untouched
    assert torch.equal(state[1][:m * 32], last.reshape(-1))
    assert not torch.equal(state[0], buffers[0]) and buffers[0].shape == (size,)


def test_layer_reference_reads_the_previous_output_as_rows_of_its_k():
    import torch
    g = torch.Generator().manual_seed(1)
    m, steps = 2, [(64, 16), (16, 32)]  # 2 x 64 written, read back as 4 rows of 32
    weights = [torch.randn(n, k, generator=g, dtype=torch.float64) for n, k in steps]
    size, _ = bench.layer_buffers(steps, m)
    buffers = [torch.randn(size, generator=g, dtype=torch.float64) for _ in range(2)]
    _, last = bench.layer_reference(buffers, weights, m)
    h = (buffers[0][:m * 16].view(m, 16) @ weights[0].t()).to(torch.bfloat16).double()
    x2 = h.reshape(-1)[:m * 32].view(m, 32)
    assert torch.allclose(last, (x2 @ weights[1].t()).to(torch.bfloat16).double())


def test_layer_chain_cli_checks_its_arguments(capsys):
    from warpsplitk.cli import main
    assert main(["bench", "--chain", "--shapes", "768,128"]) == 2
    assert "--shapes: not with --chain" in capsys.readouterr().err
    assert main(["bench", "--chain", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["bench", "--chain", "--model", "llama-3.1-8b", "--tp", "3"]) == 2
    assert "does not split over tp 3" in capsys.readouterr().err


def test_layer_path_section_and_readme_line_from_a_record(tmp_path):
    """bench --layer's record (scripts/gpu_check.sh layer) rendered: a row
    per model, TP and M, and the README's line with the MLP block's gains."""
    from script_loader import load_script
    make = load_script("make_benchmarks")
    rows = [_row(m=1, ours=13.7, cublas=21.1)]
    path = tmp_path / "b.json"
    bench.write_json(path, {"gpu": "NVIDIA H200", "command": "warpsplitk bench"}, rows)

    def layer(m, mlp_fused, mlp_unmerged, mlp_cublas):
        return {"model": "llama-3-8b", "tp": 1, "m": m, "fused_us": 300.0,
                "unmerged_us": 330.0, "cublas_us": 420.0, "mlp_fused_us": mlp_fused,
                "mlp_unmerged_us": mlp_unmerged, "mlp_cublas_us": mlp_cublas}
    record = {"environment": {"gpu": "NVIDIA H200", "command": "bash scripts/gpu_check.sh layer"},
              "rows": [layer(1, 100.0, 120.0, 160.0), layer(32, 110.0, 121.0, 121.0)]}
    page = make.benchmarks_md(make.load(path), None, 1, layer_path=record)
    assert "## A decode layer's GEMM path" in page
    # the MLP block's HBM floor: gate/up 28672x4096 and down 4096x14336 BF16 at
    # the H200's datasheet 4.8 TB/s
    floor = (28672 * 4096 + 4096 * 14336) * 2 / 4.8e6
    assert f"{floor:.1f}" == "73.4"
    assert ("| llama-3-8b | 1 | 1 | 300.0/330.0/420.0 | 100.0/120.0/160.0 | 73.4 | 1.20× | "
            "1.60× |") in page
    block = make.readme_block(make.load(path), None, layer_path=record)
    # over the unmerged path at every M; over cuBLAS at M <= 8 only
    assert "1.10–1.20× the unmerged path, 1.60–1.60× cuBLAS with PyTorch's SiLU at M ≤ 8" \
        in block


def test_decode_step_section_and_readme_line_from_a_record(tmp_path):
    """examples/llama_decode.py's record rendered: a row per batch with the
    three paths' step times and errors against float64, and the README line."""
    from script_loader import load_script
    make = load_script("make_benchmarks")
    path = tmp_path / "b.json"
    bench.write_json(path, {"gpu": "NVIDIA H200", "command": "warpsplitk bench"},
                     [_row(m=1, ours=13.7, cublas=21.1)])

    def row(batch, torch_us, ours_us, err):
        return {"batch": batch, "step_us_torch": torch_us, "step_us_warpsplitk": ours_us,
                "speedup": torch_us / ours_us, "proj_us_torch": 800.0, "proj_us_warpsplitk": 700.0,
                "rel_err_fp64": err, "top1_agree_fp64": 1.0,
                "torch": {"rel_err_fp64": 0.021, "top1_agree_fp64": 0.95}}
    record = {"command": "python examples/llama_decode.py --config llama-3-8b",
              "date": "2026-12-04", "device": "NVIDIA H200", "torch": "2.11", "transformers": "5.17",
              "args": {"steps": 32},
              "config": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
                         "num_attention_heads": 32, "num_key_value_heads": 8,
                         "vocab_size": 128256},
              "results": [row(1, 1200.0, 1100.0, 0.021), row(8, 1300.0, 1250.0, 0.021)],
              "merge": {"results": [row(1, 1200.0, 1000.0, 0.019), row(8, 1300.0, 1200.0, 0.02)]}}
    page = make.benchmarks_md(make.load(path), None, 1, decode=record)
    assert "## A model's decode step" in page
    assert "| 1 | 1200/1100/1000 | 1.20× | 800/700/700 | 2.1e-02/2.1e-02/1.9e-02 | 0.95/1.00/1.00 |" \
        in page
    block = make.readme_block(make.load(path), None, decode=record)
    assert ("1.20× the plain step at batch 1, 1.08–1.20× over batches; logits within 2.0e-02 "
            "of float64 (plain BF16: 2.1e-02)") in block


def test_held_out_section_and_readme_line_with_a_quick_tune(tmp_path):
    """The held-out shapes' default against a quick-tuned plan of some of
    them (bench of that plan: ``ours`` the plan, ``default`` the cost
    model's choice), rendered in BENCHMARKS.md and the README's line."""
    import json as json_
    from script_loader import load_script
    make = load_script("make_benchmarks")
    path = tmp_path / "b.json"
    bench.write_json(path, {"gpu": "NVIDIA H200", "command": "warpsplitk bench"},
                     [_row(m=1, ours=13.7, cublas=21.1)])

    def cell(n, m, default, reference, cublas, ours=None):
        return {"n": n, "k": 4096, "m": m, "default_us": default, "reference_us": reference,
                "cublas_us": cublas, "ours_us": ours if ours is not None else default}
    held = {"environment": {"gpu": "NVIDIA H200"},
            "rows": [cell(4096, 1, 10.0, 10.0, 15.0), cell(4096, 8, 10.0, 11.0, 14.0),
                     cell(8192, 1, 20.0, 20.0, 19.0)]}
    tuned = {"environment": {"gpu": "NVIDIA H200"},
             "rows": [cell(4096, 1, 10.0, 10.0, 15.0, ours=9.0),
                      cell(4096, 8, 10.0, 11.0, 14.0, ours=10.0),
                      cell(8192, 1, 21.0, 20.0, 19.0, ours=20.0)]}
    model = json_.loads((make.COST_MODEL).read_text())
    page = "\n".join(make.default_md(held, None, model, tuned))
    # 10/9 = 1.111, 10/10 = 1.000, 21/20 = 1.050
    assert ("against a quick tune (`warpsplitk tune`) of 2 of these shapes, timed in one run "
            "(`bench/results/h100-bench-heldout-tuned.json`): the default's time is a median "
            "1.050 of the tuned plan's (worst 1.111; within 7% in 2 of 3 cells).") in page
    assert "slower than cuBLAS in 1 of 3 cells" in page
    block = make.readme_block(make.load(path), None, held=held, tuned=tuned)
    assert "the reference heuristic 1.27×; the default's time is a median 1.050 of a quick " \
        "tune's" in block
    assert "(2 shapes, 3 cells, no plan): the default" in block  # the header's GPU: unnamed
    # measured on another GPU than the shipped plan's: the line names that GPU
    held["environment"]["gpu"] = "NVIDIA H100 80GB HBM3"
    block = make.readme_block(make.load(path), None, held=held, tuned=tuned)
    assert "(2 shapes, 3 cells, no plan, H100): the default" in block
    assert [make.gpu_part(name) for name in ("NVIDIA H200", "NVIDIA B200", "Tesla X")] == \
        ["H200", "B200", "Tesla X"]


def test_measuring_needs_a_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call, name in ((lambda: bench.bench_shape(768, 128, [1], None), "bench_shape"),
                       (lambda: bench.run_bench([(768, 128)]), "run_bench"),
                       (lambda: bench.bench_chain(), "bench_chain"),
                       (lambda: bench.bench_layer("qwen3-0.6b"), "bench_layer")):
        with pytest.raises(ValueError, match=f"^{name} measures on a CUDA GPU, and torch sees "
                                             "none$"):
            call()
    with pytest.raises(ValueError, match="unknown model 'bogus'"):  # its arguments first
        bench.bench_layer("bogus")


def test_chain_choices_take_the_chained_default_and_keep_the_plan():
    from warpsplitk.planning.plans import CUBLAS, DecodePlan, default_choice
    from warpsplitk.tactics import WarpSplitKTactic
    # 9728 x 2560 at M = 32: cuBLAS as an independent call, the kernel in a chain;
    # 100 x 128: a shape the kernel refuses
    chosen = bench.chain_choices(DecodePlan(), [(9728, 2560), (2560, 9728), (100, 128)], (1, 32))
    assert default_choice(32, 9728, 2560) == CUBLAS
    assert chosen[(9728, 2560)][32] == default_choice(32, 9728, 2560, chained=True) != CUBLAS
    assert chosen[(100, 128)] == {1: CUBLAS, 32: CUBLAS}
    kernels = bench.chain_kernels(chosen)
    assert (9728, 2560, chosen[(9728, 2560)][32], False, True) in kernels
    assert all(n != 100 for n, *_ in kernels)
    # a plan's entries, cuBLAS included, are kept
    plan = DecodePlan()
    tactic = WarpSplitKTactic(16, 8, 256, 2, 1)
    plan.set(2560, 9728, 1, tactic)
    plan.set(2560, 9728, 32, CUBLAS)
    assert bench.chain_choices(plan, [(2560, 9728)], (1, 32)) == {(2560, 9728): {1: tactic, 32: CUBLAS}}


def test_a_layer_chain_runs_gate_up_with_the_early_trigger():
    """layer_choices: the chained choices, gate/up (the call before down)
    with the early PDL trigger at M <= 8, plan entries included; the rest
    as chained."""
    from dataclasses import replace
    from warpsplitk import models
    from warpsplitk.planning.plans import CUBLAS, DecodePlan
    from warpsplitk.tactics import WarpSplitKTactic
    layer = models.layer_chain("gemma-3-12b", 1)
    shapes = [(p["n"], p["k"]) for p in layer]
    ms = (1, 8, 32)
    plain = bench.chain_choices(DecodePlan(), shapes, ms)
    chosen = bench.layer_choices(DecodePlan(), layer, ms)
    gate_up = shapes[[p["projection"] for p in layer].index("gate_up")]
    assert not any(t.early_launch for t in plain[gate_up].values())  # 236 MB: not alone
    assert chosen[gate_up] == {1: replace(plain[gate_up][1], early_launch=True),
                               8: replace(plain[gate_up][8], early_launch=True),
                               32: plain[gate_up][32]}  # M > 8: as chained
    assert {s: c for s, c in chosen.items() if s != gate_up} == \
        {s: c for s, c in plain.items() if s != gate_up}
    plan = DecodePlan()
    plan.set(*gate_up, 1, WarpSplitKTactic(48, 8, 128, 7, 2))
    plan.set(*gate_up, 8, CUBLAS)
    with pytest.warns(UserWarning, match="no entry"):  # the other shapes: not in the plan
        chosen = bench.layer_choices(plan, layer, (1, 8))
    assert chosen[gate_up] == {1: WarpSplitKTactic(48, 8, 128, 7, 2, early_launch=True), 8: CUBLAS}


def test_fp8_rows_round_trip_into_their_section(tmp_path):
    """``bench --dtype fp8`` rows: their ratios and bandwidth in the JSON, the
    BENCHMARKS grid and headline rendered from it."""
    from script_loader import load_script
    from warpsplitk.measure import fp8_bench
    make = load_script("make_benchmarks")
    rows = [fp8_bench.Fp8Row(28672, 4096, m, "32,8,256,5,2", fp8, 0.01, "32,8,256,5,2", bf16,
                             77.0, scaled, 0, 35.0, 37.1, 1.7e-3, 2.5e-2)
            for m, fp8, bf16, scaled in ((1, 39.0, 73.0, 64.0), (32, 46.0, 77.0, 73.0))]
    assert "1.87" in fp8_bench.format_row(rows[0])
    path = tmp_path / "h100-bench-fp8.json"
    fp8_bench.write_json(path, {"gpu": "NVIDIA H100 80GB HBM3", "command": "warpsplitk bench "
                                "--dtype fp8 --shapes 28672,4096", "date": "2026-12-06 07:00:00",
                                "read_TBps": 3.17}, rows)
    record = make.load(path)
    assert record["rows"][0]["fp8_over_bf16"] == round(73.0 / 39.0, 3)
    assert record["rows"][0]["weight_TBps"] == round(28672 * 4096 / 39.0e-6 / 1e12, 3)
    page = "\n".join(make.fp8_md(record, make.RESULTS / path.name))
    assert "| 28672 | 4096 | 117.4 | 39.00 (1.87×/1.64×) | 46.00 (1.67×/1.59×) |" in page
    assert "a median 3.01 TB/s (95% of the measured 3.17 TB/s read), 1.87× our BF16 call" in page


def test_fp8_bench_row_scales_for_scaled_mm():
    import torch
    from warpsplitk.measure import fp8_bench
    blocks = torch.arange(6, dtype=torch.float32).view(2, 3) + 1  # 160 x 300: partial edges
    assert torch.equal(fp8_bench.row_scales(blocks, 160, 300)[0, :2], torch.tensor([3.0, 3.0]))
    assert fp8_bench.row_scales(torch.tensor([0.5]), 4, 128).tolist() == [[0.5] * 4]
