"""Recipe-side Python: the one way a recipe's `module:function` is found and loaded.

A recipe names its own code as `module:function` (reward.fn, rollout.workflow,
rollout.agent). The module is looked for first as a file beside the recipe (`module.py`,
or `a/b.py` for `a.b`), then as an importable module. `find_module_file` only locates it;
`load_module` executes it once per process under its own name (so pickling and
dataclasses inside it work), with the recipe's folder appended to sys.path so that its
helpers import. Appended, not prepended: a recipe folder must not shadow installed
packages.

Validation reads reward and workflow files without running them (`spec_problem`: the
file parses and defines the name). An agent it imports (`agent_problem`): the agent's
contract is a class with `async def run` or an async function, which only the loaded
object can show, and an agent's import fails in ways a parse cannot see; importing it
before anything starts turns a failure ten seconds into a run into one line before it.
The controller then finds the module already loaded and does not run it again.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any


class RecipeCodeError(ValueError):
    """A recipe-side module that cannot be found or loaded."""


def _beside(module: str, recipe_dir: Path | None) -> Path | None:
    if recipe_dir is None:
        return None
    path = recipe_dir / (module.replace(".", "/") + ".py")
    return path.resolve() if path.is_file() else None


def find_module_file(module: str, recipe_dir: Path | None) -> Path | None:
    """The file that `load_module` would load, or None; imports nothing of the recipe's."""
    local = _beside(module, recipe_dir)
    if local is not None:
        return local
    if module.split(".")[0] in sys.modules or "." not in module:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        return Path(spec.origin) if spec and spec.origin else None
    return None


def load_module(module: str, recipe_dir: Path | None) -> ModuleType:
    """The module, loaded from a .py file beside the recipe if there is one, else imported."""
    path = _beside(module, recipe_dir)
    if path is None:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            where = f"no {module}.py in {recipe_dir} and " if recipe_dir else ""
            raise RecipeCodeError(f"{where}module {module!r} is not importable: {exc}") from exc
    loaded = sys.modules.get(module)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(module, path)
    if spec is None or spec.loader is None:
        raise RecipeCodeError(f"cannot load {path} as a module")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded  # before exec, so dataclasses and pickling inside it work
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[module]
        raise
    return loaded


def load_function(spec: str, recipe_dir: Path | None) -> object:
    """The callable named by `module:function`; RecipeCodeError says what is missing."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise RecipeCodeError(f"{spec!r} is not module:function")
    module = load_module(module_name, recipe_dir)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RecipeCodeError(
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
            f"{name!r}; it defines: {', '.join(public) or 'nothing callable'}"
        )
    return fn


def spec_problem(
    spec: str,
    builtins: tuple[str, ...],
    recipe_dir: Path,
    builtin_prefix: bool = True,
    launch: bool = True,
) -> tuple[str, str, bool] | None:
    """What is wrong with a reward or workflow spec, as (message, fix, only a warning), or
    None. A spec is `builtin:name` (a bare builtin name when not `builtin_prefix`, as
    workflows are named) or `module:function` found beside the recipe; a reward may also be
    `model:PATH`, a reward-model folder, which only warns when it is missing and nothing is
    launched (a plan needs no weights, DESIGN §1)."""
    from areal_cli.config.model_info import (
        REWARD_MODEL_PREFIX,
        reward_model_path,
        reward_model_problem,
    )

    if builtin_prefix and spec.startswith(REWARD_MODEL_PREFIX):
        path = reward_model_path(spec, recipe_dir)
        problem = reward_model_problem(path)
        fix = "give the final checkpoint of an algorithm: rm run, e.g. model:../runs/tiny-rm/trial0/checkpoints/step-150"
        if problem and not path.exists() and not launch:
            return f"{problem}; a real run needs it", fix, True
        return (problem, fix, False) if problem else None
    if builtin_prefix and spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name in builtins:
            return None
        return (
            f"unknown builtin '{name}'",
            f"use one of: {', '.join('builtin:' + b for b in builtins)}",
            False,
        )
    if not builtin_prefix and spec in builtins:
        return None
    module, sep, func = spec.partition(":")
    if not sep or not module or not func.isidentifier():
        if not builtins:
            return (
                f"'{spec}' is not module:Name",
                "name it as my_module:MyAgent, with my_module.py beside the recipe",
                False,
            )
        choices = ", ".join(("builtin:" if builtin_prefix else "") + b for b in builtins)
        return (
            f"'{spec}' is neither a builtin nor module:function",
            f"use one of {choices}, or my_module:my_function beside the recipe",
            False,
        )
    source = find_module_file(module, recipe_dir)
    if source is None:
        return (
            f"module '{module}' not found",
            f"put {module.replace('.', '/')}.py next to the recipe or install it",
            False,
        )
    if source.suffix != ".py":
        return None
    try:
        names = _top_level_names(source)
    except SyntaxError as err:
        return (
            f"{source.name}:{err.lineno}: {err.msg}",
            "fix the syntax error in the file",
            False,
        )
    if func not in names:
        defined = ", ".join(sorted(n for n in names if not n.startswith("_"))) or "nothing"
        return (
            f"{source.name} has no class or function named '{func}' (it defines: {defined})",
            "check the name after the colon",
            False,
        )
    return None


def _top_level_names(source: Path) -> set[str]:
    """The classes, functions and assigned names at the top of `source` (SyntaxError
    when it does not parse)."""
    import ast

    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except OSError:
        return set()
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)  # a class: an agent
    return {n.name for n in tree.body if isinstance(n, kinds)} | {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


AgentRun = Callable[..., Awaitable[Any]]  # (data, **kwargs) -> reward


def load_agent(spec: str, recipe_dir: Path | None, sync_ok: bool = False) -> Callable[[], AgentRun]:
    """A factory of the agent's per-episode entry point: `Name().run` for a class (made
    with no arguments), the function itself for an async function
    (areal_cli.rollout.agents has the whole contract); RecipeCodeError says what breaks
    it. `sync_ok` (rollout.mode subproc, areal_cli.rollout.subproc) admits a synchronous
    run or function too: it runs in a worker process of its own."""
    found = load_function(spec, recipe_dir)
    if inspect.isclass(found):
        run = getattr(found, "run", None)
        if run is None or not callable(run):
            raise RecipeCodeError(
                f"agent class {spec} has no run method: define `async def run(self, data, **kwargs)`"
            )
        if not (sync_ok or inspect.iscoroutinefunction(run)):
            raise RecipeCodeError(
                f"{spec}.run must be async: `async def run(self, data, **kwargs)`, "
                "or set rollout.mode: subproc to run a synchronous agent in worker processes"
            )
        try:
            inspect.signature(found).bind()
        except TypeError:
            raise RecipeCodeError(
                f"agent class {spec} must be made with no arguments (one per episode)"
            ) from None
        return lambda: found().run
    if not (inspect.iscoroutinefunction(found) or (sync_ok and callable(found))):
        raise RecipeCodeError(
            f"agent {spec} must be an async function `async def {spec.partition(':')[2]}(data, **kwargs)`"
            " or a class with `async def run(self, data, **kwargs)`"
        )
    return lambda: found  # type: ignore[return-value]


def agent_problem(spec: str, recipe_dir: Path, sync_ok: bool = False) -> str | None:
    """What stops `load_agent(spec)`, in one line naming the file and line where it can
    (a syntax error, an import that fails, a missing name, a broken contract); None when
    it loads. Runs the agent's module (see the module docstring)."""
    import traceback

    try:
        load_agent(spec, recipe_dir, sync_ok)
    except SyntaxError as err:
        return f"{Path(err.filename or '?').name}:{err.lineno}: {err.msg}"
    except RecipeCodeError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - whatever its import raises is the user's to see
        source = find_module_file(spec.partition(":")[0], recipe_dir)
        frames = [
            f for f in traceback.extract_tb(err.__traceback__)
            if source is not None and Path(f.filename) == source
        ]  # fmt: skip
        where = f"{source.name}:{frames[-1].lineno}: " if frames and source else ""
        return f"{where}importing the agent failed: {type(err).__name__}: {err}"
    return None
