"""recipes/diloco.py: its configs, layout checks and pair sharding (fast), then end to end
(slow): 2 replicas through tools/launch_diloco.py, exactly as a user types the one-machine
command of the README, with all three channels of the composer loop on; an exact resume of both
replicas from their checkpoints; one replica against composer_full.

Checked from what the replicas write (checkpoints and DiskLogger metrics), against values
computed here: after every sync both replicas hold bit-identical global weights (and, with
fragment_update_alpha 0, local weights equal to them); the first outer step moved the global
weights by lr * (1 + momentum) times the logged averaged pseudo-gradient norm (Nesterov SGD's
first step); the logged communication reduction equals sync_every and every quorum had both
replicas; every inner step trained channels 2 (SDPO) and 3 (trace-replay DPO) on every replica;
a run resumed from the middle checkpoint continues at the saved pair position with the saved EMA
teacher and ends with the same global weights (and the same channel-3 metrics) as the
uninterrupted run. With one replica
the inner steps log exactly composer_full's metrics (the shared composer_tune/channels/composer.py
step), a non-finite step is skipped in both yet keeps its place in the sync window, and the
sync's outer step equals one computed here from composer_full's weights.

Every run starts from the session's SFT warm start (``sft_warm_start`` in conftest.py).
"""

import math
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.channels.replay_dpo import DPOChannelConfig, PairChannel
from composer_tune.checkpointing.run_state import (
    TRAINING_STATE,
    latest_checkpoint,
    load_model_weights,
)
from composer_tune.diloco import split_into_fragments
from composer_tune.distributed import DistInfo
from composer_tune.models import qwen3_tiny
from composer_tune.run.loop import TIMING_METRICS, check_rl_batch_layout
from recipes.composer_full import ComposerFullConfig
from recipes.diloco import DiLoCoRecipe, DiLoCoRecipeConfig
from tests.recipe_runs import REPO_ROOT, TUNE, RecipeRun, checkout_env, run_recipe

SYNC_EVERY = 2
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # cpu_smoke's outer optimizer (the DiLoCo paper's)
# The inner loop's overrides, shared with the composer_full run it is compared with. Tiny
# rollouts; a dense stand-in reward (the answer ends in an odd digit) so that every group has
# reward spread and every inner step a gradient (held-out evaluation still scores answers); 2
# pairs per replica and step, so each replica's 4-pair shard takes 2 steps per epoch and a resume
# lands mid-way through the pair stream. Channels 2 and 3 at cpu_smoke's weights, channel 2 with
# an EMA teacher at a fast rate, so that an EMA restored wrongly on resume shows.
INNER = (
    "sdpo.teacher=ema",
    "sdpo.ema_rate=0.5",
    "~reward.reveal_answer",  # a MathAnswerReward argument (channel 2's feedback hint)
    "reward._component_=composer_tune.rewards.FormatReward",
    r"reward.pattern=\d*[13579]$",
    "num_prompts_per_generation=4",
    "group_size=4",
    "micro_batch_size=16",
    "eval_dataset.num_samples=16",
    "dpo.pairs_per_step=2",
    "logging.progress_bar=false",
)
QUICK = (
    f"diloco.sync_every={SYNC_EVERY}",
    f"checkpoint.save_every_n_steps={SYNC_EVERY}",
    *INNER,
)
# The README's one-machine command (python and tune: this environment's), run by `launch`.
LAUNCH_COMMAND = (
    "python", "tools/launch_diloco.py", "--replicas", "2", "--",
    "tune", "run", "recipes/diloco.py", "--config", "cpu_smoke",
)  # fmt: skip
# Whole launch on 2 busy cores; normally well under a minute.
LAUNCH_TIMEOUT_S = 600


def warm_start_from(sft: RecipeRun) -> tuple[str, str]:
    """Overrides that start from the session's SFT cpu_smoke run (the configs name the
    cpu_smoke_hints run; the warm start checks that its folder holds the run it names)."""
    return f"warm_start.output_dir={sft.output_dir}", "warm_start.config=cpu_smoke"


def launch(output_dir: Path, sft: RecipeRun, *overrides: str, replicas: int = 2) -> str:
    """The one-machine command (``LAUNCH_COMMAND``): lighthouse + ``replicas`` replicas of
    recipes/diloco.py --config cpu_smoke. Returns the launcher's combined output; fails the test
    if any replica fails."""
    executables = {"python": sys.executable, "tune": TUNE}
    command = [executables.get(word, word) for word in LAUNCH_COMMAND]
    command[command.index("--replicas") + 1] = str(replicas)
    command += [
        f"output_dir={output_dir}", *warm_start_from(sft), *QUICK, *overrides,
    ]  # fmt: skip
    env = checkout_env()
    # Two replicas share 2 cores; one thread each also keeps the runs bit-reproducible.
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def checkpoint(output_dir: Path, replica: int, step: int) -> Path:
    return output_dir / f"replica_{replica}" / "checkpoints" / f"step_{step:07d}"


def diloco_state(path: Path) -> dict[str, Any]:
    """The (single-rank) DiLoCo state stored in a checkpoint's recipe state."""
    state = torch.load(path / TRAINING_STATE, map_location="cpu", weights_only=False)
    (rank_state,) = state["recipe_state"]["diloco"]
    return rank_state


def global_weights(path: Path) -> dict[str, torch.Tensor]:
    """The global weights of a checkpoint under the model's parameter names."""
    (fragment,) = diloco_state(path)["fragments"]
    return {MODEL_NAMES[name]: tensor for name, tensor in fragment["original_parameters"].items()}


def _fragment_to_model_names() -> dict[str, str]:
    """torchft keys a fragment's global weights by fragment-local names; map them back."""
    model_cfg = OmegaConf.load(REPO_ROOT / "recipes/configs/diloco/cpu_smoke.yaml").model
    kwargs = {k: v for k, v in OmegaConf.to_container(model_cfg).items() if k != "_component_"}
    model = qwen3_tiny(**kwargs)
    names = {id(p): name for name, p in model.named_parameters()}
    (fragment,), _ = split_into_fragments(model, 1)
    return {name: names[id(p)] for name, p in fragment.named_parameters()}


MODEL_NAMES = _fragment_to_model_names()


def logged(output_dir: Path, replica: int | None) -> dict[int, dict[str, float]]:
    """Every metric of a replica's DiskLogger files (``replica=None``: a composer_full run's):
    step -> {name: value}."""
    log_dir = output_dir / (f"replica_{replica}" if replica is not None else "") / "logs"
    steps: dict[int, dict[str, float]] = {}
    for log_file in sorted(log_dir.glob("log_*.txt")):
        for line in log_file.read_text().splitlines():
            match = re.match(r"Step (\d+) \| (.*)", line)
            if match:
                pairs = (item.rsplit(":", 1) for item in match.group(2).split())
                steps.setdefault(int(match.group(1)), {}).update(
                    {name: float(value) for name, value in pairs}
                )
    return steps


def outer_steps(output_dir: Path, replica: int) -> list[dict[str, float]]:
    """The per-sync metrics a replica logged, in order."""
    return [m for _, m in sorted(logged(output_dir, replica).items()) if "diloco/outer_step" in m]


@pytest.fixture(scope="module")
def two_replicas(sft_warm_start: RecipeRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two replicas, all three channels, 3 outer steps of SYNC_EVERY inner steps, a checkpoint
    after each sync."""
    output_dir = tmp_path_factory.mktemp("diloco")
    output = launch(output_dir, sft_warm_start, f"max_steps={3 * SYNC_EVERY}")
    assert "[launcher] replica 0 finished" in output and "[launcher] replica 1 finished" in output
    return output_dir


@pytest.mark.slow
def test_replicas_agree_on_the_global_weights_after_every_sync(two_replicas: Path) -> None:
    for outer_step in (1, 2, 3):
        step = outer_step * SYNC_EVERY
        paths = [checkpoint(two_replicas, replica, step) for replica in (0, 1)]
        states = [diloco_state(path) for path in paths]
        assert [s["manager"]["step"] for s in states] == [outer_step, outer_step]
        weights = [global_weights(path) for path in paths]
        assert weights[0].keys() == weights[1].keys() == set(MODEL_NAMES.values())
        for name, tensor in weights[0].items():
            assert torch.equal(tensor, weights[1][name]), (outer_step, name)
        # fragment_update_alpha 0: after a sync each replica continues from the global weights.
        for replica, path in enumerate(paths):
            local = load_model_weights(path / "model")
            for name, tensor in weights[replica].items():
                assert torch.equal(local[name], tensor), (outer_step, replica, name)


@pytest.mark.slow
def test_first_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient(
    two_replicas: Path, sft_warm_start: RecipeRun
) -> None:
    # global_1 = global_0 - lr * (g + momentum * buf) with buf = g on the first step.
    initial = load_model_weights(latest_checkpoint(sft_warm_start.output_dir) / "model")
    after_first = global_weights(checkpoint(two_replicas, 0, SYNC_EVERY))
    moved = torch.sqrt(
        sum(
            (initial[name].double() - after_first[name].double()).square().sum()
            for name in MODEL_NAMES.values()
        )
    )
    pseudo_grad_norm = outer_steps(two_replicas, 0)[0]["diloco/pseudo_grad_norm"]
    assert pseudo_grad_norm > 0
    assert float(moved) == pytest.approx(
        OUTER_LR * (1 + OUTER_MOMENTUM) * pseudo_grad_norm, rel=1e-4
    )


@pytest.mark.slow
def test_every_sync_is_logged_with_both_replicas_and_sync_every_times_less_traffic(
    two_replicas: Path,
) -> None:
    per_replica = [outer_steps(two_replicas, replica) for replica in (0, 1)]
    for syncs in per_replica:
        assert [s["diloco/outer_step"] for s in syncs] == [1.0, 2.0, 3.0]
        for sync in syncs:
            assert sync["diloco/committed"] == 1.0
            assert sync["diloco/participants"] == 2.0
            assert sync["diloco/inner_steps"] == SYNC_EVERY
            assert sync["diloco/comm_reduction"] == pytest.approx(SYNC_EVERY)
            assert sync["diloco/dp_bytes_sent"] == pytest.approx(
                SYNC_EVERY * sync["diloco/bytes_sent"]
            )
    # Both replicas applied the same averaged pseudo-gradient at each sync.
    norms = [[s["diloco/pseudo_grad_norm"] for s in syncs] for syncs in per_replica]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    # Held-out evaluation of the global weights before and after training, on both replicas.
    for replica in (0, 1):
        evals = [m for m in logged(two_replicas, replica).values() if "eval/accuracy" in m]
        assert len(evals) == 2


@pytest.mark.slow
def test_every_inner_step_trains_channels_2_and_3_on_every_replica(two_replicas: Path) -> None:
    for replica in (0, 1):
        metrics = logged(two_replicas, replica)
        for step in range(1, 3 * SYNC_EVERY + 1):
            m = metrics[step]
            assert m["sdpo/valid_tokens"] > 0, (replica, step, m)  # channel 2 distilled
            assert 0 < m["sdpo/divergence"] < math.inf, (replica, step, m)
            assert 0 < m["dpo/loss"] < math.inf, (replica, step, m)  # channel 3 trained
            assert m["skipped_nonfinite_steps"] == 0
        # Channel 3's reference is the warm start: the first step's implicit rewards are zero
        # (up to float noise), later ones are not, and held-out pair metrics of the global
        # weights were measured before and after.
        assert metrics[1]["dpo/rewards/margins"] == pytest.approx(0.0, abs=1e-4)
        assert metrics[3 * SYNC_EVERY]["dpo/rewards/margins"] != pytest.approx(0.0, abs=1e-6)
        evals = [step for step, m in sorted(metrics.items()) if "eval/dpo_accuracy" in m]
        assert evals == [0, 3 * SYNC_EVERY]
        assert metrics[3 * SYNC_EVERY]["eval/dpo_loss"] != metrics[0]["eval/dpo_loss"]


def pair_position_after(steps: int, train_pairs: int, replicas: int, pairs_per_step: int) -> dict:
    """Where a replica's pair stream stands after ``steps`` steps: its shard (train_pairs //
    replicas pairs) is cut into batches of pairs_per_step, a new epoch starts when it is used."""
    batches_per_epoch = (train_pairs // replicas) // pairs_per_step
    return {
        "epoch": (steps - 1) // batches_per_epoch,
        "batches_in_epoch": (steps - 1) % batches_per_epoch + 1,
    }


@pytest.mark.slow
def test_resume_from_the_middle_checkpoint_ends_on_the_same_global_weights(
    two_replicas: Path, sft_warm_start: RecipeRun, tmp_path: Path
) -> None:
    # Each replica restarts from its own outer-step-2 checkpoint (as if killed after it).
    for replica in (0, 1):
        source = checkpoint(two_replicas, replica, 2 * SYNC_EVERY)
        shutil.copytree(source, checkpoint(tmp_path, replica, 2 * SYNC_EVERY))
    output = launch(
        tmp_path,
        sft_warm_start,
        f"max_steps={3 * SYNC_EVERY}",
        "checkpoint.resume_from_checkpoint=latest",
    )
    assert output.count(f"at step {2 * SYNC_EVERY}, outer step 2") == 2, output[-4000:]
    # The resumed run ends with the same summary line as an uninterrupted one (step-0 values
    # come from the checkpoint).
    assert "held-out accuracy (global weights): before " in output, output[-4000:]
    cfg = load("cpu_smoke", *INNER)
    train_pairs = int(re.search(r"dpo: (\d+) training pairs", output).group(1))
    for replica in (0, 1):
        # Channel 3 resumed at its saved pair position: the checkpoints hold the position of
        # 2 (then 3) outer steps of pairs, and the resumed steps trained on the very pairs the
        # uninterrupted run did (same DPO metrics, bit for bit), neither repeating nor skipping.
        for outer_step, run in ((2, two_replicas), (3, tmp_path)):
            state = torch.load(
                checkpoint(run, replica, outer_step * SYNC_EVERY) / TRAINING_STATE,
                map_location="cpu",
                weights_only=False,
            )
            assert state["recipe_state"]["pair_stream"] == pair_position_after(
                outer_step * SYNC_EVERY, train_pairs, 2, cfg.dpo.pairs_per_step
            )
        resumed_log, uninterrupted_log = logged(tmp_path, replica), logged(two_replicas, replica)
        for step in range(2 * SYNC_EVERY + 1, 3 * SYNC_EVERY + 1):
            dpo = {k: v for k, v in resumed_log[step].items() if k.startswith("dpo/")}
            assert dpo and dpo == {k: uninterrupted_log[step][k] for k in dpo}, step
        assert [s["diloco/outer_step"] for s in outer_steps(tmp_path, replica)] == [3.0]
        resumed = global_weights(checkpoint(tmp_path, replica, 3 * SYNC_EVERY))
        uninterrupted = global_weights(checkpoint(two_replicas, replica, 3 * SYNC_EVERY))
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), (replica, name)


def same_values(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal keys and values, NaN equal to NaN."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


@pytest.mark.slow
def test_one_replica_inner_steps_are_composer_full_steps_and_a_skipped_step_keeps_its_slot(
    sft_warm_start: RecipeRun, tmp_path: Path
) -> None:
    # One replica and one composer_full run on the same config, seed and data, all three
    # channels on; the rewards of step 2 (the sync step) overflow, so both skip it.
    nan_at_step_2 = (
        "reward._component_=tests._diloco_replica.FormatRewardOverflowAt",
        "reward.overflow_calls=[2]",
        f"max_steps={SYNC_EVERY}",
    )
    launch(tmp_path / "diloco", sft_warm_start, *nan_at_step_2, "diloco.min_replicas=1", replicas=1)
    run_recipe(
        "composer_full",
        "cpu_smoke",
        tmp_path / "full",
        *warm_start_from(sft_warm_start),
        *INNER,
        *nan_at_step_2,
    )
    diloco, full = logged(tmp_path / "diloco", 0), logged(tmp_path / "full", None)
    assert sorted(diloco) == sorted(full) == [0, 1, 2]

    def comparable(metrics: dict[str, float], step: int) -> dict[str, float]:
        # Not timings, not DiLoCo's own metrics, not the final evaluation (composer_full
        # scores its local weights, DiLoCo the global ones after the sync), and not the
        # sampler/trainer gap: the two processes' KV-cache decoding rounds the sampler's
        # log-probs differently (measured 5.0e-7 vs 5.4e-7 mean gap), while every trained value
        # is the same bit for bit.
        return {
            k: v
            for k, v in metrics.items()
            if k not in TIMING_METRICS
            and not k.startswith(("diloco/", "sampling/"))
            and not (step == 2 and k.startswith("eval/"))
        }

    for step in (0, 1, 2):
        got, expected = comparable(diloco[step], step), comparable(full[step], step)
        assert same_values(got, expected), (step, got, expected)
    for name in ("sampling/logp_diff_abs", "sampling/ratio"):
        assert diloco[1][name] == pytest.approx(full[1][name], abs=1e-5), name
    assert diloco[1]["sdpo/valid_tokens"] > 0 and 0 < diloco[1]["dpo/loss"] < math.inf
    assert math.isnan(diloco[2]["loss"]) and diloco[2]["skipped_nonfinite_steps"] == 1
    # The skipped step kept its place in the window: the sync came after inner step 2 and
    # counted 2 inner steps.
    assert diloco[2]["diloco/outer_step"] == 1 and diloco[2]["diloco/inner_steps"] == SYNC_EVERY
    # The outer step used the local weights composer_full ended with (step 1's update only):
    # global_1 = global_0 - lr * (1 + momentum) * (global_0 - local), Nesterov's first step.
    initial = load_model_weights(latest_checkpoint(sft_warm_start.output_dir) / "model")
    local = load_model_weights(latest_checkpoint(tmp_path / "full") / "model")
    synced = global_weights(checkpoint(tmp_path / "diloco", 0, SYNC_EVERY))
    assert synced.keys() == local.keys()
    assert any(not torch.equal(initial[name], local[name]) for name in local)  # step 1 trained
    for name, value in synced.items():
        pseudo_gradient = initial[name] - local[name]
        expected = initial[name] - OUTER_LR * (1 + OUTER_MOMENTUM) * pseudo_gradient
        torch.testing.assert_close(value, expected, msg=name)


# ----------------------------------------------------------------------------- fast checks


def load(name: str, *overrides: str) -> Any:
    return config.load_config(
        name,
        list(overrides),
        recipe_file=REPO_ROOT / "recipes" / "diloco.py",
        schema=DiLoCoRecipeConfig,
    )


@pytest.mark.parametrize("name", ["cpu_smoke", "qwen3_7b", "qwen3_32b"])
def test_configs_validate_and_their_diloco_section_is_consistent(name: str) -> None:
    cfg = load(name, "checkpoint.initial_checkpoint=/ckpt", "diloco.hostname=node0")
    diloco = cfg.diloco
    window = diloco.sync_every // diloco.num_fragments
    assert diloco.sync_every % diloco.num_fragments == 0
    assert window % (cfg.steps_per_generation * cfg.num_iterations) == 0
    assert cfg.max_steps % window == 0
    assert cfg.checkpoint.save_every_n_steps % window == 0
    assert (diloco.outer_lr, diloco.outer_momentum, diloco.outer_nesterov) == (0.7, 0.9, True)
    assert not diloco.should_quantize


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        (["steps_per_generation=4", "diloco.sync_every=2"], "steps_per_generation * num_iter"),
        (["max_steps=6", "diloco.sync_every=4"], "max_steps (6)"),
        (["checkpoint.save_every_n_steps=3"], "checkpoint.save_every_n_steps (3)"),
        (["num_prompts_per_generation=4", "group_size=3", "steps_per_generation=8"], "12"),
    ],
)
def test_layouts_that_cannot_work_are_rejected_naming_the_keys(
    overrides: list[str], culprit: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("REPLICA_ID", "1")
    monkeypatch.setenv("NUM_REPLICAS", "2")
    cfg = load("cpu_smoke", f"output_dir={tmp_path}", *overrides)
    recipe = DiLoCoRecipe(cfg)
    assert cfg.output_dir == str(tmp_path / "replica_1")  # each replica writes its own dir
    with pytest.raises(ValueError, match=re.escape(culprit)):
        check_rl_batch_layout(cfg, recipe.dist)  # what every RL recipe checks
        recipe._check_sync_layout(cfg)  # and DiLoCo's sync windows


def test_replica_id_must_fit_the_number_of_replicas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("REPLICA_ID", "2")
    monkeypatch.delenv("NUM_REPLICAS", raising=False)
    cfg = load("cpu_smoke", f"output_dir={tmp_path}")
    with pytest.raises(ValueError, match="NUM_REPLICAS environment variable is missing"):
        DiLoCoRecipe(cfg)
    cfg = load("cpu_smoke", f"output_dir={tmp_path}", "num_replicas=2")
    with pytest.raises(ValueError, match="replica id 2 is outside 0 .. num_replicas - 1 = 1"):
        DiLoCoRecipe(cfg)


def test_readme_and_config_header_give_the_command_ci_runs() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("### DiLoCo on one machine") :]
    start = section.index("```bash") + len("```bash")
    block = section[start : section.index("```", start)]
    words = block.replace("\\\n", " ").split()
    assert words == ["OMP_NUM_THREADS=1", *LAUNCH_COMMAND], words  # launch() sets the variable
    header = (REPO_ROOT / "recipes/configs/diloco/cpu_smoke.yaml").read_text()
    assert "#   " + " ".join(LAUNCH_COMMAND) + "\n" in header


def test_cpu_smoke_inner_loop_is_composer_fulls() -> None:
    """The DiLoCo smoke config trains exactly what composer_full's does (same warm start, task,
    held-out set, channels): every key they share has the same value."""
    diloco = OmegaConf.to_container(load("cpu_smoke", "output_dir=/run"), resolve=True)
    full = OmegaConf.to_container(
        config.load_config(
            "cpu_smoke",
            ["output_dir=/run"],
            recipe_file=REPO_ROOT / "recipes" / "composer_full.py",
            schema=ComposerFullConfig,
        ),
        resolve=True,
    )
    # DiLoCo checkpoints at outer-step boundaries (its save interval counts inner steps of whole
    # sync windows), so its checkpoint section is its own too.
    own = {
        "diloco",
        "num_replicas",
        "max_steps",
        "eval_every_n_steps",
        "eval_every_n_outer_steps",
        "checkpoint",
    }
    assert set(diloco) - own <= set(full)
    for key in sorted(set(diloco) - own):
        assert diloco[key] == full[key], key
    assert diloco["dataset"]["max_digits"] == diloco["eval_dataset"]["max_digits"] == 2


@pytest.mark.parametrize("ranks", [1, 2])
def test_each_rank_of_each_replica_takes_its_own_pairs(ranks: int) -> None:
    cfg = load("cpu_smoke", "output_dir=/run")
    dpo = DPOChannelConfig.from_mapping(
        {**OmegaConf.to_container(cfg.dpo), "reference": "live", "pairs_per_step": 2 * ranks}
    )
    tokenizer = config.instantiate(cfg.tokenizer)
    channels = {
        (replica, rank): PairChannel(
            dpo,
            model=torch.nn.Identity(),  # only read for a precomputed reference
            tokenizer=tokenizer,
            dist=DistInfo(world_size=ranks, rank=rank, device=torch.device("cpu")),
            seed=0,
            logprob_chunk_size=1024,
            state={},
            resumed=False,
            num_replicas=2,
            replica_id=replica,
        )
        for replica in (0, 1)
        for rank in range(ranks)
    }
    train_pairs = {example.pair_id for example in next(iter(channels.values())).train}
    shard = len(train_pairs) // (2 * ranks)
    for _epoch in range(2):
        used: dict[tuple[int, int], list[str]] = {key: [] for key in channels}
        for key, channel in channels.items():
            for _ in range(shard // 2):  # 2 pairs per rank and step
                batch = channel.next_batch()
                assert batch.num_pairs == 2
                used[key] += batch.pair_ids
        # Within an epoch the shards are disjoint and together use every pair but the tail.
        everything = [pair for pairs in used.values() for pair in pairs]
        assert len(set(everything)) == len(everything) == 2 * ranks * shard
        assert set(everything) <= train_pairs


def test_pairs_per_step_too_large_for_the_replicas_is_rejected() -> None:
    cfg = load("cpu_smoke", "output_dir=/run")
    dpo = DPOChannelConfig.from_mapping(
        {**OmegaConf.to_container(cfg.dpo), "reference": "live", "pairs_per_step": 8}
    )
    with pytest.raises(ValueError, match=r"dpo.pairs_per_step=8 per replica over 2 replicas"):
        PairChannel(
            dpo,
            model=torch.nn.Identity(),
            tokenizer=config.instantiate(cfg.tokenizer),
            dist=DistInfo(world_size=1, rank=0, device=torch.device("cpu")),
            seed=0,
            logprob_chunk_size=1024,
            state={},
            resumed=False,
            num_replicas=2,
            replica_id=0,
        )


def test_ctrl_c_stops_every_replica_after_one_sync_and_latest_finishes_the_run(
    two_replicas: Path, sft_warm_start: RecipeRun, tmp_path: Path
) -> None:
    """Ctrl-C to the launcher once both replicas printed their step-0 evaluation: both stop after
    the same committed sync (their stop votes travel in its quorum), save a checkpoint there
    and exit 130 with no traceback; `latest` then ends on the uninterrupted run's weights."""
    executables = {"python": sys.executable, "tune": TUNE}
    command = [executables.get(word, word) for word in LAUNCH_COMMAND]
    command += [
        f"output_dir={tmp_path}", *warm_start_from(sft_warm_start), *QUICK,
        f"max_steps={3 * SYNC_EVERY}", "checkpoint.save_every_n_steps=0",
    ]  # fmt: skip
    env = checkout_env()
    env["OMP_NUM_THREADS"] = "1"
    launcher = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.append(line)
            # Both replicas are training (a replica still importing torch would die of the
            # signal instead of stopping; the launcher then stops the other unsaved). Each
            # replica prints several step-0 lines: count replicas, not lines.
            started = {
                replica
                for replica in ("0", "1")
                for seen in lines
                if seen.startswith(f"[replica {replica}] [step 0, outer step 0]")
            }
            if len(started) == 2:
                launcher.send_signal(signal.SIGINT)
                break
        rest, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = "".join(lines) + rest
    assert launcher.returncode == 130, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    stops = re.findall(r"\[replica (\d)\] stopped at step (\d+); checkpoint (\S+);", output)
    assert sorted(replica for replica, _, _ in stops) == ["0", "1"], output[-6000:]
    (step,) = {int(step) for _, step, _ in stops}  # the same sync on both replicas
    assert step % SYNC_EVERY == 0 and 0 < step < 3 * SYNC_EVERY
    for replica in (0, 1):
        assert latest_checkpoint(tmp_path / f"replica_{replica}") == checkpoint(
            tmp_path, replica, step
        )

    output = launch(
        tmp_path, sft_warm_start, f"max_steps={3 * SYNC_EVERY}",
        "checkpoint.save_every_n_steps=0", "checkpoint.resume_from_checkpoint=latest",
    )  # fmt: skip
    assert output.count(f"at step {step}, outer step {step // SYNC_EVERY}") == 2, output[-4000:]
    for replica in (0, 1):
        resumed = global_weights(checkpoint(tmp_path, replica, 3 * SYNC_EVERY))
        uninterrupted = global_weights(checkpoint(two_replicas, replica, 3 * SYNC_EVERY))
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), (replica, name)
        resumed_log, uninterrupted_log = logged(tmp_path, replica), logged(two_replicas, replica)
        for later in range(step + 1, 3 * SYNC_EVERY + 1):
            metrics = {
                k: v
                for k, v in resumed_log[later].items()
                if k not in TIMING_METRICS and not k.startswith("diloco/total")
            }
            assert "loss" in metrics and metrics == {
                k: uninterrupted_log[later][k] for k in metrics
            }, later
