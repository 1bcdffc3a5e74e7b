"""The documentation stays in sync with the measurement records (CPU, fast).

BENCHMARKS.md and the README's bench block are generated from
bench/results/ by scripts/make_benchmarks.py; the docs are product docs
(no account of how the project was made) under a word budget; every record
is cited and every cited record exists and says how it was made.
"""

import json
import re
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
#: Words of README, BENCHMARKS (generated tables included) and docs/ together:
#: a reader's afternoon; a new record's table must displace words, not add pages.
WORD_BUDGET = 13_800
#: Records scripts/gpu_check.sh writes on a GPU host; the docs describe them
#: before the first check has produced them.
RECORD_PATH = re.compile(r"bench/results/[\w\-]+(?:\.\w+)+")
HISTORY = re.compile(r"\bsession\b|\brun [0-9]+", re.IGNORECASE)


def docs():
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def cited_records():
    return {match for path in docs() for match in RECORD_PATH.findall(path.read_text())}


def test_generated_docs_match_the_records():
    make = load_script("make_benchmarks")
    assert make.stale() == [], "run: python scripts/make_benchmarks.py"


def test_check_mode_exits_zero_when_in_sync():
    make = load_script("make_benchmarks")
    assert make.main(["--check"]) == 0


def test_check_mode_refuses_to_plot(capsys):
    make = load_script("make_benchmarks")
    with pytest.raises(SystemExit) as exit_info:
        make.main(["--check", "--plot"])
    assert exit_info.value.code == 2
    assert "--check writes nothing" in capsys.readouterr().err


def test_docs_stay_under_the_word_budget():
    words = {path.relative_to(ROOT).as_posix(): len(path.read_text().split()) for path in docs()}
    assert sum(words.values()) < WORD_BUDGET, words


def test_docs_tell_no_history():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in docs()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert found == []


def test_every_cited_record_exists():
    missing = [p for p in cited_records() if not (ROOT / p).is_file()]
    assert missing == []


def test_every_record_is_cited():
    records = {p.relative_to(ROOT).as_posix() for p in RESULTS.iterdir() if p.is_file()}
    assert records, "bench/results/ holds no record"
    assert sorted(records - cited_records()) == []


def _json_records():
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", _json_records(), ids=lambda p: p.name)
def test_each_record_says_how_it_was_made(path):
    data = json.loads(path.read_text())
    env = data.get("environment", data)
    for key in ("command", "date", "gpu"):
        assert env.get(key), f"{path.name}: environment.{key} missing"
    versions = env.get("versions", env)
    for key in ("warpsplitk", "cutlass_dsl", "torch"):
        assert versions.get(key), f"{path.name}: version of {key} missing"


def _short(choice):
    return choice if isinstance(choice, str) else choice.short()


def test_records_measured_what_the_package_chooses_today():
    """The benchmark records show the product as it is: a change to the
    default's choices (or to the built-in plan) fails here until the records
    it touches are measured again (scripts/gpu_check.sh)."""
    from warpsplitk import builtin_plan
    from warpsplitk import models
    from warpsplitk.measure.bench import layer_choices
    from warpsplitk.planning.plans import DecodePlan, default_choice
    stale = []
    held = json.loads((RESULTS / "h100-bench-heldout.json").read_text())["rows"]
    assert held and all(r["source"] == "default" for r in held)
    stale += [r for r in held if r["tactic"] != _short(default_choice(r["m"], r["n"], r["k"], 132))]
    # a plan's record times the default beside it: that time must be today's default's
    tuned = json.loads((RESULTS / "h100-bench-heldout-tuned.json").read_text())["rows"]
    assert tuned and all(r["default_us"] is not None for r in tuned)
    stale += [r for r in tuned
              if r.get("default_tactic") != _short(default_choice(r["m"], r["n"], r["k"], 132))]
    plan = builtin_plan("h200")
    table = json.loads((RESULTS / "h200-bench-plan.json").read_text())["rows"]
    stale += [r for r in table if r["tactic"] != _short(plan.tactic_for(r["n"], r["k"], r["m"], 132))]
    for r in json.loads((RESULTS / "h100-bench-layers.json").read_text())["rows"]:
        layer = models.layer_chain(r["model"], r["tp"])
        chosen = layer_choices(DecodePlan(), layer, [r["m"]])
        now = " -> ".join(_short(chosen[(p["n"], p["k"])][r["m"]]) for p in layer)
        if now != r["tactics"] or r["projections"] != " -> ".join(f"{p['n']}x{p['k']}"
                                                                  for p in layer):
            stale.append(r)
    assert stale == []


def test_architecture_lists_every_module():
    """docs/ARCHITECTURE.md's module table names each module of the package
    by its path, and nothing that is not there."""
    package = ROOT / "src" / "warpsplitk"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")
               if p.name != "__init__.py"}
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text[text.index("## Modules"):text.index("## The kernel")]
    named = set()
    for row in table.splitlines():
        if row.startswith("| `"):
            named |= set(re.findall(r"`([\w/]+\.py)`", row.split(" | ")[0]))
    assert named == modules


def test_docs_code_imports_resolve():
    """Every ``import`` of warpsplitk in the docs' Python blocks names a module
    and an attribute that exist."""
    import ast
    import importlib
    count, missing = 0, []
    for path in docs():
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.DOTALL):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "warpsplitk":
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        count += 1
                        if not hasattr(module, alias.name):
                            try:
                                importlib.import_module(f"{node.module}.{alias.name}")
                            except ImportError:
                                missing.append(f"{path.name}: {node.module}.{alias.name}")
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] == "warpsplitk":
                            count += 1
                            importlib.import_module(alias.name)
    assert count > 5 and missing == []


def _environment_table() -> set:
    """The variables named in the first column of reliability.md's table of
    environment variables."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    table = text[text.index("Every environment variable the package reads"):]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    return {name for row in rows[2:] for name in re.findall(r"`([A-Z][A-Z0-9_]+)`",
                                                             row.split("|")[1])}


def _environment_read() -> set:
    """Every environment variable the package's code reads: by name through
    os.environ/getenv, and the multicast settings the parallel modules check."""
    found = set()
    pattern = re.compile(r"""(?:environ(?:\.get)?|getenv)\s*[\(\[]\s*["']([A-Z][A-Z0-9_]+)["']""")
    for path in (ROOT / "src" / "warpsplitk").rglob("*.py"):
        found |= set(pattern.findall(path.read_text()))
    from warpsplitk.nn.parallel import MULTICAST_OFF
    return found | set(MULTICAST_OFF)


def test_every_environment_variable_read_is_documented():
    read = _environment_read()
    assert {"WARPSPLITK_CACHE_DIR", "WARPSPLITK_CACHE_MAX_SIZE", "HF_HOME"} <= read
    assert _environment_table() == read


def test_architecture_states_the_layers_the_import_test_enforces():
    """The numbered layer list in docs/ARCHITECTURE.md is tests/test_structure.py's LAYERS."""
    from test_structure import LAYERS
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    listed = [tuple(name.replace("/", ".") for name in re.findall(r"`([\w/]+?)/?`", line.split(" (")[0]))
              for line in text.splitlines() if re.match(r"\d\. `", line)]
    expected = [tuple(name for name in layer if name not in ("", "__main__")) for layer in LAYERS]
    assert listed == expected
