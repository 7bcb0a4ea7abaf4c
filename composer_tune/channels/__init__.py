"""The three loss channels of the Composer recipe, each with the glue that completes it.

* channel 1, GRPO-family RL on verifiable rewards (replicates Composer 2.5): the loss is
  ``composer_tune.losses.policy``; :mod:`composer_tune.channels.policy` samples and scores
  rollouts, computes group advantages and the step normalisation;
* channel 2, SDPO self-distillation (replicates Composer 2.5): :mod:`composer_tune.channels.sdpo`
  builds the hinted teacher's contexts, runs the distillation loss; its ``teacher`` module holds
  the EMA teacher and its checkpoint state;
* channel 3, trace-replay DPO: this project's OWN research addition, not part of Cursor's
  published recipe. :mod:`composer_tune.channels.replay_dpo` streams the pairs and evaluates
  them; :mod:`composer_tune.channels.dpo_reference` scores them under the frozen reference;
* :mod:`composer_tune.channels.composer`: the channels' settings, every decision they imply, and
  the channel step every RL recipe takes (A1-A4, DiLoCo): a generation batch's advantages and
  teacher contexts, and each channel's forward and backward for an optimiser step.
"""
