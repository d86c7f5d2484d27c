"""Resolve, check, plan: each once (DESIGN §4).

The allocation string is parsed in one function call (the check), and the plan carries
the parsed allocation to everyone else; no config field is assigned after the check.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from areal_cli.config.loader import load_config, to_yaml
from areal_cli.config.resolve import resolve
from areal_cli.config.rules import check_config
from areal_cli.launch.plan import build_plan, new_run_id, pick_ports

PACKAGE = Path(__file__).resolve().parents[2] / "areal_cli"
REPO = PACKAGE.parent
# Where a config may be built and changed: the loader builds it, resolve makes its copy.
BUILDERS = {"config/loader.py", "config/resolve.py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` as ["a", "b", "c"] ([] for anything else)."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(names)]
    return []


def _is_config(chain: list[str]) -> bool:
    """A field of the run's config: cfg.x..., config.x..., loaded.config.x..., c.cfg.x...
    (binding the config itself to a name, `self.cfg = ...`, is no change of it)."""
    for i, name in enumerate(chain):
        if name == "cfg" or (name == "config" and (i == 0 or chain[i - 1] == "loaded")):
            return i < len(chain) - 1
    return False


def test_the_allocation_string_is_parsed_in_one_place() -> None:
    calls = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if called == "parse_allocation":
                    calls.append(f"{name}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("config/rules/allocation.py:"), calls


def test_no_config_field_is_assigned_outside_the_builders() -> None:
    found = []
    for name, tree in _modules():
        if name in BUILDERS:
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                targets = node.args[:1]
            for target in targets:
                chain = _chain(target)
                if isinstance(node, ast.Call):
                    chain = chain + ["field"]  # setattr(cfg.section, ...)
                if _is_config(chain):
                    found.append(f"{name}:{node.lineno} {'.'.join(chain)}")
    assert not found, found


def test_the_plan_reads_the_checked_config_and_carries_the_parsed_allocation() -> None:
    loaded = resolve(load_config(REPO / "recipes" / "tiny_cpu.yaml"), launch=False).loaded
    result = check_config(loaded, command="train")
    assert not result.problems
    before = to_yaml(loaded.config)
    plan = build_plan(
        loaded.config,
        result.allocation,
        ports=pick_ports(loaded.config, result.allocation),
        run_id=new_run_id(),
    )
    assert to_yaml(loaded.config) == before
    assert plan.allocation is result.allocation and plan.backend == "embedded"
    written = json.loads(plan.to_json())["allocation"]
    assert written["inference_backend"] == "embedded"
    assert written["train"]["data_parallel_size"] == result.allocation.train.data_parallel_size


def test_resolve_returns_a_copy_and_keeps_the_loaded_config() -> None:
    # a Ray cluster: its servers listen on every interface, so they need a key
    overrides = ["launcher.type=ray", "launcher.ray.address=10.0.0.1:6379"]
    loaded = load_config(REPO / "recipes" / "tiny_cpu.yaml", overrides)
    resolved = resolve(loaded, launch=True)
    assert resolved.config.inference.api_key and not loaded.config.inference.api_key
    assert not resolve(loaded, launch=False).config.inference.api_key  # a plan makes none
