"""The package's shape: the layering documented in CONTRIBUTING.md (no import upward, no cycle) and module sizes."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_kvmap"
#: the 600-line cap less 40: a module is split where its ideas divide before it fills up to the cap
MAX_LINES = 560


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    """Module -> the `hf_kvmap` modules it imports anywhere in its source (function-local imports included)."""
    graph = {}
    for name, path in _modules().items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module.split(".")[0] != "hf_kvmap":
                    continue
                for alias in node.names:  # `from . import fitting` imports a module
                    child = f"{module}.{alias.name}"
                    targets.add(child if _is_module(child) else module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "hf_kvmap")
        targets.discard(name)
        graph[name] = targets
    return graph


def documented_layers() -> dict[str, int]:
    """Module (or package prefix) -> layer number, from the layers table of CONTRIBUTING.md."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = re.search(r"<!-- layers:start -->\n(.*?)<!-- layers:end -->", text, re.DOTALL).group(1)
    layers = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        number = int(cells[0].split()[0])
        for module in re.findall(r"`([\w.]+)`", cells[1]):
            layers[module if module == "hf_kvmap" else f"hf_kvmap.{module}"] = number
    return layers


def layer_of(module: str, layers: dict[str, int]) -> int:
    for prefix in sorted(layers, key=len, reverse=True):
        if module == prefix or (prefix != "hf_kvmap" and module.startswith(prefix + ".")):
            return layers[prefix]
    raise AssertionError(f"{module} is in no layer of the layers table of CONTRIBUTING.md")


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return [
        f"{source} (layer {layer_of(source, layers)}) imports {target} (layer {layer_of(target, layers)})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target, layers) > layer_of(source, layers)
    ]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


#: upward imports kept for one release behind a deprecation: (importer, imported) -> the version that removes them
DEPRECATED_UPWARD = {
    # `MappedCache.from_source(repair=)`: the cache stores, the repair (a layer above it) recomputes
    ("hf_kvmap.cache", "hf_kvmap.repair"): "0.2",
}


def deprecated_upward(layers: dict[str, int]) -> list[str]:
    return [
        f"{source} (layer {layer_of(source, layers)}) imports {target} (layer {layer_of(target, layers)})"
        for source, target in sorted(DEPRECATED_UPWARD)
    ]


def test_every_import_runs_down_the_documented_layers():
    from packaging.version import Version

    from hf_kvmap import __version__

    layers = documented_layers()
    assert upward_imports(import_graph(), layers) == deprecated_upward(layers)  # each still there, until it goes
    for pair, removed_in in DEPRECATED_UPWARD.items():
        assert Version(__version__) < Version(removed_in), f"{pair} was to be removed in {removed_in}"


def test_no_import_cycle():
    assert import_cycles(import_graph()) == []


def test_the_checks_find_a_planted_upward_import_and_a_planted_cycle():
    graph, layers = import_graph(), documented_layers()
    graph["hf_kvmap.configuration_mapper"] = graph["hf_kvmap.configuration_mapper"] | {"hf_kvmap.cache"}
    assert upward_imports(graph, layers) == sorted(
        ["hf_kvmap.configuration_mapper (layer 2) imports hf_kvmap.cache (layer 8)", *deprecated_upward(layers)]
    )
    (cycle,) = import_cycles(graph)
    assert cycle[0] == cycle[-1] == "hf_kvmap.cache" and "hf_kvmap.configuration_mapper" in cycle


def test_compute_modules_never_import_plotting_or_the_demo_family():
    graph = import_graph()
    # `loading` resolves the names a command line or a benchmark gives (a tiny-family member among them)
    front = (
        "hf_kvmap.commands",
        "hf_kvmap.cli",
        "hf_kvmap.lm_eval_model",
        "hf_kvmap.loading",
        "hf_kvmap.plotting",
        "hf_kvmap.zoo",
    )
    offenders = [
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if not source.startswith(front) and target.startswith(("hf_kvmap.plotting", "hf_kvmap.zoo"))
    ]
    assert offenders == []


def test_no_module_is_over_560_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def _imported_roots(path: Path) -> set[str]:
    """The top-level packages `path` imports (absolute imports only, function-local ones included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
    return roots


def test_the_library_never_imports_the_lab_or_the_benchmarks():
    offenders = {
        name: sorted(roots & {"lab", "benchmarks"})
        for name, path in _modules().items()
        if (roots := _imported_roots(path)) & {"lab", "benchmarks"}
    }
    assert offenders == {}


def test_the_wheel_ships_the_library_and_no_lab_module(tmp_path):
    """A wheel built from the repository's packaging (pyproject, the library, the lab and the benchmarks beside it)
    holds `hf_kvmap` and its metadata only: no module of `lab/` or `benchmarks/`, and every library module."""
    import shutil
    import zipfile

    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "results", "*.egg-info")
    for folder in ("hf_kvmap", "lab", "benchmarks"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*command, str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("hf_kvmap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    roots = {name.split("/")[0] for name in names}
    assert roots == {"hf_kvmap", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    shipped = {name.removesuffix(".py").replace("/", ".") for name in names if name.endswith(".py")}
    assert {name if path.name != "__init__.py" else f"{name}.__init__" for name, path in _modules().items()} == shipped


#: What `import hf_kvmap.cache` loads of the package: the mapping and nothing else (no fitting, fine-tuning,
#: statistics, evaluation, cards or serving). A new module here is a deliberate change of what mapping needs.
MAPPING_MODULES = {
    "hf_kvmap",
    "hf_kvmap._compat",
    "hf_kvmap._version",
    "hf_kvmap.artifacts",
    "hf_kvmap.cache",
    "hf_kvmap.configuration_mapper",
    "hf_kvmap.early_stopping",  # the MLP kind's training loop (a kind is one file: its map and its fit)
    "hf_kvmap.first_layer",
    "hf_kvmap.geometry",
    "hf_kvmap.input_checks",  # every check of caller input, `from_source`'s included (torch and the stdlib only)
    "hf_kvmap.key_norm",
    "hf_kvmap.kinds",
    "hf_kvmap.kinds.base",
    "hf_kvmap.kinds.mlp",
    "hf_kvmap.kinds.ridge",
    "hf_kvmap.layout",
    "hf_kvmap.mapping",
    "hf_kvmap.modeling_mapper",
    "hf_kvmap.modeling_mlp",
    "hf_kvmap.placement",
    "hf_kvmap.regression",  # the ridge kind's solver
    "hf_kvmap.registry",  # the kinds' registration (the one helper every registry uses)
    "hf_kvmap.rope",
    "hf_kvmap.validation",
}


def _loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.split('.')[0] == 'hf_kvmap'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_importing_the_cache_loads_only_the_mapping():
    assert _loaded_by("import hf_kvmap.cache") == MAPPING_MODULES
    # the planted check: a public name of the training side pulls its modules in on first use
    assert {"hf_kvmap.fitting", "hf_kvmap.objectives"} <= _loaded_by("import hf_kvmap; hf_kvmap.fit_mapper")


def test_every_public_name_resolves_lazily():
    import hf_kvmap

    for name in hf_kvmap.__all__:
        assert getattr(hf_kvmap, name) is not None, name
    assert set(hf_kvmap.__all__) <= set(dir(hf_kvmap))
    assert hf_kvmap.zoo.__name__ == "hf_kvmap.zoo"  # submodules resolve too
    # a submodule of the same name as a public function does not hide it once imported
    assert _loaded_by("import hf_kvmap.serving.handoff; assert hf_kvmap.handoff.__name__ == 'handoff'") >= {
        "hf_kvmap.serving.handoff"
    }
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hf_kvmap.not_a_name  # noqa: B018
