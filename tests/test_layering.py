"""The package's import layering (CONTRIBUTING.md): no module imports a higher layer, no cycles.

Read statically (every ``import`` statement, also those inside functions), so a lazy import
cannot hide an upward dependency.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specdec_kernels"

# Lowest first. A module may import its own layer or lower ones.
LAYERS = [
    # 0: names, argument checking, sampling parameters
    {"_interpreter", "_types", "_params", "_validation", "_tree_args", "_bitmask"},
    # 1: kernels and launchers (one file per op), the csrc loader (its prebuilt modules beside it), the references
    {"ops", "ops.*", "reference", "reference.*"},
    # 2: backend choice and torch.library registration
    {"_dispatch"},
    # 3: the public functions and the package itself
    {"api", ""},
    # 4: applications
    {"hf", "hf.*", "cli", "cli.*", "demo", "demo.*"},
]


def _layer(module: str) -> int:
    for level, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith(".*") and module.startswith(name[:-1])):
                return level
    raise AssertionError(f"specdec_kernels.{module} is in no layer: add it to LAYERS (and CONTRIBUTING.md)")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


# Compiled extensions (built by setup.py, not .py files), imported like modules.
EXTENSIONS = {"ops.csrc._csrc_cuda", "ops.csrc._csrc_cpu"}


def _resolve(name: str, modules) -> str:
    """The longest prefix of a dotted name (relative to the package) that is a module."""
    parts = name.split(".") if name else []
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def _imports(module: str, path: Path, modules) -> set[str]:
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("specdec_kernels"):
                    found.add(_resolve(alias.name.removeprefix("specdec_kernels").lstrip("."), modules))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("specdec_kernels"):
                    continue
                base = node.module.removeprefix("specdec_kernels").lstrip(".")
            else:
                anchor = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in modules or full in EXTENSIONS else _resolve(base, modules))
    found.discard(module)
    return found


GRAPH = {m: _imports(m, p, _modules()) for m, p in _modules().items()}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_a_higher_layer(module):
    level = _layer(module)
    upward = sorted(t for t in GRAPH[module] if _layer(t) > level)
    assert not upward, f"specdec_kernels.{module} (layer {level}) imports higher layers: {upward}"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m, stack):
        state[m] = 1
        for t in sorted(GRAPH.get(m, ())):
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(c or "specdec_kernels" for c in cycle))
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
