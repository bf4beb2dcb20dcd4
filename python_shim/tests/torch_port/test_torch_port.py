"""PyTorch's own allocator tests (cuda_cases.py, ported from its test/test_cuda.py and
test_cuda_expandable_segments.py; cudagraph_tree_cases.py, from test/inductor/test_cudagraph_trees.py)
run side by side under PyTorch's caching allocator (plain and
expandable segments) and under process-wide stepalloc (recommended and plain configuration),
over testdrv's host-memory CUDA: one process per allocator runs every test in order
(run_cases.py), as PyTorch's runner does.

Each outcome must be the one ``stepalloc.parity.PORTED`` states, which python_shim/README.md
shows (``ported_markdown()``); a test that passes under PyTorch's allocator must pass under
stepalloc (the one exception is a difference chosen on purpose, ``by_design``: stepalloc's
``empty_cache()`` and out-of-memory path give a pool in use's free memory back, which two tests
assert PyTorch does not), and one that fails under PyTorch too must say why.

Skipped when the stubs are not built (``testdrv/build.sh``) or torch is not installed.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from conftest import SHIM, run_python, torch_available
from stepalloc import parity

HERE = Path(__file__).resolve().parent
ROOT = SHIM.parent
HOSTCUDA = ROOT / "target" / "hostcuda"
RUNTIME = HOSTCUDA / "runtime"
STUB_RUNTIME = RUNTIME / "libcudart.so.13"

pytestmark = pytest.mark.skipif(
    not STUB_RUNTIME.exists() or not torch_available(),
    reason="needs torch and testdrv's stubs (testdrv/build.sh)",
)

MODES = [mode for mode, _ in parity.ALLOCATORS]


# The modules of ported tests (run_cases.py's ``CASES``), each run in a process of its own.
CASE_MODULES = ("cuda_cases", "cudagraph_tree_cases")


def ported_tests(module: str | None = None) -> list[str]:
    """``Class.test_name`` of every ported test (of ``module`` only, when given), read from the
    source."""
    names = []
    for m in CASE_MODULES if module is None else (module,):
        tree = ast.parse((HERE / f"{m}.py").read_text())
        names += [
            f"{cls.name}.{fn.name}"
            for cls in tree.body
            if isinstance(cls, ast.ClassDef)
            for fn in cls.body
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")
        ]
    return names


def run_cases(mode: str) -> dict[str, dict[str, str]]:
    """Every ported test, in one fresh process under ``mode``'s allocator: test -> RESULT."""
    library_path = [str(RUNTIME), str(HOSTCUDA), str(HOSTCUDA / "standins"), os.environ.get("LD_LIBRARY_PATH", "")]
    env = {
        "LD_PRELOAD": str(STUB_RUNTIME),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in library_path if p),
        "HOSTCUDA_DEVICES": "2",
        "HOSTCUDA_CAPACITY_MB": "1024",
        "HOSTCUDA_DELAY_US": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True" if mode == "pytorch-expandable" else "",
    }
    runner = str(HERE / "run_cases.py")
    found = {}
    for module in CASE_MODULES:
        argv = [runner, mode, f"--cases={module}"]
        code = f"import runpy, sys\nsys.argv = {argv!r}\nrunpy.run_path({runner!r}, run_name='__main__')\n"
        result = run_python(code, env=env, timeout=600)
        for line in result.stdout.splitlines():
            if line.startswith("RESULT "):
                got = json.loads(line[len("RESULT ") :])
                found[got["test"]] = got
        for test in ported_tests(module):  # what a crash left unrun
            found.setdefault(
                test, {"test": test, "outcome": "crashed", "detail": f"rc {result.returncode}: {result.stderr[-2000:]}"}
            )
    return found


_outcomes: dict[str, dict[str, dict[str, str]]] = {}


def outcomes(mode: str) -> dict[str, dict[str, str]]:
    if mode not in _outcomes:
        _outcomes[mode] = run_cases(mode)
    return _outcomes[mode]


def test_the_table_names_every_ported_test() -> None:
    assert [p.test for p in parity.PORTED] == ported_tests()
    for p in parity.PORTED:
        assert all(o in (parity.PASSES, parity.FAILS) for o in p.outcomes), p
        pytorch, stepalloc = p.outcomes[:2], p.outcomes[2:]
        # What PyTorch's allocator passes, stepalloc passes, but for a difference chosen on
        # purpose that says what stepalloc does instead; a failure under PyTorch says why.
        if parity.PASSES in pytorch:
            assert stepalloc == (parity.PASSES, parity.PASSES) or p.by_design.startswith("by design: "), p
        assert bool(p.why) == (parity.FAILS in pytorch), p
    # One deliberate difference, seen by two tests: a pool in use's free memory goes back (through
    # empty_cache, and on the out-of-memory path).
    assert sum(bool(p.by_design) for p in parity.PORTED) == 2, "one deliberate difference, no more"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("test", ported_tests())
def test_ported(test: str, mode: str) -> None:
    expected = parity.PORTED_BY_TEST[test].outcomes[MODES.index(mode)]
    got = outcomes(mode)[test]
    assert got["outcome"] == expected, f"{test} under {mode}: {got['outcome']} ({got['detail']}), the table says {expected}"


def test_readme_table_of_ported_tests_is_the_generated_one() -> None:
    readme = (SHIM / "README.md").read_text()
    begin = "<!-- ported tests: generated by stepalloc.parity.ported_markdown() -->\n"
    end = "<!-- end of ported tests -->"
    assert begin in readme and end in readme, "python_shim/README.md lacks the ported tests' markers"
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == parity.ported_markdown(), (
        "regenerate with: python3 -c 'import stepalloc.parity as p; print(p.ported_markdown())'"
    )


if __name__ == "__main__":  # pragma: no cover - a manual run prints every outcome
    for mode in MODES:
        for test, got in outcomes(mode).items():
            print(mode, json.dumps(got), file=sys.stdout, flush=True)
