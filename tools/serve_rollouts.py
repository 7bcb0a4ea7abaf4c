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
    LocalServerSettings,
    LocalTeacherServer,
    serve_until_signalled,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="HF checkpoint directory of the policy's architecture (default: the imported "
        "SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--served-model-name", default="policy", help="the requests' 'model'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="longest prompt+answer")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="rows batched together")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU KV cache size (GiB)")
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype")
    parser.add_argument(
        "--log", type=Path, default=Path("outputs/serve_rollouts.log"), help="server log file"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_dir is None:
        from composer_tune.checkpointing.gguf_import import smollm2_checkpoint

        args.model_dir = smollm2_checkpoint()
    settings = LocalServerSettings(
        model_dir=args.model_dir,
        served_model_name=args.served_model_name,
        port=args.port,
        host=args.host,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        dtype=args.dtype,
        chat_template=None,
        tool_call_parser=None,
        rollout_server=True,
    )
    server = LocalTeacherServer(settings, log_path=args.log)
    return serve_until_signalled(server, "rollout server")


if __name__ == "__main__":
    sys.exit(main())
