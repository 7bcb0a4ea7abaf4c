"""DiLoCo on torchft: config checks, fragments, the communication model, the outer step against a
plain-PyTorch reference, exact resume from a checkpoint, multi-process runs through the launcher
(two replicas bit-identical to each other and equal to the reference) and a replica killed with
SIGKILL that rejoins and heals.

The reference (``reference_diloco``) re-implements (Streaming) DiLoCo without torchft on the test
worker's data (tests/_diloco_replica.py): every replica trains its own copy with AdamW; at each
fragment sync the pseudo-gradients theta_global - theta_local are averaged, the outer Nesterov
SGD steps the global weights, and each replica's fragment becomes lerp(global, local, alpha).
Multi-process tests wait on events (process exits, lines in the replicas' metric logs) under one
generous deadline, never on fixed sleeps.
"""

from __future__ import annotations

import io
import json
import logging
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _diloco_replica as worker
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from composer_tune.diloco import (
    DiLoCoConfig,
    DiLoCoConfigError,
    DiLoCoTrainer,
    payload_bytes,
    ring_allreduce_bytes_sent,
    split_into_fragments,
)
from composer_tune.diloco.launcher import launch, replica_env, spawn_replica, start_lighthouse
from composer_tune.diloco.metrics import build_outer_step_metrics
from composer_tune.models import qwen3_tiny

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("_diloco_replica.py")
# The launcher's 2-replica smoke command (run from the repository root), exactly as documented
# in tools/launch_diloco.py.
SMOKE_COMMAND = [
    sys.executable, "tools/launch_diloco.py", "--replicas", "2", "--",
    sys.executable, "tests/_diloco_replica.py", "--outer-steps", "4", "--sync-every", "4",
]  # fmt: skip
# Upper bound for one multi-process test on 2 busy cores; normally they take well under a minute.
DEADLINE_S = 420.0


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The worker trains with one thread; matmul results can depend on the thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- reference


def reference_diloco(
    *,
    num_replicas: int,
    outer_steps: int,
    sync_every: int,
    fragments: list[list[str]],
    delay: int = 0,
    alpha: float = 0.0,
    seed: int = 0,
    make_inner: Callable[[nn.Module], torch.optim.Optimizer] = worker.make_inner_optimizer,
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Global weights after each fragment sync, and each sync's averaged pseudo-gradient norm."""
    replicas = [worker.build_model(seed) for _ in range(num_replicas)]
    inner = [make_inner(model) for model in replicas]
    local = [dict(model.named_parameters()) for model in replicas]
    global_params = dict(worker.build_model(seed).named_parameters())
    outer = [
        torch.optim.SGD([global_params[n] for n in names], lr=0.7, momentum=0.9, nesterov=True)
        for names in fragments
    ]
    window = sync_every // len(fragments)
    history: list[dict[str, torch.Tensor]] = []
    norms: list[float] = []
    averaged: dict[str, torch.Tensor] = {}
    for step in range(outer_steps * window):
        for replica_id, (model, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            worker.next_token_loss(model, worker.make_batch(seed, replica_id, step)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        position = step % window + 1  # inner steps into the current fragment's window
        fragment = (step // window) % len(fragments)
        names = fragments[fragment]
        with torch.no_grad():
            if position == window - delay:  # the pseudo-gradient is taken `delay` steps early
                averaged = {
                    n: sum(global_params[n] - params[n] for params in local) / num_replicas
                    for n in names
                }
            if position == window:
                norms.append(
                    math.sqrt(sum(float(averaged[n].double().square().sum()) for n in names))
                )
                for n in names:
                    global_params[n].grad = averaged[n]
                outer[fragment].step()
                outer[fragment].zero_grad(set_to_none=True)
                for params in local:
                    for n in names:
                        params[n].copy_(torch.lerp(global_params[n], params[n], alpha))
                history.append({n: p.detach().clone() for n, p in global_params.items()})
    return history, norms


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        ({"sync_every": 6, "num_fragments": 4}, "multiple of num_fragments"),
        ({"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 4}, "fragment_sync_delay"),
        ({"fragment_update_alpha": 1.5}, "fragment_update_alpha"),
        ({"outer_nesterov": True, "outer_momentum": 0.0}, "outer_nesterov"),
        ({"should_quantize": True}, "should_quantize"),
        ({"backend": "nccl"}, "nccl"),
        ({"backend": "mpi"}, "backend"),
        ({"quorum_timeout_s": 0}, "quorum_timeout_s"),
        ({"min_replicas": 0}, "min_replicas"),
    ],
)
def test_config_rejects_what_cannot_work_on_cpu(overrides: dict[str, Any], culprit: str) -> None:
    with pytest.raises(DiLoCoConfigError, match=culprit):
        DiLoCoConfig(**overrides).validate(torch.device("cpu"))


def test_config_from_mapping_names_unknown_keys_and_reads_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(DiLoCoConfigError, match="sync_evry"):
        DiLoCoConfig.coerce({"sync_evry": 8})
    cfg = DiLoCoConfig.coerce({"sync_every": 8, "num_fragments": 2})
    assert (cfg.sync_every, cfg.fragment_sync_every) == (8, 4)
    # A recipe's YAML section arrives as an OmegaConf node.
    section = OmegaConf.structured(DiLoCoConfig(sync_every=8, num_fragments=2))
    assert DiLoCoConfig.coerce(section) == cfg
    monkeypatch.delenv("REPLICA_ID", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(DiLoCoConfigError, match="REPLICA_ID"):
        cfg.resolved_replica_id()
    with pytest.raises(DiLoCoConfigError, match="TORCHFT_LIGHTHOUSE"):
        cfg.resolved_lighthouse_addr()
    monkeypatch.setenv("REPLICA_ID", "3")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    assert (cfg.resolved_replica_id(), cfg.resolved_lighthouse_addr()) == (3, "http://127.0.0.1:1")
    monkeypatch.setenv("REPLICA_ID", "first")
    with pytest.raises(DiLoCoConfigError, match="integer"):
        cfg.resolved_replica_id()


# ----------------------------------------------------------------------------- fragments


class _Stack(nn.Module):
    """Units of chosen sizes: an embedding-like head, a ModuleList body, a tail."""

    def __init__(self, head: int, body: list[int], tail: int) -> None:
        super().__init__()
        self.head = nn.Linear(head, 1, bias=False)
        self.body = nn.ModuleList(nn.Linear(n, 1, bias=False) for n in body)
        self.act = nn.ReLU()  # no parameters: not a unit
        self.tail = nn.Linear(tail, 1, bias=False)


@pytest.mark.parametrize(
    ("head", "body", "tail", "fragments", "expected"),
    [
        (10, [10, 10], 10, 2, [["head", "body.0"], ["body.1", "tail"]]),
        # 100 of 103: the first cut closest to half the total is right after the head.
        (100, [1, 1], 1, 2, [["head"], ["body.0", "body.1", "tail"]]),
        # Every fragment keeps a unit: the dominant tail alone, each cut as close to its target
        # (34.3 and 68.7 of 103) as the units left allow.
        (1, [1, 1], 100, 3, [["head", "body.0"], ["body.1"], ["tail"]]),
        (5, [5, 5, 5, 5], 5, 3, [["head", "body.0"], ["body.1", "body.2"], ["body.3", "tail"]]),
        (7, [], 7, 1, [["head", "tail"]]),
    ],
)
def test_fragments_are_contiguous_and_balanced(
    head: int, body: list[int], tail: int, fragments: int, expected: list[list[str]]
) -> None:
    model = _Stack(head, body, tail)
    modules, units = split_into_fragments(model, fragments)
    assert units == expected
    named = dict(model.named_modules())
    for module, names in zip(modules, units, strict=True):
        assert list(module) == [named[name] for name in names]


def test_fragments_of_qwen3_cover_every_parameter_once() -> None:
    model = qwen3_tiny(vocab_size=64, num_layers=4, embed_dim=32, intermediate_dim=64)
    modules, units = split_into_fragments(model, 2)
    seen = [id(p) for module in modules for p in module.parameters()]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())  # each exactly once
    assert units[0][0] == "tok_embeddings" and units[-1][-1] == "norm"
    assert [u for names in units for u in names] == [
        "tok_embeddings",
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
        "norm",
    ]


def test_fragments_reject_what_would_break_the_outer_step() -> None:
    with pytest.raises(ValueError, match="only 2 units"):
        split_into_fragments(_Stack(3, [], 3), 3)
    tied = _Stack(4, [4, 4], 4)
    tied.tail.weight = tied.head.weight
    tied.tail.bias = nn.Parameter(torch.zeros(1))  # a unit of its own, sharing the head's weight
    with pytest.raises(ValueError, match=r"tail\.weight is shared between fragments 0 and 1"):
        split_into_fragments(tied, 2)
    split_into_fragments(tied, 1)  # one fragment: the shared weight is updated once
    # A unit that holds only an earlier unit's weight (a tied output projection) is no unit:
    # the weight is updated once, with the head's fragment.
    del tied.tail.bias
    tied.tail.bias = None
    _, names = split_into_fragments(tied, 2)
    assert names == [["head"], ["body.0", "body.1"]]
    rooted = _Stack(2, [2], 2)
    rooted.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"\['scale'\] belong to no fragment"):
        split_into_fragments(rooted, 1)


# ----------------------------------------------------------------------------- metrics


def test_ring_allreduce_and_dp_baseline_bytes() -> None:
    assert ring_allreduce_bytes_sent(1000, 1) == 0.0
    assert ring_allreduce_bytes_sent(1000, 2) == 1000.0
    assert ring_allreduce_bytes_sent(900, 3) == pytest.approx(1200.0)
    params = [torch.zeros(3, 5), torch.zeros(7, dtype=torch.bfloat16)]
    assert payload_bytes(params) == 15 * 4 + 7 * 2
    assert payload_bytes(params, quantized=True) == 22
    metrics = build_outer_step_metrics(
        outer_step=5,
        fragment=1,
        committed=True,
        participants=4,
        healed=False,
        inner_steps=8,
        fragment_payload=250,
        model_payload=1000,
        pseudo_grad_norm=0.5,
        previous_total_sent=10.0,
        previous_total_dp_sent=20.0,
        batches_committed=17,
    )
    # DiLoCo sends one 250-byte fragment; DP would all-reduce 1000 bytes after each of 8 steps.
    assert metrics.bytes_sent == pytest.approx(1.5 * 250)
    assert metrics.dp_bytes_sent == pytest.approx(1.5 * 8000)
    assert metrics.comm_reduction == pytest.approx(32.0)
    assert metrics.total_bytes_sent == pytest.approx(10 + 375)
    assert metrics.as_dict()["diloco/participants"] == 4.0


# ----------------------------------------------------------------------------- in-process


def _run_inner_steps(trainer: DiLoCoTrainer, start: int, count: int, seed: int = 0) -> list[Any]:
    """``count`` inner steps of the worker's loop on replica 0's data; the syncs' metrics."""
    synced = []
    for step in range(start, start + count):
        worker.next_token_loss(trainer.model, worker.make_batch(seed, 0, step)).backward()
        trainer.inner_optimizer.step()
        trainer.inner_optimizer.zero_grad(set_to_none=True)
        if trainer.lr_scheduler is not None:
            trainer.lr_scheduler.step()
        synced.extend(trainer.pop_outer_steps())
    return synced


def _single_replica(
    lighthouse: str,
    seed: int = 0,
    with_scheduler: bool = False,
    make_inner: Callable[[nn.Module], torch.optim.Optimizer] = worker.make_inner_optimizer,
    **overrides: Any,
) -> DiLoCoTrainer:
    model = worker.build_model(seed)
    optimizer = make_inner(model)
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
        if with_scheduler
        else None
    )
    cfg = {"replica_id": 0, "lighthouse_addr": lighthouse, "timeout_s": 120.0, **overrides}
    return DiLoCoTrainer(model, optimizer, cfg, lr_scheduler=scheduler)


@pytest.fixture
def lighthouse() -> Iterator[Callable[[], str]]:
    """A fresh single-replica lighthouse per call (a closed replica keeps heartbeating a few
    seconds and would hold up the next one's quorum on a shared lighthouse)."""
    servers = []

    def new() -> str:
        server, addr = start_lighthouse(min_replicas=1)
        servers.append(server)
        return addr

    yield new
    for server in servers:
        server.shutdown()


def test_streaming_outer_step_matches_reference(
    one_thread: None, lighthouse: Callable[[], str]
) -> None:
    """One replica, two fragments, an overlapped all-reduce and alpha mixing: the global weights
    after every sync, the pseudo-gradient norms and the byte counts match the reference."""
    trainer = _single_replica(
        lighthouse(),
        sync_every=4,
        num_fragments=2,
        fragment_sync_delay=1,
        fragment_update_alpha=0.5,
    )
    fragments = trainer.fragment_parameter_names()
    expected, norms = reference_diloco(
        num_replicas=1, outer_steps=4, sync_every=4, fragments=fragments, delay=1, alpha=0.5
    )
    with trainer:
        globals_after = []
        synced = []
        for step in range(8):
            synced.extend(_run_inner_steps(trainer, step, 1))
            if len(synced) > len(globals_after):
                globals_after.append(trainer.global_parameters())
        _run_inner_steps(trainer, 8, 1)  # the next fragment's all-reduce is now pending
        with pytest.raises(RuntimeError, match="in flight"):
            trainer.state_dict()
    assert [m.outer_step for m in synced] == [1, 2, 3, 4]
    assert [m.fragment for m in synced] == [0, 1, 0, 1]
    for got, want in zip(globals_after, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert [m.pseudo_grad_norm for m in synced] == pytest.approx(norms, rel=1e-6)
    model = trainer.model
    fragment_bytes = [
        4 * sum(p.numel() for n, p in model.named_parameters() if n in names) for names in fragments
    ]
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    for m in synced:
        assert (m.committed, m.participants, m.healed, m.inner_steps) == (True, 1, False, 2)
        assert m.payload_bytes == fragment_bytes[m.fragment]
        assert m.bytes_sent == 0.0  # alone in the quorum: a ring all-reduce sends nothing
        assert m.comm_reduction == pytest.approx(2 * model_bytes / fragment_bytes[m.fragment])


def _muon_inner(model: nn.Module) -> torch.optim.Optimizer:
    from composer_tune.optim import Muon

    return Muon(model.named_parameters(), lr=worker.INNER_LR, ns_dtype="fp32")


def test_muon_as_the_inner_optimizer_matches_reference(
    one_thread: None, lighthouse: Callable[[], str]
) -> None:
    """``optimizer._component_=composer_tune.optim.Muon`` in recipes/diloco.py makes Muon the
    inner optimizer (the recipe's optimizer is DiLoCo's inner one): the outer steps on its
    pseudo-gradients equal the reference's with the same inner Muon, and differ from AdamW's."""
    trainer = _single_replica(lighthouse(), sync_every=2, make_inner=_muon_inner)
    fragments = trainer.fragment_parameter_names()
    expected, norms = reference_diloco(
        num_replicas=1, outer_steps=2, sync_every=2, fragments=fragments, make_inner=_muon_inner
    )
    with trainer:
        synced = _run_inner_steps(trainer, 0, 4)
        final = trainer.global_parameters()
    assert [m.outer_step for m in synced] == [1, 2]
    torch.testing.assert_close(final, expected[-1], rtol=1e-6, atol=1e-7)
    assert [m.pseudo_grad_norm for m in synced] == pytest.approx(norms, rel=1e-6)
    with_adamw, _ = reference_diloco(
        num_replicas=1, outer_steps=2, sync_every=2, fragments=fragments
    )
    assert max((final[n] - with_adamw[-1][n]).abs().max() for n in final) > 1e-3


def test_resume_from_state_dict_continues_exactly(
    one_thread: None, lighthouse: Callable[[], str]
) -> None:
    """Save mid-round, go on; a replica built from another seed that loads the checkpoint and
    trains on the same data ends with identical local and global weights, outer momentum and
    learning rate (the inner LR schedule decays every step)."""
    settings = {
        "sync_every": 4,
        "num_fragments": 2,
        "fragment_update_alpha": 0.5,
        "with_scheduler": True,
    }
    original = _single_replica(lighthouse(), **settings)
    with original:
        _run_inner_steps(original, 0, 5)  # syncs after steps 2 and 4, then one step into round 3
        buffer = io.BytesIO()
        torch.save(original.state_dict(), buffer)
        saved_step = original.outer_step
        after_save = _run_inner_steps(original, 5, 5)

    resumed = _single_replica(lighthouse(), seed=1, **settings)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    bad = {**state, "outer": {**state["outer"], "fragments": state["outer"]["fragments"][:1]}}
    with pytest.raises(ValueError, match="1 fragments"):
        resumed.load_state_dict(bad)
    resumed.load_state_dict(state)
    assert resumed.outer_step == saved_step == 2
    with resumed:
        resumed_syncs = _run_inner_steps(resumed, 5, 5)

    assert [m.outer_step for m in resumed_syncs] == [m.outer_step for m in after_save] == [3, 4, 5]
    assert [m.total_bytes_sent for m in resumed_syncs] == [m.total_bytes_sent for m in after_save]
    torch.testing.assert_close(
        resumed.global_parameters(), original.global_parameters(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        dict(resumed.model.named_parameters()),
        dict(original.model.named_parameters()),
        rtol=0,
        atol=0,
    )
    for a, b in zip(resumed.outer_optimizers, original.outer_optimizers, strict=True):
        torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)
    assert (
        resumed.lr_scheduler.get_last_lr()
        == original.lr_scheduler.get_last_lr()
        == [worker.INNER_LR / 11]
    )


# ----------------------------------------------------------------------------- processes


def _records(out_dir: Path, replica_id: int) -> list[dict[str, Any]]:
    path = out_dir / f"replica_{replica_id}" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _committed(out_dir: Path, replica_id: int) -> list[dict[str, Any]]:
    return [r for r in _records(out_dir, replica_id) if r["event"] == "sync" and r["committed"]]


def _dump(out_dir: Path, replica_id: int, kind: str, step: int) -> dict[str, torch.Tensor]:
    """A worker's ``<kind>_<step>.pt``: global weights, outer momentum or its contribution."""
    return torch.load(out_dir / f"replica_{replica_id}" / f"{kind}_{step}.pt")


# Appended to the smoke command; argparse keeps the last --outer-steps.
STREAMING_ARGS = (
    "--outer-steps 6 --num-fragments 2 --fragment-sync-delay 1 --fragment-update-alpha 0.5"
).split()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra_args", "outer_steps", "num_fragments", "delay", "alpha"),
    [
        ([], 4, 1, 0, 0.0),  # classic DiLoCo: exactly the smoke command
        (STREAMING_ARGS, 6, 2, 1, 0.5),
    ],
    ids=["smoke_classic", "streaming"],
)
def test_two_replicas_via_launcher_match_reference(
    tmp_path: Path,
    one_thread: None,
    extra_args: list[str],
    outer_steps: int,
    num_fragments: int,
    delay: int,
    alpha: float,
) -> None:
    result = subprocess.run(
        [*SMOKE_COMMAND, *extra_args, "--out-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    done = [line for line in result.stdout.splitlines() if " done: " in line]
    assert sorted(line.split(" done: ")[0] for line in done) == [
        "[replica 0] replica 0",
        "[replica 1] replica 1",
    ]
    assert "[launcher] replica 0 finished" in result.stdout

    fragments = json.loads((tmp_path / "replica_0" / "fragments.json").read_text())
    assert len(fragments) == num_fragments
    expected, norms = reference_diloco(
        num_replicas=2,
        outer_steps=outer_steps,
        sync_every=4,
        fragments=fragments,
        delay=delay,
        alpha=alpha,
    )
    for replica_id in (0, 1):
        synced = [r for r in _records(tmp_path, replica_id) if r["event"] == "sync"]
        assert [r["outer_step"] for r in synced] == list(range(1, outer_steps + 1))
        assert all(r["committed"] and r["participants"] == 2 for r in synced)
        assert [r["fragment"] for r in synced] == [s % num_fragments for s in range(outer_steps)]
        assert [r["pseudo_grad_norm"] for r in synced] == pytest.approx(norms, rel=1e-5)
        # Two participants: each sends the whole fragment once (2 (n-1)/n = 1); DP would have
        # sent the full model after each of the sync_every / num_fragments inner steps.
        for r in synced:
            assert r["bytes_sent"] == r["payload_bytes"]
            assert r["dp_bytes_sent"] == r["inner_steps"] * sum(
                r2["payload_bytes"] for r2 in synced[:num_fragments]
            )
        if num_fragments == 1:
            assert all(r["comm_reduction"] == 4.0 for r in synced)
    for step in range(1, outer_steps + 1):
        replica_0, replica_1 = (
            _dump(tmp_path, 0, "global", step),
            _dump(tmp_path, 1, "global", step),
        )
        torch.testing.assert_close(replica_0, replica_1, rtol=0, atol=0)  # bit-identical
        torch.testing.assert_close(replica_0, expected[step - 1], rtol=1e-5, atol=1e-6)


def _wait_until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)  # polling interval only; correctness never depends on it


@pytest.mark.slow
def test_killed_replica_rejoins_heals_and_no_step_is_lost_or_double_counted(
    tmp_path: Path,
) -> None:
    """Three replicas; replica 2 SIGKILLs itself mid-round after its first full-quorum sync.
    Replicas 0 and 1 keep committing with a quorum of 2; once they have, replica 2 is restarted
    from its checkpoint, heals from a live peer and joins; all stop after two full syncs.

    A replica that is slow to start may miss the first quorums and heal into a later one; the
    checks below hold for every such order.
    """
    deadline = time.monotonic() + DEADLINE_S
    server, lighthouse_addr = start_lighthouse(min_replicas=2, join_timeout_ms=120_000)
    log_path = tmp_path / "replicas.log"
    log = open(log_path, "w")  # noqa: SIM115 -- closed in finally
    lock = threading.Lock()
    base = [sys.executable, str(WORKER), "--out-dir", str(tmp_path), "--sync-every", "4"]
    base += ["--min-replicas", "2", "--checkpoint"]

    def spawn(replica_id: int, args: list[str], restart: int = 0) -> Any:
        env = replica_env(replica_id, 3, lighthouse_addr, restart=restart)
        return spawn_replica(
            [*base, *args], replica_id, env, restart=restart, out=log, lock=lock, cwd=str(REPO)
        )

    def committed_without_victim() -> bool:
        killed_after = _committed(tmp_path, 2)[-1]["outer_step"]
        return any(
            r["participants"] == 2 and r["outer_step"] > killed_after
            for r in _committed(tmp_path, 0)
        )

    original = ["--stop-after-recovery", "3", "2"]
    replicas = {
        0: spawn(0, original),
        1: spawn(1, original),
        2: spawn(2, [*original, "--kill-after-full-quorum", "3"]),
    }
    try:
        victim = replicas[2].process.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert victim == -signal.SIGKILL
        _wait_until(committed_without_victim, deadline, "a sync of replicas 0 and 1 alone")
        replicas[2] = spawn(2, ["--stop-after-full", "3", "2"], restart=1)
        for replica in replicas.values():
            assert replica.process.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    except BaseException:
        log.flush()
        print(log_path.read_text()[-20000:])
        raise
    finally:
        for replica in replicas.values():
            replica.terminate(grace_s=5)
        log.close()
        server.shutdown()

    _assert_fault_run_consistent(tmp_path)


def _assert_fault_run_consistent(out_dir: Path) -> None:
    """The fault test's checks on the replicas' logs and weight dumps."""
    # One "life" per process: (replica, restart count) -> its committed syncs, in order.
    lives: dict[tuple[int, int], list[dict[str, Any]]] = {}
    resumed_from: dict[tuple[int, int], int | None] = {}
    for r in range(3):
        for rec in _records(out_dir, r):
            if rec["event"] == "start":
                resumed_from[(r, rec["restart"])] = rec["resumed_from"]
            elif rec["committed"]:
                lives.setdefault((r, rec["restart"]), []).append(rec)
    assert sorted(lives) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    steps = {life: [rec["outer_step"] for rec in records] for life, records in lives.items()}
    final = steps[(0, 0)][-1]
    for life, records in lives.items():
        # Each process committed consecutive outer steps: none skipped, none repeated.
        assert steps[life] == list(range(steps[life][0], steps[life][-1] + 1)), life
        # It healed exactly when it joined a quorum that was ahead of its own (resumed) step.
        behind = steps[life][0] - 1 > (resumed_from[life] or 0)
        assert [rec["healed"] for rec in records] == [behind] + [False] * (len(records) - 1)
    assert steps[(0, 0)][-1] == steps[(1, 0)][-1] == steps[(2, 1)][-1] == final
    killed_after, healed_at = steps[(2, 0)][-1], steps[(2, 1)][0]
    # The restart resumed its checkpoint (the step it died after), then healed from a live peer
    # after at least one sync ran without it.
    assert resumed_from[(2, 1)] == killed_after
    assert lives[(2, 1)][0]["healed"] and healed_at > killed_after + 1

    # Every step's quorum is exactly the processes that logged that step, and they agree on it.
    participants: dict[int, int] = {}
    for step in range(1, final + 1):
        logged = [rec for records in lives.values() for rec in records if rec["outer_step"] == step]
        sizes = {rec["participants"] for rec in logged}
        assert sizes == {len(logged)}, (step, logged)
        participants[step] = len(logged)
    assert participants[killed_after] == participants[healed_at] == participants[final] == 3
    assert all(participants[s] == 2 for s in range(killed_after + 1, healed_at))
    # torchft's running count of committed (replica, step) pairs agrees with the logs.
    for records in (lives[(0, 0)], lives[(1, 0)], lives[(2, 1)]):
        assert records[-1]["batches_committed"] == sum(participants.values())
    # After every sync the global weights and outer momentum of all replicas in it are
    # identical (the healed one's included).
    for step in range(1, final + 1):
        holders = [life[0] for life in lives if step in steps[life]]
        for kind in ("global", "momentum"):
            reference = _dump(out_dir, holders[0], kind, step)
            for r in holders[1:]:
                torch.testing.assert_close(_dump(out_dir, r, kind, step), reference, rtol=0, atol=0)
    # No work counted twice or dropped: each sync's averaged pseudo-gradient, recovered from the
    # outer Nesterov momentum (m_s = 0.9 m_(s-1) + g_s), is the sum of the members' own
    # pseudo-gradients over the quorum size; a member that healed in that sync contributes zero.
    previous = None
    for step in range(1, final + 1):
        members = [
            (life, rec)
            for life, records in lives.items()
            for rec in records
            if rec["outer_step"] == step
        ]
        momentum = _dump(out_dir, members[0][0][0], "momentum", step)
        averaged = {n: m - 0.9 * previous[n] if previous else m for n, m in momentum.items()}
        own = [
            _dump(out_dir, life[0], "contribution", step)
            for life, rec in members
            if not rec["healed"]
        ]
        expected = {n: sum(c[n] for c in own) / len(members) for n in momentum}
        torch.testing.assert_close(averaged, expected, rtol=1e-4, atol=1e-6, msg=f"step {step}")
        previous = momentum


# ----------------------------------------------------------------------------- launcher


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", body]


# Replica 0 waits for a signal; replica 1 fails once replica 0 is ready to report SIGTERM.
_FAIL_ONE = """
import os, signal, sys, time, pathlib
flag = pathlib.Path(sys.argv[1])
if os.environ["REPLICA_ID"] == "0":
    def stop(*_):
        print("got SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    flag.touch()
    signal.pause()
while not flag.exists():
    time.sleep(0.05)
print("failing", flush=True)
sys.exit(3)
"""


def test_launcher_stops_the_others_when_a_replica_fails(tmp_path: Path) -> None:
    out = io.StringIO()
    status = launch([*_script(_FAIL_ONE), str(tmp_path / "ready")], replicas=2, out=out)
    text = out.getvalue()
    assert status == 3, text
    assert "[replica 1] failing" in text
    assert "[replica 0] got SIGTERM" in text
    assert "[launcher] replica 1 failed with status 3; stopping the others" in text


_FAIL_FIRST_RUN = """
import os, sys
print("run", os.environ["REPLICA_ID"], os.environ["REPLICA_RESTART"],
      os.environ["NUM_REPLICAS"], os.environ["TORCHFT_LIGHTHOUSE"], flush=True)
sys.exit(1 if os.environ["REPLICA_ID"] == "1" and os.environ["REPLICA_RESTART"] == "0" else 0)
"""


def test_launcher_restarts_a_failed_replica_with_its_id(tmp_path: Path) -> None:
    out = io.StringIO()
    assert launch(_script(_FAIL_FIRST_RUN), replicas=2, max_restarts=1, out=out) == 0
    text = out.getvalue()
    lighthouse = text.split("[launcher] lighthouse at ")[1].split()[0]
    assert lighthouse.startswith("http://127.0.0.1:")
    for replica_id, restart in [(0, 0), (1, 0), (1, 1)]:
        assert f"[replica {replica_id}] run {replica_id} {restart} 2 {lighthouse}" in text
    assert "[launcher] replica 1 exited with status 1; restart 1/1" in text
    assert launch(_script(_FAIL_FIRST_RUN), replicas=2, max_restarts=0, out=io.StringIO()) == 1
    with pytest.raises(ValueError, match="no replica command"):
        launch([], replicas=2)


_WAIT_FOR_SIGTERM = """
import signal, sys
def stop(*_):
    print("got SIGTERM", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
signal.pause()
"""


_IGNORE_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _interrupt_launcher(replica_script: str, signals: int) -> tuple[int, str]:
    """Starts the launcher with 2 replicas running ``replica_script``; once both print "ready",
    sends SIGINT ``signals`` times (the second once both replicas report the first); returns the
    launcher's exit code and output."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "tools/launch_diloco.py",
            "--replicas",
            "2",
            "--",
            *_script(replica_script),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert launcher.stdout is not None
        sent = 0
        for line in launcher.stdout:  # blocks until each line arrives
            lines.append(line)
            ready = sum("] ready" in seen for seen in lines) == 2
            both_got_sigterm = (
                sum(seen.startswith("[replica") and "SIGTERM" in seen for seen in lines) == 2
            )
            if ready and sent == 0 or sent == 1 and both_got_sigterm and sent < signals:
                launcher.send_signal(signal.SIGINT)
                sent += 1
            if sent == signals:
                break
        rest, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return launcher.returncode, "".join(lines) + rest


@pytest.mark.slow
def test_launcher_ctrl_c_asks_every_replica_to_stop_and_waits_for_them() -> None:
    returncode, text = _interrupt_launcher(_WAIT_FOR_SIGTERM, signals=1)
    assert returncode == 130, text
    assert "[replica 0] got SIGTERM" in text and "[replica 1] got SIGTERM" in text
    assert "[launcher] got SIGINT; the replicas stop after their next sync" in text
    assert "[launcher] replica 0 exited with status 0" in text
    assert "Traceback" not in text


_REPLICA_1_DIES_ON_SIGTERM = """
import os, signal, sys, time
terms = []
def on_term(*_):
    if os.environ["REPLICA_ID"] == "1":
        sys.exit(143)  # as if killed before its stop handler was installed
    terms.append(1)
    if len(terms) == 2:
        sys.exit(143)  # a second SIGTERM aborts, as the recipe's StopRequest does
    print("stopping at the next sync", flush=True)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.slow
def test_launcher_stops_the_others_when_a_replica_dies_instead_of_stopping() -> None:
    returncode, text = _interrupt_launcher(_REPLICA_1_DIES_ON_SIGTERM, signals=1)
    assert returncode == 130, text
    assert "[launcher] replica 1 exited with status 143" in text
    assert "the other replicas cannot sync without it: stopping them unsaved" in text
    assert "[replica 0] stopping at the next sync" in text
    assert "Traceback" not in text


@pytest.mark.slow
def test_launcher_second_ctrl_c_kills_replicas_that_do_not_stop() -> None:
    returncode, text = _interrupt_launcher(_IGNORE_SIGTERM, signals=2)
    assert returncode == 130, text
    assert "[replica 0] ignoring SIGTERM" in text and "[replica 1] ignoring SIGTERM" in text
    assert "[launcher] got SIGINT again; killing the replicas" in text
    assert "Traceback" not in text


def test_cpu_replicas_drop_only_torchft_flight_recorder_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from composer_tune.diloco.trainer import quiet_flight_recorder_warning

    quiet_flight_recorder_warning()
    quiet_flight_recorder_warning()  # idempotent: one filter
    manager_logger = logging.getLogger("torchft.manager")
    assert len(manager_logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="torchft.manager"):
        manager_logger.warning(
            "[r/0 - step 1] Unable to reset NCCL flight recorder recording so traces will be "
            "incorrect."
        )
        manager_logger.warning("[r/0 - step 1] some other torchft warning")
    assert [record.getMessage() for record in caplog.records] == [
        "[r/0 - step 1] some other torchft warning"
    ]
