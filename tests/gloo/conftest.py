"""Helpers for tests that start real torchrun ranks on the gloo backend."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from areal_cli.rundir.batch import RolloutBatch, write_batch
from areal_cli.trainer.attention import KERNEL_ENV
from tests.conftest import free_port

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def make_model(
    path: Path,
    seed: int = 0,
    vocab: int = 96,
    tied: bool = False,
    heads: int = 2,
    kv_heads: int = 2,
) -> Path:
    """A ~100k-parameter Llama saved with save_pretrained (fp32, untied)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64 // heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_batches(
    directory: Path,
    n_steps: int,
    n_seqs: int = 8,
    group_size: int = 4,
    vocab: int = 96,
    seed: int = 0,
) -> Path:
    """Fixed rollout batches step-1..step-N with random tokens, behaviour logprobs and
    rewards. Their tokens are marked one version behind the trainer (as in the asynchronous
    steady state): random behaviour logprobs did not come from the trainer's weights, so
    the batch must not pass for on-policy, which would skip the proximal pass."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, n_steps + 1):  # step k trains v(k-1): its tokens are from v(k-2)
        seqs = []
        for _ in range(n_seqs):
            prompt = int(torch.randint(3, 9, (1,), generator=gen))
            completion = int(torch.randint(2, 12, (1,), generator=gen))
            n = prompt + completion
            mask = torch.cat([torch.zeros(prompt), torch.ones(completion)]).to(torch.int8)
            seqs.append(
                {
                    "input_ids": torch.randint(0, vocab, (n,), generator=gen),
                    "loss_mask": mask,
                    "logprobs": (-torch.rand(n, generator=gen) * 5 - 0.5) * mask,
                    "versions": torch.where(mask.bool(), step - 2, -1).to(torch.int32),
                }
            )
        rewards = torch.randint(0, 2, (n_seqs,), generator=gen).float().tolist()
        write_batch(directory, step, RolloutBatch.from_sequences(seqs, rewards, group_size))
    return directory


def write_config(path: Path, model: Path, fileroot: Path, **overrides: object) -> Path:
    """A trainer config (the resolved config.yaml a run would hold)."""
    import yaml

    cfg = {
        "experiment_name": "gloo",
        "trial_name": "t",
        "allocation_mode": "embedded:d1+fsdp:d2",
        "total_train_steps": 4,
        "cluster": {"fileroot": str(fileroot)},
        "model": {"path": str(model)},
        "rollout": {"batch_size": 2, "group_size": 4},
        "gconfig": {"temperature": 1.0},
        "actor": {
            "optimizer": {"lr": 1e-3},
            "eps_clip": 0.2,
            "use_decoupled_loss": True,
            "rejection_sampling": {"upper": 5.0},
        },
        "recover": {"freq_steps": 0},
    }
    for key, value in overrides.items():
        node = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


# torchrun makes a folder per launch for its logs (in /tmp when not told where, and never
# removes it): the tests give it this one, removed when the session ends.
_TORCHRUN_LOGS = tempfile.mkdtemp(prefix="areal-tests-torchrun-")
atexit.register(shutil.rmtree, _TORCHRUN_LOGS, True)


def torchrun_argv(nproc: int, *target: str) -> list[str]:
    """`torchrun ... TARGET` (a script, or -m module) with `nproc` ranks on a free port.
    Every rank runs under the collectives guard (tests/gloo/guard.py): a collective that
    areal code issues outside areal_cli.trainer.collectives fails the rank."""
    return [
        TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--log-dir", _TORCHRUN_LOGS,
        "-m", "tests.gloo.guard", *target,
    ]  # fmt: skip


def torchrun_target(nproc: int, *target: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `torchrun ... TARGET` with `nproc` gloo ranks; it must succeed."""
    argv = torchrun_argv(nproc, *target)
    env = {
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "PYTHONUNBUFFERED": "1",
        "HOME": str(Path.home()),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    if KERNEL_ENV in os.environ:  # scripts/gpu_bench.py --trainer-attention
        env[KERNEL_ENV] = os.environ[KERNEL_ENV]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def layout_args(allocation: str) -> list[str]:
    """The trainer's --dp/--cp/--tp for the train side of `allocation`, as the launcher
    passes them (the trainer never parses the allocation string)."""
    from areal_cli.config.allocation import parse_allocation

    train = parse_allocation(allocation).train
    dp, cp, tp = (
        train.data_parallel_size,
        train.context_parallel_size,
        train.tensor_parallel_size,
    )
    return ["--dp", str(dp), "--cp", str(cp), "--tp", str(tp)]


def torchrun(
    nproc: int, config: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run the trainer under real torchrun with `nproc` gloo ranks."""
    return torchrun_target(
        nproc, "-m", "areal_cli.trainer.main", "--config", str(config), *args, timeout=timeout
    )


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_model(tmp_path / "model")
