"""Serve rollouts for training: vLLM's OpenAI-compatible server, set up so that an RL recipe's
``rollout.server.url`` can generate there and push its weights into it.

The server runs with vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``: its ``/collective_rpc``),
composer-tune's weight receiver as the vLLM worker extension
(``composer_tune.rollout.async_rollouts.WeightReceiver``: it joins the trainer's torch.distributed
group, gloo on CPUs and NCCL on GPUs, and loads the weights broadcast there) and log-probs of the
distribution it samples from (``--logprobs-mode processed_logprobs``), which the loss's sampling
correction compares with the trainer's. Start it from a checkpoint of the policy's architecture
(its weights are replaced by the trainer's first push):

    python tools/serve_rollouts.py --model-dir checkpoints/smollm2 --host 0.0.0.0 --port 8000
    tune run recipes/grpo.py --config smollm2 rollout.server.url=http://HOST:8000 \\
        rollout.max_staleness=1

The same server on a GPU machine, with vLLM's own command (composer-tune installed there):

    VLLM_SERVER_DEV_MODE=1 vllm serve DIR --logprobs-mode processed_logprobs \\
        --worker-extension-cls composer_tune.rollout.async_rollouts.WeightReceiver

It runs until Ctrl-C (or SIGTERM), then stops every process it started. Exit status: 0 after a
stop, 1 when the server cannot start (the error quotes its log).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from composer_tune.teachers.local_server import (
    LocalTeacherServer,
    add_server_arguments,
    serve_until_signalled,
    server_settings,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_arguments(
        parser, model_name="policy", port=8000, max_num_seqs=256,
        log=Path("outputs/serve_rollouts.log"),
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = server_settings(
        args, host=args.host, chat_template=None, tool_call_parser=None, rollout_server=True
    )
    return serve_until_signalled(LocalTeacherServer(settings, log_path=args.log), "rollout server")


if __name__ == "__main__":
    sys.exit(main())
