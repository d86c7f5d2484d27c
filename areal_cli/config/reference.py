"""Render the schema's field docs as Markdown: `python -m areal_cli.config.reference`.

docs/config-reference.md is this module's output; tests/unit/test_reference.py fails when
the two differ, so the reference always matches the code.
"""

from __future__ import annotations

import dataclasses
import typing

from areal_cli.config.schema import ExperimentConfig

HEADER = """# Recipe reference

Every key a recipe may set, generated from the field docs in `areal_cli/config/schema.py`
by `python -m areal_cli.config.reference > docs/config-reference.md`. Keys are written as
`section.key`; on the command line, override any of them with `section.key=value`.
"""


def _type_text(tp: typing.Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else repr(f.default).replace("'", "")
    value = f.default_factory()  # type: ignore[misc]
    return repr(value).replace("'", "") if not dataclasses.is_dataclass(value) else ""


def _constraints(meta: typing.Mapping) -> str:
    parts = []
    if meta.get("choices"):
        parts.append("one of " + ", ".join(map(str, meta["choices"])))
    for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if meta.get(name) is not None:
            parts.append(f"{symbol} {meta[name]:g}")
    return "; ".join(parts)


def render(cls: type = ExperimentConfig, prefix: str = "") -> str:
    """Markdown for `cls` and its nested sections."""
    hints = typing.get_type_hints(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            sections.append(render(tp, key + "."))
            continue
        doc = f.metadata.get("doc", "").replace("|", "\\|")
        rule = _constraints(f.metadata)
        rows.append(
            f"| `{key}` | {_type_text(tp)} | `{_default_text(f)}` | {doc}{' (' + rule + ')' if rule else ''} |"
        )
    title = prefix.rstrip(".") or "top level"
    doc = (cls.__doc__ or "").strip().splitlines()[0]
    out = [f"## `{title}` ({cls.__name__})\n\n{doc}\n"]
    if rows:
        out.append(
            "| key | type | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    return "\n".join(out + sections)


def main() -> None:
    print(HEADER + "\n" + render(), end="")


if __name__ == "__main__":
    main()
