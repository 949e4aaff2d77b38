"""DESIGN.md's package boundaries: who may import whom, checked on the source text."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("nvl72", "comms", "moe", "aot", "launch", "perf")
# package -> first-party packages it may import
ALLOWED = {
    "launch": {"launch", "nvl72"},
    "perf": {"perf", "nvl72", "comms", "moe", "aot"},
    "nvl72": {"nvl72", "comms", "moe", "aot"},
    "comms": {"comms", "aot"},
    "moe": {"moe", "aot"},
    "aot": {"aot"},
}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_import_rules(pkg):
    bad = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        for lineno, top in _imports(path):
            if top in PACKAGES and top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {top}")
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_no_pickle_between_processes():
    """Messages travel as msgpack/JSON; pickle is banned from the service and libraries."""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for lineno, top in _imports(path):
                if top in ("pickle", "cloudpickle", "dill"):
                    bad.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not bad, bad
