"""The channels' shared glue as the recipes use it: channel 2's config checks apply to A2 and
A4 alike, the EMA teacher has one checkpoint key (older A2 checkpoints still load), channel 1's
step normalisation counts what the loss divides by, and every recipe builds the same random
initial weights on every rank."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torchtune import training

from composer_tune import config
from composer_tune.channels.composer import (
    UNSCORED_BATCHES_LIMIT,
    ComposerChannels,
    ComposerObjective,
    RewardUnscoredError,
)
from composer_tune.channels.policy import step_normalization
from composer_tune.channels.sdpo.teacher import (
    EMATeacher,
    ema_teacher_state,
    load_ema_teacher_state,
    sdpo_config_from,
)
from composer_tune.distributed import DistInfo
from composer_tune.losses import PolicyLossConfig
from composer_tune.models import qwen3_tiny
from recipes.composer_full import ComposerFullConfig, ComposerFullRecipe
from recipes.grpo import GRPOConfig, GRPORecipe
from recipes.sdpo import SDPOConfig, SDPORecipe
from tests.recipe_runs import REPO_ROOT

CPU = torch.device("cpu")
ONE_PROCESS = DistInfo(world_size=1, rank=0, device=CPU)
# What rank 0 of a 2-process torchrun sees (no collective is called here).
TWO_RANKS = DistInfo(world_size=2, rank=0, device=CPU)


def _config(recipe: str, schema: type, tmp_path: Path, *overrides: str) -> object:
    return config.load_config(
        "cpu_smoke",
        [f"output_dir={tmp_path / recipe}", "warm_start=null", *overrides],
        recipe_file=REPO_ROOT / "recipes" / f"{recipe}.py",
        schema=schema,
    )


@pytest.mark.parametrize(
    ("recipe", "schema"), [("sdpo", SDPOConfig), ("composer_full", ComposerFullConfig)]
)
def test_ema_teacher_under_torchrun_needs_teacher_top_k_in_a2_and_a4(
    recipe: str, schema: type, tmp_path: Path
) -> None:
    cfg = _config(recipe, schema, tmp_path, "sdpo.teacher=ema", "sdpo.loss.top_k=null")
    assert sdpo_config_from(cfg, ONE_PROCESS).teacher == "ema"
    with pytest.raises(ValueError, match="sdpo.teacher=ema under torchrun needs sdpo.loss.top_k"):
        sdpo_config_from(cfg, TWO_RANKS)
    if recipe == "composer_full":
        with pytest.raises(ValueError, match="under torchrun"):
            ComposerChannels.from_config(cfg, TWO_RANKS)


def test_a4_checks_the_teacher_length_like_a2(tmp_path: Path) -> None:
    # A hint makes the teacher's sequence longer than the student's: an unset limit, or one
    # past the model's positions, is refused before training (A4 did not check it before).
    cfg = _config(
        "composer_full",
        ComposerFullConfig,
        tmp_path,
        "sdpo.context.max_teacher_tokens=100000",
        "dpo.weight=0",
    )
    recipe = ComposerFullRecipe(cfg)
    with pytest.raises(ValueError, match=r"max_teacher_tokens \(100000\) must be set to at most"):
        recipe.setup()


def _teacher(seed: int) -> EMATeacher:
    torch.manual_seed(seed)
    policy = qwen3_tiny(vocab_size=64, max_seq_len=32)
    torch.manual_seed(seed + 1)
    return EMATeacher(policy, rate=0.1, teacher=qwen3_tiny(vocab_size=64, max_seq_len=32))


def test_ema_teacher_state_round_trip_and_older_a2_key() -> None:
    saved = _teacher(0)
    saved.num_updates = 7
    state = ema_teacher_state(saved, ONE_PROCESS)
    assert list(state) == ["sdpo_ema"]
    for stored in (state, {"ema_teacher": {"model": saved.module.state_dict(), "num_updates": 7}}):
        restored = _teacher(10)  # other weights
        load_ema_teacher_state(restored, stored, source="ckpt", device=CPU, cpu_offload=False)
        assert restored.num_updates == 7
        for name, value in saved.module.state_dict().items():
            assert torch.equal(restored.module.state_dict()[name], value), name
    with pytest.raises(ValueError, match="ckpt has no EMA teacher"):
        load_ema_teacher_state(_teacher(1), {}, source="ckpt", device=CPU, cpu_offload=False)
    load_ema_teacher_state(None, {}, source="ckpt", device=CPU, cpu_offload=False)  # no-op


def test_step_normalization_counts_active_tokens_and_micro_batches() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=torch.bool)
    rows = type(
        "Rows",
        (),
        {
            "completion_mask": mask,
            "truncated": torch.tensor([False, True, False]),
            "__len__": lambda self: 3,
        },
    )()
    plain = step_normalization(rows, PolicyLossConfig("dapo"), ONE_PROCESS, micro_batch_size=2)
    assert (plain.active_tokens, plain.world_size, plain.num_micro_batches) == (6.0, 1, 2)
    masked = step_normalization(
        rows,
        PolicyLossConfig("dapo", mask_truncated_completions=True),
        ONE_PROCESS,
        micro_batch_size=3,
    )
    assert (masked.active_tokens, masked.num_micro_batches) == (3.0, 1)  # row 1 truncated


@pytest.mark.parametrize(("recipe", "schema"), [("grpo", GRPOConfig), ("sdpo", SDPOConfig)])
def test_random_init_is_the_same_whatever_the_rank_seeded(
    recipe: str, schema: type, tmp_path: Path
) -> None:
    """torchtune's set_seed offsets the seed by the rank; FSDP shards one model, so the random
    initial weights must come from cfg.seed alone (A2 built them from the offset stream)."""
    weights = []
    for rank_offset in (0, 1):
        cfg = _config(recipe, schema, tmp_path / str(rank_offset), "eval_dataset=null")
        instance = {"grpo": GRPORecipe, "sdpo": SDPORecipe}[recipe](cfg)
        training.set_seed(seed=cfg.seed + rank_offset)  # what rank 1's set_seed does
        instance.setup()
        weights.append({k: v.clone() for k, v in instance.run.model.state_dict().items()})
        instance.cleanup()
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


def test_a_run_stops_when_its_reward_scores_nothing_three_batches_in_a_row() -> None:
    """reward/unscored 1.0 for UNSCORED_BATCHES_LIMIT generation batches in a row stops the run
    with the first row's reason; a batch with one row scored starts the count again."""
    objective = object.__new__(ComposerObjective)  # the check reads only its own counter
    objective._unscored_batches = 0
    rollout = SimpleNamespace(feedback=["unscored: the sandbox could not run the grader (x)"])
    check = objective._stop_if_nothing_is_scored
    for unscored in (1.0, 1.0, 0.5, 1.0, 1.0):  # never three in a row
        check(rollout, unscored)
    with pytest.raises(RewardUnscoredError) as raised:
        check(rollout, 1.0)
    assert str(raised.value) == (
        f"the reward scored no completion of the last {UNSCORED_BATCHES_LIMIT} generation "
        "batches (reward/unscored 1.0); the first one's reason: unscored: the sandbox could not "
        "run the grader (x)"
    )
