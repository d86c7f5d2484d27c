# Usage: .venv/bin/python scripts/import_areal_examples.py AREAL_CHECKOUT [OUT_DIR]
#
# Runs `areal import-recipe` on every training config under AReaL's examples/ (its entry
# script beside it when one is found), then `areal validate` and `areal train --dry-run
# --json` on each import, and prints a Markdown table: imported and valid (with the GPUs
# the plan uses against AReaL's allocation), or refused with the missing feature.
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

AREAL = [sys.executable, "-m", "areal_cli.cli"]
NOT_TRAINING = ("environ_ref.yaml", ".sky.yaml")


def entry_script(config: Path) -> Path | None:
    """The Python script beside a config that runs it: the one that names the config's
    dataset or algorithm, else the only one."""
    scripts = sorted(p for p in config.parent.glob("*.py") if p.name != "__init__.py")
    stem = config.stem
    for s in scripts:
        if (
            s.stem == stem
            or s.stem in stem
            or stem.startswith(s.stem.split("_")[0] + "_sft")
            and "sft" in s.stem
        ):
            return s
    if "sft" in stem:
        return next((s for s in scripts if "sft" in s.stem), None)
    rl = [s for s in scripts if s.stem.endswith(("_rl", "rl_mt", "train"))]
    return rl[0] if rl else (scripts[0] if len(scripts) == 1 else None)


def areal_gpus(text: str) -> int | None:
    """GPUs of AReaL's allocation: inference d*t*p plus trainer d*t*p*c (older single
    strings too)."""
    modes = re.findall(r"^\s*(?:backend|allocation_mode):\s*\"?([^\"#\n]+)", text, re.M)
    total = 0
    for mode in modes:
        if "${" in mode:
            continue
        for component in mode.strip().split("+"):
            sizes = dict(re.findall(r"([dptc])(\d+)", component))
            n = 1
            for v in sizes.values():
                n *= int(v)
            total += n if sizes else 0
    return total or None


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AREAL, *args], capture_output=True, text=True, timeout=120)


def main() -> None:
    root = Path(sys.argv[1])
    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/areal-imports")
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = sorted(
        p for p in (root / "examples").rglob("*.y*ml") if not p.name.endswith(NOT_TRAINING)
    )
    print("| AReaL config | result | GPUs (AReaL / areal plan) |")
    print("|---|---|---|")
    counts = {"valid": 0, "valid_but_data": 0, "refused": 0, "invalid": 0}
    for config in configs:
        rel = config.relative_to(root)
        out = out_dir / (str(rel).replace("/", "__").removesuffix(".yaml") + ".areal.yaml")
        script = entry_script(config)
        args = ["import-recipe", str(config), "-o", str(out)]
        imported = run(*args, *(["--script", str(script)] if script else []))
        if imported.returncode != 0:
            reason = imported.stderr.strip().splitlines()[-1].removeprefix("error: ")
            reason = reason.split(": ", 1)[-1]
            print(f"| {rel} | refused: {reason} | |")
            counts["refused"] += 1
            continue
        checked = run("validate", str(out), f"cluster.fileroot={out_dir}/runs")
        errors = [x for x in checked.stderr.splitlines() if x.startswith("error:")]
        missing = [e for e in errors if "dataset path does not exist" in e]
        if checked.returncode != 0 and errors and missing == errors:
            where = missing[0].split("does not exist: ")[1].split(";")[0]
            print(
                f"| {rel} | imported; valid but for its data file ({where} is not here: AReaL's scripts write it) | |"
            )
            counts["valid_but_data"] += 1
            continue
        if checked.returncode != 0:
            print(
                f"| {rel} | imported, {len(errors)} errors: {errors[0][7:] if errors else checked.stderr[-200:]} | |"
            )
            counts["invalid"] += 1
            continue
        plan = run("train", str(out), "--dry-run", "--json", f"cluster.fileroot={out_dir}/runs")
        gpus = "?"
        if plan.returncode == 0:
            data = json.loads(plan.stdout)
            procs = data.get("processes", [])
            gpus = str(
                sum(len(p.get("gpus") or []) * max(1, len(p.get("nodes") or [])) for p in procs)
            )
        lost = imported.stderr.strip().split(", ")[-1].split(" not honoured")[0]
        via = f" (script {script.name})" if script else ""
        theirs = areal_gpus(config.read_text())
        if re.search(r"n_gpus_per_node:\s*0\b", config.read_text()):
            theirs, gpus = f"CPU ({theirs} processes)", f"CPU ({len(procs)} processes)"
        print(f"| {rel} | imported, valid; {lost} not honoured{via} | {theirs} / {gpus} |")
        counts["valid"] += 1
    print()
    print(
        f"{len(configs)} configs: {counts['valid']} imported and valid, "
        f"{counts['valid_but_data']} valid but for a data file AReaL's scripts write, "
        f"{counts['refused']} refused, {counts['invalid']} imported but invalid"
    )


if __name__ == "__main__":
    main()
