"""The imported recipe as YAML: a header that accounts for every AReaL key not carried
over as it was, then the keys in the order of areal's reference."""

from __future__ import annotations

from areal_cli.config.areal_import.convert import Imported

ORDER = (
    "experiment_name", "trial_name", "algorithm", "allocation_mode", "seed",
    "total_train_steps", "cluster", "launcher", "model", "actor", "critic", "sft", "rm",
    "rollout", "gconfig", "dataset", "reward", "inference", "saver", "recover", "eval",
    "logging",
)  # fmt: skip


def render(imported: Imported, source: str, out_name: str) -> str:
    """The YAML text of `imported` (from AReaL recipe `source`), to be saved as `out_name`."""
    import yaml

    header = [
        f"Usage: areal train {out_name}",
        "",
        f"Imported from the AReaL recipe {source} by `areal import-recipe`.",
    ]
    for title, lines in (
        ("Changed (AReaL's key -> areal's)", imported.changed),
        ("Dropped (AReaL bookkeeping, or what areal does anyway)", imported.dropped),
        ("Not honoured (check these before training)", imported.lost),
    ):
        if lines:
            header += ["", f"{title}:"] + [f"  {line}" for line in lines]
    recipe = imported.recipe
    ordered = {k: recipe[k] for k in ORDER if k in recipe}
    ordered.update({k: v for k, v in recipe.items() if k not in ordered})
    body = yaml.safe_dump(ordered, sort_keys=False, default_flow_style=False, width=100)
    return "".join(f"# {line}".rstrip() + "\n" for line in header) + "\n" + body
