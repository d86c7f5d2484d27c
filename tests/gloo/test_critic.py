"""The PPO critic (algorithm: ppo) under real torchrun with gloo ranks: the same step at
1, 2 and 3 ranks (uneven shards), an exact resume of actor and critic, and the critic's
conversion out of the recover entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_cli.rundir import handoff
from areal_cli.rundir.batch import RolloutBatch, write_batch
from tests.conftest import run_areal
from tests.gloo.conftest import torchrun, write_config
from tests.gloo.test_trainer import _load_all, _max_diff, _weights

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

EOS = 2  # LlamaConfig's default eos_token_id, which tests.gloo.conftest.make_model keeps
CRITIC_KEYS = ("value_loss", "explained_variance", "value_mean", "return_mean", "critic_grad_norm")


def _batches(directory: Path, n_steps: int, n_seqs: int = 8) -> Path:
    """Fixed batches whose sequences end by EOS (every other one) or by the length limit,
    with 0/1 rewards and completions of 2-11 tokens."""
    gen = torch.Generator().manual_seed(5)
    for step in range(1, n_steps + 1):  # steps count from 1; tokens one version behind
        seqs = []
        for k in range(n_seqs):
            prompt = int(torch.randint(3, 9, (1,), generator=gen))
            completion = int(torch.randint(2, 12, (1,), generator=gen))
            ids = torch.randint(3, 96, (prompt + completion,), generator=gen)
            if k % 2 == 0:
                ids[-1] = EOS
            mask = torch.cat([torch.zeros(prompt), torch.ones(completion)]).to(torch.int8)
            seqs.append(
                {
                    "input_ids": ids,
                    "loss_mask": mask,
                    "logprobs": (-torch.rand(len(ids), generator=gen) * 5 - 0.5) * mask,
                    "versions": torch.where(mask.bool(), step - 2, -1).to(torch.int32),
                }
            )
        rewards = torch.randint(0, 2, (n_seqs,), generator=gen).float().tolist()
        write_batch(directory, step, RolloutBatch.from_sequences(seqs, rewards, 1))
    return directory


def _config(tmp_path: Path, model_dir: Path, name: str, **extra: object) -> Path:
    settings = {"algorithm": "ppo", "critic.lr": 2e-3, "rollout.group_size": 1, **extra}
    settings["rollout.batch_size"] = 8
    return write_config(tmp_path / f"{name}.yaml", model_dir, tmp_path / name, **settings)


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "logs" / "trainer-metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_ppo_step_is_the_same_at_one_two_and_three_ranks(tmp_path: Path, model_dir: Path) -> None:
    batches = _batches(tmp_path / "batches", 2)
    runs = {}
    for nproc, n_mbs in ((1, 1), (2, 2), (3, 1)):
        cfg = _config(
            tmp_path,
            model_dir,
            f"r{nproc}",
            total_train_steps=2,
            allocation_mode=f"embedded:d1+fsdp:d{nproc}",
            **{"actor.mb_spec.n_mbs": n_mbs},
        )
        torchrun(nproc, cfg, "--batches", str(batches))
        runs[nproc] = tmp_path / f"r{nproc}" / "gloo" / "t"
    one = _metrics(runs[1])
    assert all(set(CRITIC_KEYS) <= set(row) for row in one)
    assert one[0]["value_loss"] > 0
    for nproc in (2, 3):
        for a, b in zip(one, _metrics(runs[nproc]), strict=True):
            for key in ("loss", "grad_norm", *CRITIC_KEYS):
                assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (nproc, key)
        assert _max_diff(_weights(runs[1], 2), _weights(runs[nproc], 2)) < 1e-5
        critics = [
            _load_all(r / "checkpoints" / "critic" / "step-2") for r in (runs[1], runs[nproc])
        ]
        assert _max_diff(*critics) < 1e-5, nproc
    config = json.loads((runs[1] / "checkpoints" / "critic" / "step-2" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]


def test_ppo_resume_restores_the_critic_and_it_converts(tmp_path: Path, model_dir: Path) -> None:
    batches = _batches(tmp_path / "batches", 4)
    extra = {"recover.freq_steps": 1, "recover.keep_last": 2}
    straight = _config(tmp_path, model_dir, "a", **extra)
    torchrun(2, straight, "--batches", str(batches))
    resumed = _config(tmp_path, model_dir, "b", **extra)
    torchrun(2, resumed, "--batches", str(batches), "--steps", "2")
    torchrun(2, resumed, "--batches", str(batches), "--resume")
    run_a, run_b = tmp_path / "a" / "gloo" / "t", tmp_path / "b" / "gloo" / "t"
    for key in ("loss", "value_loss", "explained_variance"):
        assert [m[key] for m in _metrics(run_a)] == [m[key] for m in _metrics(run_b)], key
    critic = {r: _load_all(r / "checkpoints" / "critic" / "step-4") for r in (run_a, run_b)}
    assert _max_diff(critic[run_a], critic[run_b]) == 0.0
    # the recover entry holds both models; --part critic converts the critic, and verifies
    newest = handoff.latest(run_b / "recover", "step-")
    out = tmp_path / "critic-hf"
    critic_config = run_b / "model-critic"  # a trainer-only run has no RUN/config.yaml to say so
    done = run_areal(
        "convert-checkpoint",
        *(str(newest.path), str(out), "--part", "critic", "--verify"),
        *("--model-config", str(critic_config)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max |logit difference| = 0" in done.stdout
    assert torch.equal(_load_all(out)["score.weight"], critic[run_b]["score.weight"])
    actor = run_areal(
        "convert-checkpoint",
        str(newest.path),
        str(tmp_path / "actor-hf"),
        "--model-config",
        str(model_dir),
    )
    assert actor.returncode == 0, actor.stderr
    assert "lm_head.weight" in _load_all(tmp_path / "actor-hf")
