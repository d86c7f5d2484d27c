"""Online mode (`rollout.mode: online`, AReaL's online proxy): an application outside the
run drives the episodes over HTTP, and the controller trains on the sessions that end.

The routes, on the agent proxy (areal_cli.rollout.proxy), with AReaL's names and keys:
  POST /rl/start_session   admin key (rollout.proxy.admin_api_key; on loopback without
                           one, anyone local). Body {"task_id": ..., "api_key": ...},
                           both optional. Answers {"session_id", "api_key", "base_url"}: a
                           new session and its own key; or 429 while the staleness bound
                           holds new sessions (retry after a moment). An api_key this run
                           issued refreshes it: its session, if still open, ends as by
                           end_session, and a new one takes the same key.
  POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages (also without
                           /v1): the session's key as a Bearer token (or x-api-key), which
                           names the session; recorded as for any agent episode.
  POST /rl/set_reward      session key. {"reward": r} rewards the session's last
                           completion; {"interaction_id": id, "reward": r} the completion
                           of that id (a response's `id`). 404 once the session ended.
  POST /rl/end_session     session key. The session's samples are ready for training.
A wrong or missing key gets 401.

Groups and staleness. The rollout loop launches groups under the staleness gate as for
any workflow; in online mode a launched group is `rollout.group_size` session slots. A
session joins the oldest open group of its task_id with a free slot, else the oldest
group no task holds yet (sessions without a task_id share groups in arrival order).
So a client that starts group_size sessions of one task gets a GRPO group of them. The
group's version is the servers' version when its first session joined; each token also
carries its own. When every slot's session ended (or timed out) the group is done and
goes into a batch like any other: ended sessions with completions and a reward are
trained, with rewards passed back through turns by `rollout.turn_discount` and samples
made as `rollout.agent_samples` says (areal_cli.rollout.agents).

Time-outs (`rollout.session_timeout_s`): a session idle for that long (no request of
its own being handled, and none arriving or answered since) is ended and not trained on
(online_timeouts); a group whose free slots nobody took for that long since its last
join closes with the sessions it has (online_unfilled). Each
session is counted once, in the step whose batch takes its group: online_sessions, and
of those online_timeouts, online_no_reward (ended with no reward set) and online_empty
(ended with no completion) are not trained on.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from areal_cli.data.requests import json_object
from areal_cli.rollout.agents import episode_samples
from areal_cli.rollout.proxy import bad_request, error_answer, not_found, request_key
from areal_cli.rollout.state import Group

if TYPE_CHECKING:
    from areal_cli.rollout.proxy import AgentProxy, Episode

ADMIN_ROUTES = ("/rl/start_session",)
SESSION_ROUTES = ("/rl/set_reward", "/rl/end_session")


@dataclass(eq=False)
class Session:
    id: str
    key: str
    task: str
    group: OpenGroup
    episode: Episode
    last_seen: float  # when a request of its own last arrived or was answered
    rewards: dict[str, float] = field(default_factory=dict)  # completion id -> reward
    state: str = "open"  # open, ended, timeout
    in_flight: int = 0  # its requests being handled now (it is not idle meanwhile)
    closed_at: float = 0.0  # when it ended or timed out (its key is forgotten later)


@dataclass(eq=False)
class OpenGroup:
    """One launched group's session slots, until its sessions are done."""

    index: int
    size: int
    done: asyncio.Future[Group]
    task: str | None = None  # the task_id that holds it (None: no session yet)
    version: int = -1
    sessions: list[Session] = field(default_factory=list)
    last_join: float = 0.0
    closed: bool = False  # no more joins (full, or its free slots timed out)
    unfilled: int = 0

    def free(self) -> int:
        return 0 if self.closed else self.size - len(self.sessions)


@dataclass(frozen=True)
class SessionSettings:
    group_size: int
    timeout_s: float
    admin_key: str = ""  # empty: start_session needs no key (loopback only; rules check)
    samples: str = "concat"
    turn_discount: float = 1.0
    seed: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> SessionSettings:
        r = cfg.rollout
        return cls(
            r.group_size, r.session_timeout_s, r.proxy.admin_api_key, r.agent_samples,
            r.turn_discount, cfg.seed,
        )  # fmt: skip


class NoPrompts:
    """Online mode's prompt stream: the sessions bring their own prompts, so a batch saves
    no dataset position and a resumed run has none to restore."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class OnlineSessions:
    """The online sessions of one run: their routes and the groups they fill."""

    def __init__(
        self, proxy: AgentProxy, settings: SessionSettings, version: Callable[[], int]
    ) -> None:
        self.proxy, self.settings, self.version = proxy, settings, version
        self.groups: list[OpenGroup] = []  # launched, not yet done (oldest first)
        self.by_key: dict[str, Session] = {}
        self.started = self.ended = self.timed_out = 0
        proxy.sessions = self

    def card(self) -> dict[str, Any]:
        """What RUN/proxy.json tells outside clients (scripts/online_client.py reads it)."""
        return {
            "address": self.proxy.address,
            "base_url": f"{self.proxy.address}/v1",
            "start_session": f"{self.proxy.address}/rl/start_session",
            "admin_key_required": bool(self.settings.admin_key),
            "group_size": self.settings.group_size,
        }

    # ------------------------------------------------------------------ the loop's side

    @staticmethod
    async def no_workflow(_client: Any, _sample: Any) -> Any:
        raise RuntimeError("online mode runs no workflow: outside sessions fill the groups")

    async def group(self, index: int, _version: int) -> Group:
        """Open a group of `group_size` slots; its Group once its sessions are done."""
        slots = OpenGroup(
            index, self.settings.group_size, asyncio.get_running_loop().create_future()
        )
        self.groups.append(slots)
        try:
            return await slots.done
        finally:
            if slots in self.groups:
                self.groups.remove(slots)

    async def watch(self, period_s: float = 0.5) -> None:
        """End the sessions and close the groups that timed out (a task of the loop)."""
        while True:
            await asyncio.sleep(period_s)
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        limit = self.settings.timeout_s
        for group in list(self.groups):
            for session in group.sessions:
                if session.state == "open" and self._idle(session, now) > limit:
                    session.state, session.closed_at = "timeout", now
                    self.timed_out += 1
                    self.proxy.close_episode(session.episode)
            if group.task is not None and group.free() and now - group.last_join > limit:
                group.unfilled, group.closed = group.free(), True
            self._settle(group)
        # a closed session's key answers 404 for another timeout, then 401 (bounded memory)
        for key in [k for k, s in self.by_key.items() if s.closed_at and now - s.closed_at > limit]:
            del self.by_key[key]

    @staticmethod
    def _idle(session: Session, now: float) -> float:
        """How long the session has been idle: 0 while one of its requests is being
        handled (a slow server or a paused one is not the client's silence)."""
        return 0.0 if session.in_flight else now - session.last_seen

    @contextmanager
    def handling(self, token: str | None) -> Iterator[None]:
        """Around the handling of a request with `token` (the proxy's middleware): its
        session, if the key names one, is busy until the answer is sent."""
        session = self.by_key.get(token or "")
        if session is None:  # the admin key, or none
            yield
            return
        session.in_flight += 1
        session.last_seen = time.monotonic()
        try:
            yield
        finally:
            session.in_flight -= 1
            session.last_seen = time.monotonic()

    def summary(self, counted_in_steps: int) -> dict[str, int]:
        """Every session started, by where it went; `counted_in_steps`: the sessions the
        written batches' figures count (online_sessions summed)."""
        open_ = self.started - self.ended - self.timed_out
        return {
            "started": self.started,
            "ended": self.ended,
            "timed_out": self.timed_out,
            "open_at_end": open_,
            "counted_in_steps": counted_in_steps,
            "after_last_batch": self.started - counted_in_steps,
        }

    def describe(self) -> str:
        """For the watchdog's report."""
        open_ = sum(s.state == "open" for g in self.groups for s in g.sessions)
        free = sum(g.free() for g in self.groups)
        return (
            f"online: {open_} sessions open, {free} free slots; so far {self.started} "
            f"started, {self.ended} ended, {self.timed_out} timed out "
            f"(rollout.session_timeout_s {self.settings.timeout_s:g})"
        )

    def _settle(self, group: OpenGroup) -> None:
        """Resolve the group once no slot is free and none of its sessions is open."""
        if group.done.done() or group.free() or any(s.state == "open" for s in group.sessions):
            return
        if not group.sessions:
            return  # closed with no session at all: cannot happen (closing needs a task)
        counters = {
            "online_sessions": float(len(group.sessions)),
            "online_timeouts": 0.0,
            "online_no_reward": 0.0,
            "online_empty": 0.0,
            "online_unfilled": float(group.unfilled),
            "agent_completions": 0.0,
        }
        trajectories = []
        for session in group.sessions:
            completions = session.episode.completions
            counters["agent_completions"] += len(completions)
            if session.state == "timeout":
                counters["online_timeouts"] += 1
            elif not completions:
                counters["online_empty"] += 1
            elif not session.rewards:
                counters["online_no_reward"] += 1
            else:
                trajs, made = episode_samples(
                    completions, session.rewards, self.settings.samples,
                    self.settings.turn_discount,
                )  # fmt: skip
                trajectories += trajs
                for key, value in made.items():
                    counters[key] = counters.get(key, 0.0) + value
        for session in group.sessions:  # the keys stay known: a late call gets 404
            session.episode.completions = []
        group.done.set_result(Group(trajectories, group.version, group.index, counters))

    # ------------------------------------------------------------------ HTTP

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/rl/start_session", self._start)
        app.router.add_post("/rl/set_reward", self._set_reward)
        app.router.add_post("/rl/end_session", self._end)

    def refuse(self, path: str, token: str | None) -> str | None:
        """Why a request with this key may not use `path` (None: it may)."""
        if path in ADMIN_ROUTES:
            admin = self.settings.admin_key
            if admin and token != admin:
                return (
                    "start_session needs the admin key (rollout.proxy.admin_api_key) as "
                    "Authorization: Bearer KEY"
                )
            return None
        if path.endswith("/models"):
            return None
        if token is None or token not in self.by_key:
            return (
                "a session key is needed: POST /rl/start_session gives one; send it as "
                "Authorization: Bearer KEY"
            )
        return None

    def episode_of(self, token: str | None) -> Episode:
        """The open session's episode for a completion request; 404 once it ended."""
        return self._session(token).episode

    def _session(self, token: str | None) -> Session:
        session = self.by_key[token or ""]  # refuse() let only known keys through
        if session.state == "timeout":
            raise not_found(
                f"session {session.id} timed out (rollout.session_timeout_s) and was not trained"
            )
        if session.state != "open":
            raise not_found(f"session {session.id} has ended")
        return session

    async def _start(self, request: web.Request) -> web.Response:
        body = await _body(request)
        task = body.get("task_id")
        if task is not None and not isinstance(task, str):
            return error_answer(400, "task_id must be a string")
        key = body.get("api_key")
        if key is not None and key not in self.by_key:
            return error_answer(
                400, "api_key was not issued by this run; leave it out for a new session"
            )
        group = self._slot(task or "")
        if group is None:
            busy = error_answer(
                429,
                "no capacity: the staleness bound (rollout.max_staleness) holds new sessions "
                "until the trainer takes a batch; retry shortly",
            )
            busy.headers["Retry-After"] = "1"
            return busy
        if key is not None and self.by_key[key].state == "open":
            self._finish(self.by_key[key])  # a refresh ends the key's open session
        now = time.monotonic()
        if group.task is None:
            group.task, group.version = task or "", self.version()
        slot = len(group.sessions)
        seed = (self.settings.seed * 1_000_003 + group.index * 997 + slot * 31) % (2**31)
        episode = self.proxy.open_episode(seed)
        key = key or f"sk-sess-{secrets.token_urlsafe(24)}"
        session = Session(f"{task or 'session'}-{group.index}-{slot}", key, task or "", group, episode, now)  # fmt: skip
        group.sessions.append(session)
        group.last_join = now
        group.closed = group.closed or len(group.sessions) == group.size
        self.by_key[key] = session
        self.started += 1
        return web.json_response(
            {"session_id": session.id, "api_key": key, "base_url": f"{self.proxy.address}/v1"}
        )

    def _slot(self, task: str) -> OpenGroup | None:
        """The group a session of `task` joins (see the module docstring); None: none."""
        free = [g for g in self.groups if g.free() and not g.done.done()]
        same = [g for g in free if g.task == task]
        if same:
            return same[0]
        return next((g for g in free if g.task is None), None)

    async def _set_reward(self, request: web.Request) -> web.Response:
        body = await _body(request)  # first: the session's state is read after any wait
        session = self._session(request_key(request))
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            return error_answer(400, "reward must be a number")
        completions = session.episode.completions
        if not completions:
            return error_answer(400, f"session {session.id} has no completion to reward yet")
        cid = body.get("interaction_id") or completions[-1].id
        if cid not in {c.id for c in completions}:
            return error_answer(
                400, f"interaction_id {cid!r} is no completion of session {session.id}"
            )
        session.rewards[cid] = float(reward)
        return web.json_response(
            {"session_id": session.id, "interaction_id": cid, "reward": reward}
        )

    async def _end(self, request: web.Request) -> web.Response:
        session = self._session(request_key(request))
        self._finish(session)
        return web.json_response({"session_id": session.id, "status": "ended"})

    def _finish(self, session: Session) -> None:
        session.state, session.closed_at = "ended", time.monotonic()
        self.ended += 1
        session.episode.completions = self.proxy.close_episode(session.episode)
        self._settle(session.group)


async def _body(request: web.Request) -> Mapping[str, Any]:
    return await json_object(request, bad_request)
