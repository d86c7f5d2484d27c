"""Episode workflows against a scripted inference client (unit level; the e2e tests use real servers)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from areal_cli.config.schema import GenerationHyperparameters
from areal_cli.rollout.workflows import EpisodeClient, multi_turn, single_turn, token_versions


def testtoken_versions_from_spans() -> None:
    meta = {
        "weight_version": "3",
        "weight_versions": [
            {"version": 2, "start": 0, "end": 2},
            {"version": 3, "start": 2, "end": 5},
        ],
    }
    assert token_versions(meta, 5) == [2, 2, 3, 3, 3]
    assert token_versions({"weight_version": "4"}, 3) == [4, 4, 4]


class _Tokenizer:
    """Characters as token ids; a ChatML-like template."""

    eos_token_id = 1
    chat_template = "<role>content EOS"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(
        self, messages, add_generation_prompt: bool, tokenize: bool
    ) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += self.encode(f"<{m['role']}>") + self.encode(m["content"]) + [self.eos_token_id]
        if add_generation_prompt:
            ids += self.encode("<assistant>")
        return ids


@dataclass
class _Result:
    value: float
    error: str | None = None
    timed_out: bool = False


class _Reward:
    """Scores exact answers; keeps the token ids each call carried (what a model reward scores)."""

    def __init__(self) -> None:
        self.ids: list[list[int] | None] = []

    async def score(self, text: str, answer: str, fields: dict, ids=None) -> _Result:
        self.ids.append(ids)
        return _Result(1.0 if text.strip() == answer else 0.0)


class _Server:
    """Answers from a script; every answer ends with EOS (finish reason stop)."""

    def __init__(self, answers: list[str]):
        self.answers = answers
        self.calls: list[list[int]] = []

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.calls.append(list(input_ids))
        text = self.answers[len(self.calls) - 1]
        ids = [ord(c) for c in text] + [1]
        return {
            "output_ids": ids,
            "text": text,
            "meta_info": {
                "output_token_logprobs": [[-0.5, i, None] for i in ids],
                "weight_version": "7",
                "finish_reason": {"type": "stop", "matched": 1},
            },
        }


def _client(server: _Server) -> EpisodeClient:
    return EpisodeClient(server, _Tokenizer(), GenerationHyperparameters(), _Reward(), seed=5)


def test_single_turn_marks_only_generated_tokens() -> None:
    server = _Server(["42"])
    client = _client(server)
    traj = asyncio.run(single_turn(client, {"prompt_ids": [10, 11, 12], "answer": "42"}))
    assert traj.input_ids == [10, 11, 12, ord("4"), ord("2"), 1]
    assert client._reward.ids == [traj.input_ids]  # a model reward scores the whole sequence
    assert traj.loss_mask == [0, 0, 0, 1, 1, 1]
    assert traj.versions == [-1, -1, -1, 7, 7, 7] and traj.logprobs[3:] == [-0.5] * 3
    assert traj.reward == 1.0 and traj.oldest_version == 7


def test_multi_turn_appends_feedback_and_discounts() -> None:
    server = _Server(["41", "42"])
    traj = asyncio.run(
        multi_turn(_client(server), {"prompt_ids": [10], "answer": "42"}, max_turns=2)
    )
    assert traj.n_turns == 2 and traj.reward == pytest.approx(0.9)
    second_context = server.calls[1]
    feedback = second_context[len([10]) + 3 :]  # after the prompt and the first answer "41"+EOS
    text = "".join(chr(i) if i > 1 else "|" for i in feedback)
    assert text.startswith("<user>That is not right") and text.endswith("|<assistant>")
    assert (
        traj.input_ids[: len(second_context)] == second_context
    )  # the trajectory is the real context
    assert sum(traj.loss_mask) == 6  # two answers of 2 tokens + EOS each


def test_multi_turn_stops_when_right() -> None:
    server = _Server(["42"])
    traj = asyncio.run(
        multi_turn(_client(server), {"prompt_ids": [10], "answer": "42"}, max_turns=3)
    )
    assert traj.n_turns == 1 and traj.reward == 1.0 and len(server.calls) == 1


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """The builtin models' real byte-level BPE tokenizer and chat template (trained locally)."""
    from areal_cli.models.tiny_model import build_tokenizer

    return build_tokenizer()


class _BpeServer(_Server):
    """The scripted server, answering in real token ids (answer then EOS)."""

    def __init__(self, answers: list[str], tokenizer) -> None:
        super().__init__(answers)
        self.tokenizer = tokenizer

    async def generate(self, input_ids, sampling_params, return_logprob=True):
        self.calls.append(list(input_ids))
        text = self.answers[len(self.calls) - 1]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return {
            "output_ids": ids,
            "text": text,
            "meta_info": {
                "output_token_logprobs": [[-0.5, i, None] for i in ids],
                "weight_version": "3",
                "finish_reason": {"type": "stop", "matched": ids[-1]},
            },
        }


def test_multi_turn_context_is_the_chat_template_rendering_with_a_real_tokenizer(
    bpe_tokenizer,
) -> None:
    """The second turn's context is token for token what the chat template renders for
    the whole conversation, so the model sees the format it was trained on."""
    from areal_cli.rollout.workflows import FEEDBACK

    def render(messages):
        out = bpe_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    question = [{"role": "user", "content": "What is 3+4?"}]
    server = _BpeServer(["8", "7"], bpe_tokenizer)
    client = EpisodeClient(server, bpe_tokenizer, GenerationHyperparameters(), _Reward(), seed=1)
    traj = asyncio.run(
        multi_turn(client, {"prompt_ids": render(question), "answer": "7"}, max_turns=2)
    )
    conversation = question + [
        {"role": "assistant", "content": "8"},
        {"role": "user", "content": FEEDBACK},
    ]
    assert server.calls[1] == render(conversation)
    assert traj.n_turns == 2 and traj.reward == pytest.approx(0.9)
    answers = [t for t, m in zip(traj.input_ids, traj.loss_mask, strict=True) if m]
    eos = bpe_tokenizer.eos_token_id
    assert bpe_tokenizer.decode(answers) == bpe_tokenizer.decode(
        [*bpe_tokenizer.encode("8"), eos, *bpe_tokenizer.encode("7"), eos]
    )
