"""What every recipe's run shares apart from its own loop: the RL config schema
(:mod:`~composer_tune.run.schema`), the resumable run state and the loop's pieces (set-up start,
epoch iterator, clip-guard-step, throughput window, end-of-batch save and stop)."""
