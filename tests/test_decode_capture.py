"""The sampler's capturable decode loop: CUDA-graph replays, syncs every k steps, one weight
cast per call (composer_tune.rollout.generation and .step_capture).

No GPU here, so the CUDA-graph capture is emulated on the CPU by tracing the decode step with
``make_fx``: like a capture, the trace records the step's tensor operations once (Python-side
effects, such as a counter kept in Python or a value read back to the host, happen only then)
and every replay reruns those operations on the same tensors. A step that is not capturable
therefore decodes wrongly here as it would on a GPU. References are the eager loop, which the
tests in test_generation.py check against full recomputation and transformers' generate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torchtune.modules import TiedLinear

from composer_tune.models import qwen3_tiny
from composer_tune.models.build import enable_autocast
from composer_tune.models.hf_backend import build_hf_causal_lm
from composer_tune.rollout import generate, generation, step_capture
from composer_tune.rollout.generation import _sample, _Sampling
from tests.test_transformers_backend import FAMILIES as TRANSFORMERS_FAMILIES

VOCAB = 97
PAD = 0
# Different lengths (left padding), one longer than a span bucket below.
PROMPTS = [[5, 17, 3, 44, 9, 12, 60, 8, 2, 71], [8, 2], [31, 31, 7, 90], [4]]
BUCKET = 8  # span bucket in these tests: 20 new tokens cross several buckets


class _TracedCapture:
    """A StepCapture that traces the step with make_fx (which runs it once, as a capture
    followed by its first replay) and counts the captures."""

    def __init__(self) -> None:
        self.captures = 0

    def __call__(self, step: Callable[[], None]) -> Callable[[], None]:
        self.captures += 1
        return make_fx(step)()


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> _TracedCapture:
    """``generate(..., cuda_graphs=True)`` on the CPU, through the emulated capture."""
    capture = _TracedCapture()
    monkeypatch.setattr(step_capture, "SPAN_BUCKET", BUCKET)
    monkeypatch.setattr(
        generation,
        "_step_capture",
        lambda device, cuda_graphs, *_: capture if cuda_graphs else None,
    )
    return capture


def _native() -> nn.Module:
    torch.manual_seed(0)
    # A wide init gives peaky logits, so a wrong mask, position or cache slot changes the argmax.
    return qwen3_tiny(
        vocab_size=VOCAB, initializer_range=0.5, embed_dim=96, num_heads=6, num_kv_heads=2
    ).eval()


def _transformers(family: str) -> nn.Module:
    torch.manual_seed(0)
    return build_hf_causal_lm(TRANSFORMERS_FAMILIES[family](), max_seq_len=128).eval()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "native_qwen3": _native,
    "transformers_llama": lambda: _transformers("llama_tied"),
    # A sliding window shorter than the rows: the window is computed from the cache's
    # positions, which a captured step must update on the device.
    "transformers_mistral": lambda: _transformers("mistral"),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_captured_greedy_decoding_is_token_identical_to_the_eager_loop(family, traced) -> None:
    model = MODELS[family]()
    eager = generate(model, PROMPTS, max_new_tokens=20, pad_id=PAD, greedy=True)
    replayed = generate(
        model, PROMPTS, max_new_tokens=20, pad_id=PAD, greedy=True, cuda_graphs=True
    )
    assert replayed.completions == eager.completions
    # Slots filled reach 10 + 19 = 29: spans 16, 24 and 32 after the eager warm-up steps.
    assert traced.captures == 3
    assert not model.caches_are_setup()


def test_captured_sampling_reproduces_the_eager_rows_from_the_same_seed(traced) -> None:
    model = _native()

    def run(**options) -> generation.GenerationOutput:
        return generate(
            model,
            PROMPTS,
            max_new_tokens=16,
            pad_id=PAD,
            temperature=1.3,
            top_k=40,
            top_p=0.9,
            generator=torch.Generator().manual_seed(3),
            return_logprobs=True,
            **options,
        )

    eager, replayed = run(), run(cuda_graphs=True, sync_every=5)
    assert replayed.completions == eager.completions
    for ours, theirs in zip(replayed.logprobs, eager.logprobs, strict=True):
        torch.testing.assert_close(ours, theirs)
    assert traced.captures >= 1


@pytest.mark.parametrize("sync_every", [1, 3, 16])
def test_rows_stop_where_they_would_with_any_sync_interval(sync_every: int) -> None:
    model = _native()
    free = generate(model, PROMPTS, max_new_tokens=12, pad_id=PAD, greedy=True).completions
    stop = free[0][3]  # row 0 stops at its 4th token; rows without it run to the cap
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    out = generate(
        model,
        PROMPTS,
        max_new_tokens=12,
        pad_id=PAD,
        greedy=True,
        stop_tokens=[stop],
        sync_every=sync_every,
    )
    for row, completion in enumerate(free):
        expected = completion[: completion.index(stop) + 1] if stop in completion else completion
        assert out.completions[row] == expected
        assert bool(out.truncated[row]) == (stop not in completion)
    if all(stop in completion for completion in free):
        return
    assert len(calls) == 1 + 11  # a row ran to the cap: prefill + 11 decode forwards


def test_a_batch_that_finishes_early_runs_at_most_sync_every_minus_one_extra_steps() -> None:
    model = _native()
    first = generate(model, [[5, 6, 7]], max_new_tokens=1, pad_id=PAD, greedy=True).completions
    stop = first[0][0]
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    out = generate(
        model,
        [[5, 6, 7]],
        max_new_tokens=50,
        pad_id=PAD,
        greedy=True,
        stop_tokens=[stop],
        sync_every=4,
    )
    assert out.completions == [[stop]]
    # The row finished at its first token: the host looks after it (no decode forward).
    assert len(calls) == 1


class _NaNRowDecoder(nn.Module):
    """Stub decoder whose row 1 gets NaN logits from the third decode step on."""

    reads_cache_span = False

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)
        self.setup = False
        self.forwards = 0

    def setup_caches(self, *_, **__) -> None:
        self.setup = True

    def caches_are_setup(self) -> bool:
        return self.setup

    def caches_are_enabled(self) -> bool:
        return self.setup

    def forward(self, tokens, *, mask, input_pos):
        self.forwards += 1
        logits = torch.zeros(*tokens.shape, 5)
        if self.forwards >= 3:
            logits[1] = float("nan")
        return logits


@pytest.mark.parametrize("sync_every", [1, 4])
def test_nan_logits_in_the_loop_are_reported_by_row(sync_every: int, monkeypatch) -> None:
    # torchtune's local_kv_cache would delete caches on attention modules; the stub has none.
    stub = _NaNRowDecoder()
    monkeypatch.setattr(generation, "local_kv_cache", lambda model, **_: _StubCache(model))
    with pytest.raises(ValueError, match=r"sampling rows \[1\]"):
        generate(stub, [[1], [2]], max_new_tokens=10, pad_id=PAD, sync_every=sync_every)


class _StubCache:
    def __init__(self, model: _NaNRowDecoder) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.setup = True

    def __exit__(self, *_) -> None:
        self.model.setup = False


@pytest.mark.parametrize("host_checks", [True, False], ids=["ranked_head", "full_sort"])
def test_device_side_top_p_draws_from_the_nucleus(host_checks: bool) -> None:
    # 3000 tokens, a nucleus of a few: the host-checked path ranks the 1024 most likely tokens
    # only, the capturable one sorts the whole row; both must draw from the same distribution.
    generator = torch.Generator().manual_seed(0)
    logits = torch.full((3000,), -10.0)
    logits[:4] = torch.tensor([4.0, 3.5, 3.0, 2.0])
    probs = torch.softmax(logits.double(), -1)
    nucleus_size = int((probs.sort(descending=True).values.cumsum(0) < 0.6).sum()) + 1
    nucleus = torch.zeros_like(probs)
    nucleus[:nucleus_size] = probs[:nucleus_size] / probs[:nucleus_size].sum()
    sampling = _Sampling(1.0, None, 0.6, host_checks=host_checks)
    draws = torch.cat([_sample(logits.expand(1000, -1), sampling, generator)[0] for _ in range(8)])
    counts = torch.bincount(draws, minlength=3000).double()
    n = counts.sum()
    assert torch.all(counts[nucleus == 0] == 0)
    tolerance = 5 * torch.sqrt(nucleus * (1 - nucleus) / n) + 1e-9
    assert torch.all((counts / n - nucleus).abs() <= tolerance), (counts[:4] / n, nucleus[:4])


def test_captured_sampling_follows_the_models_distribution(traced) -> None:
    """Sampled rows of the replayed loop against the model's own next-token distribution: the
    second token of 600 rows of one prompt, binned by its first token's most common value."""
    model = _native()
    prompt = [5, 17, 3]
    out = generate(
        model,
        [prompt] * 600,
        max_new_tokens=2,
        pad_id=PAD,
        temperature=2.0,
        generator=torch.Generator().manual_seed(0),
        cuda_graphs=True,
    )
    with torch.no_grad():
        first_probs = torch.softmax(model(torch.tensor([prompt]))[0, -1].double() / 2.0, -1)
    firsts = torch.tensor([row[0] for row in out.completions])
    counts = torch.bincount(firsts, minlength=VOCAB).double()
    n = counts.sum()
    tolerance = 5 * torch.sqrt(first_probs * (1 - first_probs) / n) + 1e-9
    assert torch.all((counts / n - first_probs).abs() <= tolerance)
    # The second token came out of a replayed step: check it against the model given the first.
    common = int(counts.argmax())
    seconds = torch.tensor([row[1] for row in out.completions if row[0] == common])
    with torch.no_grad():
        second_logits = model(torch.tensor([[*prompt, common]]))[0, -1].double() / 2.0
    second_probs = torch.softmax(second_logits, -1)
    counts = torch.bincount(seconds, minlength=VOCAB).double()
    n = counts.sum()
    tolerance = 5 * torch.sqrt(second_probs * (1 - second_probs) / n) + 1e-9
    assert n >= 50 and torch.all((counts / n - second_probs).abs() <= tolerance)
    assert traced.captures == 0  # two tokens: the one decode step is an eager warm-up step


class _OpCounter(TorchDispatchMode):
    """Counts casts of the given parameters and oneDNN weight reorders."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.ids = {id(p) for p in params}
        self.casts = 0
        self.reorders = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.ids:
            self.casts += 1
        if func is torch.ops.mkldnn._reorder_linear_weight.default:
            self.reorders += 1
        return func(*args, **(kwargs or {}))


def _bf16_native() -> nn.Module:
    model = _native()
    enable_autocast(model, "bf16", torch.device("cpu"))
    return model


def test_autocast_weights_are_cast_once_per_call_not_once_per_token(monkeypatch) -> None:
    monkeypatch.setattr(generation, "_packed_cpu_linears", lambda *_: contextlib.nullcontext())
    model = _bf16_native()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    with _OpCounter(matrices) as counter:
        generate(model, PROMPTS, max_new_tokens=12, pad_id=PAD, greedy=True)
    # Every matrix once (the tied embedding as the output projection), over 12 forwards.
    assert counter.casts == len(matrices)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 on this CPU"
)
def test_packed_cpu_weights_decode_the_same_tokens_and_are_packed_once(monkeypatch) -> None:
    model = _bf16_native()
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    with _OpCounter([]) as counter:
        packed = generate(model, PROMPTS, max_new_tokens=12, pad_id=PAD, greedy=True)
    assert counter.reorders == len(linears) + 1  # and the tied output head, once per call
    assert all("forward" not in vars(linear) for linear in linears)  # restored
    assert isinstance(model.output, TiedLinear)
    monkeypatch.setattr(generation, "_packed_cpu_linears", lambda *_: contextlib.nullcontext())
    plain = generate(model, PROMPTS, max_new_tokens=12, pad_id=PAD, greedy=True)
    assert packed.completions == plain.completions


def test_graphs_are_chosen_for_dense_span_reading_decoders_only() -> None:
    from torchtune.models.qwen2._component_builders import qwen2

    assert generation._capturable(_native())
    assert generation._capturable(_transformers("llama_tied"))
    assert not generation._capturable(_transformers("qwen3_moe"))  # routes tokens by value
    torchtune_own = qwen2(
        vocab_size=VOCAB,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=16,
        intermediate_dim=32,
        max_seq_len=64,
    )
    assert not generation._capturable(torchtune_own)  # its cache reads its position back
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model on a CUDA device"):
        generate(_native(), PROMPTS, max_new_tokens=2, pad_id=PAD, cuda_graphs=True)
