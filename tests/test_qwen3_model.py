"""Qwen3 decoder: published sizes, KV-cache decoding, head_fn, torchtune integration."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune.generation import (
    generate,
    get_causal_mask_from_padding_mask,
    get_position_ids_from_padding_mask,
)
from torchtune.modules import TiedLinear, TransformerSelfAttentionLayer
from torchtune.modules.common_utils import disable_kv_cache
from torchtune.training import set_activation_checkpointing

from composer_tune.models import (
    CausalDecoder,
    DecoderArgs,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_14b,
    qwen3_32b,
    qwen3_tiny,
)

# Values copied from each Qwen/Qwen3-*/config.json (vocab 151936, head_dim 128, 8 kv heads,
# rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960 for all of them).
HF_CONFIGS = {
    qwen3_0_6b: dict(layers=28, hidden=1024, heads=16, ffn=3072, tied=True),
    qwen3_1_7b: dict(layers=28, hidden=2048, heads=16, ffn=6144, tied=True),
    qwen3_4b: dict(layers=36, hidden=2560, heads=32, ffn=9728, tied=True),
    qwen3_8b: dict(layers=36, hidden=4096, heads=32, ffn=12288, tied=False),
    qwen3_14b: dict(layers=40, hidden=5120, heads=40, ffn=17408, tied=False),
    qwen3_32b: dict(layers=64, hidden=5120, heads=64, ffn=25600, tied=False),
}
# Totals as published on the model cards / implied by the safetensors index sizes.
APPROX_TOTALS = {qwen3_0_6b: 0.596e9, qwen3_8b: 8.19e9, qwen3_32b: 32.76e9}


def _hf_param_count(layers: int, hidden: int, heads: int, ffn: int, tied: bool) -> int:
    """Parameters of a Qwen3 dense model, counted from the HF config the way HF lays them out."""
    vocab, head_dim, kv_heads = 151936, 128, 8
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 2 * head_dim
    mlp = 3 * hidden * ffn
    per_layer = attn + mlp + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


@pytest.mark.parametrize("builder", list(HF_CONFIGS), ids=lambda b: b.__name__)
def test_published_sizes_match_hf_configs(builder) -> None:
    hf = HF_CONFIGS[builder]
    with torch.device("meta"):
        model = builder()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == _hf_param_count(**hf)
    if builder in APPROX_TOTALS:
        assert n_params == pytest.approx(APPROX_TOTALS[builder], rel=2e-3)
    assert model.config == DecoderArgs(
        vocab_size=151936,
        num_layers=hf["layers"],
        num_heads=hf["heads"],
        num_kv_heads=8,
        embed_dim=hf["hidden"],
        intermediate_dim=hf["ffn"],
        head_dim=128,
        max_seq_len=40960,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=hf["tied"],
    )
    assert isinstance(model.output, TiedLinear) == hf["tied"]


def test_builder_from_yaml() -> None:
    cfg = OmegaConf.create(
        {"_component_": "composer_tune.models.qwen3_tiny", "vocab_size": 100, "num_layers": 3}
    )
    model = tt_config.instantiate(cfg)
    assert isinstance(model, CausalDecoder)
    assert len(model.layers) == 3 and model.tok_embeddings.num_embeddings == 100


def test_invalid_args_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        qwen3_tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        qwen3_tiny(head_dim=0)


def _tiny(**kwargs) -> CausalDecoder:
    torch.manual_seed(0)
    model = qwen3_tiny(vocab_size=128, max_seq_len=64, initializer_range=0.2, **kwargs)
    return model.eval()


def _left_padded_batch(vocab: int, prompt_lens: list[int], n_new: int):
    """Random tokens (never the pad id 0) for prompts of different lengths, left-padded."""
    width = max(prompt_lens) + n_new
    tokens = torch.randint(1, vocab, (len(prompt_lens), width))
    padding_mask = torch.ones_like(tokens, dtype=torch.bool)
    for row, length in enumerate(prompt_lens):
        padding_mask[row, : max(prompt_lens) - length] = False
    return tokens.masked_fill(~padding_mask, 0), padding_mask


@pytest.mark.parametrize("tied", [True, False])
def test_kv_cache_decoding_matches_full_forward(tied: bool) -> None:
    model = _tiny(tie_word_embeddings=tied)
    prompt_lens, n_new, cache_len = [5, 3, 7], 4, 16
    tokens, padding_mask = _left_padded_batch(128, prompt_lens, n_new)
    prefill = max(prompt_lens)
    positions = get_position_ids_from_padding_mask(padding_mask)
    with torch.no_grad():
        full = model(
            tokens, mask=get_causal_mask_from_padding_mask(padding_mask), input_pos=positions
        )
        # Each row on its own, unpadded, with default positions and causal masking.
        alone = [model(tokens[i : i + 1, padding_mask[i]])[0] for i in range(len(prompt_lens))]

        model.setup_caches(batch_size=3, dtype=torch.float32, decoder_max_seq_len=cache_len)
        assert model.caches_are_enabled()
        cache_mask = get_causal_mask_from_padding_mask(padding_mask, target_seq_len=cache_len)
        for _attempt in range(2):  # the second pass checks reset_caches
            steps = [
                model(
                    tokens[:, :prefill],
                    mask=cache_mask[:, :prefill],
                    input_pos=positions[:, :prefill],
                )
            ]
            for t in range(prefill, prefill + n_new):
                steps.append(
                    model(
                        tokens[:, t : t + 1],
                        mask=cache_mask[:, t : t + 1],
                        input_pos=positions[:, t : t + 1],
                    )
                )
            cached = torch.cat(steps, dim=1)
            for i in range(len(prompt_lens)):
                real = padding_mask[i]
                torch.testing.assert_close(cached[i, real], full[i, real], atol=1e-5, rtol=0)
                torch.testing.assert_close(cached[i, real], alone[i], atol=1e-5, rtol=0)
            model.reset_caches()


def test_kv_cache_requires_mask_and_positions() -> None:
    model = _tiny()
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=8)
    with pytest.raises(ValueError, match="mask"):
        model(torch.ones(1, 2, dtype=torch.long))


def test_disabled_cache_still_causal() -> None:
    """torchtune's disable_kv_cache leaves caches allocated: attention must stay causal."""
    model = _tiny()
    tokens = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        expected = model(tokens)
        model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=16)
        with disable_kv_cache(model):
            got = model(tokens)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_torchtune_generate_with_cache_matches_greedy_full_forward() -> None:
    model = _tiny(tie_word_embeddings=False)
    prompt, _ = _left_padded_batch(128, [4, 6], 0)
    n_new = 5
    expected = prompt
    with torch.no_grad():
        for _ in range(n_new):  # greedy decoding by full re-forward of the left-padded batch
            pad = expected != 0
            logits = model(
                expected,
                mask=get_causal_mask_from_padding_mask(pad),
                input_pos=get_position_ids_from_padding_mask(pad),
            )
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=16)
        generated, _ = generate(model, prompt, max_generated_tokens=n_new, pad_id=0, top_k=1)
    assert torch.equal(generated, expected)


@pytest.mark.parametrize("tied", [True, False])
def test_head_fn_gets_normed_hidden_and_output_module(tied: bool) -> None:
    model = _tiny(tie_word_embeddings=tied)
    tokens = torch.randint(0, 128, (2, 7))
    targets = torch.randint(0, 128, (2, 7))

    def chunked_logprobs(h: torch.Tensor, output) -> torch.Tensor:
        assert output is model.output and h.shape == (2, 7, model.config.embed_dim)
        chunks = [
            torch.log_softmax(output(hc).float(), -1).gather(-1, tc.unsqueeze(-1)).squeeze(-1)
            for hc, tc in zip(h.split(3, dim=1), targets.split(3, dim=1), strict=True)
        ]
        return torch.cat(chunks, dim=1)

    logprobs = model(tokens, head_fn=chunked_logprobs)
    logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(tokens)
    assert logits.dtype == torch.float32
    reference = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    reference.sum().backward()
    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_activation_checkpointing_keeps_gradients() -> None:
    tokens = torch.randint(0, 128, (2, 10))
    grads = []
    for checkpointed in (False, True):
        model = _tiny().train()
        if checkpointed:
            set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
        model(tokens).logsumexp(-1).mean().backward()
        # Checkpoint wrappers rename parameters; compare under the state-dict names.
        grads.append(
            {
                n.replace("._checkpoint_wrapped_module", ""): p.grad
                for n, p in model.named_parameters()
            }
        )
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
