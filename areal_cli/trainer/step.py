"""One trainer step: advantages, proximal logprobs, packed micro-batches, PPO update.

Every rank reads the whole batch (it is small next to the model) and computes the
advantages of every group itself, so no group is ever split across ranks for that. The
batch is then cut into `ppo_n_minibatches` consecutive minibatches (one optimizer step
each); inside a minibatch, rank r takes the r-th contiguous slice of sequences (slices
differ by at most one sequence when the count does not divide) and packs it into
micro-batches of at most `max_tokens_per_mb` tokens.

Collectives: every rank issues the same collectives in the same order, whatever its
sequences are. FSDP2 all-gathers in each forward and reduce-scatters in each backward, so
the ranks must run the same number of micro-batches. Each rank plans its own shard, one
all-reduce MAX gives the count every rank runs, and a rank that planned fewer re-plans
with that count as its minimum. Where its shard has fewer sequences than that, the rest
are empty micro-batches: a one-token forward (and a backward of zero) that takes part in
the collectives and adds nothing to the loss, the gradients or the stats. The proximal and
reference passes run the same plan. Statistics are reduced over a fixed set of keys.

Loss normalisation: each micro-batch loss is divided by the minibatch's GLOBAL number of
loss tokens (or sequences, for seq_mean), computed identically on every rank from the
full batch, and multiplied by the number of ranks that hold different tokens (dp x cp)
because FSDP averages gradients over them. So the gradient is the same however the batch
is split over ranks and micro-batches.

Layouts (`StepLayout`, from the trainer's mesh): sequences are split over the dp ranks
only; the ranks of one tensor-parallel group see the same tokens and compute the same
loss, from logits split over the vocabulary (`losses.VocabShard`). Per-token sums are
reduced over one rank per token (dp x cp), so tp replicas are not counted twice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from areal_cli.config.schema import NormConfig, TrainEngineConfig
from areal_cli.rundir.batch import RolloutBatch
from areal_cli.trainer import advantages, attention, collectives, losses
from areal_cli.trainer.layout import StepLayout
from areal_cli.trainer.packing import pack_sequences, plan_micro_batches, to_device

Beat = Callable[[str], None]
PROX_APPROXIMATIONS = ("loglinear", "linear", "rollout")  # logged by prox_logp_method: metrics


def _no_beat(phase: str) -> None:
    pass


@dataclass
class _Shard:
    """This rank's sequences of one minibatch, packed into micro-batches.

    `micro_batches[j]` holds indices into the shard; an empty list is a micro-batch that
    only takes part in the collectives."""

    micro_batches: list[list[int]]
    padding_fraction: float
    replanned: bool = False  # this rank planned fewer micro-batches than another rank


def split_range(n: int, parts: int, index: int) -> range:
    """The `index`-th of `parts` contiguous slices of range(n); the first n % parts slices
    hold one item more than the others."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def label_space(tokens: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The per-token tensors of packed sequences, shifted so that position p carries what
    belongs to the token after it (its label, mask, behaviour logprob and version): the
    logits at p are scored on it. A sequence's last position has no label (IGNORE); its
    first token has no position, and it is a prompt token, never trained."""

    def shifted(key: str, fill: float) -> torch.Tensor:
        return torch.cat([torch.cat([t[key][1:], t[key].new_full((1,), fill)]) for t in tokens])

    packed = pack_sequences([t["input_ids"] for t in tokens])
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "seq_ids": packed.seq_ids,
        "labels": shifted("input_ids", losses.IGNORE),
        "loss_mask": shifted("loss_mask", 0),
        "logprobs": shifted("logprobs", 0.0),
        "versions": shifted("versions", -1),
        # masked tokens of each whole sequence, for seq_mean when a sequence is split
        "seq_counts": torch.tensor([float(t["loss_mask"][1:].sum()) for t in tokens]),
        "real": torch.ones(len(packed.input_ids), dtype=torch.bool),
    }


def _slice_for_context_parallel(mb: dict[str, torch.Tensor], layout: StepLayout) -> slice:
    """Pad the micro-batch to a multiple of cp with a filler sequence (no labels, no loss)
    and return this rank's slice of positions."""
    pad = attention.pad_to_multiple(len(mb["input_ids"]), layout.cp_size)
    if pad:
        filler = {
            "input_ids": torch.zeros(pad, dtype=mb["input_ids"].dtype),
            "position_ids": torch.arange(pad, dtype=mb["position_ids"].dtype),
            "seq_ids": torch.full((pad,), len(mb["seq_counts"]), dtype=mb["seq_ids"].dtype),
            "labels": torch.full((pad,), losses.IGNORE, dtype=mb["labels"].dtype),
            "loss_mask": torch.zeros(pad, dtype=mb["loss_mask"].dtype),
            "logprobs": torch.zeros(pad, dtype=mb["logprobs"].dtype),
            "versions": torch.full((pad,), -1, dtype=mb["versions"].dtype),
            "real": torch.zeros(pad, dtype=torch.bool),
        }
        for key, extra in filler.items():
            mb[key] = torch.cat([mb[key], extra])
        mb["seq_counts"] = torch.cat([mb["seq_counts"], torch.ones(1)])  # the filler's (no loss)
    return attention.local_slice(len(mb["input_ids"]), layout.cp_size, layout.cp_rank)


@dataclass
class DeviceBatch:
    """A packed micro-batch ready to run: its label-space tensors (`label_space`; this
    rank's slice under context parallelism, plus `seq_counts`) on the model's device, and
    the attention's planned context. Everything the forward needs from the host is here,
    so the forward and backward need no host sync."""

    tensors: dict[str, torch.Tensor]
    context: Any  # attention._Context


def device_batch(
    model: nn.Module, batch: RolloutBatch, seqs: list[int], layout: StepLayout
) -> DeviceBatch:
    """Pack `seqs`, slice them for this rank, plan the attention, and copy both to the
    model's device without waiting (`packing.to_device`)."""
    mb = label_space([batch.sequence(i) for i in seqs])
    device = next(model.parameters()).device
    here = _slice_for_context_parallel(mb, layout) if layout.cp_size > 1 else slice(None)
    local = {k: to_device(v[here], device) for k, v in mb.items() if k != "seq_counts"}
    local["seq_counts"] = to_device(mb["seq_counts"], device)
    context = layout.attention.prepare(layout.cp_group, layout.cp_size, mb["seq_ids"], device)
    return DeviceBatch(local, context)


def forward_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    seqs: list[int],
    temperature: float,
    layout: StepLayout,
    support: torch.Tensor | None = None,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Packed forward over `seqs`, in label space (`label_space`); with context
    parallelism, over this rank's slice of the positions. Returns (logprobs of the labels,
    entropy (None with `entropy=False`: a pass over the logits, and collectives under
    tensor parallelism, saved where nobody logs it), the per-position tensors of the
    slice, plus `seq_counts`, and with `support` (token ids) `support_logp`: each
    position's mean logprob over them)."""
    ready = device_batch(model, batch, seqs, layout)
    return logprobs_of(model, ready, temperature, layout, support, entropy)


def logprobs_of(
    model: nn.Module,
    ready: DeviceBatch,
    temperature: float,
    layout: StepLayout,
    support: torch.Tensor | None = None,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """`forward_logprobs` of a micro-batch already on the device."""
    local = dict(ready.tensors)
    with layout.attention.running(ready.context):
        logits = model(
            input_ids=local["input_ids"][None],
            position_ids=local["position_ids"][None],
            use_cache=False,  # load-bearing: with a cache transformers ignores packing
        ).logits[0]  # in the model's dtype: the float32 math runs chunk by chunk
    logp, ent = losses.label_logprobs_and_entropy(
        logits, local["labels"], temperature, layout.vocab, entropy
    )
    if support is not None:
        local["support_logp"] = losses.support_logprob_mean(
            logits, to_device(support, logits.device), layout.vocab
        )
    return logp, ent, local


def _label_tensors(run: _StepRun, seqs: list[int]) -> dict[str, torch.Tensor]:
    """The label-space tensors of `seqs` that this rank's forward sees (its slice under
    context parallelism), on the CPU, without a forward."""
    mb = label_space([run.batch.sequence(i) for i in seqs])
    here = _slice_for_context_parallel(mb, run.layout) if run.layout.cp_size > 1 else slice(None)
    return {k: v[here] for k, v in mb.items() if k != "seq_counts"}


def empty_forward(model: nn.Module, layout: StepLayout) -> torch.Tensor:
    """The forward of an empty micro-batch: one token (per context-parallel rank), so every
    FSDP unit gathers its parameters; returns a zero connected to them, whose backward
    reduce-scatters zeros."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    with layout.attention.micro_batch(
        layout.cp_group, layout.cp_size, torch.arange(layout.cp_size), device
    ):
        out = model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
    logits = out if torch.is_tensor(out) else out.logits  # a scalar head returns its scores
    return logits.float().sum() * 0.0


def seq_advantages(batch: RolloutBatch, cfg: TrainEngineConfig) -> torch.Tensor:
    """Per-sequence advantages of the whole batch (given, or from rewards: the estimator's
    preset, or with adv_estimator custom the recipe's reward_norm and adv_norm, this one
    weighted by each sequence's trained tokens)."""
    if batch.advantages is not None:
        return batch.advantages.float()
    if cfg.adv_estimator == "custom":
        reward_norm, adv_norm = norm_of(cfg.reward_norm), norm_of(cfg.adv_norm)
    else:
        reward_norm, adv_norm = advantages.PRESETS[cfg.adv_estimator], advantages.Norm()
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(batch.seqlens)), batch.seqlens.long(), output_size=len(batch.loss_mask)
    )
    trained = torch.zeros(len(batch.seqlens)).index_add_(0, seq_of_token, batch.loss_mask.float())
    overlong = None
    if cfg.overlong_reward_penalty:
        if not batch.max_new_tokens:
            raise ValueError("the overlong penalty needs the batch's max_new_tokens")
        overlong = advantages.Overlong(
            batch.max_new_tokens, cfg.overlong_tokens, cfg.overlong_penalty_factor
        )
    return advantages.advantages(
        batch.rewards.float(), batch.groups, reward_norm, adv_norm, trained,
        scaling=cfg.reward_scaling, bias=cfg.reward_bias, clip=cfg.reward_clip,
        overlong=overlong, zero_if=batch.truncated if cfg.mask_no_eos_with_zero else None,
    )  # fmt: skip


def norm_of(section: NormConfig) -> advantages.Norm:
    """The recipe's reward_norm or adv_norm section as a Norm."""
    return advantages.Norm(
        section.mean_level, section.std_level, section.mean_leave1out,
        section.std_unbiased, section.eps,
    )  # fmt: skip


class _SavedForBackward:
    """Counts the bytes autograd keeps for backward during a forward, each storage once
    and parameters not at all: the activation memory of one micro-batch, exactly."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self) -> _SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter):
            local = getattr(tensor, "_local_tensor", tensor)
            try:
                storage = local.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # no storage of its own (a collective's pending result)
                key, size = id(local), local.numel() * local.element_size()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += size
        return tensor


class Stats:
    """Sums and maxima over a fixed set of keys, all-reduced once at the end of the step.

    The keys come from the config, never from what a rank happened to see, so every rank
    reduces tensors of the same length. A value may be a float or a 0-d tensor on the
    model's device: sums of tensors stay there until the reduction (no host sync per
    micro-batch), which moves them to the group's device (trainer.collectives)."""

    def __init__(self, sum_keys: list[str], max_keys: list[str]) -> None:
        self.sums: dict[str, Any] = dict.fromkeys(sum_keys, 0.0)
        self.maxes: dict[str, Any] = dict.fromkeys(max_keys, -math.inf)

    def add(self, key: str, value: Any) -> None:
        if torch.is_tensor(value):
            value = value.detach().to(torch.float64)
        self.sums[key] = self.sums[key] + value

    def max(self, key: str, value: Any) -> None:
        current = self.maxes[key]
        if torch.is_tensor(value):  # stays on its device, like the sums
            value = value.detach().to(torch.float64)
            if torch.is_tensor(current):
                self.maxes[key] = torch.maximum(value, current)
            else:
                self.maxes[key] = value.clamp(min=current)
        elif torch.is_tensor(current):
            self.maxes[key] = current.clamp(min=float(value))
        else:
            self.maxes[key] = max(current, float(value))

    def reduce(self, group: Any = None) -> dict[str, float]:
        sums = collectives.reduce_values(list(self.sums.values()), "sum", group)
        maxes = collectives.reduce_values(list(self.maxes.values()), "max", group)
        out = dict(zip(self.sums, sums, strict=True))
        # A maximum over no token at all is reported as 0, like the per-micro-batch stats.
        out.update(
            (k, v if math.isfinite(v) else 0.0) for k, v in zip(self.maxes, maxes, strict=True)
        )
        return out


def _stat_keys(
    cfg: TrainEngineConfig, critic: ValueModel | None = None, distill: bool = False
) -> tuple[list[str], list[str]]:
    sums = ["loss", "loss_tokens", "tokens", "entropy_sum", "clip_frac_sum", "behav_logprob_sum"]
    if critic is not None:
        sums += critic.stat_keys
    sums += ["padding_fraction_sum", "replanned_shards", "empty_micro_batches"]
    maxes = ["activation_bytes"]
    if cfg.kl_ctl > 0:
        sums.append("kl_sum")
    if cfg.c_clip is not None:
        sums.append("dual_clip_frac_sum")
    if cfg.use_decoupled_loss and not cfg.use_sapo_loss:
        sums += ["imp_weight_sum", "imp_weight_dropped", "imp_weight_clamped", "behave_kl_sum"]
        maxes.append("imp_weight_max")
        if cfg.prox_logp_method == "metrics":
            sums += [f"prox_{name}_abs_err" for name in PROX_APPROXIMATIONS]
            sums.append("prox_compared")
    if cfg.m2_threshold is not None:
        sums.append("m2_dropped")
    if distill:
        sums.append("distill_kl_sum")
    return sums, maxes


class ValueModel(Protocol):
    """What the actor's step asks of a value model: the PPO critic
    (areal_cli.trainer.critic.Critic) implements it. The step never imports the critic, so
    the critic can use the step's machinery (packing, micro-batch plans) without a cycle."""

    stat_keys: list[str]  # its per-token sums, reduced with the actor's

    def targets(
        self, batch: RolloutBatch, shards, plans, cfg: TrainEngineConfig, layout, beat, stats
    ) -> list[list[Any]]:
        """Per micro-batch of this rank, before any update: an object whose `advantages`
        (per position, label space) the actor's loss takes."""
        ...

    def update(self, batch, minibatch, shard, plan, row, layout, beat, stats) -> list[float]:
        """Its own optimizer steps on one minibatch, after the actor's; the grad norms."""
        ...

    def skip_minibatch(self) -> None:
        """A minibatch without sequences (the same on every rank): its schedule steps."""
        ...

    def finish_stats(self, out: dict[str, float], grad_norms: list[float]) -> dict[str, float]:
        """Its figures from the reduced sums (popping its `stat_keys`)."""
        ...


@dataclass
class Teacher:
    """On-policy distillation (the teacher section): the frozen teacher, sharded like the
    actor, and the weights of the RL and distillation losses."""

    model: nn.Module
    rl_loss_weight: float = 1.0
    distill_loss_weight: float = 0.005


@dataclass
class _StepRun:
    """What every pass of one step reads: the batch cut into minibatches, this rank's
    shard of each and its agreed micro-batch plan, and the stats being summed."""

    model: nn.Module
    batch: RolloutBatch
    cfg: TrainEngineConfig
    temperature: float
    layout: StepLayout
    beat: Beat
    stats: Stats
    minibatches: list[list[int]]
    shards: list[list[int]]
    plans: list[_Shard]
    distill: Teacher | None = None

    @property
    def n_minibatches(self) -> int:
        return len(self.minibatches)


@dataclass
class _Inputs:
    """What the update's losses take beside the model's own logprobs, computed before the
    first update: per-sequence advantages, or the critic's per-token targets; the proximal
    and reference logprobs of every micro-batch (None where not needed)."""

    adv_seq: torch.Tensor | None
    targets: list[list[Any]] | None
    prox: list[list[torch.Tensor | None]] | None
    ref: list[list[torch.Tensor | None]] | None
    m2_cutoffs: list[float] | None = None  # M2PO: per minibatch, keep m2 <= it
    version: int | None = None  # the weights' version as the step starts (the proximal's)
    teacher: list[list[torch.Tensor | None]] | None = None  # on-policy distillation
    on_policy: bool = False  # every generated token came from the weights of `version`


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batch: RolloutBatch,
    cfg: TrainEngineConfig,
    temperature: float,
    ref_model: nn.Module | None = None,
    beat: Beat = _no_beat,
    layout: StepLayout | None = None,
    critic: ValueModel | None = None,
    policy_version: int | None = None,
    teacher: Teacher | None = None,
) -> dict[str, float]:
    """Run one PPO step on `batch` (collective over every trainer rank).

    `ref_model` (frozen, same sharding) is required when `cfg.kl_ctl > 0`. `beat` is told
    each phase as it starts (the heartbeat that the controller's watchdog reads). `layout`
    says how this rank takes part (default: data parallel over the whole world). With a
    `critic` (a `ValueModel`), advantages are per token by GAE, and the critic takes its
    own optimizer step after the actor's in every minibatch. `policy_version` is the
    version of the model's weights now: when every generated token of the batch came from
    it, the proximal policy is the behaviour policy. With a `teacher` (its frozen
    model, sharded like the actor, and the loss weights), the loss adds the student's
    reverse KL to it (on-policy distillation, `losses.reverse_kl_loss`).

    The proximal policy of decoupled PPO is the model as the step starts. With one
    minibatch, the step's own training forward runs on exactly those weights (nothing is
    updated before it), so its detached logprobs are the proximal ones and no separate
    pass is made. With more minibatches, an on-policy batch takes the behaviour logprobs
    as proximal, and any other batch pays one no-grad pass before the first update.
    """
    layout = layout or StepLayout.data_parallel()
    if cfg.kl_ctl > 0 and ref_model is None:
        raise ValueError("actor.kl_ctl > 0 needs a reference model")
    temperature = temperature if temperature > 0 else 1.0
    run = _plan_step(model, batch, cfg, temperature, layout, beat, critic, teacher)
    inputs = _before_update(run, ref_model, critic, policy_version)
    grad_norms, critic_norms = [], []
    for m in range(run.n_minibatches):
        if not run.minibatches[m]:  # fewer sequences than minibatches: the same on every rank
            if scheduler is not None:
                scheduler.step()
            if critic is not None:
                critic.skip_minibatch()
            continue
        _train_minibatch(run, m, inputs)
        beat("optimizer step" + _of(m, run.n_minibatches))
        grad_norms.append(optimizer_step(model, optimizer, cfg.optimizer.gradient_clipping))
        if scheduler is not None:
            scheduler.step()
        if critic is not None:
            mb_args = (run.minibatches[m], run.shards[m], run.plans[m], inputs.targets[m])
            critic_norms += critic.update(batch, *mb_args, layout, beat, run.stats)
    return _step_stats(run, grad_norms, critic_norms, optimizer, critic)


def _plan_step(model, batch, cfg, temperature, layout, beat, critic, teacher=None) -> _StepRun:
    """Cut the batch into minibatches and this rank's shards, and agree on their plans."""
    n = cfg.ppo_n_minibatches
    minibatches = [list(split_range(batch.n_seqs, n, m)) for m in range(n)]
    shards = [
        [mb[i] for i in split_range(len(mb), layout.dp_size, layout.dp_rank)] for mb in minibatches
    ]
    stats = Stats(*_stat_keys(cfg, critic, teacher is not None))
    beat("plan micro-batches")
    plans = agree_on_micro_batches(batch, shards, cfg)
    return _StepRun(
        model, batch, cfg, temperature, layout, beat, stats, minibatches, shards, plans, teacher
    )


def _before_update(
    run: _StepRun,
    ref_model: nn.Module | None,
    critic: ValueModel | None,
    version: int | None,
) -> _Inputs:
    """The passes before the first update, in this order on every rank: the proximal
    logprobs (when needed, see train_step), the reference's, the teacher's, the critic's
    targets."""
    cfg = run.cfg
    adv_seq = seq_advantages(run.batch, cfg) if critic is None else None
    on_policy = version is not None and is_on_policy(run.batch, version)
    prox, cutoffs = None, None
    m2po = cfg.m2_threshold is not None and not on_policy  # on policy: every m2 is 0
    stale = cfg.use_decoupled_loss and not on_policy and run.n_minibatches > 1
    if m2po or (stale and cfg.prox_logp_method != "loglinear"):
        # minibatch 0 trains on the step's first weights, the proximal ones: its own
        # forward gives them, unless M2PO needs them before that forward
        prox = _no_grad_logprobs(run.model, run, "proximal", skip_first=not m2po)
    if m2po:
        cutoffs = [_m2_cutoff(run, m, row, cfg.m2_threshold) for m, row in enumerate(prox)]
    ref = _no_grad_logprobs(ref_model, run, "reference") if cfg.kl_ctl > 0 else None
    teacher = run.distill
    teacher_logp = _no_grad_logprobs(teacher.model, run, "teacher") if teacher else None
    targets = None
    if critic is not None:
        targets = critic.targets(
            run.batch, run.shards, run.plans, cfg, run.layout, run.beat, run.stats
        )
    return _Inputs(adv_seq, targets, prox, ref, cutoffs, version, teacher_logp, on_policy)


def _m2_cutoff(run: _StepRun, m: int, prox: list[torch.Tensor | None], threshold: float) -> float:
    """M2PO's cutoff for minibatch `m` (losses.m2_cutoff) over the second moments of its
    trained tokens on every rank that holds other tokens (collective, the same on all)."""
    values = [torch.zeros(0, dtype=torch.float64)]
    for j, mb in enumerate(run.plans[m].micro_batches):
        if mb and prox[j] is not None:
            t = _label_tensors(run, [run.shards[m][i] for i in mb])
            mask = t["loss_mask"].bool()
            values.append(((prox[j].cpu() - t["logprobs"]) ** 2)[mask].double())
    mine = torch.cat(values)
    everyone = collectives.all_gather_object(mine, run.layout.stats_group)
    return losses.m2_cutoff(torch.cat(everyone), threshold)


def _train_minibatch(run: _StepRun, m: int, inputs: _Inputs) -> None:
    """Forward and backward of every micro-batch of minibatch `m` (gradients accumulate)."""
    normalizer = global_normalizer(run.batch, run.minibatches[m], run.cfg.loss_agg_mode)
    plan, layout = run.plans[m], run.layout
    n_mbs = len(plan.micro_batches)
    for j, mb in enumerate(plan.micro_batches):
        run.beat(f"train mb {j + 1}/{n_mbs}" + _of(m, run.n_minibatches))
        if not mb:
            (empty_forward(run.model, layout) * layout.data_world).backward()
            continue
        seqs = [run.shards[m][i] for i in mb]
        ready = device_batch(run.model, run.batch, seqs, layout)
        _train_micro_batch(run, (m, j), seqs, ready, inputs, normalizer)


def _train_micro_batch(
    run: _StepRun,
    at: tuple[int, int],
    seqs: list[int],
    ready: DeviceBatch,
    inputs: _Inputs,
    normalizer: int,
) -> None:
    """Forward, loss, backward and stats of one micro-batch already on the device: no
    host sync in here (tests/unit/test_no_host_sync.py holds it to that)."""
    with _SavedForBackward() as saved:
        logp, entropy, t = logprobs_of(run.model, ready, run.temperature, run.layout)
    run.stats.max("activation_bytes", saved.bytes)
    loss, lstats = _micro_batch_loss(run, at, seqs, logp, t, inputs, normalizer)
    (loss * run.layout.data_world).backward()
    _record(run.stats, loss, lstats, entropy, t["loss_mask"].bool(), t)


def _micro_batch_loss(
    run: _StepRun,
    at: tuple[int, int],
    seqs: list[int],
    logp: torch.Tensor,
    t: dict,
    inputs: _Inputs,
    normalizer: int,
) -> tuple[torch.Tensor, dict]:
    """The PPO loss (decoupled or plain, plus KL) of micro-batch j of minibatch m (`at`),
    normalised by the minibatch's global count (`normalizer`)."""
    cfg, (m, j) = run.cfg, at
    mask = t["loss_mask"].bool()
    if inputs.targets is not None:
        adv = inputs.targets[m][j].advantages.to(logp.device)  # per token, from the critic
    else:
        # one more value (0) for the filler sequence a context-parallel micro-batch may end with
        adv_seq = inputs.adv_seq
        values = to_device(torch.cat([adv_seq[seqs], adv_seq.new_zeros(1)]), logp.device)
        adv = losses.broadcast_to_tokens(values, mask, t["seq_ids"])
    clip = {"eps_clip": cfg.eps_clip, "eps_clip_higher": cfg.eps_clip_higher, "c_clip": cfg.c_clip}
    if cfg.importance_sampling_level == "sequence":  # GSPO (context parallelism is refused)
        clip["seq_ids"] = t["seq_ids"]
    proximal = _proximal(run, m, j, logp, t, inputs)
    if inputs.m2_cutoffs is not None and math.isfinite(inputs.m2_cutoffs[m]):
        kept = mask & ((proximal - t["logprobs"]) ** 2 <= inputs.m2_cutoffs[m])
        run.stats.add("m2_dropped", (mask & ~kept).sum())
        mask = kept  # dropped tokens: no loss, still counted by the normalizer (M2PO)
    if cfg.use_sapo_loss:
        tau = {"tau_pos": cfg.sapo_tau_pos, "tau_neg": cfg.sapo_tau_neg}
        loss_tok, lstats = losses.sapo_policy_loss(
            logp, t["logprobs"], adv, mask, **tau, seq_ids=clip.get("seq_ids")
        )
    elif cfg.use_decoupled_loss:
        rejection = losses.Rejection(**dataclasses.asdict(cfg.rejection()))
        loss_tok, lstats = losses.decoupled_ppo_loss(
            logp, proximal, t["logprobs"], adv, mask,
            rejection=rejection, rejection_seq_ids=t["seq_ids"], **clip,
        )  # fmt: skip
    else:
        loss_tok, lstats = losses.ppo_policy_loss(logp, t["logprobs"], adv, mask, **clip)
    if inputs.ref is not None:
        kl = losses.kl_penalty(logp, inputs.ref[m][j], mask, cfg.kl_ctl, cfg.kl_estimator)
        loss_tok = loss_tok + kl
        run.stats.add("kl_sum", (kl.detach() / cfg.kl_ctl).sum())
    if inputs.teacher is not None:
        weights = run.distill
        distill, rkl = losses.reverse_kl_loss(logp, inputs.teacher[m][j], t["logprobs"], mask)
        loss_tok = weights.rl_loss_weight * loss_tok + weights.distill_loss_weight * distill
        run.stats.add("distill_kl_sum", (rkl * mask).sum())
    loss = losses.aggregate_loss(
        loss_tok, mask, normalizer, cfg.loss_agg_mode, t["seq_ids"], t["seq_counts"]
    )
    return loss, lstats


def _proximal(run: _StepRun, m: int, j: int, logp: torch.Tensor, t: dict, inputs: _Inputs):
    """The proximal logprobs of micro-batch j of minibatch m: the policy as the step
    starts. With one minibatch, its own forward runs on those weights. With more, an
    on-policy batch takes the behaviour logprobs in every minibatch; otherwise minibatch
    0's forward gives them, and later minibatches take them from the proximal pass, or
    under prox_logp_method: loglinear from AReaL's interpolation (losses.loglinear_proximal)."""
    if run.n_minibatches == 1:  # nothing is updated before this forward
        return logp.detach()
    if inputs.on_policy:
        return t["logprobs"]
    if m == 0:  # still the step's first weights
        return logp.detach()
    if inputs.prox is not None and inputs.prox[m][j] is not None:
        exact = inputs.prox[m][j].to(logp.device)
        if run.cfg.prox_logp_method == "metrics":
            _approximation_errors(run, logp, t, exact, inputs.version)
        return exact
    if run.cfg.prox_logp_method == "loglinear" and inputs.version is not None:
        return losses.loglinear_proximal(logp, t["logprobs"], t["versions"], inputs.version)
    return t["logprobs"]  # no use_decoupled_loss: the behaviour policy


def _approximation_errors(run: _StepRun, logp, t: dict, exact, version) -> None:
    """prox_logp_method: metrics: how far each approximation of the proximal logprobs is
    from the recomputed ones, summed over the trained tokens (AReaL's metrics mode)."""
    mask = t["loss_mask"].bool()
    guesses = {  # the order of PROX_APPROXIMATIONS
        "loglinear": losses.loglinear_proximal(logp, t["logprobs"], t["versions"], version),
        "linear": losses.linear_proximal(logp, t["logprobs"], t["versions"], version),
        "rollout": t["logprobs"],
    }
    for name, guess in guesses.items():
        run.stats.add(f"prox_{name}_abs_err", ((guess - exact).abs() * mask).sum())
    run.stats.add("prox_compared", mask.sum())


def _step_stats(
    run: _StepRun,
    grad_norms: list[float],
    critic_norms: list[float],
    optimizer: torch.optim.Optimizer,
    critic: ValueModel | None,
) -> dict[str, float]:
    """The step's figures: the plans' counts, then every sum reduced once."""
    stats = run.stats
    for plan in run.plans:
        stats.add("padding_fraction_sum", plan.padding_fraction)
        stats.add("replanned_shards", plan.replanned)
        stats.add("empty_micro_batches", sum(1 for mb in plan.micro_batches if not mb))
    run.beat("reduce stats")
    out = stats.reduce(run.layout.stats_group)
    result = critic.finish_stats(out, critic_norms) if critic is not None else {}
    world = run.layout.data_world
    result.update(_finish_stats(out, grad_norms, run.batch, world, run.n_minibatches, optimizer))
    return result


def _of(m: int, n_minibatches: int) -> str:
    return f" of minibatch {m + 1}/{n_minibatches}" if n_minibatches > 1 else ""


def agree_on_micro_batches(
    batch: RolloutBatch, shards: list[list[int]], cfg: TrainEngineConfig
) -> list[_Shard]:
    """Plan each minibatch's shard so that every rank runs the same number of micro-batches.

    One all-reduce MAX over the ranks' own counts (one value per minibatch) gives the
    count K. A rank that planned fewer re-plans with K as its minimum, which spreads its
    sequences over more, smaller micro-batches; where that still gives fewer than K (fewer
    sequences than K), or where the greedy packing overshoots K, it pads its own plan
    with empty micro-batches."""
    lengths = [[int(batch.seqlens[i]) for i in shard] for shard in shards]
    return agree_on_plans(lengths, cfg)


def agree_on_plans(lengths: list[list[int]], cfg: TrainEngineConfig) -> list[_Shard]:
    """`agree_on_micro_batches` for items of the given lengths (one list per minibatch):
    sequences, or units that must share a micro-batch, such as a preference pair."""
    spec = cfg.mb_spec
    own = [plan_micro_batches(ls, spec.max_tokens_per_mb, spec.n_mbs) for ls in lengths]
    counts = collectives.reduce_values([len(p.mbs) for p in own], "max")
    plans = []
    for ls, plan, k in zip(lengths, own, (int(c) for c in counts), strict=True):
        short = len(plan.mbs) < k
        if short:
            again = plan_micro_batches(ls, spec.max_tokens_per_mb, k)
            plan = again if len(again.mbs) <= k else plan
        padded = plan.mbs + [[] for _ in range(k - len(plan.mbs))]
        plans.append(_Shard(padded, plan.padding_fraction, short))
    return plans


def is_on_policy(batch: RolloutBatch, version: int) -> bool:
    """Every generated token of `batch` came from weights `version` (the same answer on
    every rank: each reads the whole batch)."""
    generated = batch.loss_mask.bool()
    return bool((batch.versions[generated] == version).all())


@torch.no_grad()
def _no_grad_logprobs(
    model: nn.Module, run: _StepRun, name: str, skip_first: bool = False
) -> list[list[torch.Tensor | None]]:
    """Logprobs of every micro-batch under `model` as it is now: the proximal policy
    (current weights before this step's update, for decoupled PPO) or the reference.
    `skip_first`: none for minibatch 0 (all None; every rank skips it alike)."""
    out = []
    for m, (shard, plan) in enumerate(zip(run.shards, run.plans, strict=True)):
        row: list[torch.Tensor | None] = []
        if skip_first and m == 0:
            out.append([None] * len(plan.micro_batches))
            continue
        for j, mb in enumerate(plan.micro_batches):
            run.beat(f"{name} mb {j + 1}/{len(plan.micro_batches)}" + _of(m, len(run.plans)))
            if mb:
                seqs = [shard[i] for i in mb]
                logp, _, _ = forward_logprobs(
                    model, run.batch, seqs, run.temperature, run.layout, entropy=False
                )
                row.append(logp)
            else:
                empty_forward(model, run.layout)
                row.append(None)
        out.append(row)
    return out


def global_normalizer(batch: RolloutBatch, seqs: list[int], mode: str) -> int:
    masks = [batch.sequence(i)["loss_mask"] for i in seqs]
    one_sequence_each = [torch.zeros(len(m), dtype=torch.long) for m in masks]
    return max(1, losses.loss_normalizer(masks, mode, one_sequence_each))


def _record(stats: Stats, loss, lstats: dict, entropy, mask, t: dict) -> None:
    """Add a micro-batch's figures to the sums; every value stays where it was computed
    (no host sync between micro-batches)."""
    n_tok = mask.sum()
    stats.add("loss", loss.detach())
    stats.add("loss_tokens", n_tok)
    stats.add("tokens", t["real"].sum())
    stats.add("entropy_sum", (entropy * mask).sum())
    stats.add("clip_frac_sum", lstats["clip_frac"] * n_tok)
    if "dual_clip_frac" in lstats:
        stats.add("dual_clip_frac_sum", lstats["dual_clip_frac"] * n_tok)
    if "imp_weight_mean" in lstats:
        stats.add("imp_weight_sum", lstats["imp_weight_mean"] * n_tok)
        stats.max("imp_weight_max", lstats["imp_weight_max"])
        stats.add("imp_weight_dropped", lstats["imp_weight_drop_frac"] * n_tok)
        stats.add("imp_weight_clamped", lstats["imp_weight_clamp_frac"] * n_tok)
        kept = n_tok * (1.0 - lstats["imp_weight_drop_frac"])
        stats.add("behave_kl_sum", lstats["behave_approx_kl"] * kept)
    stats.add("behav_logprob_sum", (t["logprobs"] * mask).sum())


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, clip: float) -> float:
    # Every parameter that takes part in the forward has a gradient on every rank (empty
    # micro-batches included), so the norm's collectives see the same tensors everywhere.
    params = [p for p in model.parameters() if p.grad is not None]
    norm = grad_norm([p.grad for p in params])
    if clip > 0 and norm > clip:
        scale = clip / (norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm of gradients that may be DTensors on different meshes (FSDP2's
    dp x cp mesh for some parameters, dp x cp by tp for tensor-parallel ones), as
    `clip_grad_norm_` would give on one process. Each rank sums the squares of the blocks
    it is the primary holder of (`is_primary_block`: replicas are counted once), on the
    group's device (one host sync in all, after the reduction), then one all-reduce over
    the world: a single reduction, so every rank gets the same bits and clips by the same
    factor."""
    total = torch.zeros((), dtype=torch.float64, device=collectives.device())
    for g in grads:
        if is_primary_block(g):
            local = g.to_local() if hasattr(g, "to_local") else g
            total += local.double().pow(2).sum().to(total.device)
    return float(collectives.all_reduce(total).sqrt())


def is_primary_block(t: torch.Tensor) -> bool:
    """Whether this rank's piece of `t` is the one to count (or write) among its copies.

    A DTensor's mesh covers the ranks that hold different pieces of it, plus Replicate
    dims; ranks outside its mesh hold the same pieces again (FSDP-only parameters on the
    dp x cp mesh of each tp coordinate). Every copy set partitions the world, so exactly
    one contains rank 0: its ranks are primary, at coordinate 0 of any Replicate dim. A
    plain tensor is the same everywhere: rank 0's copy is primary."""
    rank = collectives.rank()
    if not hasattr(t, "device_mesh"):
        return rank == 0
    mesh, placements = t.device_mesh, tuple(t.placements)
    if any(p.is_partial() for p in placements):
        raise ValueError("a Partial DTensor has no blocks of its own")
    if 0 not in mesh.mesh.flatten().tolist():
        return False
    return all(
        not p.is_replicate() or mesh.get_local_rank(i) == 0 for i, p in enumerate(placements)
    )


def _finish_stats(out, grad_norms, batch, world, n_minibatches, optimizer) -> dict[str, float]:
    loss_tokens = max(out.pop("loss_tokens"), 1.0)
    result = {
        "loss": out.pop("loss"),
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "clip_frac": out.pop("clip_frac_sum") / loss_tokens,
        "entropy": out.pop("entropy_sum") / loss_tokens,
        "behav_logprob_mean": out.pop("behav_logprob_sum") / loss_tokens,
        "tokens": out.pop("tokens"),
        "loss_tokens": loss_tokens,
        "padding_fraction": out.pop("padding_fraction_sum") / (world * n_minibatches),
        # (rank, minibatch) shards that re-planned to match another rank's micro-batch
        # count, and the empty micro-batches that took part in collectives only
        "replanned_shards": out.pop("replanned_shards"),
        "empty_micro_batches": out.pop("empty_micro_batches"),
        "reward_mean": float(batch.rewards.mean()) if batch.n_seqs else 0.0,
        "lr": optimizer.param_groups[0]["lr"],
    }
    result["activation_bytes"] = out.pop("activation_bytes")  # largest micro-batch, any rank
    if "kl_sum" in out:
        result["kl"] = out.pop("kl_sum") / loss_tokens
    if "dual_clip_frac_sum" in out:
        result["dual_clip_frac"] = out.pop("dual_clip_frac_sum") / loss_tokens
    if "imp_weight_sum" in out:
        result["imp_weight_mean"] = out.pop("imp_weight_sum") / loss_tokens
        result["imp_weight_max"] = out.pop("imp_weight_max")
        # actor.rejection_sampling: the shares of trained tokens it dropped or clamped
        dropped = out.pop("imp_weight_dropped")
        result["rejected_frac"] = dropped / loss_tokens
        result["clamped_frac"] = out.pop("imp_weight_clamped") / loss_tokens
        kept = max(loss_tokens - dropped, 1.0)
        # AReaL's behave_approx_kl: the mean of log(prox / behav) over the kept tokens
        result["behave_approx_kl"] = out.pop("behave_kl_sum") / kept
    if "prox_compared" in out:  # prox_logp_method: metrics, over the recomputed tokens
        compared = max(out.pop("prox_compared"), 1.0)
        for name in PROX_APPROXIMATIONS:
            result[f"prox_{name}_abs_err"] = out.pop(f"prox_{name}_abs_err") / compared
    if "distill_kl_sum" in out:  # the student's per-token reverse KL to the teacher
        result["distill_kl"] = out.pop("distill_kl_sum") / loss_tokens
    if "m2_dropped" in out:  # M2PO: the share of trained tokens its filter dropped
        result["m2_drop_frac"] = out.pop("m2_dropped") / loss_tokens
    return result
