"""config key ``autocast: bf16``: bf16 matmuls in every forward, fp32 weights and gradients;
``auto``: bf16 only where the device multiplies it natively."""

import pytest
import torch

from composer_tune.models import qwen3_tiny
from composer_tune.models.build import enable_autocast, resolve_autocast
from composer_tune.rollout import generate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return qwen3_tiny(vocab_size=64, initializer_range=0.5)


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_fp32_weights() -> None:
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, cast = _model(), _model()
    enable_autocast(cast, "bf16", torch.device("cpu"))
    seen: list[torch.dtype] = []
    cast.layers[0].attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    reference, logits = plain(tokens), cast(tokens)
    assert seen == [torch.bfloat16]
    # bf16 rounding: close to the fp32 model, but not equal (so the cast really happened).
    assert 0 < (logits.float() - reference).abs().max() < 0.1 * reference.abs().max()
    logits.float().logsumexp(-1).sum().backward()
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in cast.parameters()
    )


def test_unknown_autocast_dtype_is_named() -> None:
    with pytest.raises(
        ValueError, match="autocast must be null or one of \\['auto', 'bf16'\\], got 'fp16'"
    ):
        enable_autocast(_model(), "fp16", torch.device("cpu"))


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch, native) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    assert resolve_autocast("auto", "cpu") == ("bf16" if native else None)
    assert resolve_autocast("auto", "cuda") == "bf16"
    assert resolve_autocast("bf16", "cpu") == "bf16" and resolve_autocast(None, "cpu") is None
    model = _model()
    enable_autocast(model, "auto", torch.device("cpu"))
    assert getattr(model, "autocast_dtype", None) == (torch.bfloat16 if native else None)


def test_generation_under_bf16_autocast_builds_bf16_caches_and_tracks_fp32_greedy() -> None:
    prompts = [[1, 5, 9, 3], [7, 2], [4, 4, 8, 1, 6, 2]]
    plain, cast = _model(), _model()
    enable_autocast(cast, "bf16", torch.device("cpu"))
    reference = generate(plain, prompts, max_new_tokens=6, pad_id=0, greedy=True)
    output = generate(cast, prompts, max_new_tokens=6, pad_id=0, greedy=True)
    assert not cast.caches_are_setup()  # the bf16 caches were built and deleted again
    # bf16 rounding may flip a near-tie late in a row; the first tokens agree.
    assert [row[:2] for row in output.completions] == [row[:2] for row in reference.completions]


def test_full_sequence_attention_runs_in_fp32_on_a_cpu_under_bf16_autocast(monkeypatch) -> None:
    """A CPU's bf16 flash-attention backward is slower than an fp32 upcast's, so the native
    decoder's full-sequence attention runs in fp32 under bf16 autocast: in training and no-grad
    forwards alike (their outputs agree exactly, so old log-probs equal the training forward's),
    while the sampler's cached attention stays in bf16."""
    model = _model()
    enable_autocast(model, "bf16", torch.device("cpu"))
    seen: list[torch.dtype] = []
    attention = torch.nn.functional.scaled_dot_product_attention

    def recording(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append(query.dtype)
        return attention(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        no_grad = model(tokens)
    trained = model(tokens)
    assert seen == [torch.float32] * (2 * len(model.layers))
    assert trained.dtype == no_grad.dtype and torch.equal(trained.detach(), no_grad)
    trained.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    seen.clear()
    generate(model, [[1, 5, 9, 3], [7, 2]], max_new_tokens=3, pad_id=0, greedy=True)
    assert seen and set(seen) == {torch.bfloat16}
