"""composer-tune: torchtune-style post-training recipes (the channel ladder of Composer 2.5)
for Llama-, Qwen2- and Qwen3-family models."""

import os
from pathlib import Path

CACHE_ENV = "COMPOSER_TUNE_CACHE"


def default_cache_dir() -> Path:
    """``$COMPOSER_TUNE_CACHE``, else ``~/.cache/composer_tune`` (imported checkpoints, the leak
    check's searches); here so that light modules need not import the model code."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "composer_tune")
