"""Decoupled PPO without a separate proximal pass: with one minibatch, the training
forward's own detached logprobs are the proximal ones; with more, a batch that the current
weights generated takes the behaviour logprobs as proximal, so the update is the one plain
PPO against them gives."""

from __future__ import annotations

import copy

import pytest
import torch

from areal_cli.config.schema import TrainEngineConfig
from areal_cli.rundir.batch import RolloutBatch
from areal_cli.trainer import attention
from areal_cli.trainer.step import is_on_policy, train_step


def _batch(version: int) -> RolloutBatch:
    torch.manual_seed(1)
    seqs = []
    for n_prompt, n_out in [(5, 3), (4, 4), (6, 2), (3, 3)]:
        seqs.append(
            {
                "input_ids": torch.randint(0, 100, (n_prompt + n_out,)),
                "loss_mask": torch.tensor([0] * n_prompt + [1] * n_out, dtype=torch.int8),
                "logprobs": torch.tensor([0.0] * n_prompt + [-4.0] * n_out),
                "versions": torch.tensor([-1] * n_prompt + [version] * n_out, dtype=torch.int32),
            }
        )
    return RolloutBatch.from_sequences(seqs, [1.0, 0.0, 1.0, 0.0], 2)


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float()
    attention.register(1)
    model.config._attn_implementation = attention.ATTENTION
    return model


def _step(model, batch, cfg, version):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    phases: list[str] = []
    stats = train_step(
        model, optimizer, None, batch, cfg, 1.0, beat=phases.append, policy_version=version
    )
    return stats, phases


def test_is_on_policy_reads_only_generated_tokens() -> None:
    assert is_on_policy(_batch(3), 3) and not is_on_policy(_batch(2), 3)


@pytest.mark.parametrize("version,skipped", [(3, True), (2, False)])
def test_with_minibatches_the_proximal_pass_runs_only_off_policy(
    version: int, skipped: bool
) -> None:
    cfg = TrainEngineConfig(use_decoupled_loss=True, ppo_n_minibatches=2)
    model = _model()
    plain = copy.deepcopy(model)
    _, phases = _step(model, _batch(version), cfg, 3)
    assert any("proximal" in p for p in phases) is not skipped
    if skipped:  # the same update as plain PPO against the behaviour logprobs
        cfg = TrainEngineConfig(use_decoupled_loss=False, ppo_n_minibatches=2)
        _step(plain, _batch(version), cfg, 3)
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("version", [3, 2])
def test_one_minibatch_takes_the_proximal_logprobs_from_its_own_forward(
    version: int, monkeypatch
) -> None:
    """No separate pass, on- or off-policy; the proximal logprobs given to the loss are
    what a no-grad forward of the model as the step starts gives."""
    from areal_cli.trainer import losses
    from areal_cli.trainer.step import StepLayout, forward_logprobs

    seen = []
    loss = losses.decoupled_ppo_loss
    monkeypatch.setattr(
        losses,
        "decoupled_ppo_loss",
        lambda logp, prox, *a, **k: seen.append(prox) or loss(logp, prox, *a, **k),
    )
    model, batch = _model(), _batch(version)
    with torch.no_grad():
        ids = list(range(batch.n_seqs))
        before, _, t = forward_logprobs(
            copy.deepcopy(model), batch, ids, 1.0, StepLayout.data_parallel()
        )
    _, phases = _step(model, batch, TrainEngineConfig(use_decoupled_loss=True), 3)
    assert not any("proximal" in p for p in phases)
    assert len(seen) == 1 and not seen[0].requires_grad
    mask = t["loss_mask"].bool()
    torch.testing.assert_close(seen[0][mask], before[mask], rtol=0, atol=1e-6)
