"""A trainer micro-batch's forward, loss, backward and stats read nothing back from the
device (issue 45). On a GPU each such read (`.item()`, `float(t)`, `bool(t)`, a boolean
mask index, `nonzero`) stops the host until the GPU has caught up, so the next kernels are
queued late. The step plans everything on the host before a micro-batch starts
(`step.device_batch`); `step._train_micro_batch` runs here under a dispatch mode that
records every op that would sync, for the loss variants the recipes can pick."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from areal_cli.config.schema import MicroBatchSpec, RejectionSamplingConfig, TrainEngineConfig
from areal_cli.trainer import attention, step

aten = torch.ops.aten
# ops whose result (or whose output's size) depends on tensor values: a device sync on CUDA
_READS = {
    aten._local_scalar_dense.default,  # .item(), float(t), bool(t), int(t)
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
}


class SyncRecorder(TorchDispatchMode):
    """Records (op, where) for every op in _READS, every index by a boolean mask and every
    repeat_interleave without output_size."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func in _READS
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            hit = any(
                t is not None and t.dtype == torch.bool for t in args[1] if torch.is_tensor(t)
            )
        if func is aten.repeat_interleave.Tensor:
            hit = kwargs.get("output_size") is None
        if hit:
            frames = [f for f in traceback.extract_stack() if "areal_cli" in f.filename]
            where = (
                f"{frames[-1].filename.split('areal_cli')[-1]}:{frames[-1].lineno}"
                if frames
                else "?"
            )
            self.reads.append(f"{func} at {where}")
        return func(*args, **kwargs)


def _model() -> torch.nn.Module:
    """A 2-layer decoder with the trainer's packed attention (the one installed: every
    trainer model shares it, as under a mesh)."""
    from areal_cli.models.decoder import DecoderConfig, DecoderLM
    from areal_cli.trainer import attention

    torch.manual_seed(0)
    cfg = DecoderConfig.from_dict(
        {
            "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128,
            "tie_word_embeddings": True,
        }
    )  # fmt: skip
    model = DecoderLM(cfg).float()
    model.attention = attention.installed()
    return model


def _batch():
    from areal_cli.rundir.batch import RolloutBatch

    torch.manual_seed(1)
    seqs = []
    for n_prompt, n_out in [(5, 3), (4, 9), (6, 2), (3, 3), (7, 6), (2, 11)]:
        seqs.append(
            {
                "input_ids": torch.randint(0, 64, (n_prompt + n_out,)),
                "loss_mask": torch.tensor([0] * n_prompt + [1] * n_out, dtype=torch.int8),
                "logprobs": -torch.rand(n_prompt + n_out) * 4,
                "versions": torch.tensor([-1] * n_prompt + [1] * n_out, dtype=torch.int32),
            }
        )
    return RolloutBatch.from_sequences(seqs, [1.0, 0.0, 1.0, 0.0, 0.5, 0.2], 2)


def _sequence_rejection() -> RejectionSamplingConfig:
    return RejectionSamplingConfig(level="sequence", lower=0.5)


VARIANTS = {
    "ppo": {},
    "decoupled": {"use_decoupled_loss": True, "ppo_n_minibatches": 2},
    "decoupled, sequence rejection": {
        "use_decoupled_loss": True, "ppo_n_minibatches": 2,
        "rejection_sampling": _sequence_rejection,
    },
    "seq_mean, dual clip": {"loss_agg_mode": "seq_mean", "c_clip": 3.0},
    "gspo": {"importance_sampling_level": "sequence"},
    "sapo": {"use_sapo_loss": True},
    "kl to the reference": {"kl_ctl": 0.1},
    "m2po": {"m2_threshold": 0.04, "use_decoupled_loss": True},
    "several micro-batches": {"mb_spec": lambda: MicroBatchSpec(max_tokens_per_mb=24)},
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_micro_batch_reads_nothing_back_from_the_device(name, monkeypatch) -> None:
    given = {k: v() if callable(v) else v for k, v in VARIANTS[name].items()}
    cfg = TrainEngineConfig(**given)
    attention.register(1)
    model = _model()
    ref = _model() if cfg.kl_ctl > 0 else None
    recorder = SyncRecorder()
    real = step._train_micro_batch
    calls = []

    def guarded(*args, **kwargs):
        calls.append(1)
        with recorder:
            return real(*args, **kwargs)

    monkeypatch.setattr(step, "_train_micro_batch", guarded)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = step.train_step(model, optimizer, None, _batch(), cfg, 1.0, ref, policy_version=2)
    assert calls and stats["loss_tokens"] > 0
    assert recorder.reads == [], "\n".join(recorder.reads)


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        assert float(grad.sum()) != 0.5  # a host read in a backward
        return grad * 2


def test_the_recorder_sees_a_host_read() -> None:
    """The guard itself: a mask index and a float() are recorded, in a backward too."""
    recorder = SyncRecorder()
    x = torch.randn(8, requires_grad=True)
    with recorder:
        _ = x[x > 0]
        _ = float(x.detach().sum())
        _ReadsInBackward.apply(x).sum().backward()
    assert len(recorder.reads) == 3
