"""Loading a tokenizer without importing torch where that gives the same tokenizer.

`AutoTokenizer` imports the model's config class, and with it torch: about 2 s of the
controller's start on a 2-core machine, before any process is launched. A folder whose
`tokenizer_config.json` names transformers' generic fast tokenizer (`TokenizersBackend`,
or its older name `PreTrainedTokenizerFast`) is loaded by that class directly: the same
class `AutoTokenizer` would pick, built from the same files. Any other class (a model's
own tokenizer, a slow one, a folder without the file) goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_class(folder: str | Path) -> str | None:
    """The class named by FOLDER/tokenizer_config.json, or None (no such local file)."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        return json.loads(path.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a model folder, as `AutoTokenizer.from_pretrained(folder)` gives it."""
    if tokenizer_class(folder) in GENERIC_FAST:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
