"""The timing method's GPU facts (warpsplitk.runtime.timing), on a CPU."""

import pytest

from warpsplitk.runtime import timing


def test_a_timing_under_the_gpus_hbm_peak_is_believed():
    # the H200's limit is 6.0 TB/s (4.8 x 1.25); a B200 reads at up to 8
    assert timing.max_plausible_tbps("NVIDIA H200") == 6.0
    assert timing.max_plausible_tbps("NVIDIA B200") == 10.0
    assert timing.max_plausible_tbps("NVIDIA H100 80GB HBM3") == 3.35 * 1.25
    assert timing.max_plausible_tbps("a GPU of tomorrow") == timing.UNKNOWN_GPU_MAX_TBPS
    weight = 4096 * 4096 * 2
    at_7_tbps = weight / 7e12 * 1e6
    assert at_7_tbps >= timing.physical_floor_us(weight, "NVIDIA B200")
    assert at_7_tbps < timing.physical_floor_us(weight, "NVIDIA H200")
    assert timing.physical_floor_us(weight, "NVIDIA H200") == weight / 6e12 * 1e6
    with pytest.raises(ValueError, match="gpu must be a device name"):
        timing.physical_floor_us(weight, None)


def test_no_known_gpu_reads_faster_than_the_unknown_gpus_limit():
    assert max(timing.DATASHEET_TBPS.values()) < timing.UNKNOWN_GPU_MAX_TBPS


@pytest.mark.parametrize("name, key", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"),
                                       ("NVIDIA", "gpu"), ("", "gpu")])
def test_records_are_named_for_the_gpu_model(name, key):
    assert timing.record_name(name) == key


def test_floors_are_at_the_datasheet_bandwidth_of_the_gpu():
    from warpsplitk.runtime import timing
    assert timing.datasheet_tbps("NVIDIA H200") == 4.8
    assert timing.datasheet_tbps("NVIDIA B200") == 8.0
    # a GPU the table lacks: the H200's, as a stated assumption
    assert timing.datasheet_tbps("NVIDIA H20") == timing.DEFAULT_DATASHEET_TBPS == 4.8
