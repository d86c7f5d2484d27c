"""The import direction of the package (DESIGN §5), checked on the source (AST).

Layers, bottom to top; a module may import its own package and any lower layer:
  0 config        schema, allocation, loader, validation
  1 rundir        the run-directory protocols (handoff, batch format, layout, heartbeats)
  2 models        builtin models, built locally
  3 data          datasets: reading rows, chat templates, prompt and answer token ids
  4 trainer, inference, rollout, metrics
                  never each other, except rollout -> inference.client
  5 launch, weights
                  placing and supervising processes; convert-checkpoint
  6 evaluation, agents (areal's own agents, which use rollout's rewards)
  7 cli
Imports inside functions count too: a lazy import still ties the packages together.
Inside a package the modules import each other without a cycle (a cycle hides which
module is the lower one, and a lazy import only postpones it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "areal_cli"
LAYERS = {
    "config": 0,
    "rundir": 1,
    "models": 2,
    "data": 3,
    "trainer": 4,
    "inference": 4,
    "rollout": 4,
    "metrics": 4,
    "launch": 5,
    "weights": 5,
    "evaluation": 6,
    "agents": 6,
    "cli": 7,
}
ALLOWED = {("rollout", "areal_cli.inference.client")}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "areal_cli":
                found += [(node.lineno, f"areal_cli.{a.name}") for a in node.names]
            elif node.module.startswith("areal_cli."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("areal_cli.")]
    return found


def test_every_package_has_a_layer() -> None:
    packages = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if p.is_file() or any(p.glob("*.py"))  # not a data folder (yaml/: recipe fragments)
    }
    packages = {p for p in packages if not p.startswith("_") and p not in ("py",)}
    assert packages - {"py"} <= set(LAYERS) | {"py.typed"}, packages - set(LAYERS)


def test_imports_point_down() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        own = _package(".".join(rel.parts)) or rel.parts[-1]
        if own == "__init__":
            continue
        for line, target in _imports(path):
            other = _package(target)
            if other == own or (own, target) in ALLOWED:
                continue
            if other not in LAYERS or LAYERS[other] >= LAYERS[own]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """Each module of a package -> the modules of the same package it imports."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        own = _package(name)
        graph[name] = {
            t for t in targets if t in modules and t != name and own and _package(t) == own
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found() -> None:
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_no_import_cycle_inside_a_package() -> None:
    found = _cycles(_module_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


# --------------------------------------------------------------- run-directory names

ENTRY_NAMES = {
    "logs", "heartbeat", "registry", "rollouts", "weights", "checkpoints", "recover", "eval",
    "tensorboard", "slurm", "model", "model-rm", "model-critic", "critic",
}  # fmt: skip
FILE_NAMES = {
    "config.yaml", "plan.json", "run.json", "metrics.jsonl", "trainer-metrics.jsonl",
    "reward_curve.png", "loss_curve.png", "job.sbatch",
}  # fmt: skip
# Paths that are no run directory's, though a part is spelled like one: (file, name, why)
NOT_A_RUN_DIRECTORY = {
    ("areal_cli/cli.py", "logs"),  # $AREAL_CACHE_DIR/logs: where `areal serve` logs by default
}


def _path_parts(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants used as parts of a path: `x / "name"`, `"name" / x`,
    `x.joinpath("name", ...)`, and f-strings that start an entry name (`f"step-{k}"`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    found.append((node.lineno, side.value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("joinpath", "glob", "rglob", "with_name")
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((node.lineno, arg.value))
        elif isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and first.value in ("step-", "v"):
                found.append((node.lineno, first.value))
    return found


def _spells_a_run_name(text: str) -> bool:
    parts = [p for p in text.replace("*", "").split("/") if p]
    return any(p in ENTRY_NAMES or p in FILE_NAMES or p.startswith("step-") for p in parts) or (
        text in ("step-", "v")
    )


def test_only_the_run_directory_package_spells_its_names() -> None:
    """RUN/weights, RUN/metrics.jsonl, step-K, ... are named in areal_cli.rundir.paths
    (RunDir) only; everywhere else asks RunDir for them."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if rel.parts[1] == "rundir":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, text in _path_parts(tree):
            if _spells_a_run_name(text) and (str(rel), text) not in NOT_A_RUN_DIRECTORY:
                wrong.append(f"{rel}:{line} spells {text!r}")
        for node in ast.walk(tree):  # the file names, wherever they stand (not in prose)
            if isinstance(node, ast.Constant) and node.value in FILE_NAMES:
                wrong.append(f"{rel}:{node.lineno} spells {node.value!r}")
    assert not wrong, "use areal_cli.rundir.paths.RunDir:\n" + "\n".join(wrong)


def test_only_the_top_layers_start_the_cli() -> None:
    """A child `python -m areal_cli.cli` re-enters the top layer, out of the import
    test's sight: only launch and above may start one (models/ once did, for a build)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        own = _package(".".join(rel.parts)) or rel.parts[-1]
        if LAYERS.get(own, 0) < LAYERS["launch"] and '"areal_cli.cli"' in path.read_text():
            wrong.append(str(rel))
    assert not wrong, wrong


def test_no_function_is_longer_than_a_screen() -> None:
    """A function holds one step that can be read whole: at most 80 lines (files have no
    cap; they are split along seams, not to a size)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} {lines}")
    assert not long, long
