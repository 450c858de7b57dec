"""The package's architecture, checked from the source: imports run one way, from the command line
down to the foundations, with no cycle between modules, and a function-level import is reserved
for heavy optional dependencies."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lora_bench"

# Bottom to top. A unit (a top-level module or subpackage of lora_bench) may import units of lower
# layers and modules of its own unit, never a unit of its own layer or above.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "escaping"),
    ("fileio", "timing", "progress", "optional", "signals"),
    ("download", "safe_yaml"),
    ("model", "kernels"),
    ("config",),
    ("lora", "data"),
    ("classifier",),
    ("peers", "results"),
    ("train",),
    ("sweep", "report", "bench", "trackers"),
    ("publish",),
    ("cli",),
    ("__main__",),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# What a function may import lazily: heavy or optional dependencies (and the project modules that
# exist only to wrap one, such as the Triton kernels and the C++ op's build).
LAZY_ALLOWED = ("tensorflow", "triton", "matplotlib", "transformers", "peft", "safetensors", "huggingface_hub",
                "dask", "distributed", "line_profiler", "torchao", "bitsandbytes", "ninja", "torch.utils.cpp_extension",
                "mlflow", "tensorboard",
                "lora_bench.kernels.lora_triton", "lora_bench.kernels.adamw_triton", "lora_bench.kernels.triton_launch",
                "lora_bench.kernels.dora_triton", "lora_bench.kernels.dora_triton_bwd",
                "lora_bench.kernels.lora_cpp",
                "lora_bench.sweep.dask_runner")
# A command's body imports what it runs, so that ``lora-bench --help`` and a mistyped flag answer
# at once instead of after the seconds it takes to import torch and the rest.
COMMANDS = "lora_bench.cli"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["lora_bench", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(path: Path, module: str, mods: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import statement of a file; ``from
    package import module`` counts as importing the module."""
    tree = ast.parse(path.read_text())
    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            names = {f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names}
        elif isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        else:
            continue
        out += [(n, node.lineno, id(node) in in_function) for n in sorted(names)]
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = collections.defaultdict(set)
    lazy_problems = []
    for mod, path in mods.items():
        for name, line, lazy in _imports(path, mod, mods):
            target = name if name in mods else None
            if lazy and not name.startswith(LAZY_ALLOWED) and target and not mod.startswith(COMMANDS):
                lazy_problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} inside a function")
            if target and target != mod and not mod.startswith(target + "."):
                graph[mod].add(target)
    return graph, lazy_problems


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {""}
    assert units <= set(LAYER_OF), f"units without a declared layer: {sorted(units - set(LAYER_OF))}"


def test_imports_only_go_down_the_layers():
    graph, _ = _graph()
    wrong = []
    for mod, targets in graph.items():
        for t in targets:
            a, b = _unit(mod), _unit(t)
            if b == "" or a == b:
                continue  # the package root (its version) and a unit's own modules
            if LAYER_OF[b] >= LAYER_OF[a]:
                wrong.append(f"{mod} -> {t} ({a}: layer {LAYER_OF[a]}, {b}: layer {LAYER_OF[b]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_between_modules():
    graph, _ = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(_modules()):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_function_level_imports_are_only_for_heavy_optional_dependencies():
    _, problems = _graph()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("edge", [("lora_bench.results.store", "lora_bench.train.run"),
                                  ("lora_bench.sweep.spec", "lora_bench.report.aggregate")])
def test_the_checker_sees_an_upward_and_a_sibling_import(edge, monkeypatch):
    """The rules above can fail: an upward import and an import between units of one layer are
    reported."""
    real = _graph

    def with_edge():
        graph, lazy = real()
        graph[edge[0]].add(edge[1])
        return graph, lazy

    monkeypatch.setitem(globals(), "_graph", with_edge)
    with pytest.raises(AssertionError, match="against the layer order"):
        test_imports_only_go_down_the_layers()


def test_the_package_imports_no_bench_or_experiment_code():
    """What a benchmark script or an experiment needs lives outside the package: no module of
    lora_bench imports ``benchmarks`` or ``experiments`` (top-level folders beside it)."""
    wrong = []
    mods = _modules()
    for mod, path in mods.items():
        for name, line, _ in _imports(path, mod, mods):
            if name.split(".")[0] in ("benchmarks", "experiments"):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_bench_and_experiment_check_sees_such_an_import(monkeypatch):
    real = _imports
    monkeypatch.setitem(globals(), "_imports", lambda path, module, mods: [*real(path, module, mods),
                                                                          ("experiments.tma", 1, False)])
    with pytest.raises(AssertionError, match="imports experiments.tma"):
        test_the_package_imports_no_bench_or_experiment_code()


def test_the_command_line_imports_no_torch_until_a_command_runs():
    """``lora-bench --help`` and ``--version`` answer at once: importing the command line (and the
    settings' declaration its options come from) loads neither torch nor pandas."""
    import subprocess
    import sys

    probe = ("import sys, lora_bench.cli; "
             "print(' '.join(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing lora_bench.cli loads {out.stdout.strip()}"


def test_module_basenames_are_unique():
    """A file's name says what it is without its folder: no two modules of the package share one."""
    names = collections.Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)
