"""Strict JSON reading (jsonfile.py): duplicate keys and deep nesting are
one-line ValueErrors, in every file the library reads."""

import json
import types
from importlib import resources
from pathlib import Path

import pytest

from warpsplitk import jsonfile, models, shapes
from warpsplitk.measure import plot
from warpsplitk.planning import cost_model, decode_plan

DATA = Path(resources.files("warpsplitk").joinpath("data"))


def test_loads_names_a_duplicate_key_at_any_depth():
    with pytest.raises(ValueError, match=r"^here: not valid JSON \(duplicate key 'x'\)$"):
        jsonfile.loads('{"x": 1, "x": 2}', "here")
    with pytest.raises(ValueError, match=r"^here: not valid JSON \(duplicate key 'm'\)$"):
        jsonfile.loads('{"a": [{"b": {"m": 1, "n": 2, "m": 1}}]}', "here")
    # the same key in two objects is no duplicate
    assert jsonfile.loads('{"a": {"x": 1}, "b": {"x": 2}}', "here") == \
        {"a": {"x": 1}, "b": {"x": 2}}


def test_loads_refuses_deep_nesting_and_broken_text():
    with pytest.raises(ValueError, match=r"^deep: not valid JSON \(nested too deeply\)$"):
        jsonfile.loads("[" * 100_000 + "]" * 100_000, "deep")
    with pytest.raises(ValueError, match=r"^broken: not valid JSON \(Expecting"):
        jsonfile.loads('{"a": ', "broken")


def test_read_json_names_the_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"k": 1, "k": 1}')
    with pytest.raises(ValueError, match=rf"^{path}: not valid JSON \(duplicate key 'k'\)$"):
        jsonfile.read_json(path, "table")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'none.json'}: no such table$"):
        jsonfile.read_json(tmp_path / "none.json", "table")


def test_a_plan_file_with_two_entries_for_one_m_is_refused(tmp_path):
    # json would keep the second entry silently; the plan would run a tactic nobody chose
    path = tmp_path / "plan.json"
    path.write_text('{"format": "%s", "version": %d, "shapes": [{"n": 768, "k": 128, "entries": '
                    '{"1": {"tactic": "16,8,128,1,1"}, "1": {"tactic": "cublas"}}}]}'
                    % (decode_plan.PLAN_FORMAT, decode_plan.PLAN_VERSION))
    with pytest.raises(ValueError, match=rf"^{path}: not valid JSON \(duplicate key '1'\)$"):
        decode_plan.load_plan(path)


def test_the_shipped_data_has_no_duplicate_key():
    files = sorted(DATA.glob("*.json"))
    assert files
    for path in files:
        jsonfile.loads(path.read_text(encoding="utf-8"), str(path))


def _fake_package(tmp_path, name, text):
    """A package whose data folder holds only ``name`` (``text``), as
    ``resources`` would hand it to the module reading it."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_text(text)
    return types.SimpleNamespace(files=lambda package: tmp_path)


# each reader of a shipped file: its module, the file, how to read it, and the caches to clear
BUILT_IN = {
    "plan": (decode_plan, "plan-h200.json", lambda: decode_plan.builtin_plan("h200"),
             "built-in plan 'h200'", ()),
    "cost model": (cost_model, "cost-model-h200.json", lambda: cost_model.shipped_model("h200"),
                   "cost model 'h200'", (cost_model.shipped_model,)),
    "shapes": (shapes, "decode-shapes.json", shapes.load, "built-in shape table", ()),
    "models": (models, "models.json", models.model_names, "built-in model table",
               (models._table,)),
}


@pytest.mark.parametrize("reader", sorted(BUILT_IN))
def test_every_shipped_file_is_read_strictly(reader, tmp_path, monkeypatch):
    module, name, read, where, caches = BUILT_IN[reader]
    monkeypatch.setattr(module, "resources", _fake_package(tmp_path, name, '{"a": 1, "a": 2}'))
    for cached in caches:
        cached.cache_clear()
    try:
        with pytest.raises(ValueError, match=rf"^{where}: not valid JSON \(duplicate key 'a'\)$"):
            read()
    finally:
        for cached in caches:
            cached.cache_clear()  # the real file again, for the tests after this one


def test_the_plot_refuses_a_duplicate_key_in_one_line(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text('{"rows": [], "rows": []}')
    with pytest.raises(SystemExit) as done:
        plot.main([str(path), str(tmp_path / "b.png")])
    assert done.value.code == 2
    assert f"{path}: not valid JSON (duplicate key 'rows')" in capsys.readouterr().err
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(SystemExit):
        plot.main([str(path), str(tmp_path / "b.png")])
    assert "a bench JSON holds an object with a 'rows' list" in capsys.readouterr().err
    assert not (tmp_path / "b.png").exists()
