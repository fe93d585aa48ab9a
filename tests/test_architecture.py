"""The package's shape: folders follow the data flow and import only from earlier ones, modules
stay small, and the public API is curated (no public name is shadowed by a module)."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import jaxremat as jr

ROOT = Path(jr.__file__).parent
# the data flow; a folder imports only from itself and the folders before it
LAYERS = ("core", "model", "profiling", "solvers", "run", "api", "tools")
MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT)


def _imported(path: Path) -> set[str]:
    """Every jaxremat module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxremat"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jaxremat")}
    return out


def test_every_module_sits_in_a_layer_folder():
    assert {p.relative_to(ROOT).parts[0] for p in _modules()} == set(LAYERS)
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py", "__main__.py"]


def test_imports_follow_the_data_flow():
    wrong = []
    for path in _modules():
        layer = LAYERS.index(path.relative_to(ROOT).parts[0])
        for name in _imported(path):
            parts = name.split(".")
            if len(parts) == 1:  # `import jaxremat` from inside the package
                wrong.append(f"{path.relative_to(ROOT)} imports the top-level package")
            elif LAYERS.index(parts[1]) > layer:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)


def test_modules_stay_small():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_public_names_are_not_shadowed_by_modules():
    for name in jr.__all__:
        value = getattr(jr, name)
        assert not isinstance(value, types.ModuleType), f"jaxremat.{name} is a module"
    for name in ("profile", "solve", "plan", "simulate", "execute", "remat_chain", "remat_nnx", "pareto"):
        assert inspect.isfunction(getattr(jr, name)), name


def test_subpackages_curate_their_names():
    import jaxremat.api
    import jaxremat.model
    import jaxremat.profiling
    import jaxremat.run
    import jaxremat.solvers

    for package in (jaxremat.api, jaxremat.model, jaxremat.profiling, jaxremat.run, jaxremat.solvers):
        for name in package.__all__:
            assert not isinstance(getattr(package, name), types.ModuleType), f"{package.__name__}.{name}"
