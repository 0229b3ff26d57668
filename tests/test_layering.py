"""The package's structure: imports only run down the layers, no circle, and a function-local import says why.

Read from the source (ast), so the function-local imports count too. A unit is a subpackage or top-level module
of nsa_titan (``config``, ``models``, ``train`` ...).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nsa_titan

PACKAGE = Path(nsa_titan.__file__).resolve().parent

# Bottom to top; a unit may import units of lower layers only. config sits above models because it generates
# its [model] section from NSAModelArgs (models/nsa/args.py, which imports no torch).
LAYERS = [
    {"errors", "kernels"},
    {"models"},
    {"config", "data"},
    {"components", "parallelisms", "checkpoint"},
    {"fault"},
    {"train"},
    {"generate", "experiments"},
    {"eval"},
]
# Imports that still run up, each with the change that removes it; the test fails when one disappears, so that
# this list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# Files whose function-local imports predate the rule; rewritten by issue 15 item 2 (loading a model to run).
LOCAL_IMPORT_RULE_PENDING: tuple[str, ...] = ()
_REASON = re.compile(r"#\s*noqa: PLC0415 - (cycle|optional)\b")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        yield rel, ast.parse(path.read_text(), filename=str(path)), path.read_text().splitlines()


def _unit(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _imported_units(rel: Path, tree: ast.AST) -> set[str]:
    here = ["nsa_titan", *rel.with_suffix("").parts][:-1]  # relative imports start from the containing package
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            names = [".".join(base + ([node.module] if node.module else []))]
        else:
            continue
        out.update(n.split(".")[1] for n in names if n.startswith("nsa_titan.") and len(n.split(".")) > 1)
    return out


def _rank(unit: str) -> int:
    ranks = [i for i, layer in enumerate(LAYERS) if unit in layer]
    assert ranks, f"nsa_titan/{unit} is in no layer of tests/test_layering.py: add it where it belongs"
    return ranks[0]


def test_imports_only_run_down_the_layers():
    upward = set()
    for rel, tree, _ in _modules():
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue  # nsa_titan/__init__.py imports nothing
        src = _unit(rel)
        for dst in _imported_units(rel, tree) - {src}:
            if _rank(dst) >= _rank(src):
                upward.add((src, dst))
    unexpected = {edge: "" for edge in upward if edge not in KNOWN_UPWARD}
    assert not unexpected, f"imports that run up or sideways: {sorted(unexpected)} (layers: {LAYERS})"
    fixed = set(KNOWN_UPWARD) - upward
    assert not fixed, f"no longer imported upward, remove from KNOWN_UPWARD: {sorted(fixed)}"


def test_function_local_imports_say_why():
    """Only an import cycle or an optional dependency justifies an import inside a function (it hides an arrow
    of the structure above); the noqa says which in one word."""
    missing = []
    for rel, tree, lines in _modules():
        if str(rel).startswith(LOCAL_IMPORT_RULE_PENDING):
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not _REASON.search(lines[node.lineno - 1]):
                    missing.append(f"nsa_titan/{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not missing, "function-local imports need '# noqa: PLC0415 - cycle|optional':\n" + "\n".join(missing)


def test_reading_a_config_does_not_import_torch():
    """The [model] section is generated from NSAModelArgs; nsa_titan.models loads torch only for the model."""
    code = "import sys, nsa_titan.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
