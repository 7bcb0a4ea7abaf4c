"""One DiLoCo replica for tests/test_diloco.py and the launcher smoke run.

The inner loop is deliberately small, the outer loop is the real ``DiLoCoTrainer``: a seeded
2-layer ``qwen3_tiny`` learns "next token = this token + 1 (mod vocab)" on counting sequences
whose starts depend on (seed, replica, inner step), with AdamW. The test recomputes DiLoCo in
plain PyTorch from ``build_model``, ``make_batch``, ``next_token_loss`` and
``make_inner_optimizer`` below, so these four define the data and the inner step for both.

Run by tools/launch_diloco.py (``REPLICA_ID`` / ``TORCHFT_LIGHTHOUSE`` in the environment).
With ``--out-dir`` each replica writes under ``<out-dir>/replica_<id>/``:

- ``metrics.jsonl``: a ``start`` record per process, then one record per sync
  (``OuterStepMetrics`` fields, the process's restart count, inner steps so far);
- ``fragments.json``: the model's parameter names in each fragment;
- ``global_<outer_step>.pt``: the global weights after each committed sync;
- ``momentum_<outer_step>.pt``: the outer optimizer's momentum buffers after it (the averaged
  pseudo-gradient g of a sync is ``momentum_s - 0.9 * momentum_(s-1)``);
- ``contribution_<outer_step>.pt``: theta_global - theta_local just before the sync, i.e. the
  pseudo-gradient this replica put into the all-reduce unless it healed in that sync (fragment
  sync delay 0 only: with a delay the all-reduce starts earlier);
- ``checkpoint.pt`` (with ``--checkpoint``): the trainer's state after every sync, loaded again
  when the process restarts.

Fault-test switches: ``--kill-after-full-quorum N`` makes the process SIGKILL itself two inner
steps after its first committed sync with N participants; ``--stop-after-recovery N K`` stops
after a full (N) quorum, a smaller one, then K full ones; ``--stop-after-full N K`` after K full
ones. Both stop rules look only at committed syncs, which every replica in a quorum sees alike,
so all replicas stop at the same outer step.

Also a test device for tests/test_diloco_recipe.py: :class:`FormatRewardOverflowAt`, a reward that
overflows (the largest finite float) at chosen calls, so that a recipe run skips chosen steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer_tune.diloco import DiLoCoConfig, DiLoCoTrainer
from composer_tune.diloco.launcher import RESTART_ENV
from composer_tune.models import qwen3_tiny
from composer_tune.rewards import FormatReward
from composer_tune.rewards.base import RewardResult

VOCAB = 64
SEQ = 12
BATCH = 4
INNER_LR = 3e-3


class FormatRewardOverflowAt(FormatReward):
    """``FormatReward`` whose ``overflow_calls``-th calls (1-based) score every other completion
    with the largest finite float (an overflowing reward): each group's reward statistics
    overflow, its advantages and the policy loss are NaN, and the recipe's non-finite guard skips
    that step. (A non-finite score would not do: NaN or inf means "could not score", which gets
    zero advantage.) Passed as
    ``reward._component_=tests._diloco_replica.FormatRewardOverflowAt reward.overflow_calls=[...]``.
    """

    def __init__(self, overflow_calls: Sequence[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overflow_calls = {int(call) for call in overflow_calls}
        self.calls = 0

    def __call__(
        self, completions: Sequence[str], samples: Sequence[Mapping[str, Any]]
    ) -> list[RewardResult]:
        self.calls += 1
        results = super().__call__(completions, samples)
        if self.calls not in self.overflow_calls:
            return results
        return [
            RewardResult(sys.float_info.max if index % 2 == 0 else r.score, r.correct, r.feedback)
            for index, r in enumerate(results)
        ]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return qwen3_tiny(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=32,
        intermediate_dim=64,
        head_dim=16,
        max_seq_len=SEQ,
        initializer_range=0.1,
    )


def make_inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR)


def make_batch(seed: int, replica_id: int, inner_step: int) -> torch.Tensor:
    """Counting sequences; the starts are a pure function of (seed, replica, inner step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + replica_id * 100_003 + inner_step)
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    return (starts + torch.arange(SEQ)) % VOCAB


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def params_digest(params: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(params[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def outer_momentum(trainer: DiLoCoTrainer) -> dict[str, torch.Tensor]:
    """Each parameter's outer-optimizer momentum buffer, by model name."""
    return {
        name: outer.state[param]["momentum_buffer"].clone()
        for outer, names in zip(
            trainer.outer_optimizers, trainer.fragment_parameter_names(), strict=True
        )
        for name, param in zip(names, outer.param_groups[0]["params"], strict=True)
        if param in outer.state  # a fragment not synced yet has no momentum
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--num-fragments", type=int, default=1)
    parser.add_argument("--fragment-sync-delay", type=int, default=0)
    parser.add_argument("--fragment-update-alpha", type=float, default=0.0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--outer-steps", type=int, default=None, help="stop at this outer step")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--kill-after-full-quorum", type=int, default=None, metavar="N")
    parser.add_argument(
        "--stop-after-recovery", type=int, nargs=2, default=None, metavar=("N", "K")
    )
    parser.add_argument("--stop-after-full", type=int, nargs=2, default=None, metavar=("N", "K"))
    return parser


def should_stop(args: argparse.Namespace, outer_step: int, participants: list[int]) -> bool:
    """``participants``: the quorum size of each committed sync this process saw, in order."""
    if args.outer_steps is not None and outer_step >= args.outer_steps:
        return True
    if args.stop_after_full is not None:
        full, streak = args.stop_after_full
        return len(participants) >= streak and all(p == full for p in participants[-streak:])
    if args.stop_after_recovery is not None:
        full, streak = args.stop_after_recovery
        if len(participants) <= streak or any(p != full for p in participants[-streak:]):
            return False
        before = participants[:-streak]
        # The last sync before the streak had a smaller quorum, and a full one came earlier.
        return before[-1] < full and full in before
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.outer_steps is None and not (args.stop_after_full or args.stop_after_recovery):
        raise SystemExit("give --outer-steps or a --stop-after-* rule")
    torch.set_num_threads(1)  # the test's reference computation uses one thread too
    restart = int(os.environ.get(RESTART_ENV, "0"))

    model = build_model(args.seed)
    optimizer = make_inner_optimizer(model)
    cfg = DiLoCoConfig(
        sync_every=args.sync_every,
        num_fragments=args.num_fragments,
        fragment_sync_delay=args.fragment_sync_delay,
        fragment_update_alpha=args.fragment_update_alpha,
        min_replicas=args.min_replicas,
        timeout_s=120.0,
        quorum_timeout_s=600.0,
    )
    trainer = DiLoCoTrainer(model, optimizer, cfg)
    replica_id = trainer.replica_id

    out = args.out_dir / f"replica_{replica_id}" if args.out_dir is not None else None
    checkpoint = out / "checkpoint.pt" if out is not None and args.checkpoint else None
    inner_step = 0
    resumed_from = None
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        trainer.load_state_dict(saved["diloco"])
        inner_step = saved["inner_step"]
        resumed_from = trainer.outer_step

    def record(entry: dict) -> None:
        if out is not None:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "fragments.json").write_text(json.dumps(trainer.fragment_parameter_names()))
    record({"event": "start", "restart": restart, "resumed_from": resumed_from})

    # Registered before the trainer's hooks, so it runs before a sync in the same step().
    contribution: dict[str, torch.Tensor] = {}

    def measure_contribution(*_: object) -> None:
        params = dict(model.named_parameters())
        for name, value in trainer.global_parameters().items():
            contribution[name] = value - params[name].detach()

    if out is not None:
        optimizer.register_step_post_hook(measure_contribution)

    participants: list[int] = []
    kill_countdown = None
    first_loss = last_loss = None
    with trainer:
        while not should_stop(args, trainer.outer_step, participants):
            loss = next_token_loss(model, make_batch(args.seed, replica_id, inner_step))
            loss.backward()
            optimizer.step()  # may run a fragment sync
            optimizer.zero_grad(set_to_none=True)
            inner_step += 1
            first_loss = loss.item() if first_loss is None else first_loss
            last_loss = loss.item()
            for metrics in trainer.pop_outer_steps():
                record(
                    {
                        "event": "sync",
                        "restart": restart,
                        "inner_step": inner_step,
                        "loss": last_loss,
                        **asdict(metrics),
                    }
                )
                if not metrics.committed:
                    continue
                participants.append(metrics.participants)
                if out is not None:
                    step = metrics.outer_step
                    torch.save(trainer.global_parameters(), out / f"global_{step}.pt")
                    torch.save(dict(contribution), out / f"contribution_{step}.pt")
                    torch.save(outer_momentum(trainer), out / f"momentum_{step}.pt")
                if checkpoint is not None:
                    staging = checkpoint.with_suffix(".partial")
                    torch.save({"diloco": trainer.state_dict(), "inner_step": inner_step}, staging)
                    os.replace(staging, checkpoint)
                if kill_countdown is None and metrics.participants == args.kill_after_full_quorum:
                    kill_countdown = 2
            if kill_countdown is not None:
                kill_countdown -= 1
                if kill_countdown < 0:
                    print(f"replica {replica_id}: SIGKILL at inner step {inner_step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
    print(
        f"replica {replica_id} done: outer_step={trainer.outer_step} inner_steps={inner_step} "
        f"loss {first_loss:.3f} -> {last_loss:.3f} "
        f"global={params_digest(trainer.global_parameters())}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
