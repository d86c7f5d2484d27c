"""`areal import-recipe`: AReaL recipes as areal recipes (convert: the steps; names: the
tables; render: the YAML with its header)."""

from areal_cli.config.areal_import.convert import (
    Imported,
    ImportRefused,
    import_recipe,
    looks_like_areal,
)
from areal_cli.config.areal_import.render import render

__all__ = ["ImportRefused", "Imported", "import_recipe", "looks_like_areal", "render"]
