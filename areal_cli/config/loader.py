"""Turn a recipe file plus `key.path=value` overrides into an `ExperimentConfig`.

Precedence, lowest to highest: dataclass defaults, the recipe's `defaults:` files (in
order, each after its own defaults), the recipe itself, then command-line overrides.
`${a.b}` refers to another key of the merged config (or its default); `${env:NAME}` and
`${env:NAME,fallback}` read the environment. A string that is exactly one `${...}` takes
the referenced value's type.

Relative paths in path fields (model.path, dataset.path, ...) are taken relative to the
directory of the YAML file that set them, so a recipe works from any working directory;
paths given on the command line are relative to the working directory (errors say so
through errors.PATH_RULE). `defaults:` entries are looked up next to the recipe, then in
each parent directory in turn, then among the fragments shipped in the package
(areal_cli/yaml/), so a recipe copied anywhere still finds yaml/cluster/local_cpu.yaml.

Every problem is collected with its key path and file:line before anything is raised.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from areal_cli.config.errors import (
    COMMAND_LINE,
    ConfigErrors,
    ConfigProblem,
    Location,
    did_you_mean,
)
from areal_cli.config.schema import ExperimentConfig

KeyPath = tuple[str, ...]
_INTERP = re.compile(r"\$\{([^}]*)\}")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".yaml", ".yml", ".txt", ".safetensors")
_BROKEN = object()  # a value whose interpolation failed (already reported; skip it later)


@dataclasses.dataclass
class LoadedConfig:
    """A built config plus where each key came from."""

    config: ExperimentConfig
    locations: dict[KeyPath, Location]
    recipe: Path

    def where(self, key: str) -> Location | None:
        """File and line of `key`, or of its nearest ancestor that has one."""
        parts = tuple(key.split("."))
        while parts:
            if parts in self.locations:
                return self.locations[parts]
            if "[" in parts[-1]:  # an item of a list: the list's line
                parts = parts[:-1] + (parts[-1].split("[", 1)[0],)
                continue
            parts = parts[:-1]
        return None


class _Collector:
    """Accumulates problems; every stage appends here instead of raising."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []
        self.invalid: set[str] = set()  # keys whose value is wrong or missing ("" for all)

    def add(
        self,
        key: str,
        message: str,
        fix: str = "",
        where: Location | None = None,
        *,
        harmless: bool = False,
    ) -> None:
        """Record a problem; `harmless` ones (an ignored unknown key) leave every value intact."""
        self.problems.append(ConfigProblem(key, message, fix, where))
        if not harmless:
            self.invalid.add(key)


# ---------------------------------------------------------------- reading YAML


def _read_yaml(path: Path, out: _Collector) -> tuple[dict, dict[KeyPath, Location]] | None:
    """Parse one YAML file into (mapping, key locations); None after reporting a problem."""
    shown = _display_path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        out.add("", f"file not found: {shown}", "check the path", Location(shown))
        return None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        out.add(
            "",
            f"cannot read {shown}: {exc.__class__.__name__}",
            "pass a readable YAML file",
            Location(shown),
        )
        return None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        out.add(
            "",
            f"YAML syntax error: {problem}",
            "fix the indentation, quoting or brackets there",
            Location(shown, line),
        )
        return None
    finally:
        loader.dispose()
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        out.add(
            "",
            f"the top level must be a mapping of keys, got {type(data).__name__}",
            "write `key: value` lines",
            Location(shown, 1),
        )
        return None
    locations: dict[KeyPath, Location] = {}
    _record_locations(node, (), shown, locations, out)
    return data, locations


def _record_locations(
    node: yaml.Node, prefix: KeyPath, shown: str, locations: dict, out: _Collector
) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = str(key_node.value)
        path = prefix + (key,)
        where = Location(shown, key_node.start_mark.line + 1)
        if key in seen:
            out.add(
                ".".join(path),
                "duplicate key (the later value would silently win)",
                "keep only one",
                where,
            )
        seen.add(key)
        locations[path] = where
        _record_locations(value_node, path, shown, locations, out)


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- composition


# The fragments areal ships (areal_cli/yaml/: cluster/, engine/, inference/), which a
# `defaults:` entry such as yaml/cluster/local_cpu.yaml finds wherever the recipe lives.
PACKAGED_DEFAULTS = Path(__file__).resolve().parents[1]


def _find_default(name: str, base_dir: Path) -> Path | None:
    """A `defaults:` entry: beside the recipe (or in a folder above it) first, then among
    the fragments shipped with areal."""
    candidate = Path(name).expanduser()
    if candidate.is_absolute():
        return candidate if candidate.is_file() else None
    for directory in [base_dir, *base_dir.parents, PACKAGED_DEFAULTS]:
        if (directory / candidate).is_file():
            return directory / candidate
    return None


def _packaged_fragments() -> str:
    found = sorted(PACKAGED_DEFAULTS.glob("yaml/*/*.yaml"))
    return ", ".join(str(f.relative_to(PACKAGED_DEFAULTS)) for f in found) or "none installed"


def _compose(path: Path, out: _Collector, stack: tuple[Path, ...] = ()) -> tuple[dict, dict]:
    """Load `path` after its `defaults:` files, deepest first; returns (data, locations)."""
    read = _read_yaml(path, out)
    if read is None:
        return {}, {}
    data, locations = read
    defaults = data.pop("defaults", [])
    where = locations.get(("defaults",), Location(_display_path(path)))
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        out.add(
            "defaults",
            "must be a list of YAML file paths",
            "write `defaults: [yaml/engine/fsdp_cpu.yaml]`",
            where,
        )
        defaults = []
    merged: dict = {}
    merged_locs: dict = {}
    for name in defaults:
        found = _find_default(name, path.parent)
        if found is None:
            out.add(
                "defaults",
                f"defaults file not found: {name}",
                f"looked next to {_display_path(path)}, in the folders above it and among "
                f"areal's own fragments ({_packaged_fragments()})",
                where,
            )
            continue
        if found.resolve() in stack:
            out.add(
                "defaults",
                f"{name} includes itself (a cycle)",
                "remove the circular defaults entry",
                where,
            )
            continue
        sub_data, sub_locs = _compose(found, out, stack + (found.resolve(),))
        _merge(merged, sub_data)
        merged_locs.update(sub_locs)
    _merge(merged, data)
    merged_locs.update({k: v for k, v in locations.items() if k != ("defaults",)})
    return merged, merged_locs


def _merge(base: dict, update: dict) -> None:
    """Deep-merge `update` into `base`; mappings merge, everything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _apply_override(data: dict, locations: dict, text: str, out: _Collector) -> None:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        out.add(
            "",
            f"override '{text}' is not of the form key.path=value",
            "write for example actor.optimizer.lr=1e-5",
            COMMAND_LINE,
        )
        return
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = tuple(key.split("."))
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
        locations[parts[: i + 1]] = COMMAND_LINE
    node[parts[-1]] = value
    locations[parts] = COMMAND_LINE


# ---------------------------------------------------------------- interpolation


def _lookup(tree: Any, parts: list[str]) -> tuple[bool, Any]:
    for part in parts:
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif dataclasses.is_dataclass(tree) and part in {f.name for f in dataclasses.fields(tree)}:
            tree = getattr(tree, part)
        else:
            return False, None
    return True, tree


def _interpolate(data: dict, locations: dict, out: _Collector) -> None:
    defaults = ExperimentConfig()

    def resolve_ref(ref: str, key: KeyPath, chain: tuple[str, ...]) -> Any:
        ref = ref.strip()
        where = locations.get(key)
        if ref.startswith("env:"):
            name, sep, fallback = ref[4:].partition(",")
            if name.strip() in os.environ:
                return os.environ[name.strip()]
            if sep:
                return fallback.strip()
            out.add(
                ".".join(key),
                f"environment variable {name.strip()} is not set (from ${{{ref}}})",
                f"export it or write ${{env:{name.strip()},fallback}}",
                where,
            )
            return _BROKEN
        if ref in chain:
            out.add(
                ".".join(key),
                f"interpolation cycle: {' -> '.join(chain + (ref,))}",
                "break the cycle by giving one key a literal value",
                where,
            )
            return _BROKEN
        found, value = _lookup(data, ref.split("."))
        if not found:
            found, value = _lookup(defaults, ref.split("."))
            if dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
        if not found:
            out.add(
                ".".join(key),
                f"broken interpolation ${{{ref}}}: no key '{ref}'",
                _suggest_path(ref),
                where,
            )
            return _BROKEN
        return resolve_value(value, key, chain + (ref,))

    def resolve_value(value: Any, key: KeyPath, chain: tuple[str, ...]) -> Any:
        if isinstance(value, str) and "${" in value:
            whole = _INTERP.fullmatch(value)
            if whole:
                return resolve_ref(whole.group(1), key, chain)
            parts = [resolve_ref(m.group(1), key, chain) for m in _INTERP.finditer(value)]
            if any(p is _BROKEN for p in parts):
                return _BROKEN
            pieces = iter(parts)
            return _INTERP.sub(lambda m: str(next(pieces)), value)
        if isinstance(value, dict):
            return {k: resolve_value(v, key + (str(k),), chain) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve_value(v, key, chain) for v in value]
        return value

    resolved = resolve_value(data, (), ())
    data.clear()
    data.update(resolved)


def _all_key_paths(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    paths = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        paths.append(name)
        if dataclasses.is_dataclass(hints[f.name]):
            paths.extend(_all_key_paths(hints[f.name], name + "."))
    return paths


def _suggest_path(path: str) -> str:
    return did_you_mean(path, _all_key_paths())


# ---------------------------------------------------------------- building dataclasses


def _type_name(tp: Any) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "text"}
    if tp in names:
        return names[tp]
    return getattr(tp, "__name__", str(tp))


def _coerce(
    value: Any, tp: Any, key: str, where: Location | None, out: _Collector
) -> tuple[bool, Any]:
    """Check `value` against type `tp`; returns (ok, converted value)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return True, None
        return _coerce(value, args[0], key, where, out)
    if origin is list:
        if not isinstance(value, list):
            out.add(
                key,
                f"expected a list, got {_describe(value)}",
                "write [a, b] or one `- item` per line",
                where,
            )
            return False, None
        (item_tp,) = typing.get_args(tp)
        items = [_coerce(v, item_tp, f"{key}[{i}]", where, out) for i, v in enumerate(value)]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        if not isinstance(value, dict):
            out.add(
                key,
                f"expected a mapping, got {_describe(value)}",
                "write `name: value` lines under it",
                where,
            )
            return False, None
        return True, {
            str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return True, value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return True, value
        if value is None:
            out.add(key, "expected text, got null", "give a value or remove the key", where)
            return False, None
    fix = "quote it to make it text" if tp is str else f"write {_type_name(tp)}"
    out.add(key, f"expected {_type_name(tp)}, got {_describe(value)}", fix, where)
    return False, None


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    kind = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "text",
        list: "list",
        dict: "mapping",
    }
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind.get(type(value), type(value).__name__)} {text}"


def _check_range(value: Any, meta: dict, key: str, where: Location | None, out: _Collector) -> None:
    if value is None:
        return
    fix = meta.get("fix", "")
    choices = meta.get("choices")
    if choices and value not in choices:
        out.add(
            key,
            f"'{value}' is not one of {', '.join(map(str, choices))}",
            fix or did_you_mean(str(value), map(str, choices)),
            where,
        )
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = [
        ("gt", ">", lambda a, b: a > b),
        ("ge", ">=", lambda a, b: a >= b),
        ("lt", "<", lambda a, b: a < b),
        ("le", "<=", lambda a, b: a <= b),
    ]
    for name, symbol, ok in bounds:
        limit = meta.get(name)
        if limit is not None and not ok(value, limit):
            out.add(
                key,
                f"must be {symbol} {limit:g}, got {value:g}",
                fix or f"set a value {symbol} {limit:g}",
                where,
            )
            return


def _build(cls: type, data: dict, prefix: KeyPath, ctx: _BuildContext) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = prefix + (str(key),)
        dotted = ".".join(path)
        where = ctx.locations.get(path)
        if key not in fields:
            ctx.out.add(
                dotted,
                "unknown key",
                _unknown_key_hint(str(key), fields, prefix),
                where,
                harmless=True,
            )
            continue
        if value is _BROKEN:
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if value is None:
                continue
            if not isinstance(value, dict):
                ctx.out.add(
                    dotted,
                    f"expected a section of keys, got {_describe(value)}",
                    f"indent the keys of '{key}' under it",
                    where,
                )
                continue
            kwargs[key] = _build(tp, value, path, ctx)
            continue
        ok, converted = _coerce(value, tp, dotted, where, ctx.out)
        if not ok:
            continue
        meta = fields[key].metadata
        _check_range(converted, meta, dotted, where, ctx.out)
        if meta.get("path") and isinstance(converted, str):
            converted = _anchor_path(converted, where)
        kwargs[key] = converted
    return cls(**kwargs)


@dataclasses.dataclass
class _BuildContext:
    locations: dict[KeyPath, Location]
    out: _Collector


def _unknown_key_hint(key: str, fields: dict, prefix: KeyPath) -> str:
    from areal_cli.config.areal_import.names import HINTS

    areal_name = HINTS.get(".".join((*prefix, key)))
    if areal_name is not None:  # AReaL's name for one of ours
        return f"this is AReaL's name: areal's is '{areal_name}'"
    hint = did_you_mean(key, fields)
    if hint.startswith("did you mean"):
        return hint.replace("'", "'" + ".".join(prefix) + ("." if prefix else ""), 1)
    elsewhere = [p for p in _all_key_paths() if p.split(".")[-1] == key]
    if elsewhere:
        return f"did you mean '{elsewhere[0]}'?"
    return hint


def _anchor_path(value: str, where: Location | None) -> str:
    """Make a recipe-relative path absolute; leave hub ids, builtin: names and empties."""
    if not value or value.startswith("builtin:") or "://" in value or "${" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    base = Path.cwd()
    if where is not None and where.file.endswith((".yaml", ".yml")):
        base = Path(where.file).resolve().parent
    anchored = base / path
    if not anchored.exists() and is_hub_id(value):
        return value  # a hub id such as Qwen/Qwen2.5-1.5B-Instruct
    return str(anchored.resolve())


# ---------------------------------------------------------------- entry point


def load_config(recipe: str | Path, overrides: list[str] | None = None) -> LoadedConfig:
    """Read, compose, override, interpolate and type-check a recipe.

    Raises `ConfigErrors` listing every problem found; cross-field checks are in
    `rules.check_config`. The error carries the config as far as it could be built
    (`partial`) and the keys whose values are unusable (`invalid`), so callers can run the
    cross-field checks that do not read those keys and report everything at once.
    """
    out = _Collector()
    path = Path(recipe)
    if not path.exists():
        out.add(
            "",
            f"recipe not found: {recipe}",
            "check the path (recipes live in recipes/)",
            Location(str(recipe)),
        )
        raise ConfigErrors(out.problems)
    data, locations = _compose(path, out, (path.resolve(),))
    for text in overrides or []:
        _apply_override(data, locations, text, out)
    _interpolate(data, locations, out)
    config = _build(ExperimentConfig, data, (), _BuildContext(locations, out))
    loaded = LoadedConfig(config, locations, path)
    if out.problems:
        raise ConfigErrors(out.problems, partial=loaded, invalid=out.invalid)
    return loaded


def is_hub_id(value: str) -> bool:
    """True for `org/name` strings that are not local paths (no file extension, not on disk)."""
    if not _HUB_ID.match(value) or value.startswith((".", "/")) or Path(value).exists():
        return False
    return Path(value).suffix.lower() not in _FILE_SUFFIXES


REDACTED = "<redacted>"


def to_yaml(config: ExperimentConfig) -> str:
    """The resolved config as YAML, in schema order (what `config.yaml` holds and
    `areal validate` prints), with the API key redacted: nothing reads it back from there
    (the trainer needs none, and --resume takes it from the recipe again)."""
    data = dataclasses.asdict(config)
    if data["inference"]["api_key"]:
        data["inference"]["api_key"] = REDACTED
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
