"""The three loss channels of the Composer recipe, each with the glue that completes it.

* channel 1, GRPO-family RL on verifiable rewards (replicates Composer 2.5): the loss is
  ``composer_tune.losses.policy``; :mod:`composer_tune.channels.policy` samples and scores
  rollouts, computes group advantages and the step normalisation;
* channel 2, SDPO self-distillation (replicates Composer 2.5): :mod:`composer_tune.channels.sdpo`
  builds the hinted teacher's contexts, runs the distillation loss, keeps the EMA teacher;
* channel 3, trace-replay DPO: this project's OWN research addition, not part of Cursor's
  published recipe. :mod:`composer_tune.channels.replay_dpo` streams the pairs and evaluates
  them; :mod:`composer_tune.channels.dpo_reference` scores them under the frozen reference;
* :mod:`composer_tune.channels.composer`: the channels' settings and the combined objective of
  one optimiser step (A4 and DiLoCo).
"""
