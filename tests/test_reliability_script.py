"""scripts/reliability.py's verdicts, on made-up results (no GPU)."""

from script_loader import load_script


def test_a_soak_fails_on_drift_error_or_memory_growth():
    soak_failed = load_script("reliability").soak_failed
    clean = {"outputs_differing": 0, "worst_rel_err_vs_fp64": 4e-3,
             "memory_allocated_before": 1 << 30, "memory_allocated_after": 1 << 30}
    assert not soak_failed(clean)
    assert soak_failed(clean | {"outputs_differing": 1})
    assert soak_failed(clean | {"worst_rel_err_vs_fp64": 1e-2})
    assert soak_failed(clean | {"memory_allocated_after": (1 << 30) + 512})
