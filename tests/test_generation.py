"""Tests for composer_tune.rollout.generation: batched KV-cache sampling and sequence packing.

References are computed independently of the code under test: greedy decoding by recomputing
the whole (left-padded or unpadded) sequence each step without a cache, masks and positions built
with plain Python loops, and sampling distributions written out by hand.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torchtune.models.qwen2._component_builders import qwen2

from composer_tune.distributed import finish_process, setup_distributed, teardown_distributed
from composer_tune.rollout import generate, pack_sequences, sample_next_token
from tests.recipe_runs import run_torchrun

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB = 97
PAD = 0
PROMPTS = [[5, 17, 3, 44, 9, 12, 60], [8, 2], [31, 31, 7, 90], [4]]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Run this module's tiny models on one intra-op thread, restoring the setting after.

    They gain nothing from threading, and on a shared, loaded machine OpenMP workers waiting
    for each other made this file ~10x slower (150 s instead of 16 s) with two threads.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _tiny_qwen2() -> nn.Module:
    return qwen2(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=256,
    )


def _tiny_qwen3() -> nn.Module:
    models = pytest.importorskip("composer_tune.models")
    if not hasattr(models, "qwen3_tiny"):
        pytest.skip("composer_tune.models.qwen3_tiny has not landed yet")
    # A wide init gives peaky logits, so wrong masks or positions change the argmax.
    return models.qwen3_tiny(vocab_size=VOCAB, initializer_range=0.5)


@pytest.fixture(params=["qwen2", "qwen3"])
def model(request: pytest.FixtureRequest) -> nn.Module:
    """A tiny random float32 decoder with torchtune's KV-cache API."""
    torch.manual_seed(0)
    build = _tiny_qwen2 if request.param == "qwen2" else _tiny_qwen3
    return build().float().eval()


def _greedy_recompute_batched(model: nn.Module, prompts: list[list[int]], steps: int):
    """Greedy decoding without a cache: the left-padded batch is re-run in full every step.

    The mask and positions are built element by element: key k is visible to query q of row i
    iff k <= q and k is a real token (or k == q, so pad queries see something); positions
    count real tokens before each slot.
    """
    width = max(len(p) for p in prompts)
    rows = [[PAD] * (width - len(p)) + list(p) for p in prompts]
    real = [[False] * (width - len(p)) + [True] * len(p) for p in prompts]
    with torch.no_grad():
        for _ in range(steps):
            length = len(rows[0])
            mask = torch.zeros(len(rows), length, length, dtype=torch.bool)
            pos = torch.zeros(len(rows), length, dtype=torch.long)
            for i in range(len(rows)):
                for q in range(length):
                    pos[i, q] = max(sum(real[i][:q]), 0)
                    for k in range(q + 1):
                        mask[i, q, k] = real[i][k] or k == q
            logits = model(torch.tensor(rows), mask=mask, input_pos=pos)[:, -1]
            for i, token in enumerate(logits.argmax(-1).tolist()):
                rows[i].append(token)
                real[i].append(True)
    return [row[width:] for row in rows]


def _greedy_recompute_single(model: nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding of one unpadded prompt, re-running the full sequence each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_greedy_with_cache_equals_full_recompute_on_left_padded_batch(model: nn.Module) -> None:
    steps = 8
    out = generate(model, PROMPTS, max_new_tokens=steps, pad_id=PAD, temperature=0.0)
    assert out.completions == _greedy_recompute_batched(model, PROMPTS, steps)
    assert out.truncated.all()
    assert out.completion_lengths.tolist() == [steps] * len(PROMPTS)


def test_batch_result_equals_each_prompt_decoded_alone(model: nn.Module) -> None:
    steps = 8
    batched = generate(model, PROMPTS, max_new_tokens=steps, pad_id=PAD, greedy=True)
    for prompt, completion in zip(PROMPTS, batched.completions, strict=True):
        assert completion == _greedy_recompute_single(model, prompt, steps)
        alone = generate(model, [prompt], max_new_tokens=steps, pad_id=PAD, greedy=True)
        assert alone.completions == [completion]


def test_chunked_prefill_matches_single_prefill(model: nn.Module) -> None:
    kwargs = dict(max_new_tokens=6, pad_id=PAD, temperature=0.8, return_logprobs=True)
    one = generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), **kwargs)
    chunked = generate(
        model, PROMPTS, generator=torch.Generator().manual_seed(3), prefill_chunk=2, **kwargs
    )
    assert chunked.completions == one.completions
    for a, b in zip(chunked.logprobs, one.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_stop_tokens_end_rows_and_flag_truncation(model: nn.Module) -> None:
    steps = 8
    free = generate(model, PROMPTS, max_new_tokens=steps, pad_id=PAD, greedy=True).completions
    # Stop on the 3rd token row 0 produces (and on a token no row produces, to test a set).
    stop = free[0][2]
    unused = next(t for t in range(VOCAB) if all(t not in c for c in free))
    out = generate(
        model, PROMPTS, max_new_tokens=steps, pad_id=PAD, greedy=True, stop_tokens=(unused, stop)
    )
    for row, completion in enumerate(free):
        if stop in completion:
            expected = completion[: completion.index(stop) + 1]
            assert out.completions[row] == expected
            assert not out.truncated[row]
        else:
            assert out.completions[row] == completion
            assert out.truncated[row]
        assert out.completion_lengths[row] == len(out.completions[row])
    assert not out.truncated[0]


def test_loop_stops_early_once_every_row_is_done() -> None:
    torch.manual_seed(0)
    model = _tiny_qwen2().eval()
    prompt = [[5, 6, 7]]
    first = generate(model, prompt, max_new_tokens=1, pad_id=PAD, greedy=True).completions[0][0]
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    out = generate(model, prompt, max_new_tokens=50, pad_id=PAD, greedy=True, stop_tokens=[first])
    assert out.completions == [[first]]
    assert not out.truncated[0]
    assert len(calls) == 1  # the prefill only: no decode forward after the row finished


def test_top_k_one_equals_greedy(model: nn.Module) -> None:
    greedy = generate(model, PROMPTS, max_new_tokens=6, pad_id=PAD, greedy=True)
    top1 = generate(
        model,
        PROMPTS,
        max_new_tokens=6,
        pad_id=PAD,
        temperature=1.5,
        top_k=1,
        generator=torch.Generator().manual_seed(0),
        return_logprobs=True,
    )
    assert top1.completions == greedy.completions
    # A single candidate has probability 1.
    assert all(torch.equal(lp, torch.zeros_like(lp)) for lp in top1.logprobs)


def test_same_seed_reproduces_and_other_seed_differs(model: nn.Module) -> None:
    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return generate(
            model, PROMPTS, max_new_tokens=10, pad_id=PAD, temperature=2.0, generator=gen
        ).completions

    assert run(7) == run(7)
    assert run(7) != run(8)


def _reference_logprob(logits: torch.Tensor, token: int, temperature: float, top_k, top_p):
    """Log-probability of ``token`` under temperature / top-k / top-p, one Python token at a time."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])[:top_k]
    kept, kept_mass, total = [], 0.0, sum(probs[t] for t in order)
    for t in order:
        kept.append(t)
        kept_mass += probs[t] / total
        if kept_mass >= top_p:
            break
    if token not in kept:
        return -math.inf
    return math.log(probs[token] / sum(probs[t] for t in kept))


def test_logprobs_match_full_forward_recomputation(model: nn.Module) -> None:
    temperature, top_k, top_p = 0.7, 20, 0.9
    out = generate(
        model,
        PROMPTS,
        max_new_tokens=6,
        pad_id=PAD,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(1),
        return_logprobs=True,
    )
    packed = pack_sequences(PROMPTS, out.completions, pad_id=PAD)
    with torch.no_grad():
        logits = model(packed.tokens)  # right padding: the default causal mask suffices
    for row in range(len(PROMPTS)):
        targets = packed.completion_mask[row].nonzero().squeeze(-1).tolist()
        expected = [
            _reference_logprob(
                logits[row, t - 1], int(packed.tokens[row, t]), temperature, top_k, top_p
            )
            for t in targets
        ]
        torch.testing.assert_close(
            out.logprobs[row], torch.tensor(expected, dtype=torch.float32), atol=2e-4, rtol=1e-4
        )


class _CacheHolder(nn.Module):
    """Stands in for an attention layer: torchtune's delete_kv_caches looks for ``kv_cache``."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache: nn.Module | None = None
        self.cache_enabled = False


class FixedLogitsDecoder(nn.Module):
    """Decoder stub whose next-token logits are always ``logits``: a known distribution."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)
        self.attn = _CacheHolder()
        self.unused = nn.Linear(1, 1)  # gives generate() a parameter dtype / device

    def setup_caches(
        self, batch_size, dtype, *, encoder_max_seq_len=None, decoder_max_seq_len=None
    ):
        self.attn.kv_cache = nn.Identity()
        self.attn.cache_enabled = True

    def caches_are_setup(self) -> bool:
        return self.attn.kv_cache is not None

    def caches_are_enabled(self) -> bool:
        return self.attn.cache_enabled

    def forward(self, tokens, *, mask, input_pos):
        assert mask.shape[:2] == tokens.shape and input_pos.shape == tokens.shape
        return self.logits.expand(*tokens.shape, -1)


STUB_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])


def _sample_counts(**sampling) -> torch.Tensor:
    """Counts of each token over 200 rows x 20 steps sampled from the stub."""
    out = generate(
        FixedLogitsDecoder(STUB_LOGITS),
        [[1]] * 200,
        max_new_tokens=20,
        pad_id=PAD,
        generator=torch.Generator().manual_seed(0),
        **sampling,
    )
    tokens = torch.tensor(out.completions).flatten()
    return torch.bincount(tokens, minlength=len(STUB_LOGITS)).double()


def _assert_frequencies(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Empirical frequencies within 5 binomial standard deviations of ``probs``."""
    n = counts.sum()
    assert torch.all(counts[probs == 0] == 0), f"sampled tokens of probability 0: {counts}"
    tolerance = 5 * torch.sqrt(probs * (1 - probs) / n) + 1e-9
    assert torch.all((counts / n - probs).abs() <= tolerance), (counts / n, probs)


def test_temperature_sampling_follows_softmax() -> None:
    _assert_frequencies(
        _sample_counts(temperature=1.7), torch.softmax(STUB_LOGITS / 1.7, -1).double()
    )


def test_top_p_samples_only_the_nucleus() -> None:
    probs = torch.softmax(STUB_LOGITS.double(), -1)
    # The two most likely tokens hold ~0.65 < 0.7, three reach ~0.80: the nucleus is {0, 1, 2}.
    assert probs[:2].sum() < 0.7 <= probs[:3].sum()
    nucleus = torch.zeros_like(probs)
    nucleus[:3] = probs[:3] / probs[:3].sum()
    _assert_frequencies(_sample_counts(top_p=0.7), nucleus)


def test_top_p_below_top_token_mass_keeps_the_top_token() -> None:
    counts = _sample_counts(top_p=1e-6)
    assert counts[0] == counts.sum()


def test_top_k_and_top_p_compose() -> None:
    # Top-2 after temperature 3 leaves probabilities ~(0.54, 0.46); top_p 0.5 keeps the first.
    assert (_sample_counts(temperature=3.0, top_k=2, top_p=0.5)[1:] == 0).all()
    # With top_p 0.6 both of the two survive, in proportion softmax([2, 1.5] / 3).
    two = torch.zeros(len(STUB_LOGITS), dtype=torch.float64)
    two[:2] = torch.softmax(STUB_LOGITS[:2].double() / 3.0, -1)
    _assert_frequencies(_sample_counts(temperature=3.0, top_k=2, top_p=0.6), two)


def test_sampling_across_cdf_blocks_follows_the_distribution() -> None:
    # A vocabulary spanning several 1024-token CDF blocks plus a ragged tail, with the mass on
    # block edges and everything else impossible (-inf logits).
    vocab = 2500
    support = torch.tensor([0, 1023, 1024, 2047, 2048, 2499])
    probs = torch.zeros(vocab, dtype=torch.float64)
    probs[support] = torch.tensor([0.1, 0.2, 0.05, 0.25, 0.3, 0.1], dtype=torch.float64)
    logits = probs.log().float().expand(2000, -1)
    generator = torch.Generator().manual_seed(0)
    draws = [sample_next_token(logits, generator=generator)[0] for _ in range(10)]
    _assert_frequencies(torch.bincount(torch.cat(draws), minlength=vocab).double(), probs)


@pytest.mark.parametrize("top_p", [0.3, 0.999], ids=["nucleus_in_head", "nucleus_past_head"])
def test_top_p_over_a_large_vocabulary(top_p: float) -> None:
    # 3000 tokens: more than the 1024 ranked first, so both the ranked-head shortcut (small
    # nucleus) and the full sort (nucleus reaching past the head) are exercised.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=generator) * 2
    tokens, logprobs = sample_next_token(logits, top_p=top_p, generator=generator)
    expected = [
        _reference_logprob(row_logits, int(token), 1.0, None, top_p)
        for row_logits, token in zip(logits, tokens, strict=True)
    ]
    torch.testing.assert_close(logprobs, torch.tensor(expected, dtype=torch.float32))
    nucleus_sizes = [
        int((torch.softmax(row.double(), -1).sort(descending=True).values.cumsum(0) < top_p).sum())
        + 1
        for row in logits
    ]
    assert (max(nucleus_sizes) > 1024) == (top_p == 0.999)


def test_model_state_restored_and_training_works_after(model: nn.Module) -> None:
    model.train()
    model.norm.eval()  # a submodule deliberately left in eval mode by the caller
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    before = model(tokens)

    generate(model, PROMPTS, max_new_tokens=4, pad_id=PAD, temperature=1.0)

    assert model.training and not model.norm.training
    assert all(m.training for m in model.layers.modules())
    assert not model.caches_are_setup() and not model.caches_are_enabled()
    logits = model(tokens)  # a stale (disabled) cache would silently make attention non-causal
    torch.testing.assert_close(logits, before)
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_pack_sequences_layout() -> None:
    packed = pack_sequences([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], pad_id=PAD)
    assert packed.tokens.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert packed.completion_mask.tolist() == [
        [False, False, False, True, True],
        [False, True, True, True, False],
    ]
    assert packed.padding_mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    assert packed.input_pos.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert packed.prompt_lengths.tolist() == [3, 1]
    assert packed.completion_lengths.tolist() == [2, 3]


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[1], []], {}, r"prompts\[1\] is empty"),
        ([[1, VOCAB]], {}, rf"prompts\[0\] holds token id {VOCAB}"),
        ([[1]], {"pad_id": -1}, "pad_id -1"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1]], {"top_p": 0.0}, "top_p"),
        ([[1]], {"top_k": 0}, "top_k"),
        ([[1]], {"temperature": -1.0}, "temperature"),
        ([[1] * 200], {"max_new_tokens": 100}, "max_seq_len"),
    ],
)
def test_bad_arguments_raise_clear_errors(prompts, kwargs, message) -> None:
    args = {"max_new_tokens": 2, "pad_id": PAD} | kwargs
    with pytest.raises(ValueError, match=message):
        generate(_tiny_qwen2(), prompts, **args)


def test_non_finite_logits_are_reported_by_row() -> None:
    logits = torch.zeros(3, 5)
    logits[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"sampling rows \[1\]"):
        sample_next_token(logits, generator=torch.Generator().manual_seed(0))


def test_model_with_caches_already_set_up_is_rejected() -> None:
    model = _tiny_qwen2()
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=16)
    with pytest.raises(ValueError, match="already has caches"):
        generate(model, [[1]], max_new_tokens=2, pad_id=PAD)


@pytest.fixture(scope="module")
def ours_and_hf(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3 and the same weights loaded by transformers' Qwen3ForCausalLM."""
    models = pytest.importorskip("composer_tune.models")
    checkpointing = pytest.importorskip("composer_tune.checkpointing")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = models.qwen3_tiny(vocab_size=VOCAB, initializer_range=0.5).eval()
    path = tmp_path_factory.mktemp("hf_checkpoint")
    checkpointing.save_hf_checkpoint(ours.state_dict(), ours.config, path)
    return ours, AutoModelForCausalLM.from_pretrained(path).eval()


def test_greedy_matches_transformers_generate(ours_and_hf) -> None:
    ours, hf = ours_and_hf
    steps = 8
    width = max(len(p) for p in PROMPTS)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        expected = hf.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=PAD,
            eos_token_id=None,
        )[:, width:]
    out = generate(ours, PROMPTS, max_new_tokens=steps, pad_id=PAD, greedy=True)
    assert out.completions == expected.tolist()


def test_logprobs_match_transformers_logits_warpers(ours_and_hf) -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ours, hf = ours_and_hf
    temperature, top_k, top_p = 1.3, 30, 0.8
    out = generate(
        ours,
        PROMPTS,
        max_new_tokens=6,
        pad_id=PAD,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(5),
        return_logprobs=True,
    )
    # transformers applies its warpers in this order too.
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]
    )
    for prompt, completion, logprobs in zip(PROMPTS, out.completions, out.logprobs, strict=True):
        sequence = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = hf(sequence).logits[0]
        expected = []
        for t in range(len(prompt), sequence.shape[1]):
            scores = warpers(sequence[:, :t], logits[t - 1 : t].clone())
            expected.append(torch.log_softmax(scores, dim=-1)[0, sequence[0, t]])
        torch.testing.assert_close(logprobs, torch.stack(expected), atol=2e-4, rtol=1e-4)


def _sync_ranks_worker(out_dir: Path) -> None:
    """torchrun worker: FSDP2-sharded greedy generation with ``sync_ranks`` on 2 gloo ranks.

    The ranks get prompts of different widths (different prefill chunk counts) and rank 0's rows
    stop after one token, so unsynchronised they would run different numbers of forwards (and
    deadlock, forwards of a sharded model being collectives). Each rank writes its completions
    and forward counts, those of an unsharded copy decoding alone, and the loss of a training
    forward/backward after generation on both.
    """
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.training import shard_model

    from composer_tune.models import qwen3_tiny

    setup_distributed("cpu")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    sharded = qwen3_tiny(vocab_size=VOCAB, initializer_range=0.5)
    reference = copy.deepcopy(sharded).eval()
    shard_model(
        sharded,
        [lambda _name, module: isinstance(module, TransformerSelfAttentionLayer)],
        cpu_offload=False,
        reshard_after_forward=True,
    )
    prompts = PROMPTS[:2] if rank == 0 else PROMPTS[2:]  # widest prompt 7 vs 4 tokens
    kwargs = {"max_new_tokens": 8, "pad_id": PAD, "greedy": True, "prefill_chunk": 3}
    if rank == 0:
        first = generate(reference, prompts, **(kwargs | {"max_new_tokens": 1})).completions
        kwargs["stop_tokens"] = sorted({row[0] for row in first})

    counts = {"sharded": 0, "reference": 0}
    sharded.register_forward_hook(lambda *_: counts.__setitem__("sharded", counts["sharded"] + 1))
    reference.register_forward_hook(
        lambda *_: counts.__setitem__("reference", counts["reference"] + 1)
    )
    sharded.train()
    out = generate(sharded, prompts, sync_ranks=True, **kwargs)
    expected = generate(reference, prompts, **kwargs)

    tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    loss = sharded(tokens).logsumexp(-1).mean()
    loss.backward()
    reference.train()
    reference_loss = reference(tokens).logsumexp(-1).mean()
    result = {
        "completions": out.completions,
        "expected": expected.completions,
        # Both minus the training forward.
        "forwards": counts["sharded"] - 1,
        "reference_forwards": counts["reference"] - 1,
        "loss": loss.item(),
        "reference_loss": reference_loss.item(),
        "still_training": sharded.training,
        "caches_removed": not sharded.caches_are_setup(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    teardown_distributed()


@pytest.mark.slow
def test_sync_ranks_with_fsdp2(tmp_path: Path) -> None:
    pytest.importorskip("composer_tune.models", reason="needs qwen3_tiny")
    run_torchrun(Path(__file__).resolve(), str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Unsynchronised, the ranks would run different numbers of forwards ...
    assert ranks[0]["reference_forwards"] != ranks[1]["reference_forwards"]
    # ... synchronised, they run the same, with unchanged results.
    assert ranks[0]["forwards"] == ranks[1]["forwards"]
    for result in ranks:
        assert result["completions"] == result["expected"]
        assert result["loss"] == pytest.approx(result["reference_loss"], abs=1e-5)
        assert result["still_training"] and result["caches_removed"]
    assert all(len(row) == 1 for row in ranks[0]["completions"])  # rank 0 stopped early


if __name__ == "__main__":
    finish_process(lambda: _sync_ranks_worker(Path(sys.argv[1])))
