"""SANTA / S²ANTA: the per-layer sample-budget schedule learned by REINFORCE (Lee et al., arXiv:2605.01910, App. K, L).

* :mod:`calib.santa.policy` — softmax policy, multinomial schedules, the REINFORCE step and the
  artifact schedule (largest remainder, >= 1 per layer).
* :mod:`calib.santa.inbox` — the shared-directory protocol: policy snapshots, result records,
  claim, quarantine and temp sweeping.
* :mod:`calib.santa.volume` — atomic writes and bounded, non-blocking reads on the shared volume.
* :mod:`calib.santa.lease` — the single-aggregator lease (O_EXCL file + heartbeat, no flock).
* :mod:`calib.santa.worker` — ``run_worker``: read policy, sample, evaluate, publish.
* :mod:`calib.santa.aggregator` — ``run_aggregator``: claim, update, commit, resume after crashes.

Nothing here imports torch, MLflow or Hydra: the reward evaluation and tracking are callables that
the caller passes in.
"""
