"""Scalar-head folders (areal_cli.models.scalar_head) and a reward model as a reward
(`reward.fn: model:PATH`, areal_cli.rollout.reward_model), on the tiny model: the folder
HF loads, scores that do not depend on batching, and the pool's batched calls."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_cli.models.scalar_head import make_scalar_folder
from areal_cli.rollout.reward_model import RewardModel
from areal_cli.rollout.rewards import RewardPool
from tests.conftest import REPO, heavy_imports_after, run_areal


@pytest.fixture(scope="module")
def scalar_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scalar_folder(tiny_model_dir, tmp_path_factory.mktemp("rm") / "model-rm", seed=3)


def _sequences(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    prompt = list(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 3+5?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    return [prompt + tok.encode(a, add_special_tokens=False) + [tok.eos_token_id]
            for a in ("8", "17", "3 and more words")]  # fmt: skip


def test_scalar_folder_is_the_body_with_a_seeded_head(
    tiny_model_dir: Path, scalar_dir: Path, tmp_path: Path
) -> None:
    config = json.loads((scalar_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1 and config["tie_word_embeddings"] is False
    body, head = (
        load_file(str(tiny_model_dir / "model.safetensors")),
        load_file(str(scalar_dir / "model.safetensors")),
    )
    assert head["score.weight"].shape == (1, config["hidden_size"])
    assert "lm_head.weight" not in head
    assert all(torch.equal(body[k], head[k]) for k in body if k != "lm_head.weight")
    again = make_scalar_folder(tiny_model_dir, tmp_path / "again", seed=3)
    assert torch.equal(
        load_file(str(again / "model.safetensors"))["score.weight"], head["score.weight"]
    )
    with pytest.raises(ValueError, match="already has a scalar head"):
        make_scalar_folder(scalar_dir, tmp_path / "twice", seed=3)


def test_scores_match_hf_and_do_not_depend_on_the_batch(scalar_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    seqs = _sequences(scalar_dir)
    model = RewardModel(scalar_dir)
    together = model.score_ids(seqs)
    alone = [model.score_ids([s])[0] for s in seqs]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(v, 4) for v in together)) == 3  # the answers score differently
    hf = AutoModelForSequenceClassification.from_pretrained(scalar_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # HF pools at the last token that is not the pad token: the EOS
        pooled = [float(hf(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]
    assert together == pytest.approx(pooled, abs=1e-5)
    # a completion cut before its EOS is scored as if it ended there
    assert model.score_ids([seqs[0][:-1]])[0] == pytest.approx(together[0], abs=1e-6)


def test_a_llama_reward_model_scores_without_transformers_modeling(scalar_dir: Path) -> None:
    """A Llama-family reward model runs on our decoder (DecoderScorer): the reward
    worker never imports transformers' modeling code (seconds of its first call)."""
    printed, heavy = heavy_imports_after(
        "from pathlib import Path\n"
        "from areal_cli.rollout.reward_model import RewardModel\n"
        f"print(RewardModel(Path({str(scalar_dir)!r})).score_ids([[5, 6, 7]])[0])\n"
    )
    assert len(printed) == 1 and math.isfinite(float(printed[0]))
    assert heavy == []


def test_pool_batches_model_reward_calls(scalar_dir: Path) -> None:
    seqs = _sequences(scalar_dir)
    expected = RewardModel(scalar_dir).score_ids(seqs)

    async def run(pool: RewardPool) -> list:
        calls = [pool.score("", "", {}, ids=s) for s in seqs * 4]
        return await asyncio.gather(*calls, pool.score("text only", "8", {}))

    with RewardPool(f"model:{scalar_dir}", num_workers=1, timeout_s=60) as pool:
        assert pool.batched
        *results, no_ids = asyncio.run(run(pool))
        assert [r.value for r in results] == pytest.approx(expected * 4, abs=1e-5)
        assert all(r.error is None for r in results)
        assert no_ids.value == 0.0 and "token ids" in no_ids.error
        assert (pool.n_calls, pool.n_errors, pool.n_timeouts) == (13, 1, 0)
        assert pool.n_batches < 4  # the 12 calls that arrived together went in one or two


def test_a_folder_that_is_no_reward_model_is_refused_before_launch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    recipe = str(REPO / "recipes" / "tiny_cpu.yaml")
    wrong = run_areal("validate", recipe, f"reward.fn=model:{tiny_model_dir}")
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert "reward.fn" in wrong.stderr and "not a reward model" in wrong.stderr, wrong.stderr
    # one not trained yet: a plan only warns (it needs no weights), a real run refuses
    missing = f"reward.fn=model:{tmp_path / 'not-yet'}"
    plan = run_areal("train", recipe, "--dry-run", missing, f"cluster.fileroot={tmp_path}")
    assert plan.returncode == 0 and "a real run needs it" in plan.stdout + plan.stderr
    run = run_areal("train", recipe, missing, f"cluster.fileroot={tmp_path}")
    assert run.returncode == 2 and "no config.json" in run.stderr, run.stdout + run.stderr
    assert "Traceback" not in wrong.stderr + run.stderr
    assert not (tmp_path / "tiny-cpu").exists()  # nothing started, nothing written
