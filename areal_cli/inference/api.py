"""The engine's request and response types, with SGLang's field names.

`GenerateRequest.from_dict` takes a `/generate` body (`input_ids`, `sampling_params`,
`return_logprob`, `rid`) and `GenerateOutput.to_dict` gives SGLang's answer (`output_ids`,
`meta_info` with `output_token_logprobs`, `finish_reason`, `weight_version(s)`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# SGLang sampling keys we accept only at their no-op value, so SGLang clients that always
# send them keep working, while a request that relies on them fails loudly.
_NOOP_SAMPLING_KEYS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "stop": (None, "", []),
    "min_new_tokens": (0,),
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True, False),
    "no_stop_trim": (True, False),
}


_COERCE: dict[str, Callable[[Any], Any]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_new_tokens": int,
    "stop_token_ids": lambda ids: tuple(int(t) for t in ids),
    "ignore_eos": bool,
    "sampling_seed": int,
    "skip_special_tokens": bool,
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang names). temperature 0 means greedy;
    top_k < 1 and top_p == 1 disable truncation; stop_token_ids stop even with ignore_eos."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        """Build from an SGLang `sampling_params` dict; raises ValueError on unsupported keys."""
        data = dict(data or {})
        for key, allowed in _NOOP_SAMPLING_KEYS.items():
            if key in data and data.pop(key) not in allowed:
                raise ValueError(f"sampling param {key!r} is not supported by this engine")
        unknown = sorted(set(data) - set(_COERCE))
        if unknown:
            raise ValueError(f"unknown sampling params: {', '.join(unknown)}")
        values = {k: _COERCE[k](v) for k, v in data.items() if v is not None}
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise ValueError on out-of-range values."""
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerateRequest:
    """One generation request: a prompt (`input_ids` or `text`) plus sampling settings."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    rid: str | None = None

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> GenerateRequest:
        """Build from a single (non-batched) SGLang `/generate` body."""
        input_ids = body.get("input_ids")
        if input_ids is not None and not all(isinstance(t, int) for t in input_ids):
            raise ValueError("input_ids must be a flat list of integers")
        text = body.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError("text must be a string")
        return cls(
            input_ids=list(input_ids) if input_ids is not None else None,
            text=text,
            sampling_params=SamplingParams.from_dict(body.get("sampling_params")),
            return_logprob=bool(body.get("return_logprob") or False),
            rid=None if body.get("rid") is None else str(body["rid"]),
        )


@dataclass
class GenerateOutput:
    """The result of one request; `to_dict` gives SGLang's `/generate` response."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]
    weight_version: str
    weight_versions: list[dict[str, Any]]
    e2e_latency: float

    def to_dict(self, return_logprob: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "weight_versions": self.weight_versions,
            "e2e_latency": self.e2e_latency,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(self.output_logprobs, self.output_ids, strict=True)
            ]
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler state."""

    weight_version: str
    model_path: str
    paused: bool
    num_running: int
    num_waiting: int
    progress: dict[str, int]  # rid -> output tokens so far, running and waiting requests
    kv_cache_bytes: int = 0  # the running batch's KV buffers now


class WeightUpdate(NamedTuple):
    """What `update_weights_from_disk` did."""

    ok: bool
    message: str
    stats: EngineStats  # the engine right after the update (or the refusal)
