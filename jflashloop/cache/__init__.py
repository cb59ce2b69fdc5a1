"""The paged cross-loop KV cache, one module per part (all internal).

* ``_config``: :class:`~jflashloop.CacheConfig`, :class:`~jflashloop.LoopStorage`, ``sparse_loop``,
  :class:`~jflashloop.Policy` (a named one-loop layout that makes a ``CacheConfig``);
* ``_prediction``: :class:`~jflashloop.LoopPrediction` (a loop predicted from the loop before it);
* ``_layout``: what the cache holds: its pytrees (:class:`~jflashloop.PagedKVCache`
  down to one stream's tiles), the error bits, the tiles' byte layout;
* ``_regions``: where each token is read from (sink, pages, ring): ``regions()``;
* ``_pages``: full pages of every loop as a residual chain of tiles, and back;
* ``_state``: the state machine (create, prefill, write_token, commit, append, free);
* ``_chunks``: ``append_tokens`` (a chunk of tokens per sequence at once);
* ``_inspect``: reconstruct, check, validate;
* ``_storage``: byte accounting.

The public names are re-exported by :mod:`jflashloop` (``CacheConfig``, ...),
:mod:`jflashloop.paged_cache` (the operations) and :mod:`jflashloop.storage`.
"""
