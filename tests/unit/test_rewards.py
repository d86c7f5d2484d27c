"""Built-in rewards, reward resolution, and the RewardPool's error, timeout and crash handling."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_cli.rollout.rewards import (
    RewardPool,
    RewardResult,
    call_reward,
    exact_match,
    last_number,
    math_answer,
    numeric,
    resolve_reward,
)

REWARD_FILE = """
import os
import time


def graded(completion, answer, bonus=0.0, **fields):
    if completion == "hang":
        time.sleep(30)
    if completion == "raise":
        raise RuntimeError("bad sample")
    if completion == "crash":
        os._exit(3)
    return float(completion == answer) + bonus


def not_a_number(completion, answer, **fields):
    return "yes"
"""

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72.\n#### 72"
)


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    return tmp_path


# --------------------------------------------------------------------------- builtins


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("42", "42", 1.0),
        ("  42 \n", "42", 1.0),
        ("a  b\n c", "a b c", 1.0),
        ("42.", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_exact_match(completion: str, answer: str, expected: float) -> None:
    assert exact_match(completion, answer) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", 1234.0),
        ("-3.5", -3.5),
        ("x = -3.5 then 7", 7.0),
        ("10-2", 2.0),  # a minus between numbers is subtraction, not a sign
        ("costs $1,234,567.25 total", 1234567.25),
        ("1,2345", 2345.0),  # not a thousands group
        ("about 2e3 items", 2000.0),
        ("answer: .5", 0.5),
        ("no digits here", None),
    ],
)
def test_last_number(text: str, expected: float | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 1,234.", "1234", 1.0),
        ("So it is -3.5", "-3.5", 1.0),
        ("-3.50", "-3.5", 1.0),
        ("3.5", "-3.5", 0.0),
        ("I first got 12 but the answer is 13", "12", 0.0),
        ("no number at all", "12", 0.0),
        ("0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),  # within 1e-6
        ("the result is 72", GSM8K_ANSWER, 1.0),  # GSM8K reference: number after ####
    ],
)
def test_numeric(completion: str, answer: str, expected: float) -> None:
    assert numeric(completion, answer) == expected


def test_numeric_reference_without_number_is_an_error() -> None:
    with pytest.raises(ValueError, match="no number"):
        numeric("42", "forty-two")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"so the result is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{72}", GSM8K_ANSWER, 1.0),
        ("She sold 72 clips.\n#### 72", GSM8K_ANSWER, 1.0),
        (r"\boxed{71}", GSM8K_ANSWER, 0.0),
        (r"\boxed{1+x^2}", "x^2+1", 1.0),
        ("I do not know", "72", 0.0),
    ],
)
def test_math(completion: str, answer: str, expected: float) -> None:
    assert math_answer(completion, answer) == expected


def test_math_off_the_main_thread() -> None:
    # math-verify's SIGALRM timeouts only work on the main thread; the builtin must cope.
    async def run() -> float:
        return await asyncio.to_thread(math_answer, r"\boxed{\frac{1}{2}}", "0.5")

    assert asyncio.run(run()) == 1.0


# --------------------------------------------------------------------------- resolution


def test_resolve_builtins() -> None:
    assert resolve_reward("builtin:exact_match") is exact_match
    assert resolve_reward("builtin:numeric", Path(".")) is numeric
    assert resolve_reward("builtin:math") is math_answer


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("builtin:nope", "unknown builtin 'nope'.*exact_match, math, numeric"),
        ("exact_match", "expected builtin:NAME, model:PATH or module:function"),
        ("my_reward:", "expected builtin:NAME"),
        ("my_reward:missing", "no function 'missing'.*graded"),
        ("no_such_module_xyz:fn", "no_such_module_xyz.py in .* not importable"),
    ],
)
def test_resolve_errors(recipe_dir: Path, spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_reward(spec, recipe_dir)


def test_resolve_file_beside_recipe(recipe_dir: Path) -> None:
    fn = resolve_reward("my_reward:graded", recipe_dir)
    assert fn("a", "a") == 1.0
    assert fn("a", "b", bonus=0.5) == 0.5


def test_resolve_importable_module() -> None:
    assert resolve_reward("areal_cli.rollout.rewards:numeric") is numeric


def test_call_reward_checks_value_and_fields(recipe_dir: Path) -> None:
    fn = resolve_reward("my_reward:graded", recipe_dir)
    # the answer column is usually called "answer": it must not be passed twice
    assert call_reward(fn, "7", "7", {"answer": "7", "question": "q", "bonus": 1.0}) == 2.0
    with pytest.raises(TypeError, match="str, not a number"):
        call_reward(resolve_reward("my_reward:not_a_number", recipe_dir), "a", "a", {})
    with pytest.raises(ValueError, match="nan"):
        call_reward(lambda c, a: float("nan"), "a", "a", {})


# --------------------------------------------------------------------------- pool


def test_pool_custom_reward_errors_and_fields(recipe_dir: Path) -> None:
    async def run(pool: RewardPool) -> list[RewardResult]:
        return [
            await pool.score("7", "7", {"answer": "7", "bonus": 0.5}),
            await pool.score("raise", "7", {}),
            await pool.score("7", "8", {}),  # the same worker keeps serving after an error
            await pool.score("x", "x", {"unpicklable": lambda: 0}),
        ]

    with RewardPool("my_reward:graded", recipe_dir, num_workers=1, timeout_s=10) as pool:
        ok, raised, wrong, bad_fields = asyncio.run(run(pool))
        assert ok == RewardResult(1.5)
        assert raised.value == 0.0 and not raised.timed_out
        assert raised.error == "RuntimeError: bad sample"
        assert wrong == RewardResult(0.0)
        assert bad_fields.value == 0.0 and bad_fields.error
        assert (pool.n_calls, pool.n_errors, pool.n_timeouts) == (4, 2, 0)


def test_pool_timeout_kills_hung_worker(recipe_dir: Path) -> None:
    async def run(pool: RewardPool) -> None:
        hung_proc = pool._workers[0].proc
        result = await pool.score("hang", "x")
        assert result == RewardResult(0.0, "reward timed out after 0.5s", timed_out=True)
        assert hung_proc.poll() is not None  # the sleeping worker was killed
        start = time.monotonic()
        assert (await pool.score("x", "x")).value == 1.0
        assert time.monotonic() - start < 5.0  # a fresh worker answers promptly

    with RewardPool("my_reward:graded", recipe_dir, num_workers=1, timeout_s=0.5) as pool:
        asyncio.run(run(pool))
        assert (pool.n_calls, pool.n_errors, pool.n_timeouts) == (2, 0, 1)


def worker_outlives(driver: str, cwd: Path) -> bool:
    """Run `driver` (a controller's stand-in, which prints its busy worker's pid and then
    waits on it), kill it with -9 once the worker is busy, and say whether the worker
    was still alive 10 s later."""
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], cwd=cwd, stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(proc.stdout.readline())
        time.sleep(1.0)  # the request is on its way: the worker is busy in user code
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return False
            if state == "Z":  # dead, waiting for init to reap it
                return False
            time.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        return True
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_busy_worker_dies_with_a_controller_killed_with_9(recipe_dir: Path) -> None:
    """A reward that hangs must not keep running (holding the terminal's output open)
    after its controller was killed with -9."""
    driver = f"""
import asyncio
from areal_cli.rollout.rewards import RewardPool

async def main():
    pool = RewardPool("my_reward:graded", {str(recipe_dir)!r}, timeout_s=600)
    assert (await pool.score("1", "1")).value == 1.0  # loaded and answering
    print(pool._workers[0].proc.pid, flush=True)
    await pool.score("hang", "x")

asyncio.run(main())
"""
    assert not worker_outlives(driver, recipe_dir)


def test_pool_worker_crash_is_an_error(recipe_dir: Path) -> None:
    async def run(pool: RewardPool) -> tuple[RewardResult, RewardResult]:
        return await pool.score("crash", "x"), await pool.score("x", "x")

    with RewardPool("my_reward:graded", recipe_dir, timeout_s=10) as pool:
        crashed, after = asyncio.run(run(pool))
    assert crashed.value == 0.0 and "exit code 3" in (crashed.error or "")
    assert after == RewardResult(1.0)
    assert pool.n_errors == 1


def test_pool_concurrent_calls_share_workers(recipe_dir: Path) -> None:
    async def run(pool: RewardPool) -> list[RewardResult]:
        calls = [pool.score(str(i), str(i % 2), {}) for i in range(6)]
        return await asyncio.gather(*calls)

    with RewardPool("my_reward:graded", recipe_dir, num_workers=2, timeout_s=10) as pool:
        results = asyncio.run(run(pool))
        assert [r.value for r in results] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        assert len(pool._workers) == 2


def test_pool_rejects_bad_spec_and_closed_use(recipe_dir: Path) -> None:
    with pytest.raises(ValueError, match="no function 'nope'"):
        RewardPool("my_reward:nope", recipe_dir)
    pool = RewardPool("builtin:exact_match")
    procs = [w.proc for w in pool._workers]
    pool.close()
    pool.close()  # idempotent
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.score("a", "a"))


@pytest.mark.slow
def test_pool_builtin_math(recipe_dir: Path) -> None:
    async def run(pool: RewardPool) -> list[RewardResult]:
        return await asyncio.gather(
            pool.score(r"\boxed{\frac{1}{2}}", "0.5"),
            pool.score(r"\boxed{72}", GSM8K_ANSWER, {"question": "How many clips?"}),
            pool.score(r"\boxed{3}", "4"),
        )

    with RewardPool("builtin:math", num_workers=2, timeout_s=30) as pool:
        assert [r.value for r in asyncio.run(run(pool))] == [1.0, 1.0, 0.0]
        assert pool.n_errors == 0


def test_pool_cancelled_call_frees_its_worker(recipe_dir: Path) -> None:
    async def run(pool: RewardPool) -> RewardResult:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pool.score("hang", "x"), 0.3)
        return await asyncio.wait_for(pool.score("x", "x"), 10)

    with RewardPool("my_reward:graded", recipe_dir, num_workers=1, timeout_s=60) as pool:
        hung_proc = pool._workers[0].proc
        assert asyncio.run(run(pool)) == RewardResult(1.0)
        assert hung_proc.poll() is not None
