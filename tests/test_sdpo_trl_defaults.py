"""TRL 1.16 ``SDPOTrainer``'s own SDPO settings: the sampled-token reverse KL, the importance
ratio clip and TRL's per-sample averaging, against TRL's computation on identical logits.

TRL is not a dependency (only the ``bench`` extra installs it), so the oracle below is TRL
1.16's computation rewritten step by step from ``trl/experimental/sdpo`` (``loss_utils``:
``compute_sampled_token_self_distillation_loss``, ``apply_importance_sampling_clipping``;
``sdpo_trainer.SDPOTrainer._compute_self_distillation_loss``: the per-sample mean over
``loss_mask`` then the mean over samples). Where TRL is installed, the last test calls its
functions too. The config test loads ``sdpo smollm2_trl``, the config that runs TRL's defaults.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.channels.sdpo import SDPOChannelConfig
from composer_tune.losses.distill import DistillConfig
from recipes.sdpo import SDPOConfig
from tests.recipe_runs import REPO_ROOT
from tests.test_distill_loss import BATCH, COMPLETION, make_inputs, run

TRL_SETTINGS = {"mode": "sampled_token", "alpha": 1.0, "is_clip": 2.0, "averaging": "row"}


def _gathered_logits(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, C, V]`` student and teacher logits at the completion positions (what TRL's
    ``_compute_teacher_student_logits`` hands the loss), from the same hidden states."""
    rows = torch.arange(BATCH)[:, None]
    student = inputs["output"](inputs["student_hidden"][rows, inputs["student_positions"]])
    teacher = inputs["output"](inputs["teacher_hidden"][rows, inputs["teacher_positions"]])
    return student, teacher.detach()


def trl_sdpo_loss(inputs: dict, *, is_clip: float | None, temperature: float) -> torch.Tensor:
    """TRL 1.16's sampled-token SDPO loss, step by step (logits divided by the temperature as
    TRL's ``_forward_logits`` does)."""
    student_logits, teacher_logits = _gathered_logits(inputs)
    student_logits, teacher_logits = student_logits / temperature, teacher_logits / temperature
    targets = inputs["targets"]
    # selective_log_softmax(student_logits, completion_ids), and the teacher's
    student_logp = torch.log_softmax(student_logits, -1).gather(-1, targets[..., None])[..., 0]
    teacher_logp = torch.log_softmax(teacher_logits, -1).gather(-1, targets[..., None])[..., 0]
    per_token_loss = (student_logp - teacher_logp).detach() * student_logp
    if is_clip is not None:
        negative_approx_kl = (student_logp - inputs["old_logprobs"]).detach().clamp(-20.0, 20.0)
        per_token_loss = per_token_loss * negative_approx_kl.exp().clamp(max=is_clip)
    loss_mask = (inputs["completion_mask"] & inputs["has_teacher"][:, None]).to(torch.float64)
    per_sample = (per_token_loss * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1.0)
    return per_sample.mean()


def _both(settings: dict, *, temperature: float = 1.0) -> tuple[torch.Tensor, ...]:
    inputs = make_inputs(seed=3)
    cfg = DistillConfig(temperature=temperature, **settings)
    ours = run(inputs, cfg).loss
    (ours_grad,) = torch.autograd.grad(ours, inputs["student_hidden"])
    theirs = trl_sdpo_loss(inputs, is_clip=cfg.is_clip, temperature=temperature)
    (theirs_grad,) = torch.autograd.grad(theirs, inputs["student_hidden"])
    return ours, theirs, ours_grad, theirs_grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("is_clip", [2.0, None])
def test_sampled_token_row_mean_equals_trl(temperature: float, is_clip: float | None) -> None:
    ours, theirs, ours_grad, theirs_grad = _both(
        {**TRL_SETTINGS, "is_clip": is_clip}, temperature=temperature
    )
    assert ours.item() != 0.0
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-10, atol=1e-12)


def test_token_averaging_is_not_trls_on_uneven_rows() -> None:
    """The project's default token mean differs from TRL's sample mean where rows have
    different numbers of distilled tokens (row 2 has a padding slot): the oracle can tell."""
    ours, theirs, _, _ = _both({**TRL_SETTINGS, "averaging": "token"})
    assert abs(ours.item() - theirs.item()) > 1e-6


def test_sampled_token_logs_the_one_sample_reverse_kl() -> None:
    inputs = make_inputs(seed=3)
    out = run(inputs, DistillConfig(**{**TRL_SETTINGS, "is_clip": None}))
    student_logits, teacher_logits = _gathered_logits(inputs)
    targets = inputs["targets"]
    log_ratio = (
        torch.log_softmax(student_logits, -1) - torch.log_softmax(teacher_logits, -1)
    ).gather(-1, targets[..., None])[..., 0]
    valid = out.valid
    torch.testing.assert_close(out.divergence[valid], log_ratio[valid].detach())
    assert out.metrics["distill/divergence"] == pytest.approx(float(log_ratio[valid].mean()))


@pytest.mark.parametrize(
    "settings, culprit",
    [
        ({"alpha": 0.5}, "alpha=0.5"),
        ({"top_k": 10}, "top_k=10"),
        ({"token_clip": 1.0}, "token_clip=1.0"),
        ({"mode": "full"}, "mode must be one of"),
        ({"averaging": "sample"}, "averaging must be one of"),
    ],
)
def test_settings_that_do_not_combine_are_refused_by_name(settings: dict, culprit: str) -> None:
    base = {"mode": "sampled_token", "alpha": 1.0}
    with pytest.raises(ValueError, match=culprit):
        DistillConfig(**{**base, **settings})


def test_smollm2_trl_config_runs_trls_defaults_and_its_loss_equals_trls() -> None:
    cfg = config.load_config(
        "smollm2_trl", ["output_dir=unused"], recipe_file=REPO_ROOT / "recipes" / "sdpo.py",
        schema=SDPOConfig,
    )  # fmt: skip
    sdpo = SDPOChannelConfig.from_mapping(OmegaConf.to_container(cfg.sdpo, resolve=True))
    # TRL 1.16 SDPOConfig defaults: distillation_weight 1.0 (no policy-gradient term),
    # sampled_token, alpha 1, is_clip 2.0, an EMA teacher at 0.05 per step, successful
    # siblings as demonstrations and no environment feedback.
    assert cfg.loss.weight == 0.0 and sdpo.weight == 1.0
    assert (sdpo.loss.mode, sdpo.loss.alpha, sdpo.loss.is_clip) == ("sampled_token", 1.0, 2.0)
    assert sdpo.loss.averaging == "row" and sdpo.loss.top_k is None
    assert (sdpo.teacher, sdpo.ema_rate) == ("ema", 0.05)
    assert list(sdpo.context.sources) == ["sibling"]
    inputs = make_inputs(seed=5)
    ours = run(inputs, sdpo.loss).loss
    theirs = trl_sdpo_loss(inputs, is_clip=sdpo.loss.is_clip, temperature=sdpo.loss.temperature)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


def test_trl_itself_where_installed() -> None:
    loss_utils = pytest.importorskip("trl.experimental.sdpo.loss_utils")
    inputs = make_inputs(seed=7)
    student_logits, teacher_logits = _gathered_logits(inputs)
    per_token = loss_utils.compute_sampled_token_self_distillation_loss(
        student_logits, teacher_logits, inputs["targets"], distillation_alpha=1.0
    )
    student_logp = torch.log_softmax(student_logits, -1).gather(-1, inputs["targets"][..., None])[
        ..., 0
    ]
    per_token = loss_utils.apply_importance_sampling_clipping(
        per_token, student_logp, inputs["old_logprobs"], 2.0
    )
    loss_mask = (inputs["completion_mask"] & inputs["has_teacher"][:, None]).to(per_token.dtype)
    theirs = ((per_token * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1.0)).mean()
    ours = run(inputs, DistillConfig(**TRL_SETTINGS)).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert COMPLETION == inputs["targets"].shape[1]
