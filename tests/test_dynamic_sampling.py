"""DAPO's dynamic sampling (composer_tune/run/dynamic_sampling.py) on hand-made generation
batches: which groups are dropped (unscored rows included), the refill until the batch is full,
the limit and what trains when nothing is kept, ranks agreeing on one group count, the metrics,
off leaving the rollouts as they were, exact resume of the prompts drawn, the set-up errors;
and a GRPO run with it on (slow)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from composer_tune.channels.composer import GenerationBatch
from composer_tune.distributed import DistInfo
from composer_tune.guards import NonFiniteGuard
from composer_tune.losses import (
    PolicyLossConfig,
    StepNormalization,
    compute_advantages,
    policy_loss,
)
from composer_tune.rollout.generation import pack_sequences
from composer_tune.rollout.rollouts import RolloutBatch
from composer_tune.run import dynamic_sampling as module
from composer_tune.run.dynamic_sampling import (
    DynamicSampling,
    DynamicSamplingSection,
    informative_groups,
)
from composer_tune.run.loop import epoch_batches
from composer_tune.run.rl import RLRun
from composer_tune.run.state import RunProgress
from tests.recipe_runs import run_recipe, run_tune

G = 4  # group size
PAD = 0
SINGLE = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
DIFFER = [0.0, 1.0, 0.0, 0.0]  # an informative group's rewards
EQUAL = [1.0, 1.0, 1.0, 1.0]


def _batch(groups: Sequence[Sequence[float]], name: str) -> RolloutBatch:
    """A generation batch of one group per reward list; prompt ``g`` is ``{"id": f"{name}.{g}"}``
    and its rows' tokens differ in length from group to group (so batches differ in width)."""
    prompts, completions, samples = [], [], []
    for g, _ in enumerate(groups):
        sample = {"id": f"{name}.{g}"}
        prompt = [1 + (len(name) + g) % 7] * (2 + (len(name) * 3 + g) % 5)
        for row in range(G):
            prompts.append(prompt)
            completions.append([10 + row + g] * (1 + (row + 2 * g + len(name)) % 6))
            samples.append(sample)
    packed = pack_sequences(prompts, completions, pad_id=PAD)
    rows = len(prompts)
    rewards = torch.tensor([r for group in groups for r in group], dtype=torch.float32)
    return RolloutBatch(
        tokens=packed.tokens,
        input_pos=packed.input_pos,
        completion_mask=packed.completion_mask,
        old_logp=torch.randn(packed.tokens.shape) * packed.completion_mask,
        ref_logp=None,
        rewards=rewards,
        correct=rewards > 0.5,
        feedback=[f"feedback {row}" for row in range(rows)],
        truncated=torch.zeros(rows, dtype=torch.bool),
        prompt_lengths=packed.prompt_lengths,
        completion_lengths=packed.completion_lengths,
        group_ids=torch.arange(len(groups)).repeat_interleave(G),
        texts=[f"{name} row {row}" for row in range(rows)],
        samples=samples,
        draw_metrics={"task_sampler/batch_pass_rate": float(len(name))},
    )


class Stream:
    """Generation batches in turn, counting how many were drawn (none past the list)."""

    def __init__(self, batches: Sequence[RolloutBatch]) -> None:
        self.batches, self.drawn = list(batches), 0

    def __iter__(self) -> Iterator[RolloutBatch]:
        return self

    def __next__(self) -> RolloutBatch:
        assert self.drawn < len(self.batches), "drew past the limit"
        self.drawn += 1
        return self.batches[self.drawn - 1]


def _sampling(
    train_groups: int = 4,
    max_generation_batches: int = 10,
    steps_per_generation: int = 1,
    dist: DistInfo = SINGLE,
) -> DynamicSampling:
    section = DynamicSamplingSection(enabled=True, max_generation_batches=max_generation_batches)
    return DynamicSampling(
        section,
        group_size=G,
        train_groups=train_groups,
        steps_per_generation=steps_per_generation,
        dist=dist,
        pad_id=PAD,
    )


def _ids(batch: RolloutBatch) -> list[str]:
    """The prompt of each group of ``batch``, in order."""
    return [batch.samples[row]["id"] for row in range(0, len(batch), G)]


def _metrics(batch: RolloutBatch) -> dict[str, float]:
    return {k: v for k, v in batch.draw_metrics.items() if k.startswith("dynamic_sampling/")}


def test_a_group_is_dropped_when_its_scored_rewards_are_all_equal() -> None:
    nan, inf = math.nan, math.inf
    groups = [
        [0.0, 0.0, 0.0, 0.0],  # all wrong
        [1.0, 1.0, 1.0, 1.0],  # all right
        [0.5, 0.5, 0.5, 0.25],  # one differs
        [nan, 1.0, nan, 0.0],  # two scored, differing
        [nan, 1.0, nan, 1.0],  # two scored, equal
        [nan, nan, 0.7, nan],  # one scored: no advantage
        [nan, nan, nan, nan],  # none scored
        [inf, 1.0, -inf, 1.0],  # non-finite rewards are unscored too
        [-2.0, 3.0, 3.0, 3.0],
    ]
    rewards = torch.tensor([r for group in groups for r in group])
    expected = [False, False, True, True, False, False, False, False, True]
    assert informative_groups(rewards, G).tolist() == expected
    # The groups kept are exactly those with a non-zero advantage (NaN rewards: unscored).
    finite = torch.where(torch.isfinite(rewards), rewards, math.nan)
    moved = compute_advantages(finite, G).view(-1, G).ne(0).any(dim=1)
    assert moved.tolist() == expected


def test_refills_until_the_batch_is_full_in_the_order_drawn() -> None:
    stream = Stream(
        [
            _batch([EQUAL, DIFFER, EQUAL, EQUAL], "a"),
            _batch([DIFFER, EQUAL, DIFFER, EQUAL], "bb"),
            _batch([EQUAL, DIFFER, DIFFER, DIFFER], "ccc"),
            _batch([DIFFER] * 4, "dddd"),  # never drawn: the batch is full before
        ]
    )
    trained = _sampling(train_groups=4).fill(stream)
    assert stream.drawn == 3
    assert _ids(trained) == ["a.1", "bb.0", "bb.2", "ccc.1"]
    assert trained.group_ids.tolist() == torch.arange(4).repeat_interleave(G).tolist()
    # Every row is its generation batch's row, padded to the widest.
    for group, (source, index) in enumerate([(0, 1), (1, 0), (1, 2), (2, 1)]):
        original = stream.batches[source].select(slice(index * G, (index + 1) * G))
        rows = trained.select(slice(group * G, (group + 1) * G))
        width = original.tokens.shape[1]
        for name in ("tokens", "input_pos", "completion_mask", "old_logp"):
            assert torch.equal(getattr(rows, name)[:, :width], getattr(original, name)), name
        assert not rows.completion_mask[:, width:].any()
        assert (rows.tokens[:, width:] == PAD).all()
        assert rows.input_pos[0].tolist() == list(range(rows.tokens.shape[1]))
        assert torch.equal(rows.rewards, original.rewards)
        assert rows.texts == original.texts and rows.feedback == original.feedback
    assert compute_advantages(trained.rewards, G).view(-1, G).ne(0).any(dim=1).all()
    assert _metrics(trained) == {
        "dynamic_sampling/generation_batches": 3.0,
        "dynamic_sampling/generated_groups": 12.0,
        "dynamic_sampling/dropped_groups": 6.0,
        "dynamic_sampling/kept_fraction": 0.5,
        "dynamic_sampling/trained_groups": 4.0,
        "dynamic_sampling/unfiltered": 0.0,
        "dynamic_sampling/generated_reward_mean": pytest.approx(
            float(torch.cat([b.rewards for b in stream.batches[:3]]).mean())
        ),
    }
    # The last generation batch's draw metrics (the task sampler's) ride along.
    assert trained.draw_metrics["task_sampler/batch_pass_rate"] == 3.0
    # tokens/generated counts what was sampled, dropped groups included.
    sampled = sum(float(b.completion_mask.sum()) for b in stream.batches[:3])
    assert trained.sampled_tokens == sampled > float(trained.completion_mask.sum())
    assert GenerationBatch(trained, None, None, {}).generated_tokens == sampled


def test_oversampled_batches_keep_the_first_informative_groups() -> None:
    # train_groups below the generation batch's prompts: one batch fills it, the rest dropped.
    stream = Stream([_batch([EQUAL, DIFFER, DIFFER, DIFFER], "a")])
    trained = _sampling(train_groups=2).fill(stream)
    assert stream.drawn == 1 and _ids(trained) == ["a.1", "a.2"]
    assert _metrics(trained)["dynamic_sampling/trained_groups"] == 2.0


def test_the_limit_trains_on_what_is_kept() -> None:
    batches = [
        _batch([EQUAL, DIFFER, EQUAL, EQUAL], "a"),
        _batch([EQUAL, EQUAL, EQUAL, DIFFER], "bb"),
        _batch([DIFFER] * 4, "ccc"),
    ]
    stream = Stream(batches)
    trained = _sampling(train_groups=4, max_generation_batches=2).fill(stream)
    assert stream.drawn == 2  # stopped at the limit
    assert _ids(trained) == ["a.1", "bb.3"]
    metrics = _metrics(trained)
    assert metrics["dynamic_sampling/generation_batches"] == 2.0
    assert metrics["dynamic_sampling/dropped_groups"] == 6.0
    assert metrics["dynamic_sampling/trained_groups"] == 2.0
    assert metrics["dynamic_sampling/unfiltered"] == 0.0
    # Whole steps only: 3 kept groups of 4 rows do not split into 8 equal steps; 2 groups do.
    stream = Stream([_batch([DIFFER, DIFFER, EQUAL, EQUAL], "a"), batches[1]])
    trained = _sampling(train_groups=4, max_generation_batches=2, steps_per_generation=8).fill(
        stream
    )
    assert _ids(trained) == ["a.0", "a.1"] and len(trained) % 8 == 0


def test_nothing_kept_trains_the_last_batch_as_drawn_without_dividing_by_zero() -> None:
    batches = [_batch([EQUAL] * 4, "a"), _batch([[0.0] * 4] * 3 + [[math.nan] * 4], "bb")]
    stream = Stream([*batches, _batch([DIFFER] * 4, "ccc")])
    trained = _sampling(max_generation_batches=2).fill(stream)
    assert stream.drawn == 2 and trained is batches[1]
    metrics = _metrics(trained)
    assert metrics["dynamic_sampling/unfiltered"] == 1.0
    assert metrics["dynamic_sampling/kept_fraction"] == 0.0
    assert metrics["dynamic_sampling/trained_groups"] == 4.0
    assert metrics["dynamic_sampling/generated_reward_mean"] == pytest.approx(16 / 28)
    # Its step: zero advantages, and every objective's loss and gradient stay finite.
    advantages = compute_advantages(trained.rewards, G)
    assert not advantages.any()
    mask = trained.completion_mask
    for objective in ("grpo", "dr_grpo", "bnpo", "dapo"):
        logp = (torch.randn(mask.shape) * mask).requires_grad_()
        loss, _ = policy_loss(
            logp,
            logp.detach(),
            advantages,
            mask,
            PolicyLossConfig(objective=objective, max_completion_length=8),
            normalization=StepNormalization(float(mask.sum()), 1, 1),
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), objective


def test_a_batch_with_nothing_to_drop_is_returned_as_it_is() -> None:
    batch = _batch([DIFFER] * 4, "a")
    stream = Stream([batch])
    trained = _sampling(train_groups=4).fill(stream)
    assert trained is batch and stream.drawn == 1
    assert _metrics(trained)["dynamic_sampling/dropped_groups"] == 0.0


def _lockstep_all_reduce(world: int) -> object:
    """A sum over ``world`` threads standing in for ranks (every call is a collective). Ranks
    that make different numbers of calls break its barrier (a deadlock in a real run) instead
    of hanging the test."""
    barrier, slots = threading.Barrier(world, timeout=60), {}

    def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
        name = threading.current_thread().name
        slots[name] = value.clone()
        barrier.wait()
        total = sum(slots.values())
        barrier.wait()  # everyone has read before the next call writes
        value.copy_(total)
        return value

    return all_reduce_sum


@pytest.mark.parametrize(
    "rank_batches, drawn, trained_groups, unfiltered",
    [
        # Rank 0 is full at once, rank 1 after three batches: both draw three, train 2 each.
        (
            [
                [[DIFFER, DIFFER], [DIFFER, EQUAL], [EQUAL, EQUAL]],
                [[EQUAL, EQUAL], [EQUAL, DIFFER], [DIFFER, EQUAL]],
            ],
            3,
            [2, 2],
            0.0,
        ),
        # At the limit rank 1 holds one group: rank 0 trains one of its two as well.
        (
            [[[DIFFER, DIFFER], [DIFFER, DIFFER]], [[EQUAL, EQUAL], [EQUAL, DIFFER]]],
            2,
            [1, 1],
            0.0,
        ),
        # Rank 1 holds none: every rank trains its last batch as drawn.
        (
            [[[DIFFER, DIFFER], [DIFFER, DIFFER]], [[EQUAL, EQUAL], [EQUAL, EQUAL]]],
            2,
            [2, 2],
            1.0,
        ),
    ],
)
def test_ranks_train_on_the_same_number_of_groups(
    monkeypatch: pytest.MonkeyPatch,
    rank_batches: list,
    drawn: int,
    trained_groups: list[int],
    unfiltered: float,
) -> None:
    world = len(rank_batches)
    all_reduce_sum = _lockstep_all_reduce(world)
    monkeypatch.setattr(module, "all_reduce_sum", all_reduce_sum)
    limit = len(rank_batches[0])
    results: dict[int, tuple[int, RolloutBatch]] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            stream = Stream(
                [_batch(groups, f"r{rank}b{n}") for n, groups in enumerate(rank_batches[rank])]
            )
            dist = DistInfo(world_size=world, rank=rank, device=torch.device("cpu"))
            trained = _sampling(
                train_groups=2 * world, max_generation_batches=limit, dist=dist
            ).fill(stream)
            results[rank] = (stream.drawn, trained)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
        for r in range(world)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert len(results) == world
    assert [results[r][0] for r in range(world)] == [drawn] * world
    assert [len(results[r][1]) // G for r in range(world)] == trained_groups
    metrics = [_metrics(results[r][1]) for r in range(world)]
    assert metrics[0] == metrics[1]  # every rank logs the same figures
    assert metrics[0]["dynamic_sampling/unfiltered"] == unfiltered
    assert metrics[0]["dynamic_sampling/trained_groups"] == sum(trained_groups)


def test_resume_draws_what_the_uninterrupted_run_draws() -> None:
    """The extra generation batches advance the run's data position and sampling generator, which
    checkpoints hold: a run resumed from its state trains on the uninterrupted run's groups."""
    prompts = [{"id": f"p{i}"} for i in range(40)]

    def rollout(samples: list[dict], generator: torch.Generator) -> RolloutBatch:
        # A prompt's group is informative with a chance that depends on the prompt.
        groups = []
        for sample in samples:
            chance = (int(sample["id"][1:]) % 5) / 5
            informative = float(torch.rand((), generator=generator)) < chance
            groups.append(DIFFER if informative else EQUAL)
        return _batch(groups, "x")

    def progress() -> RunProgress:
        generator = torch.Generator().manual_seed(11)
        return RunProgress(guard=NonFiniteGuard(max_consecutive=3), sampling_generator=generator)

    def training_batches(run: RunProgress) -> Iterator[RolloutBatch]:
        sampler = DistributedSampler(prompts, num_replicas=1, rank=0, shuffle=True, seed=5)
        loader = DataLoader(prompts, batch_size=4, sampler=sampler, drop_last=True, collate_fn=list)
        generated = (
            rollout(samples, run.sampling_generator)
            for samples in epoch_batches(loader, sampler, run)
        )
        return _sampling(train_groups=4, max_generation_batches=3).batches(generated)

    def ids(batches: Iterator[RolloutBatch], count: int) -> list[list[str]]:
        return [_ids(next(batches)) for _ in range(count)]

    straight = ids(training_batches(progress()), 8)
    first = progress()
    before = ids(training_batches(first), 3)
    state = first.state_dict(SINGLE)
    resumed = progress()
    resumed.load_state_dict(state, SINGLE)
    assert before + ids(training_batches(resumed), 5) == straight
    assert state["epoch"] * 10 + state["batches_in_epoch"] > 3  # refills were drawn
    # A negative control: without the saved state the rest differs.
    assert ids(training_batches(progress()), 5) != straight[3:]


def _config(*overrides: str) -> DictConfig:
    """The keys ``DynamicSampling.from_config`` reads, dynamic sampling on, with ``key=value``
    overrides."""
    cfg = OmegaConf.create(
        {
            "dynamic_sampling": {"enabled": True},
            "rollout": {"max_staleness": 0, "server": {"url": None}},
            "group_size": G,
            "num_prompts_per_generation": 4,
            "steps_per_generation": 1,
        }
    )
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def test_off_leaves_the_rollouts_as_they_were() -> None:
    cfg = _config("dynamic_sampling.enabled=false")
    assert DynamicSampling.from_config(cfg, SINGLE, policy_weight=1.0, pad_id=PAD) is None
    # RLRun.rollouts hands over each rollout as sampled when dynamic sampling is off.
    batches = [_batch([EQUAL] * 4, "a"), _batch([DIFFER] * 4, "b")]
    run = RLRun.__new__(RLRun)
    run.stream, run.dynamic_sampling = None, None
    run.prompt_batches = lambda: iter([["first"], ["second"]])
    handed = iter(batches)
    run.rollout = lambda samples, reference, push_always: next(handed)
    rollouts = run.rollouts()
    assert next(rollouts) is batches[0] and next(rollouts) is batches[1]
    assert batches[0].draw_metrics == {"task_sampler/batch_pass_rate": 1.0}
    # On, the same stream passes through DynamicSampling: the all-equal batch is dropped.
    cfg.dynamic_sampling.enabled = True
    run.dynamic_sampling = DynamicSampling.from_config(cfg, SINGLE, policy_weight=1.0, pad_id=PAD)
    handed = iter(batches)
    trained = next(run.rollouts())
    assert _ids(trained) == _ids(batches[1]) and torch.equal(trained.tokens, batches[1].tokens)
    # Both batches were sampled through RLRun.rollout, where the task sampler observes them.
    assert next(handed, None) is None


def test_settings_it_cannot_serve_are_named() -> None:
    def error(cfg: DictConfig, policy_weight: float = 1.0, dist: DistInfo = SINGLE) -> str:
        with pytest.raises(ValueError) as raised:
            DynamicSampling.from_config(cfg, dist, policy_weight=policy_weight, pad_id=PAD)
        return str(raised.value)

    assert "max_generation_batches must be >= 1" in error(
        _config("dynamic_sampling.max_generation_batches=0")
    )
    assert "train_groups must be >= 1" in error(_config("dynamic_sampling.train_groups=0"))
    assert "group_size >= 2" in error(_config("group_size=1"))
    assert "loss.weight is 0" in error(_config(), policy_weight=0.0)
    assert "rollout.max_staleness=0" in error(_config("rollout.max_staleness=1"))
    assert "rollout worker" in error(_config("rollout.server.url=http://h:1"))
    two = DistInfo(world_size=2, rank=0, device=torch.device("cpu"))
    assert "multiple of the number of ranks (2)" in error(
        _config("dynamic_sampling.train_groups=3"), dist=two
    )
    assert "steps_per_generation=4" in error(
        _config("steps_per_generation=4", "group_size=2", "dynamic_sampling.train_groups=1")
    )
    sampling = DynamicSampling.from_config(_config(), SINGLE, policy_weight=1.0, pad_id=PAD)
    assert isinstance(sampling, DynamicSampling) and sampling.share == 4


@pytest.mark.slow  # GRPO runs of the toy model from random init: 3 steps, then 2 resumed (40 s)
def test_grpo_with_dynamic_sampling_logs_its_metrics_and_resumes_exactly(tmp_path: Path) -> None:
    from tests.test_grpo_recipe import QUICK, _log_files, _logged, _without_timing

    # The random model's replies rarely end in an odd digit: most groups are all 0, refilled.
    common = [
        "warm_start=null",
        *QUICK,
        "dataset.num_samples=64",
        "max_new_tokens=4",
        "max_steps=3",
        "eval_every_n_steps=0",
        "eval_at_start=false",
        "checkpoint.save_every_n_steps=1",
        "checkpoint.keep_last=null",
        "dynamic_sampling.enabled=true",
        "dynamic_sampling.max_generation_batches=3",
        "task_sampler.target_pass_rate=0.5",
    ]
    straight = run_recipe("grpo", "cpu_smoke", tmp_path / "straight", *common)
    logged = _without_timing(_logged(_log_files(straight.output_dir)[0]))
    steps = [logged[step] for step in (1, 2, 3)]
    for values in steps:
        assert 1 <= values["dynamic_sampling/generation_batches"] <= 3
        generated = values["dynamic_sampling/generated_groups"]
        assert generated == 4 * values["dynamic_sampling/generation_batches"]
        kept = 1 - values["dynamic_sampling/dropped_groups"] / generated
        assert values["dynamic_sampling/kept_fraction"] == pytest.approx(kept)
        if values["dynamic_sampling/unfiltered"]:
            assert values["dynamic_sampling/trained_groups"] == 4
        else:  # the trained rows are informative groups only
            assert values["groups/zero_reward_std"] == 0.0
        assert math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])
        assert "task_sampler/batch_pass_rate" in values
    assert any(values["dynamic_sampling/generation_batches"] > 1 for values in steps)
    # Resumed from step 1, steps 2 and 3 are the uninterrupted run's, refills and all.
    first = straight.output_dir / "checkpoints" / "step_0000001"
    resumed = run_recipe(
        "grpo",
        "cpu_smoke",
        tmp_path / "resumed",
        *common,
        f"checkpoint.resume_from_checkpoint={first}",
        f"logging.metric_logger.log_dir={tmp_path / 'resumed_logs'}",
    )
    assert "at step 1" in resumed.stdout
    (log,) = (tmp_path / "resumed_logs").glob("log_*.txt")
    after = _without_timing(_logged(log))
    for step in (2, 3):
        assert after[step] == logged[step], step


@pytest.mark.slow  # a 2-rank FSDP2 GRPO run of the toy model from random init (30 s)
def test_two_ranks_train_on_as_many_groups_each(tmp_path: Path) -> None:
    from tests.test_grpo_recipe import QUICK, _log_files, _logged

    # A reply that starts with a visible character scores 1: most groups are all 1, some not,
    # so the ranks keep different numbers; scale_rewards=batch gathers equal shares of rows.
    result = run_tune(
        "--nproc_per_node",
        "2",
        "recipes/grpo.py",
        "--config",
        "cpu_smoke",
        f"output_dir={tmp_path / 'fsdp'}",
        "warm_start=null",
        *QUICK,
        r"reward.pattern=^\s*\S",
        "dataset.num_samples=64",
        "max_new_tokens=4",
        "max_steps=2",
        "eval_every_n_steps=0",
        "eval_at_start=false",
        "loss.scale_rewards=batch",
        "dynamic_sampling.enabled=true",
        "dynamic_sampling.max_generation_batches=4",
    )
    assert result.returncode == 0, result.stderr[-5000:]
    logged = _logged(_log_files(tmp_path / "fsdp")[0])
    for step in (1, 2):
        values = logged[step]
        assert values["dynamic_sampling/trained_groups"] in (2.0, 4.0)  # equal per rank
        assert math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])
        if not values["dynamic_sampling/unfiltered"]:
            assert values["groups/zero_reward_std"] == 0.0
