"""Data: what the recipes read and how it becomes tokens.

- any task in TRL's dataset formats, from files, a ``save_to_disk`` folder or the Hugging Face
  cache (``task_dataset``: ``TaskDataset``);
- task datasets in the project's sample format, ``{"id", "prompt" (chat messages), "answer"
  (gold final answer), "target" (reference assistant response for SFT), "solution" (reference
  rationale or None)}``: GSM8K (``gsm8k``), seeded synthetic arithmetic (``synthetic``) and
  programming problems with tests (``coding``); the first two are re-exported here;
- a checkpoint's tokenizer and chat template (``tokenizer``, ``chat_template``,
  ``qwen3_chat_template``);
- channel 3's data: agent traces ingested from Claude Code, SWE-agent and OpenHands logs
  (``traces``), redacted (``redact``), mined into preference pairs (``pairs``) and loaded for
  DPO (``preference``).
"""

from composer_tune.data.gsm8k import GSM8K
from composer_tune.data.synthetic import SyntheticArithmetic
from composer_tune.data.task_dataset import TaskDataset

__all__ = ["GSM8K", "SyntheticArithmetic", "TaskDataset"]
