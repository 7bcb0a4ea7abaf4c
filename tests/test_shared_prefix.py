"""The shared-prefix log-prob forward against the plain one, on the tiny Qwen3.

The reference is :func:`sequence_logprobs` on the same right-padded rows (itself checked
against full-logits forwards in test_rollouts.py): log-probs, entropies and parameter
gradients must agree to fp32 rounding for every packing of the groups, with padding, prompts of
different lengths, uneven completions (one token included), groups cut by a micro-batch and
groups of one row; under activation checkpointing and FSDP2 (2 gloo ranks, this file run
under torchrun) too. Negative controls: completions that may see each other, or rows that only
claim to share a prompt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.training import set_activation_checkpointing

from composer_tune.data.tokenizer import ChatTokenizer
from composer_tune.models import qwen3_tiny
from composer_tune.rewards import MathAnswerReward
from composer_tune.rollout import shared_prefix
from composer_tune.rollout.generation import pack_sequences
from composer_tune.rollout.rollouts import (
    RolloutBatch,
    _batched_logprobs,
    collect_rollouts,
    rollout_logprobs,
    sequence_logprobs,
)
from composer_tune.rollout.shared_prefix import (
    choose_completions_per_row,
    shared_prefix_logprobs,
)
from tests.recipe_runs import run_torchrun

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 994
TEMPERATURE = 0.7
# fp32 rounding: other attention kernels (a masked SDPA vs a causal one) sum in another order.
ATOL = 2e-5
GRAD_RTOL = 1e-4  # of the gradient's largest entry


def _model(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Peaky logits (wide init): a misplaced state or position shows up as a large difference.
    return qwen3_tiny(vocab_size=VOCAB, initializer_range=0.3, **kwargs)


def _batch(
    group_sizes=(3, 1, 4, 2), prompt_lengths=(5, 9, 3, 7), max_completion=7, seed=1
) -> RolloutBatch:
    """Groups of these sizes and prompt lengths (a group of one row included), completions of
    1..max_completion tokens, right-padded as collect_rollouts packs them."""
    generator = torch.Generator().manual_seed(seed)

    def ids(length: int) -> list[int]:
        return torch.randint(0, VOCAB, (length,), generator=generator).tolist()

    prompts, completions, groups = [], [], []
    for group, (size, length) in enumerate(zip(group_sizes, prompt_lengths, strict=True)):
        prompt = ids(length)
        for _ in range(size):
            prompts.append(prompt)
            length_c = int(torch.randint(1, max_completion + 1, (1,), generator=generator))
            completions.append(ids(length_c))
            groups.append(group)
    completions[0] = completions[0][:1]  # a one-token completion: only the prompt predicts it
    packed = pack_sequences(prompts, completions, pad_id=0)
    rows = len(prompts)
    return RolloutBatch(
        tokens=packed.tokens,
        input_pos=packed.input_pos,
        completion_mask=packed.completion_mask,
        old_logp=None,
        ref_logp=None,
        rewards=torch.zeros(rows),
        correct=torch.zeros(rows, dtype=torch.bool),
        feedback=[""] * rows,
        truncated=torch.zeros(rows, dtype=torch.bool),
        prompt_lengths=packed.prompt_lengths,
        completion_lengths=packed.completion_lengths,
        group_ids=torch.tensor(groups),
        texts=[""] * rows,
        samples=[{}] * rows,
    )


def _weights(shape: torch.Size) -> torch.Tensor:
    """A fixed random projection, so every entry of the result feeds the gradient."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _plain(model, rows: RolloutBatch):
    inputs = (model, rows.tokens, rows.input_pos, rows.completion_mask)
    return sequence_logprobs(*inputs, temperature=TEMPERATURE, return_entropy=True)


def _shared(model, rows: RolloutBatch, **kwargs):
    inputs = (model, rows.tokens, rows.input_pos, rows.completion_mask)
    groups = {"group_ids": rows.group_ids, "prompt_lengths": rows.prompt_lengths}
    return shared_prefix_logprobs(
        *inputs, **groups, temperature=TEMPERATURE, return_entropy=True, **kwargs
    )


def _loss(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = _weights(logp.shape)
    return (logp * weights).sum() + (entropy * weights * mask).sum()


def _gradients(model, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _assert_same(model, rows: RolloutBatch, got, want) -> None:
    (logp, entropy), (want_logp, want_entropy) = got, want
    mask = rows.completion_mask
    assert logp.shape == want_logp.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=ATOL)
    assert bool((logp[~mask] == 0).all()) and bool((entropy[~mask] == 0).all())
    torch.testing.assert_close(entropy[mask], want_entropy[mask], rtol=0, atol=ATOL)
    grads = _gradients(model, _loss(logp, entropy, mask))
    want_grads = _gradients(model, _loss(want_logp, want_entropy, mask))
    for grad, want_grad in zip(grads, want_grads, strict=True):
        scale = float(want_grad.abs().max())
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=GRAD_RTOL * max(scale, 1e-3))


@pytest.mark.parametrize("completions_per_row", [None, 1, 2, 3, 8], ids=lambda k: f"k={k}")
def test_equal_to_the_plain_forward(completions_per_row) -> None:
    model, rows = _model(), _batch()
    got = _shared(model, rows, completions_per_row=completions_per_row)
    _assert_same(model, rows, got, _plain(model, rows))


def test_equal_for_a_micro_batch_that_cuts_groups_and_shuffled_rows() -> None:
    model, rows = _model(), _batch(group_sizes=(4, 4, 4), prompt_lengths=(6, 4, 8))
    micro = rows.select(slice(2, 9))  # the end of group 0, all of group 1, the start of group 2
    _assert_same(model, micro, _shared(model, micro, completions_per_row=4), _plain(model, micro))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3))
    shuffled = RolloutBatch(
        **{
            name: value[order] if isinstance(value, torch.Tensor) else value
            for name, value in vars(rows).items()
        }
    )
    _assert_same(model, shuffled, _shared(model, shuffled), _plain(model, shuffled))


def test_equal_when_targets_skip_tokens() -> None:
    """Agent episodes: tool output between the model's turns is context, not a target."""
    model, rows = _model(), _batch(max_completion=9, seed=2)
    mask = rows.completion_mask.clone()
    for row in range(len(rows)):
        columns = mask[row].nonzero()[:, 0]
        mask[row, columns[1:3]] = False  # two "tool output" tokens after the first target
    rows.completion_mask = mask
    _assert_same(model, rows, _shared(model, rows, completions_per_row=4), _plain(model, rows))


def test_equal_under_activation_checkpointing() -> None:
    model, rows = _model(), _batch()
    want = _plain(model, rows)
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    _assert_same(model, rows, _shared(model, rows, completions_per_row=4), want)


def test_completions_that_see_each_other_differ(monkeypatch) -> None:
    """Negative control: the plain causal mask over the packed row (a later completion
    attends to the earlier ones) must change the log-probs, so the test above can fail."""
    model, rows = _model(), _batch()
    plain, _ = _plain(model, rows)

    def causal_only(layout, device):
        rows, length = layout.segment.shape
        return (
            torch.ones(length, length, dtype=torch.bool, device=device).tril().expand(rows, -1, -1)
        )

    monkeypatch.setattr(shared_prefix.PackedGroups, "attention_mask", causal_only)
    leaky, _ = _shared(model, rows, completions_per_row=4)
    assert float((leaky - plain).detach().abs().max()) > 0.1


def test_no_grad_forward_matches_and_collect_rollouts_uses_it() -> None:
    model, rows = _model().eval(), _batch()
    args = (model, rows.tokens, rows.input_pos, rows.completion_mask)
    kwargs = {"temperature": TEMPERATURE, "chunk_size": 16, "forward_batch_size": 5}
    plain = _batched_logprobs(*args, **kwargs)
    shared = _batched_logprobs(
        *args, **kwargs, group_ids=rows.group_ids, prompt_lengths=rows.prompt_lengths
    )
    torch.testing.assert_close(shared, plain, rtol=0, atol=ATOL)

    tokenizer = ChatTokenizer.from_dir(REPO_ROOT / "tests" / "assets" / "tokenizer")
    samples = [
        {"prompt": [{"role": "user", "content": text}], "answer": "4"}
        for text in ("What is 2 + 2?", "And 3 + 1, to be sure?")
    ]

    def rollout(shared_prefix: bool) -> RolloutBatch:
        return collect_rollouts(
            model,
            tokenizer,
            samples,
            MathAnswerReward(),
            group_size=3,
            max_new_tokens=5,
            temperature=TEMPERATURE,
            generator=torch.Generator().manual_seed(0),
            reference=model,
            shared_prefix=shared_prefix,
        )

    old, new = rollout(False), rollout(True)
    assert torch.equal(old.tokens, new.tokens)
    torch.testing.assert_close(new.old_logp, old.old_logp, rtol=0, atol=ATOL)
    torch.testing.assert_close(new.ref_logp, old.ref_logp, rtol=0, atol=ATOL)


def test_rollout_logprobs_picks_the_path() -> None:
    model, rows = _model(), _batch()
    with torch.no_grad():
        plain = rollout_logprobs(model, rows, shared_prefix=False, temperature=TEMPERATURE)
        shared = rollout_logprobs(model, rows, shared_prefix=True, temperature=TEMPERATURE)
        assert torch.equal(plain, _plain(model, rows)[0])
        torch.testing.assert_close(shared, _shared(model, rows)[0], rtol=0, atol=0)


def test_rows_that_do_not_share_their_prompt_are_refused() -> None:
    model, rows = _model(), _batch()
    rows.tokens[1, 2] += 1  # row 1 is in row 0's group but its prompt differs
    with pytest.raises(ValueError, match="rows 0 and 1 have the same group id"):
        _shared(model, rows)
    rows = _batch()
    rows.prompt_lengths[2] += 1  # the mask now marks a prompt token of row 2
    with pytest.raises(ValueError, match="row 2's completion_mask marks a token of its prompt"):
        _shared(model, rows)


def test_long_completions_of_a_short_prompt_run_as_plain_rows() -> None:
    """Packed rows attend densely: once the completions outweigh the shared prompt, plain
    rows cost less, and a packed row never exceeds the model's max_seq_len."""
    costs = {"token_cost": 1500.0, "pair_cost": 1.0}  # about SmolLM2's ratio
    short = choose_completions_per_row([40], [[20] * 8], max_seq_len=None, **costs)
    long = choose_completions_per_row([40], [[500] * 8], max_seq_len=None, **costs)
    capped = choose_completions_per_row([40], [[20] * 8], max_seq_len=100, **costs)
    assert (short, long, capped) == (8, 1, 3)
    model, rows = _model(max_seq_len=24), _batch(group_sizes=(6,), prompt_lengths=(9,))
    _assert_same(model, rows, _shared(model, rows), _plain(model, rows))


# ----------------------------------------------------------------------------- FSDP2


def test_fsdp2_with_activation_checkpointing_matches_one_process(tmp_path: Path) -> None:
    """2 gloo ranks, each with half the rows (group 1 is cut between them), FSDP2-sharded and
    checkpointed: per-rank log-probs and the averaged gradient equal one process's plain
    forward of the whole batch."""
    out = tmp_path / "fsdp.json"
    run_torchrun(__file__, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert result["logp_gap"] <= ATOL and result["entropy_gap"] <= ATOL, result
    assert result["grad_gap"] <= GRAD_RTOL * result["grad_scale"], result


def _fsdp_worker(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtune.training import shard_model

    from composer_tune.distributed import setup_distributed, teardown_distributed

    setup_distributed("cpu")
    rank = dist.get_rank()
    rows = _batch(group_sizes=(3, 4, 1), prompt_lengths=(5, 8, 4))
    halves = [rows.select(slice(0, 4)), rows.select(slice(4, 8))]  # group 1 is cut
    reference, model = _model(), _model()
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    shard_model(
        model,
        [lambda _name, module: isinstance(module, TransformerSelfAttentionLayer)],
        cpu_offload=False,
    )
    mine = halves[rank]
    logp, entropy = _shared(model, mine, completions_per_row=4)
    # FSDP2 averages the ranks' gradients: the reference's loss is the halves' mean.
    _loss(logp, entropy, mine.completion_mask).backward()
    grads = [
        p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()
    ]
    if rank == 0:
        plain = [_plain(reference, half) for half in halves]
        want_loss = sum(
            _loss(*values, half.completion_mask) / 2
            for values, half in zip(plain, halves, strict=True)
        )
        want_grads = _gradients(reference, want_loss)
        want_logp, want_entropy = plain[0]
        result = {
            "logp_gap": float((logp - want_logp).abs().max()),
            "entropy_gap": float(((entropy - want_entropy) * mine.completion_mask).abs().max()),
            "grad_gap": max(
                float((g - w).abs().max()) for g, w in zip(grads, want_grads, strict=True)
            ),
            "grad_scale": max(float(w.abs().max()) for w in want_grads),
        }
        Path(out_path).write_text(json.dumps(result))
    teardown_distributed()


if __name__ == "__main__":
    from composer_tune.distributed import finish_process

    finish_process(lambda: _fsdp_worker(sys.argv[1]))
