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
  6 evaluation
  7 cli
Imports inside functions count too: a lazy import still ties the packages together.
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
