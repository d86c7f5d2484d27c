"""One module owns the trainer's collectives (areal_cli.trainer.collectives), which puts
every tensor on the device its group needs: NCCL has no host tensors, so a collective
issued anywhere else can crash every GPU run while passing every CPU test (it did: a host
tensor in `agree_on_plans` under NCCL). This reads the source; tests/gloo/guard.py checks
the same at run time in every gloo test."""

from __future__ import annotations

import ast

from tests.conftest import REPO

OWNERS = {"areal_cli/trainer/collectives.py", "areal_cli/rundir/weight_group.py"}
# torch.distributed's collectives, its functional ones, and DTensor's gathers
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
    "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "barrier", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "all_gather_tensor",
    "init_process_group",
}  # fmt: skip
DISTRIBUTED_NAMES = {"dist", "funcol", "torch.distributed", "c10d"}
GATHERS = {"full_tensor", "redistribute"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every torch.distributed collective or DTensor gather in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner, name = _dotted(node.func.value), node.func.attr
        ours = owner == "collectives"  # areal_cli.trainer.collectives' own functions
        if (name in COLLECTIVES and owner in DISTRIBUTED_NAMES) or (name in GATHERS and not ours):
            found.append((node.lineno, f"{owner}.{name}" if owner else name))
    return found


def test_only_the_collectives_module_calls_torch_distributed() -> None:
    outside = []
    for path in sorted((REPO / "areal_cli").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in OWNERS:
            continue
        outside += [f"{rel}:{line} {call}" for line, call in collective_calls(path.read_text())]
    assert not outside, "collectives outside areal_cli.trainer.collectives:\n" + "\n".join(outside)


def test_the_reader_finds_the_calls_it_looks_for() -> None:
    source = (
        "import torch.distributed as dist\n"
        "dist.all_reduce(t)\n"
        "torch.distributed.barrier()\n"
        "x = t.full_tensor()\n"
        "dist.get_rank()\n"  # not a collective
        "group.broadcast([t])\n"  # not torch.distributed's
        "collectives.full_tensor(t)\n"  # the owner's
    )
    assert [line for line, _ in collective_calls(source)] == [2, 3, 4]


def test_the_owner_exists() -> None:
    assert all((REPO / owner).is_file() for owner in OWNERS)
    assert collective_calls((REPO / "areal_cli/trainer/collectives.py").read_text())
