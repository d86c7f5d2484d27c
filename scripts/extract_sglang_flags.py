"""Usage: python scripts/extract_sglang_flags.py SGLANG_PKG_DIR > tests/assets/sglang_flags.txt

Reads SGLang's server-argument field declarations (sglang/srt/arg_groups/fields/*.py) with
`ast`, without importing sglang (which needs CUDA), and prints one line per CLI flag:
`--flag-name<TAB>bool|value`. The test suite checks every flag our SGLang command line uses
against this list, so a renamed flag upstream is caught without a GPU.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def _meta_kwargs(meta: ast.expr) -> dict[str, ast.expr]:
    if isinstance(meta, ast.Call):
        return {kw.arg: kw.value for kw in meta.keywords if kw.arg}
    return {}


def extract(fields_dir: Path) -> dict[str, str]:
    flags: dict[str, str] = {}
    for path in sorted(fields_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "A"):
                continue
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            if len(elts) < 2:
                continue
            kwargs = _meta_kwargs(elts[1])
            no_cli = kwargs.get("no_cli")
            if isinstance(no_cli, ast.Constant) and no_cli.value is True:
                continue
            # SGLang's arg_utils makes bool and Optional[bool] fields store_true switches
            kind = "bool" if ast.unparse(elts[0]) in ("bool", "Optional[bool]") else "value"
            names = ["--" + node.target.id.replace("_", "-")]
            aliases = kwargs.get("aliases")
            if isinstance(aliases, ast.List):
                names += [e.value for e in aliases.elts if isinstance(e, ast.Constant)]
            for name in names:
                flags[name] = kind
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sglang_pkg_dir", type=Path, help="the installed sglang package folder")
    pkg = parser.parse_args().sglang_pkg_dir
    fields_dir = pkg / "srt" / "arg_groups" / "fields"
    if not fields_dir.is_dir():
        sys.exit(f"error: {fields_dir} not found; pass the sglang package directory")
    for name, kind in sorted(extract(fields_dir).items()):
        print(f"{name}\t{kind}")


if __name__ == "__main__":
    main()
