"""Training an EAGLE-3 draft head on the target's own samples (``rheoplan train-draft``).

* ``selfdistill``: batched sampling from the target with the chat template, recording the
  EAGLE-3 features and the target's top-k next-token log-probs (resumable shards).
* ``train``: draft vocabulary, head construction, training-time test, loss, metrics,
  the resumable training loop.
* ``cli``: ``main(argv)``, the ``train-draft`` command (``python -m rheoplan.train.cli``).
"""
