"""Deprecated path of :mod:`jflashloop.models.cache_hooks` (removed in the next release)."""

from ._deprecation import warn_moved
from .models.cache_hooks import looped_paged_attention_hook as looped_paged_attention_hook
from .models.cache_hooks import paged_attention_hook as paged_attention_hook
from .models.cache_hooks import prefill_one_loop as prefill_one_loop

warn_moved(__name__, "jflashloop.models.cache_hooks")
