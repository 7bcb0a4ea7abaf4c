"""The DiLoCo outer loop around a recipe's own inner training loop, on torchft.

A recipe keeps its training loop and wraps it::

    diloco = DiLoCoTrainer(model, optimizer, cfg.diloco, lr_scheduler=lr_scheduler)
    if resume_state is not None:
        diloco.load_state_dict(resume_state)      # before the first inner step
    with diloco:
        while diloco.outer_step < max_outer_steps:
            loss = ...; loss.backward()
            optimizer.step()  # every sync_every / num_fragments calls, also a fragment sync
            optimizer.zero_grad()
            for outer in diloco.pop_outer_steps():
                metric_logger.log_dict(outer.as_dict(), step=outer.outer_step)
            if time_to_save:  # with fragment_sync_delay > 0: right after a sync
                torch.save(diloco.state_dict(), path)

Each replica is one process (or one torchrun group, for an FSDP-sharded model) with its own
``REPLICA_ID``; all replicas reach each other through a torchft lighthouse (see
``tools/launch_diloco.py``). ``torchft.local_sgd.DiLoCo`` hooks the inner optimizer's ``step``:
after every ``sync_every / num_fragments`` inner steps it asks the lighthouse for a quorum,
all-reduces one fragment's pseudo-gradient (theta_global - theta_local, averaged over the quorum)
and, if every rank of this replica voted to commit, applies it to the fragment's global weights
with the outer optimizer (Nesterov SGD over the same ``Parameter`` objects) and makes those the
new local weights. A failed sync restores the fragment's previous global weights and is retried
at the next sync point; the torchft manager step counts committed syncs only.

Fault tolerance. A replica that dies drops out of the next quorum once its heartbeat lapses and
the others continue with a smaller quorum. A replica that (re)starts joins a later quorum; if its
manager step is behind, torchft heals it before the all-reduce: a live peer sends the state the
manager callbacks below expose (model, inner optimizer, LR scheduler, every fragment's global
weights and outer-optimizer state, manager step). The peer's model weights are mid-round local
ones; left in place (torchft's default) the healed replica would send that peer's
pseudo-gradient as its own, counting the peer's inner steps twice in the average. So after the
heal the model is reset to the global weights, as a fresh DiLoCo worker starts: the healed
replica contributes a zero pseudo-gradient to the sync it joins (each real one still counts
once, divided by the whole quorum) and its own work from then on. Starting from this replica's
own checkpoint (``load_state_dict``) resumes without a peer when every replica restarts
together; a replica that resumes behind the others heals as above.

Checkpoints: ``state_dict()`` holds everything above plus the position inside the current round,
so a resumed replica continues exactly. All replicas must start from identical weights (same seed
or same initial checkpoint): the manager runs with ``init_sync=False`` so the first sync is a real
DiLoCo step rather than a copy of one replica's weights.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from torchft.checkpointing import HTTPTransport
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroup, ProcessGroupGloo, ProcessGroupNCCL

from composer_tune.diloco.config import DiLoCoConfig
from composer_tune.diloco.fragments import split_into_fragments
from composer_tune.diloco.metrics import OuterStepMetrics, build_outer_step_metrics, payload_bytes
from composer_tune.distributed import any_rank

_STATE_KEYS = ("model", "inner_optimizer", "lr_scheduler", "outer")


# torchft warns on every quorum that it cannot reset NCCL's flight recorder when torch lacks
# it; with gloo (CPU) there is no NCCL trace to reset, so the line only alarms.
FLIGHT_RECORDER_WARNING = "Unable to reset NCCL flight recorder"


def quiet_flight_recorder_warning() -> None:
    """Drops that one message from the ``torchft.manager`` logger (once per process); every
    other torchft warning still prints."""
    manager_logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _DropFlightRecorderWarning) for f in manager_logger.filters):
        manager_logger.addFilter(_DropFlightRecorderWarning())


class _DropFlightRecorderWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return FLIGHT_RECORDER_WARNING not in record.getMessage()


class _AdvertisedHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint server (it binds every interface), advertised to healing peers
    under the configured host name instead of ``socket.gethostname()``, which need not resolve."""

    def __init__(self, hostname: str, timeout: timedelta) -> None:
        self._hostname = hostname  # set first: the base constructor logs address()
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{self._hostname}:{port}/checkpoint/"


class DiLoCoTrainer:
    """DiLoCo / Streaming DiLoCo outer loop for one replica; a context manager around the
    recipe's inner loop (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        cfg: DiLoCoConfig | Mapping[str, Any],
        *,
        lr_scheduler: Any = None,
    ) -> None:
        self.cfg = DiLoCoConfig.coerce(cfg)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.lr_scheduler = lr_scheduler
        device = next(model.parameters()).device
        self._device = device
        self.cfg.validate(device)
        self.replica_id = self.cfg.resolved_replica_id()

        self.fragments, self.fragment_units = split_into_fragments(model, self.cfg.num_fragments)
        self.outer_optimizers = [
            torch.optim.SGD(
                fragment.parameters(),
                lr=self.cfg.outer_lr,
                momentum=self.cfg.outer_momentum,
                nesterov=self.cfg.outer_nesterov,
            )
            for fragment in self.fragments
        ]
        # Fragment-local parameter names (torchft's keys) -> the model's names.
        model_names = {id(p): name for name, p in model.named_parameters()}
        self._model_names = [
            {name: model_names[id(p)] for name, p in fragment.named_parameters()}
            for fragment in self.fragments
        ]
        quantized = self.cfg.should_quantize
        self._fragment_payloads = [
            payload_bytes(fragment.parameters(), quantized=quantized) for fragment in self.fragments
        ]
        self._model_payload = payload_bytes(model.parameters(), quantized=quantized)

        self.manager = self._setup_manager(device)
        self._diloco = DiLoCo(
            self.manager,
            list(self.fragments),
            inner_optimizer,
            self.outer_optimizers,
            sync_every=self.cfg.sync_every,
            backup_device=torch.device(self.cfg.backup_device) if self.cfg.backup_device else None,
            should_quantize=quantized,
            fragment_sync_delay=self.cfg.fragment_sync_delay,
            fragment_update_alpha=self.cfg.fragment_update_alpha,
        )

        # Runs after the "default" and fragment loads of a heal (the manager calls load
        # functions in registration order), so the fragments' global weights are in place.
        self.manager.register_state_dict_fn(
            "composer_tune_diloco_heal", self._restart_round_from_global, dict
        )
        self._hooks: list[RemovableHandle] = [
            outer.register_step_pre_hook(self._make_outer_pre_hook(index))
            for index, outer in enumerate(self.outer_optimizers)
        ]
        self._inner_hook: RemovableHandle | None = None
        self._inner_steps_since_sync = 0
        self._applied: tuple[int, float] | None = None  # (fragment, pseudo-grad norm) this sync
        self._healed = False
        self._total_sent = 0.0
        self._total_dp_sent = 0.0
        self._pending: list[OuterStepMetrics] = []
        # Graceful stop: every quorum carries each replica's "was I signalled" vote (see
        # vote_to_stop), so all replicas stop after the same committed sync.
        self._signalled: Callable[[], bool] = lambda: False
        self._stop_vote: tuple[torch.Tensor, Any] | None = None
        self._stop_agreed = False
        self._start_quorum = self.manager.start_quorum
        self.manager.start_quorum = self._start_quorum_with_stop_vote  # type: ignore[method-assign]

    # ----------------------------------------------------------------------------- set-up

    def _setup_manager(self, device: torch.device) -> Manager:
        cfg = self.cfg
        if dist.is_available() and dist.is_initialized():
            # A torchrun replica group (e.g. FSDP inside the replica): torchrun hosts the store.
            group_rank, group_size = dist.get_rank(), dist.get_world_size()
            store_host, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            self._store: TCPStore | None = None
        else:
            # A single-process replica hosts its own store; the manager connects as a client.
            group_rank, group_size = 0, 1
            self._store = TCPStore(
                host_name=cfg.store_host,
                port=cfg.store_port,
                is_master=True,
                wait_for_workers=False,
            )
            store_host, store_port = cfg.store_host, self._store.port
        timeout = timedelta(seconds=cfg.timeout_s)
        nccl = cfg.resolved_backend(device) == "nccl"
        pg: ProcessGroup = (
            ProcessGroupNCCL(timeout=timeout) if nccl else ProcessGroupGloo(timeout=timeout)
        )
        if not nccl:
            quiet_flight_recorder_warning()
        return Manager(
            pg=pg,
            load_state_dict=self._load_heal_state,
            state_dict=self._heal_state,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=False,  # torchft's DiLoCo requires a synchronous quorum
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
            rank=group_rank,
            world_size=group_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=cfg.resolved_lighthouse_addr(),
            replica_id=f"diloco_replica_{self.replica_id}",
            port=cfg.manager_port,
            hostname=cfg.hostname,
            checkpoint_transport=_AdvertisedHTTPTransport(cfg.hostname, timeout),
            init_sync=False,
            max_retries=cfg.max_retries,
        )

    # ----------------------------------------------------------------------------- loop

    def __enter__(self) -> DiLoCoTrainer:
        self._diloco.__enter__()
        # Registered after torchft's hook, so it runs once that hook's sync (if any) is done.
        self._inner_hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._inner_hook is not None:
            self._inner_hook.remove()
            self._inner_hook = None
        self._diloco.__exit__(exc_type, exc, traceback)
        # After an error a quorum or transfer may still be pending: do not wait for it.
        self.close(wait=exc_type is None)

    def close(self, wait: bool = True) -> None:
        """Stops the manager (its heartbeats end, so the others drop this replica)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.manager.shutdown(wait=wait)

    def vote_to_stop(self, signalled: Callable[[], bool]) -> None:
        """Makes every later quorum carry this replica's stop vote, ``signalled()``, summed over
        the replicas with the sync's pseudo-gradients; :meth:`stop_agreed` then tells every
        replica the same answer after a committed sync. (A replica-local decision would race:
        the launcher's signal reaches replicas on either side of a sync.)"""
        self._signalled = signalled

    def stop_agreed(self) -> bool:
        """Whether some replica voted to stop in the last committed sync (call right after it;
        a collective within a multi-rank replica: the max over its ranks)."""
        return any_rank(self._stop_agreed, self._device)

    def _start_quorum_with_stop_vote(self, *args: Any, **kwargs: Any) -> None:
        # torchft's DiLoCo starts a quorum right before its pseudo-gradient allreduces: the vote
        # joins them in the same quorum, in the same order on every replica.
        self._start_quorum(*args, **kwargs)
        vote = torch.tensor([1.0 if self._signalled() else 0.0], device=self._device)
        self._stop_vote = (vote, self.manager.allreduce(vote))

    @property
    def outer_step(self) -> int:
        """Committed syncs of the whole run (torchft's manager step); the same on every
        replica of a quorum."""
        return self.manager.current_step()

    def pop_outer_steps(self) -> list[OuterStepMetrics]:
        """Metrics of the syncs run since the last call (at most one per inner step)."""
        pending, self._pending = self._pending, []
        return pending

    def _make_outer_pre_hook(self, fragment: int) -> Any:
        def hook(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            # torchft steps a fragment's outer optimizer only for a committed sync, with .grad
            # holding the averaged pseudo-gradient.
            squares = sum(
                float(_local(p.grad).double().square().sum())
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            )
            self._applied = (fragment, math.sqrt(squares))

        return hook

    def _after_inner_step(
        self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any
    ) -> None:
        self._inner_steps_since_sync += 1
        # torchft's DiLoCo counts inner steps in `_local_step` and zeroes it right after a sync.
        if self._diloco._local_step != 0:
            return
        if self._applied is not None:
            fragment, norm = self._applied
        else:  # a failed sync leaves the step, and so torchft's fragment choice, unchanged
            fragment, norm = self.outer_step % self.cfg.num_fragments, None
        metrics = build_outer_step_metrics(
            outer_step=self.outer_step,
            fragment=fragment,
            committed=self._applied is not None,
            participants=self.manager.num_participants(),
            healed=self._healed,
            inner_steps=self._inner_steps_since_sync,
            fragment_payload=self._fragment_payloads[fragment],
            model_payload=self._model_payload,
            pseudo_grad_norm=norm,
            previous_total_sent=self._total_sent,
            previous_total_dp_sent=self._total_dp_sent,
            batches_committed=self.manager.batches_committed(),
        )
        self._stop_agreed = False
        if self._stop_vote is not None:
            vote, work = self._stop_vote
            self._stop_vote = None
            work.wait()
            self._stop_agreed = metrics.committed and float(vote.item()) > 0
        self._total_sent = metrics.total_bytes_sent
        self._total_dp_sent = metrics.total_dp_bytes_sent
        self._pending.append(metrics)
        self._applied, self._healed, self._inner_steps_since_sync = None, False, 0

    # ----------------------------------------------------------------------------- weights

    def fragment_parameter_names(self) -> list[list[str]]:
        """The model's parameter names in each fragment."""
        return [list(names.values()) for names in self._model_names]

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """Copies of the global weights (as of the last sync of each fragment), by model name."""
        return {
            self._model_names[index][name]: tensor.clone()
            for index, fragment in enumerate(self._diloco._fragments)
            for name, tensor in fragment.original_parameters.items()
        }

    # ----------------------------------------------------------------------------- state

    def _heal_state(self) -> dict[str, Any]:
        # Sent to a healing peer. Copies, because torchft's HTTP transport serves CPU tensors by
        # reference and inner steps may run while the peer downloads (fragment_sync_delay).
        return copy.deepcopy(self._local_state())

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        self._load_local_state(state)

    def _restart_round_from_global(self, _state: dict[str, Any]) -> None:
        # Model := global weights, so this replica's pseudo-gradient for the sync it heals into
        # is zero instead of a copy of the sending peer's (see the module docstring).
        for fragment in self._diloco._fragments:
            fragment.restore_parameters()
        self._healed = True

    def _local_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "lr_scheduler": (
                self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
            ),
        }

    def _load_local_state(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        if (self.lr_scheduler is None) != (state["lr_scheduler"] is None):
            raise ValueError(
                "DiLoCo state: lr_scheduler state "
                + ("missing" if state["lr_scheduler"] is None else "present")
                + " but this replica "
                + ("has one" if self.lr_scheduler is not None else "has none")
            )
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def outer_state_dict(self) -> dict[str, Any]:
        """The outer loop's own state: each fragment's global weights and outer-optimizer state,
        the manager step, the position in the current round and the byte counters. Recipes that
        checkpoint the model and inner optimizer themselves save just this."""
        if self.cfg.fragment_sync_delay and (
            self._diloco._local_step >= self.cfg.fragment_sync_every - self.cfg.fragment_sync_delay
        ):
            raise RuntimeError(
                "DiLoCo state_dict: a fragment all-reduce is in flight (fragment_sync_delay "
                "window); save right after a sync instead"
            )
        return {
            "fragments": [
                {
                    "original_parameters": dict(fragment.original_parameters),
                    "outer_optimizer": outer.state_dict(),
                }
                for fragment, outer in zip(
                    self._diloco._fragments, self.outer_optimizers, strict=True
                )
            ],
            "manager": self.manager.state_dict(),
            "local_step": self._diloco._local_step,
            "inner_steps_since_sync": self._inner_steps_since_sync,
            "total_bytes_sent": self._total_sent,
            "total_dp_bytes_sent": self._total_dp_sent,
        }

    def load_outer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``outer_state_dict`` returned; call before the first inner step."""
        fragments = state["fragments"]
        if len(fragments) != len(self.outer_optimizers):
            raise ValueError(
                f"DiLoCo state has {len(fragments)} fragments, this trainer has "
                f"{len(self.outer_optimizers)} (num_fragments must match the saved run)"
            )
        for index, (saved, fragment, outer) in enumerate(
            zip(fragments, self._diloco._fragments, self.outer_optimizers, strict=True)
        ):
            names = saved["original_parameters"].keys()
            if set(names) != set(fragment.original_parameters):
                raise ValueError(
                    f"DiLoCo state: fragment {index} holds {sorted(names)}, expected "
                    f"{sorted(fragment.original_parameters)}"
                )
            for name, tensor in saved["original_parameters"].items():
                fragment.original_parameters[name].copy_(tensor)
            outer.load_state_dict(saved["outer_optimizer"])
        self.manager.load_state_dict(state["manager"])
        self._diloco._local_step = state["local_step"]
        self._inner_steps_since_sync = state["inner_steps_since_sync"]
        self._total_sent = state["total_bytes_sent"]
        self._total_dp_sent = state["total_dp_bytes_sent"]

    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted replica needs (references, like ``nn.Module.state_dict``:
        save or copy before training on)."""
        return {**self._local_state(), "outer": self.outer_state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a ``state_dict()``; call before the first inner step."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"DiLoCo state is missing {missing}")
        self._load_local_state(state)
        self.load_outer_state_dict(state["outer"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
