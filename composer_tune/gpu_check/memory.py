"""The ``memory`` part: one GRPO step of random Qwen3 models, its measured peak per phase against
``composer_tune.analysis.memory``'s estimate."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from composer_tune.gpu_check.common import (
    GIB,
    MEMORY_GOAL,
    MIB,
    PartResult,
    Settings,
    error_row,
    free_memory,
    require,
)


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    model: dict[str, Any]  # the config's model node
    label: str
    prompts: int
    group_size: int
    prompt_len: int
    completion_len: int


def memory_cases(tiny: bool) -> list[MemoryCase]:
    if tiny:
        tiny_model = {"_component_": "composer_tune.models.qwen3_tiny", "vocab_size": 512}
        return [MemoryCase(tiny_model, "qwen3_tiny", 2, 2, 24, 8)]
    return [
        MemoryCase({"_component_": f"composer_tune.models.{name}"}, name, 2, 4, 384, 128)
        for name in ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b")
    ]


def memory_config(case: MemoryCase, device: torch.device, checkpointing: bool) -> Any:
    """The recipe config (the keys ``recipes/grpo.py`` and the estimator read) of ``case``."""
    from omegaconf import OmegaConf

    rows = case.prompts * case.group_size
    return OmegaConf.create(
        {
            "model": {**case.model, "max_seq_len": case.prompt_len + case.completion_len},
            "device": device.type,
            "dtype": "bf16",
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-6},
            "enable_activation_checkpointing": checkpointing,
            "logprob_chunk_size": 1024,
            "num_prompts_per_generation": case.prompts,
            "group_size": case.group_size,
            "max_new_tokens": case.completion_len,
            "micro_batch_size": rows,  # one on-policy micro-batch, as TRL's default step
            "temperature": 1.0,
            "loss": {"objective": "grpo", "beta": 0.0},
        }
    )


class RandomPromptTokenizer:
    """The tokenizer interface ``collect_rollouts`` uses, with random prompt ids of a fixed length
    and no stop tokens, so every row samples exactly ``max_new_tokens`` (what the estimate
    assumes); a random model's ids would not decode into anything a real reward reads."""

    pad_id = 0
    stop_tokens: list[int] = []

    def __init__(self, vocab_size: int, prompt_len: int, seed: int) -> None:
        self.vocab_size, self.prompt_len = vocab_size, prompt_len
        self.generator = torch.Generator().manual_seed(seed)

    def tokenize_messages(self, messages: Any, **_: Any) -> tuple[list[int], list[bool]]:
        ids = torch.randint(1, self.vocab_size, (self.prompt_len,), generator=self.generator)
        return ids.tolist(), [True] * self.prompt_len

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, token_ids))


class RandomReward:
    """Seeded random scores: group advantages are then nonzero and the loss has a gradient."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, completions: Any, samples: Any) -> list[Any]:
        from composer_tune.rewards.base import RewardResult

        return [RewardResult(score=self.rng.random()) for _ in completions]


def measure_grpo_step(cfg: Any, case: MemoryCase, device: torch.device) -> dict[str, Any]:
    """Peak bytes of one GRPO step of ``cfg`` (rollout, forward+backward, optimizer step) after
    a warm-up step, in bench/measure_memory.py's format (``before_step``, ``peaks``)."""
    from bench import measure_memory
    from composer_tune import config
    from composer_tune.channels.policy import group_advantages, step_normalization
    from composer_tune.distributed import DistInfo
    from composer_tune.losses import PolicyLossConfig, policy_loss
    from composer_tune.models.build import build_decoder
    from composer_tune.rollout.rollouts import collect_rollouts, sequence_logprobs

    dist_info = DistInfo(world_size=1, rank=0, device=device)
    model = build_decoder(
        cfg.model,
        checkpoint=None,
        dtype=torch.bfloat16,
        dist_info=dist_info,
        seed=0,
        activation_checkpointing=cfg.enable_activation_checkpointing,
        fsdp_cpu_offload=False,
    ).train()
    optimizer = config.instantiate(cfg.optimizer, model.parameters())
    loss_cfg = PolicyLossConfig.from_mapping(
        {**cfg.loss, "max_completion_length": case.completion_len}, source="loss"
    )
    rows = case.prompts * case.group_size
    samples = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(case.prompts)]
    rollout = collect_rollouts(
        model,
        RandomPromptTokenizer(model.config.vocab_size, case.prompt_len, seed=0),
        samples,
        RandomReward(seed=0),
        group_size=case.group_size,
        max_new_tokens=case.completion_len,
        temperature=cfg.temperature,
        generator=torch.Generator(device=device).manual_seed(0),
        logprob_chunk_size=cfg.logprob_chunk_size,
        forward_batch_size=rows,
        compute_old_logp=False,  # one on-policy step: old log-probs are the detached current
    )
    advantages = group_advantages(rollout, loss_cfg, case.group_size, dist_info)

    def forward_backward() -> None:  # recipes/grpo.py's _optimizer_step for one micro-batch
        normalization = step_normalization(rollout, loss_cfg, dist_info, rows)
        logp, entropy = sequence_logprobs(
            model,
            rollout.tokens,
            rollout.input_pos,
            rollout.completion_mask,
            temperature=cfg.temperature,
            chunk_size=cfg.logprob_chunk_size,
            return_entropy=True,
        )
        loss, _ = policy_loss(
            logp,
            logp.detach(),
            advantages,
            rollout.completion_mask,
            loss_cfg,
            truncated=rollout.truncated,
            entropy=entropy,
            normalization=normalization,
            sampling_logp=rollout.sampling_logp,
        )
        loss.backward()

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward_backward()  # warm-up: the AdamW states exist from here on
    optimizer_step()
    inputs = [rollout.tokens, rollout.input_pos, rollout.completion_mask, rollout.sampling_logp]
    step = measure_memory.TrainingStep(model, optimizer, inputs, forward_backward, optimizer_step)
    measured = measure_memory.measure_step(
        model, optimizer, forward_backward, optimizer_step, inputs
    )
    rollout_peak = measure_memory.measure_rollout(step, rows, case.prompt_len, case.completion_len)[
        "peak"
    ]
    measured["peaks"][measure_memory.ROLLOUT_PHASE] = rollout_peak
    return measured


def run_memory(settings: Settings) -> PartResult:
    require("torchtune", "omegaconf")
    from bench import measure_memory
    from composer_tune.analysis import memory

    device_gib = settings.device_gib()
    rows = []
    for case in memory_cases(settings.tiny):
        for checkpointing in (True, False):
            cfg = memory_config(case, settings.device, checkpointing)
            row: dict[str, Any] = {
                "model": case.label,
                "ac": "on" if checkpointing else "off",
                "tokens": f"{case.prompts * case.group_size} x "
                f"{case.prompt_len}+{case.completion_len}",
            }
            try:
                plan = memory.plan_from_config(cfg, world_size=1, prompt_len=case.prompt_len)
                estimate = memory.estimate_memory(plan.args, plan.plan)
                if device_gib is not None:
                    fit = memory.fit_report(estimate, capacity_gib=device_gib)
                    if not fit.fits:
                        needed = fit.needed_bytes / GIB
                        rows.append(
                            {
                                **row,
                                "status": "SKIPPED",
                                "note": f"estimate {needed:.1f} GiB (with margins) > "
                                f"{device_gib:.1f} GiB on this GPU",
                            }
                        )
                        continue
                measured = measure_grpo_step(cfg, case, settings.device)
            except ImportError:
                raise
            except Exception as err:  # noqa: BLE001 - out of memory included: next case
                rows.append(error_row(row, err))
                continue
            finally:
                free_memory(settings.device)
            got = measure_memory.compare(estimate, measured)
            phases = ("rollout", "fb", "opt", "peak")
            row.update(
                {
                    f"{kind}_{phase}": got[f"{kind}_{phase}"] / MIB
                    for kind in ("est", "got")
                    for phase in phases
                }
            )
            row.update(
                {
                    "peak_ratio": got["est_peak"] / got["got_peak"],
                    "status": settings.verdict(abs(got["peak_error"]) <= MEMORY_GOAL),
                }
            )
            rows.append(row)
    how = (
        "torch.cuda.max_memory_allocated per phase"
        if settings.device.type == "cuda"
        else "CPU: torch.profiler allocation totals (bench/measure_memory.py)"
    )
    return PartResult(
        columns=[
            ("model", "model", ""),
            ("ac", "AC", ""),
            ("tokens", "rows x prompt+completion", ""),
            ("est_rollout", "rollout est MiB", ",.1f"),
            ("got_rollout", "rollout meas MiB", ",.1f"),
            ("est_fb", "fwd+bwd est MiB", ",.1f"),
            ("got_fb", "fwd+bwd meas MiB", ",.1f"),
            ("est_opt", "opt est MiB", ",.1f"),
            ("got_opt", "opt meas MiB", ",.1f"),
            ("est_peak", "peak est MiB", ",.1f"),
            ("got_peak", "peak meas MiB", ",.1f"),
            ("peak_ratio", "est / meas", ".3f"),
        ],
        rows=rows,
        notes=[
            f"Measured: {how}, of a GRPO step (objective grpo, beta 0, AdamW, clip 1.0) after "
            "a warm-up step; bf16 parameters, one process (build_decoder does not shard at world "
            "size 1).",
            f"Goal: the estimated peak within {MEMORY_GOAL:.0%} of the measured one (judged on "
            "CUDA at full size). The estimate of a row is, e.g., python tools/estimate_memory.py "
            "--model qwen3_4b --seq-len 512 --batch-size 8 --rollout-batch-size 8 "
            "--prompt-len 384 --completion-len 128 --activation-checkpointing",
        ],
    )
