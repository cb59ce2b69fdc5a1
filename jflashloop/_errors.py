"""The exceptions jflashloop raises beyond Python's own (all are ``ValueError``s)."""

from __future__ import annotations


class NonFiniteInputError(ValueError):
    """A checked entry point was given NaN or +-inf."""


class SaturationError(ValueError):
    """A checked entry point would have stored values beyond their format's range."""


class CacheStateError(ValueError):
    """A :class:`~jflashloop.PagedKVCache` is internally inconsistent (see ``paged_cache.validate``)."""


class PersistenceError(ValueError):
    """A file or bundle is corrupt, truncated, of another format version, or does not fit."""
