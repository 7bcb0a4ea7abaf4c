"""A4: the composer_full recipe end to end: its cpu_smoke config runs with all three channels,
channel 1 alone is A1 exactly, channels 1+2 are A2 and channels 1+3 are A3 exactly, a
zero-weight channel costs nothing, and FSDP2 on 2 CPU processes agrees with one process.

The mechanics tests start from random weights (``warm_start=null``) with a dense stand-in
reward, so that every group has reward spread and every step a gradient; only the cpu_smoke run
uses the session's SFT warm start.
"""

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from composer_tune import config
from composer_tune.checkpointing.run_state import latest_checkpoint
from composer_tune.run.loop import TIMING_METRICS
from recipes.composer_full import ComposerFullConfig, ComposerFullRecipe
from recipes.grpo import GRPOConfig, GRPORecipe
from recipes.replay_dpo import ReplayDPOConfig, ReplayDPORecipe
from recipes.sdpo import SDPOConfig, SDPORecipe
from tests.recipe_runs import REPO_ROOT, RecipeRun, run_recipe, run_tune

pytestmark = pytest.mark.slow

# Random weights, a reward that random completions earn about half the time, tiny batches.
MECHANICS = (
    "warm_start=null",
    "reward._component_=composer_tune.rewards.FormatReward",
    "reward.pattern=^.*[a-m]",
    "num_prompts_per_generation=4",
    "group_size=4",
    "micro_batch_size=8",
    "max_new_tokens=6",
    "eval_dataset.num_samples=16",
    "eval_max_new_tokens=6",
    "logging.progress_bar=false",
    "optimizer.lr=1e-3",
)
# composer_full's cpu_smoke reward also sets reveal_answer, a MathAnswerReward argument (channel
# 2's feedback hint) that FormatReward does not take.
FULL_MECHANICS = ("~reward.reveal_answer", *MECHANICS)
CHANNEL_1_ONLY = ("sdpo.weight=0", "dpo.weight=0")
CHANNEL_3_ONLY = ("loss.weight=0", "sdpo.weight=0")


def logged_metrics(output_dir: Path) -> dict[int, dict[str, float]]:
    """Every metric of the run's DiskLogger file, step -> {name: value}, without timings."""
    (log_file,) = (output_dir / "logs").glob("log_*.txt")
    steps: dict[int, dict[str, float]] = {}
    for line in log_file.read_text().splitlines():
        match = re.match(r"Step (\d+) \| (.*)", line)
        if match:
            pairs = (item.rsplit(":", 1) for item in match.group(2).split())
            steps.setdefault(int(match.group(1)), {}).update(
                {name: float(value) for name, value in pairs if name not in TIMING_METRICS}
            )
    return steps


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    model_dir = latest_checkpoint(output_dir) / "model"
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


class ForwardCounter:
    """Counts forward calls of a module (hook on its ``forward``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1


def run_in_process(
    recipe_cls: type, schema: type, recipe: str, output_dir: Path, overrides: list[str]
) -> tuple[object, int]:
    """Set up and train a recipe in this process; returns it and its policy's forward count."""
    cfg = config.load_config(
        "cpu_smoke",
        [f"output_dir={output_dir}", *overrides],
        recipe_file=REPO_ROOT / "recipes" / f"{recipe}.py",
        schema=schema,
    )
    instance = recipe_cls(cfg)
    instance.setup()
    counter = ForwardCounter(instance.run.model)
    instance.train()
    instance.cleanup()
    return instance, counter.calls


def test_cpu_smoke_runs_all_channels(sft_hints_warm_start: RecipeRun, tmp_path: Path) -> None:
    run = run_recipe(
        "composer_full",
        "cpu_smoke",
        tmp_path / "full",
        f"warm_start.output_dir={sft_hints_warm_start.output_dir}",
        "num_prompts_per_generation=4",
        "max_steps=2",
        "eval_dataset.num_samples=16",
        "logging.progress_bar=false",
    )
    logged = logged_metrics(run.output_dir)
    for step in (1, 2):
        assert math.isfinite(logged[step]["loss"]), logged[step]
        assert 0 < logged[step]["grad_norm"] < math.inf, logged[step]
        assert logged[step]["sdpo/valid_tokens"] > 0, logged[step]  # channel 2 distilled
        assert math.isfinite(logged[step]["dpo/loss"]), logged[step]  # channel 3 trained
    # Channel 3's reference is the warm start: before the first update every implicit reward
    # is zero up to float noise (the reference was scored in other batches).
    assert logged[0]["eval/dpo_margin"] == pytest.approx(0.0, abs=1e-4)
    assert logged[1]["dpo/rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert logged[2]["eval/dpo_margin"] != logged[0]["eval/dpo_margin"]
    assert "held-out pairs: DPO accuracy before" in run.stdout
    assert latest_checkpoint(run.output_dir).name == "step_0000002"


def test_channel_one_alone_is_grpo(tmp_path: Path) -> None:
    # Same seed, same overrides (A4's max_seq_len set to A1's and one LR schedule for both, so
    # the configs differ in nothing but A4's switched-off channels).
    common = [
        *MECHANICS,
        "max_steps=3",
        "steps_per_generation=1",
        "num_iterations=1",
        "lr_scheduler=null",
    ]
    _, grpo_forwards = run_in_process(
        GRPORecipe, GRPOConfig, "grpo", tmp_path / "grpo", [*common, "loss.beta=0.1"]
    )
    full, full_forwards = run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        tmp_path / "full",
        [
            *common,
            "~reward.reveal_answer",
            *CHANNEL_1_ONLY,
            "loss.beta=0.1",
            "model.max_seq_len=128",
        ],
    )
    grpo_log, full_log = logged_metrics(tmp_path / "grpo"), logged_metrics(tmp_path / "full")
    assert sorted(grpo_log) == sorted(full_log) == [0, 1, 2, 3]
    assert full_log == grpo_log  # every logged value, exactly: no extra channel metrics
    # Every step moved the weights (equal final weights are not two untouched copies).
    assert all(grpo_log[step]["grad_norm"] > 0 for step in (1, 2, 3)), grpo_log
    grpo_weights, full_weights = final_weights(tmp_path / "grpo"), final_weights(tmp_path / "full")
    assert grpo_weights.keys() == full_weights.keys()
    for name, value in grpo_weights.items():
        assert torch.equal(value, full_weights[name]), name
    # Nothing of the switched-off channels exists, and the policy ran the same forwards.
    assert full.pairs is None and full.ema_teacher is None
    assert full_forwards == grpo_forwards


def assert_same_weights(first: Path, second: Path) -> None:
    first_weights, second_weights = final_weights(first), final_weights(second)
    assert first_weights.keys() == second_weights.keys()
    for name, value in first_weights.items():
        assert torch.equal(value, second_weights[name]), name


PARITY = (
    "max_steps=3",
    "steps_per_generation=1",
    "num_iterations=1",
    "lr_scheduler=null",
)


def test_channels_one_and_two_are_sdpo(tmp_path: Path) -> None:
    """A4 with channel 3 off runs A2's step: one shared student forward, the same SDPO teacher
    contexts and normalisers, the same EMA-free teacher."""
    common = [*FULL_MECHANICS, *PARITY, "model.max_seq_len=128"]
    _, sdpo_forwards = run_in_process(SDPORecipe, SDPOConfig, "sdpo", tmp_path / "sdpo", common)
    full, full_forwards = run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        tmp_path / "full",
        [*common, "dpo.weight=0"],
    )
    sdpo_log, full_log = logged_metrics(tmp_path / "sdpo"), logged_metrics(tmp_path / "full")
    assert sorted(sdpo_log) == sorted(full_log) == [0, 1, 2, 3]
    for step, full_metrics in full_log.items():
        # A2 also logs its SDPO share of the loss; everything A4 logs, A2 logged identically.
        assert set(sdpo_log[step]) - set(full_metrics) <= {"sdpo/weighted_loss"}, step
        assert {name: sdpo_log[step][name] for name in full_metrics} == full_metrics, step
    assert all(full_log[step]["sdpo/valid_tokens"] > 0 for step in (1, 2, 3)), full_log
    assert all(full_log[step]["grad_norm"] > 0 for step in (1, 2, 3)), full_log
    assert_same_weights(tmp_path / "sdpo", tmp_path / "full")
    assert full.pairs is None
    assert full_forwards == sdpo_forwards


def test_channels_one_and_three_are_replay_dpo(tmp_path: Path) -> None:
    """A4 with channel 2 off runs A3's step: the same pair stream, reference table and pair
    loss after the same policy micro-batches."""
    _, replay_forwards = run_in_process(
        ReplayDPORecipe, ReplayDPOConfig, "replay_dpo", tmp_path / "a3", [*MECHANICS, *PARITY]
    )
    full, full_forwards = run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        tmp_path / "full",
        [*FULL_MECHANICS, *PARITY, "sdpo.weight=0", "dpo.weight=1.0"],  # A3 cpu_smoke: 1.0
    )
    replay_log, full_log = logged_metrics(tmp_path / "a3"), logged_metrics(tmp_path / "full")
    assert sorted(replay_log) == sorted(full_log) == [0, 1, 2, 3]
    assert full_log == replay_log  # every logged value, the pair metrics included
    assert all(math.isfinite(full_log[step]["dpo/loss"]) for step in (1, 2, 3)), full_log
    assert full_log[3]["eval/dpo_margin"] != full_log[0]["eval/dpo_margin"]
    assert_same_weights(tmp_path / "a3", tmp_path / "full")
    assert full.ema_teacher is None
    assert full_forwards == replay_forwards


def test_zero_weight_channels_cost_nothing(tmp_path: Path) -> None:
    # Channels 2 and 3 configured with their most expensive options but weight 0: no EMA
    # teacher, no reference model, no pairs, no teacher batch.
    full, _ = run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        tmp_path / "off",
        [
            *FULL_MECHANICS,
            *CHANNEL_1_ONLY,
            "max_steps=1",
            "sdpo.teacher=ema",
            "dpo.reference=live",
        ],
    )
    assert full.objective.reference is None and full.ema_teacher is None
    assert full.pairs is None
    assert "sdpo/valid_tokens" not in logged_metrics(tmp_path / "off")[1]

    # Channel 3 alone: no rollouts and no generation, so the policy's forwards are exactly the
    # reference pass, the held-out pair evaluations before and after, and one per step.
    steps = 3
    dpo, forwards = run_in_process(
        ComposerFullRecipe,
        ComposerFullConfig,
        "composer_full",
        tmp_path / "dpo",
        [
            *(item for item in FULL_MECHANICS if not item.startswith("eval_dataset.")),
            *CHANNEL_3_ONLY,
            f"max_steps={steps}",
            "eval_dataset=null",
        ],
    )
    assert dpo.objective.reference is None  # precomputed reference, no KL: no reference model
    train_pairs = len(dpo.pairs.train)
    heldout_pairs = len(dpo.pairs.heldout)
    reference_batches = sum(
        math.ceil(count / dpo.channels.dpo.reference_batch_size)
        for count in (train_pairs, heldout_pairs)
    )
    eval_batches = math.ceil(heldout_pairs / dpo.channels.dpo.eval_batch_size)
    # The counter was attached after setup, so the reference pass is not in `forwards`.
    assert forwards == 2 * eval_batches + steps
    assert reference_batches > 0
    logged = logged_metrics(tmp_path / "dpo")
    assert "reward/mean" not in logged[1] and "ratio/mean" not in logged[1]
    assert logged[1]["loss"] == pytest.approx(dpo.channels.dpo.weight * logged[1]["dpo/loss"])


def test_fsdp_two_processes(tmp_path: Path) -> None:
    """Same global batch on 1 and 2 ranks. Channel 3 alone is deterministic (no sampling), so
    its whole loss trajectory must agree; with all channels on, ranks sample other completions
    than one process, so only step 1's DPO loss and DPO gradient norm (taken before any update;
    ``log_channel_gradients`` over FSDP2 shards) are comparable."""
    runs = {
        "dpo": [*FULL_MECHANICS, *CHANNEL_3_ONLY, "max_steps=3"],
        "all": [*FULL_MECHANICS, "max_steps=2", "log_channel_gradients=true"],
    }
    logs = {}
    for name, overrides in runs.items():
        run_recipe("composer_full", "cpu_smoke", tmp_path / f"{name}_single", *overrides)
        result = run_tune(
            "--nproc_per_node",
            "2",
            "recipes/composer_full.py",
            "--config",
            "cpu_smoke",
            f"output_dir={tmp_path / f'{name}_fsdp'}",
            *overrides,
        )
        assert result.returncode == 0, result.stderr[-5000:]
        logs[name] = (
            logged_metrics(tmp_path / f"{name}_single"),
            logged_metrics(tmp_path / f"{name}_fsdp"),
        )
    single, fsdp = logs["dpo"]
    assert sorted(single) == sorted(fsdp) == [0, 1, 2, 3]
    # Tolerance: float32 sums in another order (sharded all-gathers and reduce-scatters).
    for step in (1, 2, 3):
        assert fsdp[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-4, abs=1e-5)
        assert fsdp[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-3)
    for name in ("eval/dpo_loss", "eval/dpo_margin", "eval/dpo_accuracy"):
        assert fsdp[3][name] == pytest.approx(single[3][name], rel=1e-4, abs=1e-5), name
    assert single[3]["eval/dpo_loss"] != single[0]["eval/dpo_loss"]  # it trained

    single, fsdp = logs["all"]
    assert fsdp[1]["dpo/loss"] == pytest.approx(single[1]["dpo/loss"], rel=1e-4, abs=1e-5)
    assert fsdp[1]["grad_norm/dpo"] == pytest.approx(single[1]["grad_norm/dpo"], rel=1e-3)
    for step in (1, 2):
        assert math.isfinite(fsdp[step]["loss"]) and fsdp[step]["sdpo/valid_tokens"] > 0
        shares = [fsdp[step][f"grad_share/{name}"] for name in ("policy", "sdpo", "dpo")]
        assert sum(shares) == pytest.approx(1, abs=1e-4)
    assert latest_checkpoint(tmp_path / "all_fsdp").name == "step_0000002"


def test_shared_prefix_forward_changes_no_logged_value(tmp_path: Path) -> None:
    """All three channels with each group's prompt run once (the default) and with one row per
    completion: the same first step, every logged value equal up to fp32 rounding."""
    common = [*FULL_MECHANICS, "max_steps=1", "lr_scheduler=null"]
    logs = {}
    for shared in (True, False):
        output_dir = tmp_path / f"shared_{shared}"
        full, _ = run_in_process(
            ComposerFullRecipe,
            ComposerFullConfig,
            "composer_full",
            output_dir,
            [*common, f"shared_prefix_forward={str(shared).lower()}"],
        )
        assert full.objective.shared_prefix is shared
        logs[shared] = logged_metrics(output_dir)[1]
    shared_log, plain_log = logs[True], logs[False]
    assert shared_log.keys() == plain_log.keys()
    assert shared_log["sdpo/valid_tokens"] > 0 and math.isfinite(shared_log["dpo/loss"])
    for name, value in plain_log.items():
        assert shared_log[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


def test_channel_gradient_norms_equal_each_channel_alone(tmp_path: Path) -> None:
    """``log_channel_gradients``: step 1 of all three channels logs each channel's gradient
    norm, which is the step's whole gradient norm when that channel runs alone on the same
    rollouts and pairs; the shares add to 1 and every other logged value is unchanged. Each
    channel's push on the end-of-reply logit and share of its logit gradient there are logged
    too (their values are checked in tests/test_channel_gradients.py)."""
    common = [*FULL_MECHANICS, "max_steps=1", "lr_scheduler=null"]
    runs = {
        "split": ["log_channel_gradients=true"],
        "together": [],
        "policy": ["sdpo.weight=0", "dpo.weight=0"],
        "sdpo": ["loss.weight=0", "dpo.weight=0"],
        "dpo": list(CHANNEL_3_ONLY),
    }
    logs = {}
    for name, overrides in runs.items():
        run_in_process(
            ComposerFullRecipe, ComposerFullConfig, "composer_full", tmp_path / name,
            [*common, *overrides],
        )  # fmt: skip
        logs[name] = logged_metrics(tmp_path / name)[1]
    split, together = logs["split"], logs["together"]
    channels = ("policy", "sdpo", "dpo")
    assert set(split) - set(together) == {
        f"{kind}/{name}"
        for kind in ("grad_norm", "grad_share", "eos_push", "eos_share")
        for name in channels
    }
    for name in channels:
        assert 0 < split[f"eos_share/{name}"] < 1 and split[f"eos_push/{name}"] != 0
    for name, value in together.items():
        assert split[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for name in channels:
        assert split[f"grad_norm/{name}"] == pytest.approx(logs[name]["grad_norm"], rel=1e-4)
    assert sum(split[f"grad_share/{name}"] for name in channels) == pytest.approx(1, abs=1e-4)
    assert len({split[f"grad_norm/{name}"] for name in channels}) == 3
