"""The stages of ``scripts/train_tiny.py``, one module each.

* :mod:`tiny.config`     - the run's hyper-parameters (:class:`TrainConfig`, curriculum :class:`Phase`).
* :mod:`tiny.data`       - training batches: one step's batch as a pure function of (seed, step).
* :mod:`tiny.training`   - model construction, loss, schedule, the recall stages and the task loop.
* :mod:`tiny.evaluation` - greedy exact-match evaluation of the saved weights, attention summary.
* :mod:`tiny.export`     - saving the model directory, its training record, lineage and card.

The modules import ``calib`` and the sibling script ``recall_stage``: ``scripts/train_tiny.py`` puts the
repository root and ``scripts/`` on ``sys.path`` before importing them.
"""
