"""The mutation tester's own bookkeeping (``tools/mutation.py``), without a mutation campaign: the mutants it lists
for a tiny module (what is mutated and what is not), the equivalent-mutants list matched by location, code and
mutation (not by line), and the score and detail records a run merges into. Everything on a temporary directory:
the real records under ``tools/records/`` are only read."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "mutation.py"

SNIPPET = '''"""A docstring with a + b in it."""
import math

LIMIT = "a" + "b"


def f(a, b):
    """Adds a + b."""
    if a < b:
        raise ValueError("a" + "b")
    c = a + b
    s = f"{a}" + "y"
    d = a * b  # pragma: no mutate
    return c
'''


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("mutation_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _mutants(tool, tmp_path, source=SNIPPET):
    (tmp_path / "snippet.py").write_text(source)
    return tool.collect_mutants("snippet.py", tmp_path)


def test_the_generator_lists_the_expected_mutants(tool, tmp_path):
    ms = _mutants(tool, tmp_path)
    assert [(m.line, m.location, m.code, m.mutation) for m in ms] == [
        (9, "f", "if a < b:", "`<` -> `<=` (col 9)"),
        (11, "f", "c = a + b", "`+` -> `-` (col 10)"),
    ]
    applied = [m.apply(SNIPPET).splitlines()[m.line - 1].strip() for m in ms]
    assert applied == ["if a <= b:", "c = a - b"]
    # the function the session server swaps, and the lines whose covering tests judge each mutant
    assert all(m.func == "f" and m.func_line == 7 for m in ms)
    assert ms[0].lines == (9,) and ms[1].lines == (11,)


def test_strings_raise_imports_and_pragma_lines_are_left_alone(tool, tmp_path):
    """The docstrings, the string concatenations (a plain one at module level, an f-string one in ``f``), the
    ``raise`` line and the ``# pragma: no mutate`` line give no mutant; without the pragma the last one does."""
    touched = {m.line for m in _mutants(tool, tmp_path)}
    assert touched.isdisjoint({1, 2, 4, 8, 10, 12, 13})
    unmarked = SNIPPET.replace("  # pragma: no mutate", "")
    assert [m.mutation for m in _mutants(tool, tmp_path, unmarked) if m.line == 13] == ["`*` -> `/` (col 10)"]


def test_each_operator_family(tool, tmp_path):
    source = ("def g(x, y, flag, xs):\n"
              "    if flag and x is None:\n"
              "        return -x\n"
              "    x += 2\n"
              "    return max(xs) if not flag else y.sum().mT\n")
    got = {(m.line, m.mutation.rsplit(" (col", 1)[0]) for m in _mutants(tool, tmp_path, source)}
    assert got == {
        (2, "`and` -> `or`"), (2, "`is` -> `is not`"),
        (3, "drop unary `-`"),
        (4, "`+=` -> `-=`"), (4, "`2` -> `3`"),
        (5, "`max` -> `min`"), (5, "drop unary `not`"), (5, "`.sum` -> `.mean`"), (5, "drop `.mT`"),
    }


def test_equivalent_entries_match_by_location_code_and_mutation(tool, tmp_path):
    m = _mutants(tool, tmp_path)[1]
    entry = {"location": "f", "code": "c = a + b", "mutation": "`+` -> `-` (col 10)", "why": "a test"}
    equivalent = {"snippet.py": [entry]}
    assert tool.equivalent_keys(equivalent, "snippet.py") == {m.key()}
    assert tool.equivalent_keys(equivalent, "other.py") == set()
    # lines added above the function move the mutant, not its key: the entry still matches
    shifted = _mutants(tool, tmp_path, "# a comment\n\n" + SNIPPET)
    assert [s.line for s in shifted] == [11, 13]
    assert shifted[1].key() in tool.equivalent_keys(equivalent, "snippet.py")
    # another column (the same line edited) is another mutant
    moved = _mutants(tool, tmp_path, SNIPPET.replace("c = a + b", "c = a  + b"))
    assert moved[1].key() not in tool.equivalent_keys(equivalent, "snippet.py")


def _with_status(tool, tmp_path, statuses):
    m = _mutants(tool, tmp_path)[0]
    out = []
    for s in statuses:
        out.append(tool.Mutant(**{**m.__dict__, "status": s, "tests": ["t::a", "t::b"]}))
    return out


def test_tally_counts_killed_survived_and_equivalent(tool, tmp_path, capsys):
    # as run_package leaves them: "" (to run), "equivalent?" (listed), "killed" (an earlier run's), "survived"
    ms = _with_status(tool, tmp_path, ["", "", "", "equivalent?", "equivalent?", "killed", "survived"])
    results = {"mod.py#0": "killed", "mod.py#1": "timeout", "mod.py#2": "survived", "mod.py#4": "killed"}
    stale = {"location": "gone", "code": "x = 1", "mutation": "`1` -> `2` (col 4)", "why": "-"}
    counts = tool.tally("mod.py", ms, results, {"mod.py": [stale]})
    assert counts == {"killed": 3, "survived": 2, "equivalent": 2}
    assert [m.status for m in ms] == ["killed", "timeout", "survived", "equivalent", "equivalent", "killed",
                                      "survived"]
    printed = capsys.readouterr().out
    assert "listed as equivalent but killed" in printed  # --check-equivalent: a test told it apart
    assert "stale equivalent entry" in printed and "'gone'" in printed


def test_a_run_is_merged_into_the_records(tool, tmp_path):
    (tmp_path / "mod.py").write_text("x = 1\n")
    (tmp_path / "empty.py").write_text("")
    survivor, killed = _with_status(tool, tmp_path, ["survived", "killed"])
    score = {"other.py": {"killed": 9, "survived": 1, "equivalent": 0},
             "mod.py": {"killed": 1, "survived": 5, "equivalent": 0},
             "empty.py": {"killed": 4, "survived": 0, "equivalent": 0}}
    detail = {"runs": {"old": {"wall_s": 1.0}}, "survivors": {"other.py": [{"line": 3}]}}
    run = {"results": {"mod.py": ({"killed": 1, "survived": 1, "equivalent": 0}, [survivor, killed]),
                       "empty.py": ({"killed": 0, "survived": 0, "equivalent": 0}, [])},
           "wall_s": 12.5, "tests": 40,
           "sampling": {"mod.py": {"sampled": False, "population": 2, "k": None, "seed": 0},
                        "empty.py": {"sampled": False, "population": 0, "k": None, "seed": 0}}}
    tool.record_run(score, detail, "pkg", run, tmp_path, max_tests=10)
    assert score == {"other.py": {"killed": 9, "survived": 1, "equivalent": 0},  # not run: kept
                     "mod.py": {"killed": 1, "survived": 1, "equivalent": 0},  # run: replaced
                     "empty.py": {"killed": 4, "survived": 0, "equivalent": 0}}  # no mutant now: kept
    assert detail["survivors"]["other.py"] == [{"line": 3}]
    assert detail["survivors"]["mod.py"] == [{"location": "f", "line": 9, "code": "if a < b:",
                                              "mutation": "`<` -> `<=` (col 9)", "covering_tests": 2}]
    assert detail["survivors"]["empty.py"] == []
    assert detail["sources"]["mod.py"] == tool._sha(tmp_path / "mod.py")
    assert detail["sampling"]["mod.py"]["population"] == 2
    assert detail["runs"]["old"] == {"wall_s": 1.0}
    assert detail["runs"]["pkg"] == {"wall_s": 12.5, "tests_in_pool": 40, "max_tests": 10, "mutants": 2,
                                     "modules": {"mod.py": {"killed": 1, "survived": 1, "equivalent": 0},
                                                 "empty.py": {"killed": 0, "survived": 0, "equivalent": 0}}}
    tool.write_records(tmp_path / "score.json", score, tmp_path / "detail.json", detail)
    written = json.loads((tmp_path / "score.json").read_text())
    assert written == score and list(written) == sorted(score)
    assert json.loads((tmp_path / "detail.json").read_text()) == detail


def test_sampling_is_seeded_per_module(tool, tmp_path):
    ms = _with_status(tool, tmp_path, [str(i) for i in range(10)])
    a = tool.sample_mutants(ms, 4, 0, "mod.py")
    assert [m.status for m in a] == [m.status for m in tool.sample_mutants(ms, 4, 0, "mod.py")]
    assert len(a) == 4 and [m.status for m in a] == sorted((m.status for m in a), key=int)  # file order
    assert tool.sample_mutants(ms, None, 0, "mod.py") == ms and tool.sample_mutants(ms, 10, 0, "mod.py") == ms


def test_the_records_and_the_equivalent_list_are_where_the_tool_looks(tool):
    """Read only: the default record paths exist, and every equivalent entry carries its match key and a reason."""
    assert tool.RECORDS == TOOL.parent / "records"
    for name in ("mutation_score.json", "mutation_detail.json", "mutation_equivalent.json"):
        assert (tool.RECORDS / name).is_file()
    equivalent = json.loads((tool.RECORDS / "mutation_equivalent.json").read_text())
    for module, entries in equivalent.items():
        assert module.startswith("pyro_sparsegp/") and (TOOL.parents[1] / module).is_file()
        for e in entries:
            assert {"location", "code", "mutation", "why"} <= set(e), (module, e)


def test_a_mutant_is_judged_by_its_childs_exit(tool, tmp_path):
    """A forked mutant run: exit 1 (a test failed) kills, 0 and 5 (no test ran) survive, and exit 4 kills when a test
    module no longer imports (pytest then finds no collectors for the node ids it was given), while any other exit 4
    is the harness's own failure, which stops the run."""
    log = tmp_path / "mutant.log"

    def child(code, text=""):
        def run():
            os.write(1, text.encode())  # the log is the child's file descriptor 1
            return code
        return run

    assert tool._fork(child(1), log, 30) == "killed"
    assert tool._fork(child(0), log, 30) == tool._fork(child(5), log, 30) == "survived"
    assert tool._fork(child(4, "ERROR collecting tests/x/test_y.py"), log, 30) == "killed"
    with pytest.raises(SystemExit, match="harness failed"):
        tool._fork(child(4, "usage error"), log, 30)
