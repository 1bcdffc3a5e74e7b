"""scripts/gpu_record.py: GPU test and sanitizer runs as JSON records, and the
GPU model scripts/gpu_check.sh names them for (no GPU needed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from script_loader import load_script


@pytest.fixture(scope="module")
def record():
    return load_script("gpu_record")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu_k_split" name="test_a" time="1.5"/>
<testcase classname="tests.test_gpu_k_split" name="test_b" time="0.5"><failure message="x"/></testcase>
<testcase classname="tests.test_gpu_k_split" name="test_c" time="0.1"><skipped message="no"/></testcase>
<testcase classname="tests.test_gpu_k_split" name="test_d" time="0.1"><error message="e"/></testcase>
</testsuite></testsuites>"""


def test_tests_record_counts_each_module_and_a_killed_one(record, tmp_path):
    (tmp_path / "test_gpu_k_split.xml").write_text(JUNIT)
    (tmp_path / "test_gpu_k_split.rc").write_text("1\n")
    (tmp_path / "test_gpu_kernel.rc").write_text("124\n")  # killed by its limit: no report
    counts = record.test_counts(str(tmp_path))
    assert counts["modules"]["test_gpu_k_split"] == {
        "passed": 1, "failed": 1, "skipped": 1, "errors": 1, "seconds": 2.2, "exit": "1"}
    assert counts["modules"]["test_gpu_kernel"]["errors"] == 1
    assert counts["totals"] == {"passed": 1, "failed": 1, "skipped": 1, "errors": 2}
    assert counts["failed"] == ["tests.test_gpu_k_split::test_b", "tests.test_gpu_k_split::test_d",
                                "test_gpu_kernel: no report, exit status 124"]


def _log(tmp_path, name, text, rc):
    (tmp_path / f"{name}.log").write_text(text)
    (tmp_path / f"{name}.rc").write_text(rc)


def test_sanitizer_record_is_clean_only_when_every_shard_finished_clean(record, tmp_path):
    _log(tmp_path, "memcheck-0", "70 cases, 0 wrong\n========= ERROR SUMMARY: 0 errors\n", "0")
    _log(tmp_path, "racecheck-0",
         "72 cases, 0 wrong\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 "
         "warnings)\n", "0")
    counts = record.sanitizer_counts(str(tmp_path))
    assert counts["clean"] and counts["tools"]["memcheck"]["cases"] == 70
    assert counts["tools"]["racecheck"]["reported"] == 0
    # a shard cut by its limit never prints its case count
    _log(tmp_path, "synccheck-0", "case 16,8,128,2,1 N=32 K=512 M=[1, 7, 8, 9, 32]\n", "124")
    assert not record.sanitizer_counts(str(tmp_path))["clean"]
    _log(tmp_path, "synccheck-0", "70 cases, 0 wrong\n========= ERROR SUMMARY: 3 errors\n", "9")
    counts = record.sanitizer_counts(str(tmp_path))
    assert not counts["clean"] and counts["tools"]["synccheck"]["reported"] == 3


def test_record_file_carries_command_and_environment(record, tmp_path, monkeypatch):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "test_gpu_llama.xml").write_text(JUNIT)
    (tmp_path / "reports" / "test_gpu_llama.rc").write_text("0")
    monkeypatch.setattr(record, "environment", lambda command: {"command": command, "gpu": "X"})
    out = tmp_path / "r.json"
    assert record.main(["tests", str(tmp_path / "reports"), "--command", "bash x",
                        "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["environment"] == {"command": "bash x", "gpu": "X"} and data["kind"] == "tests"
    assert data["totals"]["passed"] == 1


def test_layers_record_joins_the_chain_records_and_counts(record, tmp_path):
    def row(model, m, ours, reference, cublas):
        return {"model": model, "tp": 1, "m": m, "ours_us": ours, "reference_us": reference,
                "cublas_us": cublas, "speedup": round(cublas / ours, 3)}
    (tmp_path / "b-tp1.json").write_text(json.dumps({"rows": [row("b", 1, 10.0, 9.0, 12.0)]}))
    (tmp_path / "a-tp1.json").write_text(json.dumps(
        {"rows": [row("a", 1, 5.0, 5.5, 8.0), row("a", 8, 6.0, 6.0, 5.0)]}))
    counts = record.layer_rows(str(tmp_path))
    assert [(r["model"], r["m"]) for r in counts["rows"]] == [("a", 1), ("a", 8), ("b", 1)]
    assert counts["totals"] == {"layers": 3, "faster_than_cublas": 2, "at_least_reference": 2}


def test_layer_path_record_joins_the_layer_records_and_reads_the_targets(record, tmp_path):
    def row(model, m, fused, unmerged, cublas):
        return {"model": model, "tp": 1, "m": m, "fused_us": 0.0, "unmerged_us": 0.0,
                "cublas_us": 0.0, "mlp_fused_us": fused, "mlp_unmerged_us": unmerged,
                "mlp_cublas_us": cublas}
    (tmp_path / "b-tp8.json").write_text(json.dumps({"rows": [row("b", 32, 10.0, 11.0, 12.0)]}))
    (tmp_path / "a-tp1.json").write_text(json.dumps(
        {"rows": [row("a", 1, 10.0, 12.0, 16.0), row("a", 8, 10.0, 13.0, 15.0)]}))
    counts = record.layer_path_rows(str(tmp_path))
    assert [(r["model"], r["m"]) for r in counts["rows"]] == [("a", 1), ("a", 8), ("b", 32)]
    # the least fused-over-unmerged MLP gain anywhere; over cuBLAS at M <= 8 only
    assert counts["totals"] == {"rows": 3, "mlp_fused_over_unmerged_min": 1.1,
                                "mlp_fused_over_cublas_min_m_le_8": 1.5}


def _gpu_check(tmp_path, gpu):
    """scripts/gpu_check.sh's quick stage with torch seeing ``gpu`` (None: no
    GPU); python3 runs the script's own ``-c`` lines and logs the others."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        f"class cuda:\n    is_available = staticmethod(lambda: {gpu is not None})\n"
        f"    get_device_name = staticmethod(lambda *a: {gpu!r})\n")
    log = tmp_path / "calls"
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                    f'echo "$@" >> {log}\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GPU_NAME"}
    env.update(PATH=f"{shim.parent}{os.pathsep}{env['PATH']}", PYTHONPATH=str(fake),
               RESULTS=str(tmp_path / "results"))
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script), "quick"], env=env, capture_output=True,
                          text=True, timeout=60)
    return done, (log.read_text() if log.exists() else "")


def test_gpu_check_names_the_records_for_the_gpu(tmp_path):
    done, calls = _gpu_check(tmp_path, "NVIDIA B200")
    assert done.returncode == 0, done.stderr
    assert calls == f"scripts/quick_tune_record.py {tmp_path}/results/b200-tune-quick.json\n"


def test_gpu_check_without_a_gpu_is_one_line(tmp_path):
    done, calls = _gpu_check(tmp_path, None)
    assert done.returncode == 2 and calls == ""
    assert done.stderr == "gpu_check.sh: torch sees no CUDA GPU; the checks run on one\n"
