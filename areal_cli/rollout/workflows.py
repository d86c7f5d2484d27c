"""Episode workflows: `async def run_episode(client, sample) -> Trajectory`.

A workflow turns one dataset sample into one trajectory: the tokens it generated (with
the behaviour logprob and weight version of every generated token), the tokens it was
given (prompts, feedback), and a scalar reward. The controller runs `group_size` episodes
per prompt. Built in: `single_turn` and `multi_turn` (answer, get feedback, answer again).
A recipe may name its own as `module:function`, in a .py file beside the recipe; it
receives the same `EpisodeClient` and sample dict and returns a `Trajectory`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_cli.config.recipe_code import load_function
from areal_cli.config.schema import GenerationHyperparameters


@dataclass
class Turn:
    """One generation: output tokens, their logprobs and the versions that made them."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: str


@dataclass
class Trajectory:
    """Everything the trainer needs about one episode."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    reward_failed: bool = False
    reward_timed_out: bool = False
    text: str = ""
    n_turns: int = 0
    truncated: bool = False  # its last turn stopped at max_new_tokens (no EOS)

    def add_context(self, ids: list[int]) -> None:
        """Tokens the policy did not generate (prompt, feedback): never trained."""
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_turn(self, turn: Turn) -> None:
        """Generated tokens: trained, with their behaviour logprobs and versions."""
        self.input_ids += turn.output_ids
        self.loss_mask += [1] * len(turn.output_ids)
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.n_turns += 1
        self.truncated = turn.finish_reason == "length"

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among generated tokens (what staleness counts)."""
        generated = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(generated) if generated else 0


def token_versions(meta: dict[str, Any], n: int) -> list[int]:
    """Per-token versions from SGLang's `weight_versions` spans, else `weight_version`."""
    spans = meta.get("weight_versions")
    if spans:
        versions = [int(meta.get("weight_version", 0))] * n
        for span in spans:
            for i in range(int(span["start"]), min(int(span["end"]), n)):
                versions[i] = int(span["version"])
        return versions
    return [int(meta.get("weight_version", 0))] * n


class EpisodeClient:
    """What a workflow may use: generation, the tokenizer, and the reward."""

    def __init__(
        self,
        inference: Any,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
        reward: Any,
        seed: int,
    ):
        self.inference = inference
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self._reward = reward
        self._seed = seed

    def next_seed(self) -> int:
        """The next sampling seed of this episode (each request takes one)."""
        self._seed += 1
        return self._seed - 1

    def sampling_params(self, **overrides: Any) -> dict[str, Any]:
        params = self.gconfig.sampling_params()
        params["sampling_seed"] = self.next_seed()
        params.update(overrides)
        return params

    async def generate(self, input_ids: list[int], **sampling: Any) -> Turn:
        """Generate from `input_ids`; returns the new tokens with logprobs and versions."""
        out = await self.inference.generate(
            input_ids, self.sampling_params(**sampling), return_logprob=True
        )
        meta = out.get("meta_info", {})
        ids = list(out.get("output_ids", []))
        logprobs = [float(lp[0]) for lp in meta.get("output_token_logprobs", [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"server returned {len(ids)} tokens but {len(logprobs)} logprobs")
        finish = (meta.get("finish_reason") or {}).get("type", "")
        return Turn(ids, logprobs, token_versions(meta, len(ids)), out.get("text", ""), finish)

    async def reward(self, text: str, sample: dict[str, Any], ids: list[int] | None = None) -> Any:
        """Score `text` against the sample's answer (RewardResult: value, error, timed_out);
        `ids`, the whole conversation's tokens, are what a model reward scores."""
        return await self._reward.score(text, str(sample["answer"]), sample.get("row", {}), ids=ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat with the generation prompt appended."""
        from areal_cli.data.prompts import chat_ids

        return chat_ids(self.tokenizer, messages)


async def single_turn(client: EpisodeClient, sample: dict[str, Any]) -> Trajectory:
    """Prompt -> one answer -> reward."""
    traj = Trajectory()
    traj.add_context(sample["prompt_ids"])
    turn = await client.generate(sample["prompt_ids"])
    traj.add_turn(turn)
    traj.text = turn.text
    ids = list(sample["prompt_ids"]) + list(turn.output_ids)
    _score(traj, await client.reward(turn.text, sample, ids))
    return traj


FEEDBACK = "That is not right. Try again; answer with the number only."


async def multi_turn(
    client: EpisodeClient, sample: dict[str, Any], max_turns: int = 2
) -> Trajectory:
    """Answer; while wrong and turns remain, append feedback and answer again.

    The reward is that of the last answer, discounted by 0.9 per retry, so a first-try
    answer is worth more than a corrected one."""
    traj = Trajectory()
    traj.add_context(sample["prompt_ids"])
    context = list(sample["prompt_ids"])
    result = None
    for attempt in range(max_turns):
        turn = await client.generate(context)
        traj.add_turn(turn)
        traj.text = turn.text
        context += turn.output_ids
        result = await client.reward(turn.text, sample, context)
        if result.value > 0 or attempt == max_turns - 1:
            break
        feedback = _feedback_ids(client, turn)
        traj.add_context(feedback)
        context += feedback
    _score(traj, result, discount=0.9 ** (traj.n_turns - 1))
    return traj


def _feedback_ids(client: EpisodeClient, turn: Turn) -> list[int]:
    """Tokens that close the answer, add the feedback as a user turn, and open a new answer.

    Found by rendering a placeholder conversation with the chat template and taking what
    follows the placeholder answer, so it works for any template. A closing token the
    model already generated (its EOS) is not repeated."""
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    with_feedback = client.chat_ids(messages + [{"role": "user", "content": FEEDBACK}])
    answer = client.tokenizer.encode("A", add_special_tokens=False)
    end = _rfind(
        with_feedback,
        answer,
        before=_find(with_feedback, client.tokenizer.encode(FEEDBACK, add_special_tokens=False)),
    )
    tail = with_feedback[end + len(answer) :]
    if turn.output_ids and tail and turn.output_ids[-1] == tail[0]:
        tail = tail[1:]
    return tail


def _find(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    return len(seq)


def _rfind(seq: list[int], sub: list[int], before: int) -> int:
    for i in range(min(before, len(seq)) - len(sub), -1, -1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise ValueError(
        "the chat template dropped the assistant message; multi_turn cannot build feedback"
    )


def _score(traj: Trajectory, result: Any, discount: float = 1.0) -> None:
    traj.reward = float(result.value) * discount
    traj.reward_failed = result.error is not None and not result.timed_out
    traj.reward_timed_out = bool(result.timed_out)


@dataclass
class EpisodeOutcome:
    """What an agent episode gives (areal_cli.rollout.agents): any number of samples, and
    counts for the metrics line (agent_errors, ...)."""

    trajectories: list[Trajectory] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)


# A workflow returns one Trajectory, or an EpisodeOutcome.
Workflow = Callable[[EpisodeClient, dict[str, Any]], Awaitable[Trajectory | EpisodeOutcome]]


def resolve_workflow(spec: str, recipe_dir: Path, max_turns: int) -> Workflow:
    """single_turn, multi_turn, or module:function beside the recipe."""
    if spec == "single_turn":
        return single_turn
    if spec == "multi_turn":
        return lambda client, sample: multi_turn(client, sample, max_turns)
    return load_function(spec, recipe_dir)  # type: ignore[return-value]
