"""Run DiLoCo on one machine: a torchft lighthouse plus N replica processes (CPU / gloo).

The 2-replica smoke run of the recipe (the README's command; the composer loop with all three
channels as the inner loop; CI runs it in tests/test_diloco_recipe.py with smaller batches)::

    OMP_NUM_THREADS=1 python tools/launch_diloco.py --replicas 2 -- \\
        tune run recipes/diloco.py --config cpu_smoke

and with the bare outer loop (the test worker, a tiny Qwen3 with a next-token loss; CI runs it
in tests/test_diloco.py)::

    python tools/launch_diloco.py --replicas 2 -- \\
        python tests/_diloco_replica.py --outer-steps 4 --sync-every 4

Everything after ``--`` is the replica command, run once per replica with ``REPLICA_ID``,
``NUM_REPLICAS``, ``TORCHFT_LIGHTHOUSE``, ``REPLICA_RESTART`` and a private ``PET_MASTER_PORT``
in its environment (see composer_tune/diloco/launcher.py); ``DiLoCoTrainer`` reads the first and
third. Output lines are prefixed ``[replica i]``. The launcher exits 0 when every replica does;
when one fails (after ``--max-restarts`` restarts in total) it stops the others and exits with
that replica's status. Ctrl-C asks every replica to stop (SIGTERM: they stop together after
the next sync, save a checkpoint and exit 130) and waits for them; a second Ctrl-C kills them.
The lighthouse binds 127.0.0.1 and every address the replicas exchange is 127.0.0.1 by default
(the servers torchft 0.2.0 starts inside each replica listen on all interfaces; it offers no
option to narrow them).

Cluster form (one replica group per node or per set of GPUs):

1. One lighthouse for the job, on a host every replica can reach::

       torchft_lighthouse --min_replicas 2 --bind [::]:29510 --join_timeout_ms 60000

2. On each replica group's host, the recipe under torchrun (``tune run`` takes torchrun's
   flags) with that group's own rendezvous and replica id::

       REPLICA_ID=0 TORCHFT_LIGHTHOUSE=http://lighthouse-host:29510 \\
           tune run --nproc_per_node 8 --master_port 29600 recipes/diloco.py --config <cfg>
       REPLICA_ID=1 TORCHFT_LIGHTHOUSE=http://lighthouse-host:29510 \\
           tune run --nproc_per_node 8 --master_port 29600 recipes/diloco.py --config <cfg>

   Replica ids are distinct integers (a restarted group keeps its id). Set the diloco config's
   ``hostname`` to the group's address as the other groups see it; under torchrun the group's
   TCPStore is MASTER_ADDR:MASTER_PORT, which the other groups also connect to while
   reconfiguring, so MASTER_ADDR must be reachable too. Each rank of a group all-reduces its
   own FSDP shard of the pseudo-gradient with the same rank of the other groups.
"""

from __future__ import annotations

import argparse
import sys

from composer_tune.diloco.launcher import launch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--replicas", type=int, required=True, help="number of replica processes")
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="smallest quorum the lighthouse forms (default: --replicas)",
    )
    parser.add_argument(
        "--lighthouse",
        default=None,
        help="address of a running lighthouse (http://host:port); default: start one here",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts of failed replicas allowed in total (they rejoin and heal from a peer)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60_000,
        help="how long the lighthouse waits for heartbeating replicas to join a quorum",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5_000,
        help="silence after which the lighthouse considers a replica dead",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- replica command ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        build_parser().error("give the replica command after `--`")
    return launch(
        command,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        lighthouse_addr=args.lighthouse,
        max_restarts=args.max_restarts,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )


if __name__ == "__main__":
    sys.exit(main())
