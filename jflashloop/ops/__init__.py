"""The GPU ops, one module each, and the one rule that picks their backend.

* :mod:`._division`: exact float32 division (XLA, or the Pallas kernel);
* :mod:`._page_quantization`: page tiles encoded on write (the XLA codecs,
  or the Pallas quantize-on-write kernels);
* :mod:`._decode_attention`: decode attention over the paged cache (the
  reference path, the Pallas kernel, or the Gluon kernel);
* :mod:`._chunk_attention`: a chunk of query tokens per sequence over the
  cache and the chunk itself (chunked prefill, speculative verification);
* :mod:`._dispatch`: resolving ``implementation`` (:class:`Implementation`)
  and trying backends in order;
* :mod:`.arg_specs`: named shapes shared by tests and benchmarks.

The public functions are re-exported by :mod:`jflashloop`
(``jflashloop.decode_attention``, ...); the modules here are internal.
"""

from . import arg_specs as arg_specs
from ._dispatch import Implementation as Implementation

__all__ = ["Implementation", "arg_specs"]
