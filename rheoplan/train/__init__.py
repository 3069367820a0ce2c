"""Training an EAGLE-3 draft head on the target's own samples (``rheoplan train-draft``).

* ``prompts``: the prompt plan (shipped prompts plus thousands built by program; the
  evaluation prompts and their near duplicates kept out).
* ``tokens``: batched T=1 sampling (token ids only) and the compact uint16 shard format.
* ``generate``: the resumable sampling job (held-out, first turns, follow-up turns).
* ``features``: EAGLE-3 features and soft targets by batched teacher-forced target
  forwards at training time.
* ``selfdistill``: the target loader (SmolLM2 or any local transformers causal LM) and
  the shipped prompt files.
* ``train``: draft vocabulary, head construction, training-time test, loss, metrics,
  the resumable training loop.
* ``cli``: ``main(argv)``, the ``train-draft`` command (``python -m rheoplan.train.cli``).
"""
