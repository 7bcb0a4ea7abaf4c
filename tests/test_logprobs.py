"""Chunked, checkpointed token log-probs against one full log_softmax over the logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchtune.modules import TiedLinear

from composer_tune.losses import logprob_head, naive_token_logprobs, token_logprobs
from composer_tune.losses.logprobs import CPU_CHUNK_BYTES, CPU_MIN_CHUNK_ROWS, _cpu_chunk_rows
from composer_tune.models import qwen3_tiny

BATCH, SEQ, DIM, VOCAB = 3, 4, 16, 50


def make_inputs(seed: int = 0) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    """Hidden states (leaf with grad), an output projection and targets with two ignored slots."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, DIM, generator=generator).requires_grad_(True)
    output = nn.Linear(DIM, VOCAB, bias=False)
    with torch.no_grad():
        output.weight.copy_(torch.randn(VOCAB, DIM, generator=generator))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets[0, 3] = -100
    targets[2, 0] = -100
    return hidden, output, targets


def grads_of(value: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients of a fixed random projection of ``value`` (so every position matters)."""
    generator = torch.Generator().manual_seed(1)
    projection = torch.randn(value.shape, generator=generator, dtype=value.dtype)
    return torch.autograd.grad((value * projection).sum(), tensors, retain_graph=True)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 12, 1000])  # 12 rows: divides or not
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_naive_values_and_gradients(chunk_size: int, temperature: float) -> None:
    hidden, output, targets = make_inputs()
    chunked = token_logprobs(
        hidden, output, targets, chunk_size=chunk_size, temperature=temperature
    )
    naive = naive_token_logprobs(output(hidden), targets, temperature)
    assert chunked.shape == (BATCH, SEQ) and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, naive, rtol=0, atol=1e-5)
    assert chunked[0, 3].item() == 0.0 and chunked[2, 0].item() == 0.0  # ignore_index
    for got, want in zip(
        grads_of(chunked, hidden, output.weight),
        grads_of(naive, hidden, output.weight),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_naive_reference_matches_softmax_definition() -> None:
    """The reference itself: log(exp(z_y / tau) / sum_v exp(z_v / tau)), written out directly."""
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    targets = torch.tensor([[0, 6, 3], [2, 2, 5]])
    scaled = logits / 0.5
    expected = (
        scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1).exp() / scaled.exp().sum(-1)
    ).log()
    torch.testing.assert_close(naive_token_logprobs(logits, targets, 0.5), expected)


def test_hand_written_backward_passes_gradcheck() -> None:
    """Finite differences in float64 through log-probs and entropy together, with temperature
    and ignored positions, against the hand-written backward of the chunk kernel."""
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.tensor([[0, 5, -100], [3, 3, 1]])

    def both(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(
            hidden,
            lambda h: h @ weight.T,
            targets,
            chunk_size=4,
            temperature=0.7,
            return_entropy=True,
        )

    assert torch.autograd.gradcheck(both, (hidden, weight))


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_entropy_matches_direct_formula_with_gradients(temperature: float) -> None:
    hidden, output, targets = make_inputs(seed=2)
    logprobs, entropy = token_logprobs(
        hidden, output, targets, chunk_size=5, temperature=temperature, return_entropy=True
    )
    probs = torch.softmax(output(hidden) / temperature, dim=-1)
    direct = -(probs * probs.log()).sum(dim=-1)
    naive = naive_token_logprobs(output(hidden), targets, temperature)
    torch.testing.assert_close(entropy, direct, rtol=0, atol=1e-5)
    torch.testing.assert_close(logprobs, naive, rtol=0, atol=1e-5)
    # Entropy alone, and an objective using both outputs (e.g. an entropy bonus).
    for got_value, want_value in (
        (entropy, direct),
        (logprobs - 0.3 * entropy, naive - 0.3 * direct),
    ):
        got = grads_of(got_value, hidden, output.weight)
        want = grads_of(want_value, hidden, output.weight)
        for got_grad, want_grad in zip(got, want, strict=True):
            torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-5)


def test_tied_output_weight_gets_both_gradients() -> None:
    """Output = embedding weight (torchtune TiedLinear): its gradient sums both uses."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.roll(tokens, shifts=-1, dims=1)

    def forward(embedding: nn.Embedding, chunked: bool) -> torch.Tensor:
        hidden = torch.tanh(embedding(tokens))  # stands in for the decoder stack
        output = TiedLinear(embedding)
        if chunked:
            return token_logprobs(hidden, output, targets, chunk_size=5)
        return naive_token_logprobs(output(hidden), targets)

    grads = []
    for chunked in (True, False):
        embedding = nn.Embedding(VOCAB, DIM)
        with torch.no_grad():
            embedding.weight.copy_(
                torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(4))
            )
        grads.append(grads_of(forward(embedding, chunked), embedding.weight)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-5)


def test_bf16_weights_give_float32_logprobs() -> None:
    hidden, output, targets = make_inputs(seed=5)
    output = output.to(torch.bfloat16)
    hidden = hidden.detach().to(torch.bfloat16)
    with torch.no_grad():
        chunked = token_logprobs(hidden, output, targets, chunk_size=5)
        # Reference: the same bf16 logits, softmax in float64.
        logits = output(hidden).double()
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(
        chunked.double(), naive_token_logprobs(logits, targets), rtol=0, atol=1e-5
    )


class CountingLinear(nn.Linear):
    """An output projection that counts how many chunks it has projected."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def test_backward_recomputes_each_chunk_and_no_grad_does_not_checkpoint() -> None:
    hidden, plain, targets = make_inputs()
    output = CountingLinear(DIM, VOCAB, bias=False)
    output.load_state_dict(plain.state_dict())
    logprobs = token_logprobs(hidden, output, targets, chunk_size=5)  # 12 rows -> 3 chunks
    assert output.calls == 3
    logprobs.sum().backward()
    assert output.calls == 6  # checkpointing recomputed each chunk's logits in backward
    output.calls = 0
    with torch.no_grad():
        fast = token_logprobs(hidden, output, targets, chunk_size=5)
    assert output.calls == 3 and not fast.requires_grad
    torch.testing.assert_close(fast, logprobs.detach())


class RowRecordingTiedLinear(TiedLinear):
    """A tied output projection that records the rows of every call."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__(embedding)
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return super().__call__(x)


def test_cpu_chunks_keep_float32_logits_within_the_byte_budget() -> None:
    # A vocabulary whose 1024-row logits would take 256 MiB: chunks of 96 rows on a CPU.
    vocab, dim, rows = 65_536, 4, 200
    generator = torch.Generator().manual_seed(0)
    embedding = nn.Embedding(vocab, dim)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(vocab, dim, generator=generator))
    output = RowRecordingTiedLinear(embedding)
    hidden = torch.randn(1, rows, dim, generator=generator)
    targets = torch.randint(0, vocab, (1, rows), generator=generator)
    with torch.no_grad():
        chunked = token_logprobs(hidden, output, targets, chunk_size=1024)
        naive = naive_token_logprobs(output(hidden), targets)
    budget_rows = CPU_CHUNK_BYTES // (4 * vocab)
    assert budget_rows == 96 and output.rows[:-1] == [96, 96, 8]
    torch.testing.assert_close(chunked, naive)
    # A small vocabulary is held to chunk_size alone; the floor keeps a huge one's chunks
    # from shrinking to a few rows.
    small = RowRecordingTiedLinear(nn.Embedding(50, dim))
    with torch.no_grad():
        token_logprobs(hidden, small, targets % 50, chunk_size=1024)
    assert small.rows == [rows]
    huge = nn.Linear(dim, 16 * CPU_CHUNK_BYTES // (4 * CPU_MIN_CHUNK_ROWS), bias=False)
    assert _cpu_chunk_rows(huge) == CPU_MIN_CHUNK_ROWS


def test_logprob_head_is_what_the_model_calls() -> None:
    hidden, output, targets = make_inputs()
    head_fn = logprob_head(targets, chunk_size=4, temperature=0.9, return_entropy=True)
    logprobs, entropy = head_fn(hidden, output)
    expected, expected_entropy = token_logprobs(
        hidden, output, targets, chunk_size=12, temperature=0.9, return_entropy=True
    )
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-5)


def test_outputs_are_not_views() -> None:
    """An FSDP2 root returning a view warns that an in-place op on it would skip the
    all-gather's pre-backward hook; the model returns these tensors through head_fn."""
    hidden, output, targets = make_inputs()
    logprobs, entropy = token_logprobs(hidden, output, targets, chunk_size=5, return_entropy=True)
    assert logprobs._base is None and entropy._base is None


def test_bad_input_names_the_culprit() -> None:
    hidden, output, targets = make_inputs()
    targets[1, 2] = VOCAB
    with pytest.raises(ValueError, match=r"targets\[1, 2\] = 50 is outside the vocabulary"):
        token_logprobs(hidden, output, targets, chunk_size=5)
    with pytest.raises(ValueError, match="targets has shape"):
        token_logprobs(hidden, output, targets[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, output, targets, chunk_size=0)


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_qwen3_head_fn_matches_logits_path(tie_word_embeddings: bool) -> None:
    """Through the real model: ``head_fn=logprob_head(...)`` equals log_softmax of its logits,
    in value and in every parameter's gradient."""
    torch.manual_seed(7)
    model = qwen3_tiny(vocab_size=96, tie_word_embeddings=tie_word_embeddings)
    tokens = torch.randint(0, 96, (2, 9))
    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # next-token targets

    chunked = model(tokens, head_fn=logprob_head(targets, chunk_size=5, temperature=0.8))
    params = [p for p in model.parameters() if p.requires_grad]
    chunked_grads = grads_of(chunked, *params)
    naive = naive_token_logprobs(model(tokens), targets, temperature=0.8)
    torch.testing.assert_close(chunked, naive, rtol=0, atol=1e-5)
    for got, want in zip(chunked_grads, grads_of(naive, *params), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
