"""scripts/collect_timings.py without a GPU: what it times per cell."""

import pytest

from script_loader import load_script
from warpsplitk.planning.choose import default_tactic, reference_tactic
from warpsplitk.tactics import check_tactic

collect = load_script("collect_timings")


def test_base_set_holds_the_tuner_candidates_and_both_heuristics():
    for m, n, k in ((1, 4096, 4096), (8, 1536, 7168), (32, 7168, 384)):
        base = collect.base_set(m, n, k, 132)
        assert default_tactic(m, n, k, 132) in base and reference_tactic(m, n, k, 132) in base
        # the late trigger only, but for the default's own (and its late twin)
        default = default_tactic(m, n, k, 132)
        assert {t for t in base if t.early_launch} <= {default}
        assert default.__class__(**{**default.__dict__, "early_launch": False}) in base
        for t in base:
            check_tactic(t, n, k)


def test_twin_set_times_neighbours_of_the_fastest():
    m, n, k = 8, 4096, 4096
    base = collect.base_set(m, n, k, 132)
    # fixture timings: the first two listed are the fastest
    times = {t: 10.0 + i for i, t in enumerate(base)}
    twins = collect.twin_set(times, m, n, k, 132)
    assert twins and not set(twins) & set(times)
    for t in twins:
        check_tactic(t, n, k)
    fastest = base[:2]
    assert all(t.__class__(**{**t.__dict__, "early_launch": True}) in twins for t in fastest)
    assert any(t.x_copy == "tma" for t in twins) and any(t.l2_prefetch in (2, 4) for t in twins)


def test_shapes_come_from_arguments_or_a_model():
    args = collect.main.__globals__["argparse"].Namespace(model=None, tp=1, shapes=["256,512"])
    assert collect.shapes_of(args) == [(256, 512)]
    args.model, args.tp = "llama-3.1-8b", 2
    shapes = collect.shapes_of(args)
    assert (256, 512) in shapes and (3072, 4096) in shapes
    args.model, args.shapes = None, ["256x512"]
    with pytest.raises(SystemExit, match="a shape is N,K"):
        collect.shapes_of(args)
    args.shapes = []
    with pytest.raises(SystemExit, match="give N,K shapes or --model"):
        collect.shapes_of(args)


def test_cells_file_lists_the_tactics_per_cell(tmp_path):
    import json
    path = tmp_path / "cells.json"
    path.write_text(json.dumps({"cells": [
        {"n": 768, "k": 7168, "m": 16, "tactics": ["16,8,256,18,2+early", "16,16,256,13,2,2+early"]},
        {"n": 768, "k": 7168, "m": 4, "tactics": ["16,8,256,14,2,2+early"]},
        {"n": 768, "k": 7168, "m": 16, "tactics": ["16,8,256,18,2+early"]},  # listed again: once
        {"n": 4096, "k": 4096, "m": 1, "tactics": ["32,1,256,8,1"]}]}))
    cells = collect.read_cells(path)
    assert list(cells) == [(768, 7168), (4096, 4096)]
    assert [t.short() for t in cells[(768, 7168)][16]] == ["16,8,256,18,2+early",
                                                          "16,16,256,13,2,2+early"]
    assert [t.short() for t in cells[(768, 7168)][4]] == ["16,8,256,14,2,2+early"]


@pytest.mark.parametrize("text, words", [
    (None, "FileNotFoundError"),
    ("{", "JSONDecodeError"),
    ('{"cells": []}', "no cells"),
    ('{"cells": [{"n": 768, "k": 7168, "m": 40, "tactics": []}]}', "m <= 32"),
    ('{"cells": [{"n": 768, "k": 7168, "tactics": []}]}', "KeyError"),
    ('{"cells": [{"n": 768, "k": 7168, "m": 1, "tactics": ["16,16,256,14,2,2"]}]}', "shared memory"),
    ('{"cells": [{"n": true, "k": 7168, "m": 1, "tactics": ["16,8,256,4,1"]}]}', "positive integers"),
    ('{"cells": [{"n": 768, "k": 7168, "m": 1, "tactics": []}]}', "'tactics' is a non-empty list"),
])
def test_a_bad_cells_file_is_named_with_its_problem(tmp_path, text, words):
    path = tmp_path / "cells.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit, match=words) as error:
        collect.read_cells(path)
    assert str(path) in str(error.value)


def test_cells_do_not_mix_with_shapes(tmp_path):
    with pytest.raises(SystemExit, match="--cells: not with shapes or --model"):
        collect.main([str(tmp_path / "log.jsonl"), "256,512", "--cells", "cells.json"])
