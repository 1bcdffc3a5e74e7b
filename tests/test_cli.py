"""The command line on a CPU: arguments checked before anything heavy, one
error line and exit status 2 for a bad one, the same flags in every
command, tune's short flag list and its interface with the tuner, the plan
view's per-row source and its register counts from the disk cache."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from warpsplitk import cli, shapes as shape_table
from warpsplitk.runtime import compile as compile_module
from warpsplitk.runtime import disk_cache
from warpsplitk.cli import main
from warpsplitk.planning.plans import DecodePlan, builtin_plan
from warpsplitk.tactics import WarpSplitKTactic, ctas_per_sm
from warpsplitk.planning.choose import default_tactic
from warpsplitk.tactics import register_estimate

SRC = Path(__file__).resolve().parents[1] / "src"


def _env(**extra):
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **extra}


def _run(argv, **env):
    return subprocess.run([sys.executable, "-m", "warpsplitk.cli", *argv], env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def test_python_dash_m_runs_the_command():
    """``python -m warpsplitk`` is the ``warpsplitk`` command, exit codes included."""
    done = subprocess.run([sys.executable, "-m", "warpsplitk", "plan", "--no-compile",
                           "--shapes", "4224,7168", "--m", "1"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "4224" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", "warpsplitk", "plan", "--m", "0"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr


def _one_error(capsys, command, *words):
    """The command wrote nothing to stdout and one error line naming ``words``."""
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"warpsplitk {command}: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture
def no_gpu_needed(monkeypatch):
    """Fail the test if a command gets as far as its GPU check."""
    def refuse(command):
        raise AssertionError(f"{command} reached the GPU check")
    monkeypatch.setattr(cli.checks, "require_gpu", refuse)


# ------------------------------------------------------------ no GPU


@pytest.mark.parametrize("argv", [["bench", "--shapes", "768,128", "--m", "1"],
                                  ["tune", "--shapes", "768,128", "-o", "plan.json"]])
def test_gpu_commands_without_a_gpu_say_so_in_one_line(argv, tmp_path):
    done = subprocess.run([sys.executable, "-m", "warpsplitk.cli", *argv], cwd=tmp_path,
                          env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"warpsplitk {argv[0]}: error: no usable CUDA GPU")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "plan.json").exists()


def test_bad_arguments_come_before_the_gpu_check_and_before_torch():
    probe = ("import sys\n"
             "from warpsplitk.cli import main\n"
             "codes = [main(['bench', '--m', '0']), main(['tune', '-o', 'p.json', '--m', '0']),\n"
             "         main(['plan', '--m', '0']), main(['compile', '--n', '16', '--k', '128',\n"
             "                                          '--m', '40'])]\n"
             "print(codes, 'torch' in sys.modules, 'cutlass' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["[2,", "2,", "2,", "2]", "False", "False"], done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 4 and all("argument --m" in line for line in lines)
    assert [line.split(":")[0] for line in lines] == [
        "warpsplitk bench", "warpsplitk tune", "warpsplitk plan", "warpsplitk compile"]


def test_bench_rounds_checked_before_the_gpu(capsys, no_gpu_needed):
    assert main(["bench", "--rounds", "0", "--shapes", "768,128"]) == 2
    _one_error(capsys, "bench", "--rounds", "at least 1, got 0")


@pytest.mark.parametrize("flags,words", [
    (["--dtype", "fp8"], ["--hf-fp8-kernel", "--scales block128"]),
    (["--dtype", "fp8", "--scales", "block128"], ["--hf-fp8-kernel", "finegrained-fp8", "got"]),
])
def test_bench_hf_fp8_kernel_checked_before_the_gpu(flags, words, tmp_path, capsys,
                                                      no_gpu_needed):
    """--hf-fp8-kernel: only for block scales (what FP8Linear takes), and a
    folder holding kernels-community's finegrained-fp8."""
    assert main(["bench", "--shapes", "768,128", *flags, "--hf-fp8-kernel",
                 str(tmp_path)]) == 2
    _one_error(capsys, "bench", *words)


# ------------------------------------------------------------ --m


@pytest.mark.parametrize("command", ["plan", "bench", "tune"])
@pytest.mark.parametrize("text,words", [
    ("1-40", ["1..32", "40", "'1-40'"]),
    ("8-1", ["'8-1'", "empty"]),
    ("abc", ["'abc'", "1..32"]),
    ("0", ["1..32", "got 0"]),
    ("", ["no M given", "1..32"]),
])
def test_m_checked_whole_before_any_output(command, text, words, capsys, no_gpu_needed):
    extra = ["-o", "plan.json"] if command == "tune" else []
    assert main([command, "--m", text, *extra]) == 2
    _one_error(capsys, command, "argument --m:", *words)


def test_compile_m_is_one_m_in_1_to_32(capsys):
    assert main(["compile", "--n", "256", "--k", "1024", "--m", "40"]) == 2
    _one_error(capsys, "compile", "argument --m", "1..32", "40")
    assert main(["compile", "--n", "256", "--k", "1024", "--m", "1,8"]) == 2
    _one_error(capsys, "compile", "argument --m", "'1,8'")


def test_compile_refuses_a_tactic_the_shape_cannot_take(capsys):
    assert main(["compile", "--n", "40", "--k", "1024", "--tactic", "16,8,128,4,1"]) == 2
    _one_error(capsys, "compile", "--tactic", "N must be", "40")
    assert main(["compile", "--n", "256", "--k", "1024", "--tactic", "16,8"]) == 2
    _one_error(capsys, "compile", "argument --tactic", "'16,8'")
    # no tactic: the default's shape rules, N below the 32-bit offsets' bound
    assert main(["compile", "--n", str(2 ** 30), "--k", "1024"]) == 2
    _one_error(capsys, "compile", "N must be below 1073741824", "N=1073741824")


def test_compile_fp8_takes_the_fp8_default_and_refuses_what_fp8_refuses(capsys, monkeypatch):
    """``--fp8-scales``: the FP8-weight kernel, the FP8 default's tactic; a
    tactic FP8 weights cannot take is one line and exit 2."""
    seen = []

    class Report:
        arch, threads, smem_bytes, registers, spill_bytes, local_bytes = "sm_90a", 256, 1, 1, 0, 0
        ptx = ""

        def audit(self):
            return []

    def fake_compile(n, k, tactic, arch, has_bias=False, fp8_scales=None):
        seen.append((n, k, tactic, fp8_scales))
        return Report()
    monkeypatch.setattr(compile_module, "compile_for_arch", fake_compile)
    from warpsplitk.planning.choose import default_tactic
    assert main(["compile", "--n", "4096", "--k", "13696", "--m", "32",
                 "--fp8-scales", "block128"]) == 0
    assert seen == [(4096, 13696, default_tactic(32, 4096, 13696, 132, fp8=True,
                                                 fp8_scales="block128"), "block128")]
    assert "ptx audit     ok" in capsys.readouterr().out
    assert main(["compile", "--n", "4096", "--k", "4096", "--fp8-scales", "channel",
                 "--tactic", "16,8,128,4,1+tma"]) == 2
    _one_error(capsys, "compile", "--tactic", "FP8 weights take x_copy 'cp.async'")


# ------------------------------------------------------------ files


def test_missing_plan_file(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    for command in ("plan", "bench"):
        assert main([command, "--plan", str(missing)]) == 2
        _one_error(capsys, command, "argument --plan", str(missing), "no such plan file")


def test_malformed_plan_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plan", "--plan", str(bad)]) == 2
    _one_error(capsys, "plan", "argument --plan", str(bad), "not valid JSON")
    bad.write_text(json.dumps({"format": "something else"}))
    assert main(["plan", "--plan", str(bad)]) == 2
    _one_error(capsys, "plan", str(bad), "not a warpsplitk plan")
    bad.write_text(json.dumps({"format": "warpsplitk-plan", "version": 1,
                               "shapes": [{"n": 256, "k": 1024, "entries": []}]}))
    assert main(["plan", "--plan", str(bad)]) == 2
    _one_error(capsys, "plan", str(bad), "entries")


def test_builtin_plan_names_the_available_ones():
    with pytest.raises(ValueError, match="no built-in plan 'b200'.*'h200'"):
        builtin_plan("b200")


def test_missing_shape_table(capsys, tmp_path, no_gpu_needed):
    missing = tmp_path / "shapes.json"
    for command, extra in (("plan", []), ("bench", []), ("tune", ["-o", str(tmp_path / "p")])):
        assert main([command, "--shapes", str(missing), *extra]) == 2
        _one_error(capsys, command, "argument --shapes", str(missing), "no such shape table")


def test_shape_table_without_k(capsys, tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"shapes": [{"n": 256, "k": 1024}, {"n": 512}]}))
    assert main(["plan", "--no-compile", "--shapes", str(table)]) == 2
    _one_error(capsys, "plan", "argument --shapes", str(table), "shapes[1]", "'k'")
    table.write_text("[1, 2")
    assert main(["plan", "--no-compile", "--shapes", str(table)]) == 2
    _one_error(capsys, "plan", str(table), "not valid JSON")
    table.write_text(json.dumps({"rows": []}))
    assert main(["plan", "--no-compile", "--shapes", str(table)]) == 2
    _one_error(capsys, "plan", str(table), "'shapes' list")


def test_tune_log_missing_or_malformed(capsys, tmp_path, no_gpu_needed):
    out = tmp_path / "plan.json"
    log = tmp_path / "log.jsonl"
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 2
    _one_error(capsys, "tune", "argument --log", str(log), "no such tuning log")
    log.write_text('{"key": "256,1024,1,cublas", "n": 256, "k": 1024, "m": 1, "tactic": "cublas", '
                   '"ok": true, "us": 2.5}\nnot json\n')
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 2
    _one_error(capsys, "tune", "argument --log", str(log), "line 2", "not valid JSON")
    # a tuning run (resuming from the log, the default) checks it before the GPU too
    assert main(["tune", "--log", str(log), "-o", str(out), "--shapes", "256,1024"]) == 2
    _one_error(capsys, "tune", str(log), "line 2")
    log.write_text('[1, 2]\n')
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 2
    _one_error(capsys, "tune", str(log), "line 1", "not a tuning record")
    assert not out.exists()


def test_output_folder_must_exist(capsys, tmp_path, no_gpu_needed):
    out = tmp_path / "no such folder" / "plan.json"
    assert main(["tune", "--shapes", "256,1024", "-o", str(out)]) == 2
    _one_error(capsys, "tune", "argument --output", "does not exist")
    assert main(["bench", "--json", str(out)]) == 2
    _one_error(capsys, "bench", "argument --json", "does not exist")


# ------------------------------------------------------------ same flags


def test_same_flag_same_default_everywhere():
    parser = cli.build_parser()
    buckets = [1, 4, 8, 16, 24, 32]
    for command in ("plan", "bench", "tune"):
        args = parser.parse_args([command, "-o", "x.json"] if command == "tune" else [command])
        assert args.m == buckets, command
        assert args.shapes is None  # the built-in table
    for command in ("plan", "bench"):
        assert parser.parse_args([command]).plan is None  # the target GPU's built-in plan
    args = parser.parse_args(["compile", "--n", "256", "--k", "1024"])
    assert args.m == 1 and args.arch == "sm_90a" and args.sm_count is None  # --arch's GPU's
    args = parser.parse_args(["plan"])  # --gpu's, else sm_90a's (checks.target_gpu)
    assert args.arch is None and args.gpu is None and args.sm_count is None and args.tbps is None


def test_plan_defaults_to_the_built_in_plan_of_the_target_gpu(capsys):
    """Without --plan, the view takes the plan measured on --arch's GPU (the
    H200's for sm_90a); no plan was measured on a B200, so sm_100a shows the
    cost model's choices. bench does the same for the GPU it runs on."""
    from warpsplitk.planning.plan_cache import builtin_plan_for
    assert builtin_plan_for("NVIDIA H200", 132) == "h200"
    assert builtin_plan_for("NVIDIA H200", 114) is None  # another SM count: another model
    assert builtin_plan_for("NVIDIA B200", 148) is None
    for gpu in ([], ["--gpu", "h200"]):
        assert main(["plan", "--no-compile", "--shapes", "4224,7168", "--m", "1"] + gpu) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[1].startswith("# tactics from built-in H200 plan (1 of 1 rows")
    for gpu, sms, name in ((["--arch", "sm_100a"], 148, "B200"), (["--gpu", "h100"], 132, "H100")):
        assert main(["plan", "--no-compile", "--shapes", "4224,7168", "--m", "1"] + gpu) == 0
        out = capsys.readouterr().out
        line = out.splitlines()[1]  # the plan an H100 runs: none, and the way to the H200's
        assert line.startswith("# tactics from no plan: the default (cost model) (0 of 1 rows")
        assert line.endswith(f"no plan was measured on the {name}"
                             f"{' 80GB HBM3' if name == 'H100' else ''}: --plan h200 shows the "
                             "H200's")
        assert _rows(out)[0][-12] == default_tactic(1, 4224, 7168, sms).short()


@pytest.mark.parametrize("given, shown", [
    ([], "NVIDIA H200 (--gpu h200): sm_90a, 132 SMs; floor at 4.8 TB/s (datasheet)"),
    (["--arch", "sm_100a"], "NVIDIA B200 (--gpu b200): sm_100a, 148 SMs; floor at 8.0 TB/s"),
    (["--arch", "sm_100a", "--sm-count", "132", "--tbps", "4.8"],
     "sm_100a, 132 SMs (--sm-count); floor at 4.8 TB/s (--tbps)"),
    (["--gpu", "h100"], "NVIDIA H100 80GB HBM3 (--gpu h100): sm_90a, 132 SMs; floor at 3.35 TB/s"),
    (["--gpu", "B200"], "NVIDIA B200 (--gpu b200): sm_100a, 148 SMs; floor at 8.0 TB/s"),
    (["--gpu", "b200", "--arch", "sm_100a", "--tbps", "7.7"], "sm_100a, 148 SMs; floor at 7.7"),
    (["--gpu", "h100", "--sm-count", "114", "--tbps", "2.0"],
     "H100 80GB HBM3 (--gpu h100): sm_90a, 114 SMs (--sm-count); floor at 2.0 TB/s (--tbps)")])
def test_plan_targets_the_gpu_of_its_arch_unless_told(capsys, given, shown):
    """--gpu (else --arch's GPU) sets the arch, SMs and the floor's HBM
    bandwidth, and the header line says which and what a flag overrode."""
    assert main(["plan", "--no-compile", "--plan", "none", "--shapes", "4096,4096",
                 "--m", "1"] + given) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("# GPU ") and shown in out.splitlines()[0]
    tbps = float(shown.partition("floor at ")[2].split()[0])
    assert _rows(out)[0][-3] == f"{4096 * 4096 * 2 / (tbps * 1e6):.2f}"


@pytest.mark.parametrize("given, words", [
    (["--gpu", "a100"], ["argument --gpu: invalid choice: 'a100'", "'h100', 'h200', 'b200'"]),
    (["--gpu", "b200", "--arch", "sm_90a"], ["argument --gpu: b200 is an sm_100a GPU",
                                              "--arch sm_90a"])])
def test_a_gpu_plan_does_not_target_is_one_line(capsys, given, words):
    assert main(["plan", "--no-compile", "--shapes", "4096,4096"] + given) == 2
    _one_error(capsys, "plan", *words)


def test_plan_help_names_the_gpus_and_explains_every_column(capsys):
    from warpsplitk.cli import plan as plan_command
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for gpu in ("h100: sm_90a, 132 SMs, 3.35 TB/s", "h200: sm_90a, 132 SMs, 4.8 TB/s",
                "b200: sm_100a, 148 SMs, 8.0 TB/s", "the h200, the GPU the built-in plan"):
        assert gpu in text
    assert text.count("meas us the time the tuner measured for this cell when the plan was "
                      "made (its own run and process); BENCHMARKS.md's come from a separate "
                      "`bench` run") == 1
    explained = {line.split("  ")[0] for line in plan_command.LEGEND_LINES if line[0] != " "}
    assert explained == set(plan_command.HEADINGS) - {"projection", "N", "K", "M"} | {"N K M"}


def test_tune_shows_only_what_a_user_needs(capsys):
    tune_parser = cli.build_parser().commands["tune"]
    flags = {flag for action in tune_parser._actions for flag in action.option_strings}
    assert flags == {"-h", "--help", "--shapes", "--model", "--tp", "--m", "-o", "--output",
                     "--log", "--time-budget", "--jobs", "--fresh", "--from-log",
                     "--exhaustive", "--dtype", "--scales"}
    for gone in ("--k-split", "--k-split-4", "--x-multicast", "--early-launch", "--bulk-x",
                 "--l2-prefetch", "--bounded-prefetch", "--tma-x", "--mixed-tiles",
                 "--narrow-tiles", "--confirm", "--log-records", "--stale-records",
                 "--kernel-revision", "--gpu", "--sm-count"):
        assert main(["tune", "-o", "p.json", gone]) == 2
        _one_error(capsys, "tune", "unrecognized arguments", gone)


def test_tune_calls_the_tuner_with_its_interface_only(tmp_path, monkeypatch):
    import warpsplitk.planning.tune as tune_module
    seen = {}

    def fake_tune(shapes, ms, **kwargs):
        seen.update(kwargs, shapes=shapes, ms=list(ms))
        return DecodePlan()

    monkeypatch.setattr(tune_module, "tune", fake_tune)
    monkeypatch.setattr(cli.checks, "require_gpu", lambda command: None)
    out = tmp_path / "plan.json"
    log = tmp_path / "log.jsonl"
    assert main(["tune", "--shapes", "256,512", "--m", "1-4", "-o", str(out), "--log", str(log),
                 "--jobs", "3", "--time-budget", "60"]) == 0
    assert set(seen) - {"shapes", "ms"} == {"log_path", "resume", "progress", "time_budget_s",
                                            "jobs", "shortlist", "fp8_scales"}
    assert seen["fp8_scales"] is None  # BF16 weights unless asked
    # the quick tune unless asked for the whole space
    assert seen["shortlist"] == tune_module.SHORTLIST > 0
    assert seen["shapes"] == [(256, 512)] and seen["ms"] == [1, 2, 3, 4]
    assert seen["log_path"] == str(log) and seen["resume"] is True
    assert seen["jobs"] == 3 and seen["time_budget_s"] == 60.0
    assert json.loads(out.read_text())["format"] == "warpsplitk-plan"
    # the default Ms: every M of 1..32, each measured at its bucket
    assert main(["tune", "-o", str(out), "--fresh", "--log", str(log)]) == 0
    assert seen["ms"] == list(range(1, 33)) and seen["resume"] is False
    assert seen["jobs"] is None and seen["time_budget_s"] is None
    assert len(seen["shapes"]) == 16
    assert main(["tune", "-o", str(out), "--log", str(log), "--exhaustive"]) == 0
    assert seen["shortlist"] == 0


def test_tune_dtype_fp8_tunes_fp8_entries_with_the_scales_asked(tmp_path, monkeypatch, capsys):
    import warpsplitk.planning.tune as tune_module
    from warpsplitk.planning.choose import default_tactic
    seen = {}

    def fake_tune(shapes, ms, **kwargs):
        seen.update(kwargs, shapes=shapes, ms=list(ms))
        plan = DecodePlan()
        for m in ms:
            plan.set(256, 512, m, default_tactic(m, 256, 512, 132, fp8=True), 2.0,
                     fp8_scales=kwargs["fp8_scales"])
        return plan

    monkeypatch.setattr(tune_module, "tune", fake_tune)
    monkeypatch.setattr(cli.checks, "require_gpu", lambda command: None)
    out, log = tmp_path / "plan.json", tmp_path / "log.jsonl"
    argv = ["tune", "--shapes", "256,512", "--m", "1", "-o", str(out), "--log", str(log)]
    assert main(argv + ["--dtype", "fp8"]) == 0
    assert seen["fp8_scales"] == "channel"  # the default scales
    assert "FP8 plan (channel scales) for 1 shapes x 1 Ms written to" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["version"] == 2 and data["shapes"] == [] and len(data["fp8"]["channel"]) == 1
    assert main(argv + ["--dtype", "fp8", "--scales", "block128"]) == 0
    assert seen["fp8_scales"] == "block128"
    capsys.readouterr()
    for bad, words in ((["--scales", "tensor"], ["argument --scales: only with --dtype fp8, "
                                                 "got --dtype bf16"]),
                       (["--dtype", "bf16", "--scales", "channel"], ["only with --dtype fp8"]),
                       (["--dtype", "fp16"], ["argument --dtype: invalid choice: 'fp16'"]),
                       (["--dtype", "fp8", "--scales", "block"],
                        ["argument --scales: invalid choice: 'block'"])):
        assert main(argv + bad) == 2
        _one_error(capsys, "tune", *words)


def test_tune_from_log_dtype_fp8_rebuilds_the_fp8_entries(tmp_path, capsys):
    from warpsplitk.planning.plans import load_plan
    from warpsplitk.planning.selection import REPRESENTATIVE_MS
    from warpsplitk.planning.tune_log import log_key
    log, out = tmp_path / "log.jsonl", tmp_path / "plan.json"
    tactic = WarpSplitKTactic.parse("16,8,256,4,1")
    with open(log, "w") as f:
        for m in REPRESENTATIVE_MS:
            for scales, us in ((None, 5.0), ("tensor", 3.0)):
                f.write(json.dumps({"key": log_key(1024, 4096, m, tactic, scales), "n": 1024,
                                    "k": 4096, "m": m, "tactic": tactic.short(), "ok": True,
                                    "us": us, **({"fp8": scales} if scales else {})}) + "\n")
    base = ["tune", "--from-log", "--log", str(log), "-o", str(out)]
    assert main(base + ["--dtype", "fp8", "--scales", "tensor"]) == 0
    plan = load_plan(out)
    assert plan.entries == {} and plan.lookup(1024, 4096, 1, fp8_scales="tensor") == tactic
    assert plan.fp8_entries["tensor"][(1024, 4096)][1] == (tactic, 3.0)
    assert "FP8 plan (tensor scales) for 1 shapes written" in capsys.readouterr().out
    assert main(base + ["--dtype", "fp8", "--scales", "block128"]) == 0  # none of those scales
    assert load_plan(out).fp8_entries == {}
    assert main(base) == 0
    plan = load_plan(out)
    assert plan.fp8_entries == {} and plan.entries[(1024, 4096)][1] == (tactic, 5.0)


def test_tune_from_log_takes_the_gpu_the_log_names(tmp_path, monkeypatch, capsys):
    import warpsplitk.planning.selection as selection_module
    import warpsplitk.planning.tune as tune_module
    calls = []
    real_meta = tune_module.plan_meta

    def plan_from_log(*args, **kwargs):
        calls.append((args, kwargs))
        return DecodePlan(meta=args[2]), {}

    def plan_meta(*args, **kwargs):
        assert not kwargs
        return real_meta(*args)

    monkeypatch.setattr(selection_module, "plan_from_log", plan_from_log)
    monkeypatch.setattr(tune_module, "plan_meta", plan_meta)
    log, out = tmp_path / "log.jsonl", tmp_path / "plan.json"
    record = {"key": "256,1024,8,cublas", "n": 256, "k": 1024, "m": 8, "tactic": "cublas",
              "ok": True, "us": 2.5}
    log.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "sm_count": 132}}) + "\n"
                   + json.dumps(record) + "\n")
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out), "--m", "8"]) == 0
    (args, kwargs), = calls
    assert kwargs == {"fp8_scales": None} and args[0] == str(log) and args[1] == [5, 6, 7, 8]
    assert args[2]["gpu"] == "NVIDIA H200" and args[2]["sm_count"] == 132
    assert "plan for 0 shapes" in capsys.readouterr().out
    log.write_text(json.dumps(record) + "\n")
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 0
    assert calls[-1][0][2]["gpu"] == "unknown" and calls[-1][0][2]["sm_count"] == 132


def test_tune_from_log_rebuilds_a_plan_without_gpu(tmp_path, capsys):
    from warpsplitk.planning.plans import load_plan
    from warpsplitk.planning.selection import REPRESENTATIVE_MS
    log, out = tmp_path / "log.jsonl", tmp_path / "plan.json"
    with open(log, "w") as f:
        for m in REPRESENTATIVE_MS:
            f.write(json.dumps({"key": f"1024,4096,{m},16,8,256,4,1", "n": 1024, "k": 4096,
                                "m": m, "tactic": "16,8,256,4,1", "ok": True, "us": 5.0}) + "\n")
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 0
    assert sorted(load_plan(out).entries) == [(1024, 4096)]
    assert sorted(load_plan(out).entries[(1024, 4096)]) == list(range(1, 33))
    assert "plan for 1 shapes" in capsys.readouterr().out


def test_bench_records_its_command_line(tmp_path, monkeypatch, capsys):
    from warpsplitk.measure import bench
    from warpsplitk.planning.plans import DecodePlan
    seen = {}

    def run_bench(shapes, ms, plan, **kwargs):
        seen.update(shapes=shapes, ms=list(ms), plan=plan)
        return {"gpu": "fake", "read_TBps": 4.0, "datasheet_TBps": 4.8, "torch": "t",
                "cutlass_dsl": "c", "date": "d"}, []

    monkeypatch.setattr(bench, "run_bench", run_bench)
    monkeypatch.setattr(cli.checks, "require_gpu", lambda command: None)
    monkeypatch.setattr(cli.bench, "_device_gpu", lambda: ("NVIDIA H200", 132))
    out = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "768,128", "--m", "1,8", "--json", str(out)]
    assert main(argv) == 0
    env = json.loads(out.read_text())["environment"]
    assert env["command"] == "warpsplitk " + " ".join(argv)
    assert seen["shapes"] == [(768, 128)] and seen["ms"] == [1, 8]
    assert seen["plan"].entries == builtin_plan("h200").entries  # the H200's, by default
    assert main(["bench", "--plan", "none", "--shapes", "768,128"]) == 0
    assert isinstance(seen["plan"], DecodePlan) and seen["plan"].entries == {}
    # on a GPU no built-in plan was measured on, no plan unless one is named
    monkeypatch.setattr(cli.bench, "_device_gpu", lambda: ("NVIDIA H100 80GB HBM3", 132))
    assert main(["bench", "--shapes", "768,128"]) == 0 and seen["plan"].entries == {}
    assert main(["bench", "--plan", "h200", "--shapes", "768,128"]) == 0
    assert seen["plan"].entries == builtin_plan("h200").entries


def test_bench_fp8_times_the_named_plans_entries(tmp_path, monkeypatch, capsys):
    """``bench --dtype fp8``: the defaults unless ``--plan`` names a plan (its
    FP8 entries then time, as ``tune --dtype fp8`` wrote them); no
    --chain, --layer or --plot with it."""
    from warpsplitk.measure import fp8_bench
    from warpsplitk.planning.plans import DecodePlan
    seen = {}

    def run_fp8_bench(shapes, ms, plan=None, **kwargs):
        seen.update(shapes=shapes, plan=plan, scales=kwargs["scales"])
        return {"gpu": "fake", "read_TBps": 3.1, "datasheet_TBps": 3.35, "torch": "t",
                "cutlass_dsl": "c", "date": "d"}, []

    monkeypatch.setattr(fp8_bench, "run_fp8_bench", run_fp8_bench)
    monkeypatch.setattr(cli.checks, "require_gpu", lambda command: None)
    monkeypatch.setattr(cli.bench, "_device_gpu", lambda: ("NVIDIA H200", 132))
    assert main(["bench", "--dtype", "fp8", "--shapes", "4096,4096"]) == 0
    assert seen["plan"] is None  # not the GPU's built-in BF16 plan: the defaults
    plan = DecodePlan()
    plan.set(4096, 4096, 1, WarpSplitKTactic(32, 8, 256, 4, 2), fp8_scales="block128")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["bench", "--dtype", "fp8", "--scales", "block128", "--plan", str(path),
                 "--shapes", "4096,4096"]) == 0
    assert seen["plan"].lookup(4096, 4096, 1, fp8_scales="block128") == \
        WarpSplitKTactic(32, 8, 256, 4, 2) and seen["scales"] == "block128"
    capsys.readouterr()
    assert main(["bench", "--dtype", "fp8", "--chain"]) == 2
    _one_error(capsys, "bench", "--chain", "not with --dtype fp8")


# ------------------------------------------------------------ plan view


def _rows(out):
    """The plan table's rows split on blanks: no '#' line (the header, the
    legend, notes), no headings."""
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0].split()[:2] == ["projection", "from"], lines[0]
    return [line.split() for line in lines[1:]]


def test_plan_view_says_per_row_where_the_tactic_came_from(capsys, tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"shapes": [{"n": 256, "k": 1024, "model": "x",
                                             "projection": "y"}]}))
    assert main(["plan", "--no-compile", "--shapes", "4224,7168", str(table), "--m", "1,8"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [r[-16] for r in rows] == ["plan", "plan", "default", "default"]
    assert [tuple(r[-15:-12]) for r in rows] == [("4224", "7168", "1"), ("4224", "7168", "8"),
                                                 ("256", "1024", "1"), ("256", "1024", "8")]
    plan = builtin_plan("h200")
    assert rows[0][-12] == plan.lookup(4224, 7168, 1).short()
    assert rows[2][-12] == default_tactic(1, 256, 1024, 132).short()
    assert rows[2][-2:] == ["-", "-"]  # nothing measured for a default row
    assert "2 of 4 rows" in out.splitlines()[1]
    assert "'default': the cost model's choice where the plan has none;" in out
    assert main(["plan", "--plan", "none", "--no-compile", "--shapes", "4224,7168",
                 "--m", "1"]) == 0
    out = capsys.readouterr().out
    assert _rows(out)[0][-16] == "default"
    assert "'default': the cost model's choice;" in out  # no plan to have none


def test_model_view_says_which_mlps_are_experts(capsys):
    """--model lists a layer's dense projections; a model whose MLPs are
    (partly) mixtures of experts says how many layers' MLPs it leaves out."""
    assert main(["plan", "--no-compile", "--model", "gpt-oss-20b", "--m", "1"]) == 0
    out = capsys.readouterr().out
    assert "# gpt-oss-20b: the MLPs of experts (24 of 24 layers) are grouped GEMMs, not listed" \
        in out
    assert not any("gate_up" in r or "down" in r for r in _rows(out))
    assert main(["plan", "--no-compile", "--model", "deepseek-v3", "--tp", "8", "--m", "1"]) == 0
    out = capsys.readouterr().out
    assert "the MLPs of experts (58 of 61 layers)" in out
    assert main(["plan", "--no-compile", "--model", "llama-3-8b", "--m", "1"]) == 0
    assert "experts" not in capsys.readouterr().out


def test_plan_view_registers_from_the_disk_cache_without_compiling(tmp_path, monkeypatch):
    """Every register count cached: the plan view compiles nothing, imports
    no torch and shows the cached counts (here planted ones). (It imports
    the CuTe DSL: the DSL's CUDA build and settings are part of the key.)"""
    env = {"WARPSPLITK_CACHE_DIR": str(tmp_path / "cache"), "WARPSPLITK_DISK_CACHE": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plan = builtin_plan("h200")
    planted = {}
    for m in (1, 32):
        tactic = plan.lookup(4224, 7168, m)
        planted[m] = 70 + m
        disk_cache.store_resources(disk_cache.key("sm_90a", 4224, 7168, tactic, False, True),
                                   {"registers": planted[m], "spill_bytes": 0, "local_bytes": 0})
    assert plan.lookup(4224, 7168, 1) != plan.lookup(4224, 7168, 32)
    probe = ("import sys\n"
             "from warpsplitk.cli import main\n"
             "import warpsplitk.runtime.compile as c\n"
             "c.compile_for_arch = lambda *a, **k: sys.exit('compiled instead of reading')\n"
             "code = main(['plan', '--shapes', '4224,7168', '--m', '1,32'])\n"
             "print('torch' in sys.modules, code)\n")
    done = subprocess.run([sys.executable, "-c", probe], env=_env(**env), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "False 0"
    assert [row[-6:-4] for row in _rows("\n".join(lines[:-1]))] == [[str(planted[1]), "0"],
                                                                    [str(planted[32]), "0"]]
    assert "compiling" not in done.stderr


def test_plan_view_compiles_what_the_cache_lacks_and_keeps_it(capsys, monkeypatch):
    calls = []

    def fake_resources(n, k, tactic, arch="sm_90a", has_bias=False, use_pdl=True,
                       fp8_scales=None):
        calls.append((n, k, tactic, arch) + ((fp8_scales,) if fp8_scales else ()))
        return {"registers": 42, "spill_bytes": 0, "local_bytes": 0}

    from warpsplitk.runtime import precompile
    monkeypatch.setattr(precompile, "precompile_resources",
                        lambda kernels, arch, jobs, progress: progress(1, 1) or {})
    monkeypatch.setattr(compile_module, "arch_resources", fake_resources)
    assert main(["plan", "--shapes", "256,1024", "--m", "1", "--plan", "none",
                 "--arch", "sm_100a"]) == 0
    captured = capsys.readouterr()
    assert _rows(captured.out)[0][-6:-4] == ["42", "0"]  # registers, local frame
    assert calls == [(256, 1024, default_tactic(1, 256, 1024, 148), "sm_100a")]  # a B200
    assert "compiling 1/1" in captured.err
    calls.clear()  # e4m3 weights: the FP8 default, the FP8 kernel compiled
    assert main(["plan", "--shapes", "256,1024", "--m", "1", "--plan", "none",
                 "--dtype", "fp8", "--scales", "block128"]) == 0
    fp8 = default_tactic(1, 256, 1024, 132, fp8=True, fp8_scales="block128")
    assert calls == [(256, 1024, fp8, "sm_90a", "block128")]


def test_plan_view_of_fp8_weights(capsys, tmp_path):
    """--dtype fp8: the plan's FP8 entries for --scales, else the FP8
    default; the FP8 kernel's shared memory and CTAs per SM; the floor at
    one byte a weight. Without --dtype fp8 the plan line points at them."""
    plan = DecodePlan(meta={"gpu": "NVIDIA H100 80GB HBM3", "sm_count": 132})
    tuned = WarpSplitKTactic.parse("16,8,256,6,2")
    plan.set(4096, 4096, 1, tuned, 5.0, fp8_scales="block128")
    path = tmp_path / "plan.json"
    plan.save(path)
    argv = ["plan", "--no-compile", "--plan", str(path), "--shapes", "4096,4096", "--m", "1,8",
            "--gpu", "h100"]
    assert main(argv + ["--dtype", "fp8", "--scales", "block128"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert [r[-16] for r in rows] == ["plan", "default"]
    assert rows[0][-12] == "16,8,256,6,2"
    default = default_tactic(8, 4096, 4096, 132, fp8=True, fp8_scales="block128")
    assert rows[1][-12] == default.short()
    assert rows[0][-8] == str(ctas_per_sm(tuned, fp8=True))
    assert rows[0][-7] == str(tuned.smem_plan_for(True).total)
    assert rows[0][-3:] == ["5.01", "5.00", "100"]  # 16.8 MB at 3.35 TB/s, as measured
    assert "e4m3 weights with block128 scales" in out and "1 of 2 rows" in out
    assert main(argv) == 0  # BF16 rows: the FP8 entries are named, not shown
    assert "the plan's FP8 entries (1 shapes) show with --dtype fp8" in capsys.readouterr().out
    assert main(argv + ["--dtype", "fp8"]) == 0  # channel scales: no entry of that kind
    assert [r[-16] for r in _rows(capsys.readouterr().out)] == ["default", "default"]
    assert main(argv + ["--scales", "tensor"]) == 2
    assert "argument --scales: only with --dtype fp8" in capsys.readouterr().err


def test_plan_view_shows_the_local_frame_where_compiled(capsys, monkeypatch):
    """A kernel ptxas gives a local frame (spills) shows it next to its
    registers; --no-compile models the registers and knows no frame."""
    from warpsplitk.runtime import precompile
    monkeypatch.setattr(precompile, "precompile_resources", lambda *a: {})
    monkeypatch.setattr(compile_module, "arch_resources", lambda *a, **k: {
        "registers": 56, "spill_bytes": 24, "local_bytes": 24})
    argv = ["plan", "--shapes", "3216,7168", "--m", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _rows(out)[0][-6:-4] == ["56", "24"]
    assert "# local B   local memory frame per thread, bytes" in out
    assert main(argv + ["--no-compile"]) == 0
    row = _rows(capsys.readouterr().out)[0]
    tactic = builtin_plan("h200").lookup(3216, 7168, 1)
    assert row[-6:-4] == [str(register_estimate(tactic)), "-"]


def _table_lines(out):
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    return lines[0], lines[1:]


def test_plan_table_columns_line_up_whatever_the_tactic(capsys):
    """Every column as wide as its widest cell: the headings' right ends
    (left end for the projection) are the cells' in every row, long tactics
    (+halfH) and long projection names included."""
    from warpsplitk.cli.plan import HEADINGS
    assert main(["plan", "--no-compile", "--m", "1,32"]) == 0
    heading, rows = _table_lines(capsys.readouterr().out)
    assert any("+half" in row for row in rows)
    ends, at = [], 0
    for name in HEADINGS[1:]:
        at = heading.index(name, at) + len(name)
        ends.append(at)
    for row in rows:
        cells = list(re.finditer(r"\S+", row))[-len(ends):]  # from 'from' on: no blanks inside
        assert [cell.end() for cell in cells] == ends, row


def test_plan_table_names_every_row_apart(capsys, tmp_path):
    """A name is never cut: two projections never print alike; a shape
    given as N,K is named N×K."""
    table = shape_table.load()["shapes"]
    (tmp_path / "t.json").write_text(json.dumps({"shapes": table}))
    assert main(["plan", "--no-compile", "--m", "1", "--shapes", "4096,11008",
                 str(tmp_path / "t.json")]) == 0
    heading, rows = _table_lines(capsys.readouterr().out)
    names = [re.match(r"(.+?) +(plan|default|cublas) +\d+ +\d+ +1 ", row)[1] for row in rows]
    assert names == ["4096×11008"] + [f"{s['model']} {s['projection']}" for s in table]
    assert "kimi-k3 shared_gate_up_proj / mla_g_proj (TP16)" in names
    assert len(set(names)) == len({(s["model"], s["projection"]) for s in table}) + 1


def test_plan_legend_follows_the_table(capsys):
    assert main(["plan", "--no-compile", "--shapes", "768,128", "--m", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    from warpsplitk.cli.plan import LEGEND_LINES
    assert lines[-len(LEGEND_LINES):] == ["# " + line for line in LEGEND_LINES]
    assert lines[-len(LEGEND_LINES) - 1].startswith("768×128 ")


def test_cache_lists_resource_records(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WARPSPLITK_DISK_CACHE", raising=False)
    tactic = default_tactic(1, 256, 1024)
    disk_cache.store_resources(disk_cache.key("sm_90a", 256, 1024, tactic, False, True),
                               {"registers": 56, "spill_bytes": 0, "local_bytes": 0},
                               describe=(256, 1024, tactic, "sm_90a"))
    assert main(["cache"]) == 0
    assert "0 compiled kernels, 1 resource records" in capsys.readouterr().out
    assert main(["cache", "--list"]) == 0
    out = capsys.readouterr().out
    assert f"sm_90a N=256 K=1024 tactic={tactic.short()}: 56 registers" in out
    assert main(["cache", "--clear"]) == 0
    assert "removed 0 compiled kernels and 1 resource records" in capsys.readouterr().out
    assert disk_cache.resource_entries() == []


def test_no_shape_the_kernel_takes_is_one_line(capsys, tmp_path, no_gpu_needed):
    for command, more in (("bench", []), ("tune", ["-o", str(tmp_path / "plan.json")])):
        assert main([command, "--shapes", "24,100", "1000,4096"] + more) == 2
        _one_error(capsys, command, "no shape the kernel takes",
                   "24x100 left to cuBLAS: N must be a positive multiple of 16, got 24",
                   "1000x4096 left to cuBLAS")


def test_tune_log_with_a_half_written_last_line(capsys, tmp_path, no_gpu_needed):
    """A log whose last record a crash or a full disk cut short: the records
    before it rebuild the plan, and a resuming tune gets past reading it."""
    from warpsplitk.planning.plans import load_plan
    from warpsplitk.planning.selection import REPRESENTATIVE_MS
    log, out = tmp_path / "log.jsonl", tmp_path / "plan.json"
    with open(log, "w") as f:
        for m in REPRESENTATIVE_MS:
            f.write(json.dumps({"key": f"1024,4096,{m},16,8,256,4,1", "n": 1024, "k": 4096,
                                "m": m, "tactic": "16,8,256,4,1", "ok": True, "us": 5.0}) + "\n")
        f.write('{"key": "2048,4096,1,16,8,256,4,1", "n": 20')
    last = len(REPRESENTATIVE_MS) + 1
    with pytest.warns(RuntimeWarning, match=f"{log} line {last}: ignoring the unfinished"):
        assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 0
    assert sorted(load_plan(out).entries) == [(1024, 4096)]
    assert load_plan(out).meta["log_records"] == len(REPRESENTATIVE_MS)
    assert "plan for 1 shapes" in capsys.readouterr().out
    # resuming reads the log before the GPU: it gets as far as the GPU check
    with pytest.warns(RuntimeWarning, match=f"line {last}"), \
            pytest.raises(AssertionError, match="reached the GPU check"):
        main(["tune", "--log", str(log), "-o", str(out), "--shapes", "256,1024"])


@pytest.mark.parametrize("tbps", ["inf", "nan", "0", "-1", "x"])
def test_tbps_is_a_finite_positive_number(tbps, capsys):
    assert main(["plan", "--no-compile", "--tbps", tbps]) == 2
    _one_error(capsys, "plan", "argument --tbps", f"a positive number, got {tbps!r}")


def _valid_record(**changes):
    record = {"key": "256,1024,8,16,8,128,2,1", "n": 256, "k": 1024, "m": 8,
              "tactic": "16,8,128,2,1", "ok": True, "us": 2.5, "rev": 3}
    record.update(changes)
    return {k: v for k, v in record.items() if v is not ...}


@pytest.mark.parametrize("changes,words", [
    ({"us": 0}, ["'us' must be a positive number of microseconds, got 0"]),
    ({"us": -3}, ["got -3"]),
    ({"us": None}, ["got None"]),
    ({"us": "fast"}, ["got 'fast'"]),
    ({"us": ...}, ["got None"]),
    ({"n": ...}, ["'n' must be a positive integer, got None"]),
    ({"m": 33}, ["'m' must be in 1..32, got 33"]),
    ({"k": 1024.0}, ["'k' must be a positive integer, got 1024.0"]),
    ({"rev": "x"}, ["'rev' must be a positive integer, got 'x'"]),
    ({"key": [1]}, ["'key' must be a string, got [1]"]),
    ({"tactic": ...}, ["'tactic' must be a string, got None"]),
])
def test_tune_log_records_are_checked(changes, words, capsys, tmp_path, no_gpu_needed):
    log, out = tmp_path / "log.jsonl", tmp_path / "plan.json"
    log.write_text(json.dumps({"meta": {"gpu": "test"}}) + "\n" + json.dumps(_valid_record())
                   + "\n" + json.dumps(_valid_record(**changes)) + "\n")
    assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 2
    _one_error(capsys, "tune", "argument --log", f"{log} line 3: ", *words)
    assert not out.exists()
    # the library's own reading of the log says the same
    from warpsplitk.planning.selection import plan_from_log
    with pytest.raises(ValueError, match=f"^{log} line 3: "):
        plan_from_log(str(log))
    # a record that failed carries no time
    if changes in ({"us": None}, {"us": ...}):
        log.write_text(json.dumps(_valid_record(ok=False, **changes)) + "\n")
        assert main(["tune", "--from-log", "--log", str(log), "-o", str(out)]) == 0


def test_plan_file_times_are_checked_before_the_view_divides(capsys, tmp_path):
    plan = DecodePlan()
    plan.set(4096, 4096, 1, default_tactic(1, 4096, 4096, 132), 5.0)
    data = plan.to_json()
    data["shapes"][0]["entries"]["1"]["us"] = 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--no-compile", "--plan", str(path), "--shapes", "4096,4096",
                 "--m", "1"]) == 2
    _one_error(capsys, "plan", "argument --plan", "'us' must be a positive number")


def test_shape_and_m_helpers_refuse_non_text():
    from warpsplitk import shapes
    for bad in ([None], [(16, 128)]):
        with pytest.raises(ValueError, match="a shape is an 'N,K' string or a .json table's path, "
                                             "got "):
            shapes.shape_entries(bad)
    with pytest.raises(ValueError, match=r"Ms are given as text \(Ms in 1\.\.32 as e\.g\..*\), "
                                         r"got 5$"):
        shapes.parse_ms(5)


@pytest.mark.parametrize("path,words", [("", "a file to write, got ''"),
                                        ("somewhere/", "a file to write, got 'somewhere/'")])
def test_an_output_that_cannot_be_written_is_refused_before_compiling(path, words, capsys,
                                                                      monkeypatch):
    from warpsplitk.runtime import compile as compile_module
    monkeypatch.setattr(compile_module, "compile_for_arch", lambda *a, **k: pytest.fail("compiled"))
    assert main(["compile", "--n", "256", "--k", "1024", "--emit-ptx", path]) == 2
    _one_error(capsys, "compile", "argument --emit-ptx", words)


def test_a_file_system_refusal_is_one_line(capsys, monkeypatch):
    from warpsplitk.planning import plan_cache

    def refuse():
        raise PermissionError(13, "Permission denied", "/cache/plans")
    monkeypatch.setattr(plan_cache, "entries", refuse)
    assert main(["cache"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "warpsplitk cache: error: [Errno 13] Permission denied: '/cache/plans'\n"


def test_a_missing_dependency_is_one_line_naming_what_to_install(capsys, monkeypatch):
    """A source checkout without the CuTe DSL: the command that needs it says
    what to install in one line (exit 1), no traceback."""
    import sys as _sys
    from warpsplitk.runtime import compile as compile_module
    from warpsplitk.runtime import dsl
    monkeypatch.setitem(_sys.modules, "cutlass", None)  # import cutlass -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r"nvidia-cutlass-dsl\[cu13\]==4\.8\.1"):
        dsl.import_dsl()
    monkeypatch.setattr(compile_module, "compile_for_arch", lambda *a, **k: dsl.import_dsl())
    assert main(["compile", "--n", "256", "--k", "1024"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("warpsplitk compile: error: compiling a kernel needs the CuTe DSL")
    assert err.count("\n") == 1 and "pip install 'nvidia-cutlass-dsl[cu13]==4.8.1'" in err


def test_a_missing_module_of_the_package_itself_is_a_traceback(monkeypatch):
    """Only a dependency's absence is the user's set-up; one of warpsplitk's
    own modules missing is a bug and keeps its traceback."""
    from warpsplitk.planning import plan_cache

    def broken():
        raise ModuleNotFoundError("No module named 'warpsplitk.gone'", name="warpsplitk.gone")
    monkeypatch.setattr(plan_cache, "entries", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["cache"])


def test_the_dsl_requirement_named_in_errors_is_the_one_installed():
    import tomllib
    from pathlib import Path
    from warpsplitk.runtime.dsl import DSL_REQUIREMENT
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert DSL_REQUIREMENT in project["dependencies"]


def test_a_missing_dsl_is_said_before_any_compile_starts(capsys, monkeypatch, tmp_path):
    """`warpsplitk plan` (which compiles for registers) without the CuTe DSL:
    the one line comes before any progress, and no worker is started."""
    import sys as _sys
    from warpsplitk.runtime import precompile
    monkeypatch.setenv("WARPSPLITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(_sys.modules, "cutlass", None)
    monkeypatch.setattr(precompile, "_run_workers", lambda *a, **k: pytest.fail("started"))
    assert main(["plan", "--shapes", "4096,4096", "--m", "1"]) == 1
    captured = capsys.readouterr()
    assert "compiled" not in captured.out and "compiling" not in captured.out
    assert captured.err.startswith("warpsplitk plan: error: compiling a kernel needs the CuTe DSL")
