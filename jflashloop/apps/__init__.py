"""Applications of jflashloop: the command line, the demo, quality measurements, reports.

Nothing in the library imports these modules; they import the library and
:mod:`jflashloop.models`.

* :mod:`jflashloop.apps.cli`: the ``jflashloop`` command (also ``python -m jflashloop``).
* :mod:`jflashloop.apps.demo`: ``jflashloop demo``, SmolLM2 on BF16, INT4 and NVFP4 caches.
* :mod:`jflashloop.apps.evaluation`: ``jflashloop eval``, cache policies on SmolLM2's real K/V.
* :mod:`jflashloop.apps.quality`: the policies compared and their errors (K/V, attention, logits).
* :mod:`jflashloop.apps.calibration`: learned clipping and NVFP4 tensor scales (needs optax).
* :mod:`jflashloop.apps.loops`: ``jflashloop loops``, the looped model on the cross-loop cache.
* :mod:`jflashloop.apps.float64_metrics`: the float64 attention, error, KL and
  agreement measures that quality and the loops report share.
* :mod:`jflashloop.apps.progress`: optional tqdm progress bars.
"""
