"""Agent episodes (`rollout.agent: module:Name`): an agent written against the OpenAI SDK
runs unchanged; the agent proxy (areal_cli.rollout.proxy) records what it sampled.

The contract, close to AReaL's so that its agents move over:
  - `Name` is a class with `async def run(self, data, **kwargs)` (made once per episode,
    with no arguments) or a plain `async def Name(data, **kwargs)`;
  - `data` is the dataset row as read, a dict of its columns;
  - `kwargs` holds `base_url` (the episode's own address at the proxy, ending in /v1;
    an Anthropic SDK client takes it without that /v1, as it appends /v1/messages), `api_key` and
    `http_client` (the openai SDK's own async HTTP client, for
    `openai.AsyncOpenAI(http_client=...)`, new per episode and closed when it ends; the
    episodes' clients share one TLS context, built once);
  - it returns a float, the episode's reward, or a dict of completion id (the `id` of a
    response) to reward.
The agent's file imports nothing from areal.

From completions to samples (`rollout.agent_samples`):
  concat (the default)  the completions are walked in order; one whose prompt tokens
        start with the current sequence's tokens (its prompt and reply) extends it: the
        new prompt tokens are context, the reply is trained. One that does not (the agent
        rewrote its history, or a template renders an old turn differently) starts a new
        sequence, counted as agent_prefix_breaks. A multi-turn episode is then one
        sequence: each token is trained once, with the whole conversation before it.
  individual  one sample per completion (its prompt as context, its reply trained): the
        agent may rewrite history freely, at the cost of training shared prefixes again
        in every sample.
Rewards: the completions the agent's dict names get their reward; each other one gets the
reward of the completion after it times `rollout.turn_discount` (0 for the last). A float
reward names the last completion. A concat sequence takes the reward of its last
completion. An episode's samples share its group (the prompt's) for the advantage's
group baseline, so a group may hold any number of samples.

Failures: an agent that raises, returns no reward, or runs past `rollout.agent_timeout_s`
is counted (agent_errors, agent_timeouts) and its episode dropped, as is one that made no
completion (agent_empty); the run goes on. With `rollout.mode: subproc` the agent runs in
worker processes (areal_cli.rollout.subproc): a hung one is killed with its worker, and a
worker that dies under it is agent_crashes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_cli.config.recipe_code import AgentRun
from areal_cli.rollout.proxy import AgentProxy, Completion
from areal_cli.rollout.subproc import AgentCrashed, AgentPool, PoolBroken
from areal_cli.rollout.workflows import EpisodeClient, EpisodeOutcome, Trajectory, Turn

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)


@functools.cache
def _tls() -> ssl.SSLContext:
    """The episodes' HTTP clients share one TLS context: httpx builds a new one per client
    by default, loading the CA bundle each time (~40 ms of the controller's loop per
    episode on an EPYC core, against ~2 ms with it shared)."""
    import httpx

    return httpx.create_ssl_context()


@dataclass(frozen=True)
class AgentRunner:
    """Runs agent episodes through the proxy and makes their samples; one per run."""

    proxy: AgentProxy
    make_agent: Callable[[], AgentRun]
    samples: str = "concat"
    turn_discount: float = 1.0
    timeout_s: float = 600.0
    api_key: str = "areal"  # what the agent gets; the proxy checks it when it has a key
    name: str = "the agent"  # rollout.agent, for the watchdog's report
    pool: AgentPool | None = None  # rollout.mode subproc: the worker processes
    running: dict[str, float] = field(default_factory=dict)  # episode id -> start (monotonic)
    ended: dict[str, int] = field(
        default_factory=lambda: {"errors": 0, "timeouts": 0, "crashes": 0}
    )

    def describe(self) -> str:
        """The agent episodes in flight, for the watchdog: a stuck agent is named."""
        now = time.monotonic()
        oldest = max((now - t for t in self.running.values()), default=0.0)
        last = self.proxy.last_request_at
        asked = f"the last request came {now - last:.0f} s ago" if last else "none made a request"
        where = "" if self.pool is None else f" in {self.pool.size} worker processes"
        return (
            f"{len(self.running)} episodes of {self.name} running{where}, the oldest for "
            f"{oldest:.0f} s (rollout.agent_timeout_s {self.timeout_s:g}); {asked}; so far "
            f"{self.ended['errors']} raised, {self.ended['timeouts']} timed out and "
            f"{self.ended['crashes']} crashed"
        )

    async def episode(self, client: EpisodeClient, sample: Mapping[str, Any]) -> EpisodeOutcome:
        """One agent run on `sample` (its `row` is the agent's data); a workflow."""
        import openai

        episode = self.proxy.open_episode(client.next_seed())
        self.running[episode.id] = time.monotonic()
        fault = ""  # errors, timeouts or crashes
        reward: Any = None
        data = dict(sample.get("row", {}))
        base_url = self.proxy.base_url(episode)
        api_key = self.proxy.settings.api_key or self.api_key
        try:
            if self.pool is not None:
                reward = await self.pool.run(data, base_url, api_key, self.timeout_s)
            else:
                # the SDK's own HTTP client class (httpx's, under the name this openai uses)
                async with openai.DefaultAsyncHttpxClient(verify=_tls()) as http:
                    run = self.make_agent()
                    kwargs = {"base_url": base_url, "api_key": api_key, "http_client": http}
                    reward = await asyncio.wait_for(run(data, **kwargs), self.timeout_s)
        except TimeoutError:
            fault = "timeouts"
        except PoolBroken:
            raise  # no worker can start: the run stops with the reason
        except AgentCrashed as err:
            fault = "crashes"
            log.warning("agent episode crashed: %s", err)
        except Exception as err:  # noqa: BLE001 - an agent's failure drops its episode only
            fault = "errors"
            log.warning("agent episode failed: %s: %s", type(err).__name__, err)
        finally:
            completions = self.proxy.close_episode(episode)
            self.running.pop(episode.id, None)
        counters = {"agent_episodes": 1.0, "agent_completions": float(len(completions))}
        if not fault and not _is_reward(reward):
            log.warning("agent returned %r, not a float or a dict of id to reward", reward)
            fault = "errors"
        if fault:
            counters[f"agent_{fault}"] = 1.0
            self.ended[fault] += 1
            return EpisodeOutcome([], counters)
        if not completions:
            return EpisodeOutcome([], {**counters, "agent_empty": 1.0})
        trajs, made = episode_samples(completions, reward, self.samples, self.turn_discount)
        return EpisodeOutcome(trajs, {**counters, **made})


def episode_samples(
    completions: list[Completion],
    reward: float | Mapping[str, float],
    samples: str,
    discount: float,
) -> tuple[list[Trajectory], dict[str, float]]:
    """An episode's training samples (`rollout.agent_samples`) with their rewards, and
    its counters (agent_prefix_breaks for concat)."""
    rewards = completion_rewards(completions, reward, discount)
    if samples == "individual":
        return [_sample([c], r) for c, r in zip(completions, rewards, strict=True)], {}
    trajs, breaks = concat_samples(completions, rewards)
    return trajs, {"agent_prefix_breaks": float(breaks)}


def _is_reward(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, Mapping) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()
    )


def completion_rewards(
    completions: list[Completion], reward: float | Mapping[str, float], discount: float
) -> list[float]:
    """Each completion's reward (see the module docstring)."""
    named = dict(reward) if isinstance(reward, Mapping) else {completions[-1].id: float(reward)}
    out, after = [0.0] * len(completions), None
    for i in range(len(completions) - 1, -1, -1):
        cid = completions[i].id
        out[i] = (
            float(named[cid]) if cid in named else (after * discount if after is not None else 0.0)
        )
        after = out[i]
    return out


def concat_samples(
    completions: list[Completion], rewards: list[float]
) -> tuple[list[Trajectory], int]:
    """Completions joined where each one's prompt extends the sequence so far; the
    samples and how many times a completion did not extend (a new sequence began)."""
    samples: list[tuple[list[Completion], float]] = []
    tokens: list[int] = []
    breaks = 0
    for done, reward in zip(completions, rewards, strict=True):
        if (
            samples
            and done.prompt_ids[: len(tokens)] == tokens
            and len(done.prompt_ids) >= len(tokens)
        ):
            samples[-1][0].append(done)
            samples[-1] = (samples[-1][0], reward)
        else:
            breaks += bool(samples)
            samples.append(([done], reward))
        tokens = done.prompt_ids + done.output_ids
    return [_sample(chain, reward) for chain, reward in samples], breaks


def _sample(chain: list[Completion], reward: float) -> Trajectory:
    """One training sequence from completions that extend one another."""
    traj = Trajectory()
    for done in chain:
        traj.add_context(done.prompt_ids[len(traj.input_ids) :])
        traj.add_turn(Turn(done.output_ids, done.logprobs, done.versions, done.text, _finish(done)))
    traj.text = chain[-1].text
    traj.reward = reward
    return traj


def _finish(done: Completion) -> str:
    return "length" if done.finish_reason == "length" else "stop"
