"""Static configuration of a paged cross-loop KV cache."""

from __future__ import annotations

import dataclasses
import functools
import math

from ..codecs import INT4_KEYS, INT4_VALUES, CodecSpec
from ._prediction import LoopPrediction

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class LoopStorage:
    """How one loop's K and V are stored.

    Attributes:
      key_spec, value_spec: codecs of this loop's stream (the base for loop 0,
        the residual against the reconstructed predecessor for later loops).
      sparse_rows_per_page: None for a dense loop (every token stored); an int
        for a compact sparse residual: at most this many token rows of each
        page (per KV head) carry a residual, the others inherit the previous
        loop. Sparse codecs must group per token (``axis="token"``) so a
        compact row never shares metadata with another row.
      direct: a dense loop after the base stored on its own, like the base,
        instead of as a residual against the previous loop: it starts a new
        chain (its reconstruction reads its own stream only, and later
        loops' residuals are against it). False (the default) for a residual;
        loop 0 always starts the chain. Reading loop ``r`` then reads only the
        streams from its chain's start (:meth:`CacheConfig.chain_start`) to
        ``r``: fewer bytes per attention call for the loops after a direct one.
      prediction: None (a residual against the reconstructed predecessor), or a
        :class:`~jflashloop.LoopPrediction`: the residual is against
        ``prediction.apply(predecessor)`` instead, and the loop reconstructs
        as that plus its residual (a residual loop only). Such a loop may
        store no rows at all (``sparse_rows_per_page=0``: the prediction is
        the loop, no bytes per token). The fused kernels do not read
        predicted loops (the reference path does).
    """

    key_spec: CodecSpec = INT4_KEYS
    value_spec: CodecSpec = INT4_VALUES
    sparse_rows_per_page: int | None = None
    direct: bool = False
    prediction: LoopPrediction | None = None

    @property
    def is_sparse(self) -> bool:
        return self.sparse_rows_per_page is not None


def sparse_loop(fraction: float, page_size: int, spec: CodecSpec = INT4_VALUES) -> LoopStorage:
    """A sparse loop storing ``ceil(fraction * page_size)`` rows per page."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return LoopStorage(spec, spec, max(1, math.ceil(fraction * page_size)))


def _check_int(name: str, value) -> None:
    """``value`` must be a Python int (a bool is not one); raises ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shapes and policy of a :class:`~jflashloop.PagedKVCache` (static under jit).

    The defaults are the recommended layout (measured in ``bench/QUALITY.md``):
    INT4 G64 (K per channel over a page's 64 tokens, V per token over 64
    channels, 4.5 bits per element), 64-token pages, the first 4 tokens and
    the 64 most recent ones unquantized.

    Attributes:
      num_layers, num_kv_heads, head_dim: model shape.
      num_pages: pages in the shared pool (per layer, same ids in every layer).
      max_sequences: sequence slots (rows of the block table).
      max_pages_per_sequence: block-table width; a sequence holds at most
        ``max_pages_per_sequence * page_size`` tokens.
      loops: one :class:`LoopStorage` per loop (1 for an ordinary model),
        indexed from 0; loop 0 (the base) must be dense.
      page_size: tokens per page (16, 32, 64 or 128). Every quantization group
        lies inside one page: channel-axis K groups must divide the page size.
      sink_tokens: first tokens of each sequence kept in ``window_dtype``.
      recent_tokens: most recent tokens of each sequence kept in ``window_dtype``;
        None (the default) means one page (``page_size`` tokens): the ring
        holds the page being filled anyway, so a recent window of one page
        costs no memory. The field holds the resolved int after
        construction (``dataclasses.replace`` keeps it: pass
        ``recent_tokens=None`` with a new ``page_size`` to follow it).
      window_dtype: dtype of the unquantized windows (``"bfloat16"``).
      layer_loops: None (every layer stores its loops as ``loops``: the
        uniform policy), or one tuple of :class:`LoopStorage` per layer, each
        as long as ``loops`` and held to the same rules: layer ``i``'s pages
        are stored as ``layer_loops[i]`` (``loops`` then only gives the loop
        count). :meth:`layer` gives the config of one layer's pages.

    ``head_dim`` must be a multiple of 8 (16 for ``int2``, ``int2_lloyd_max`` and
    ``e8`` streams, 32 for ``int3`` and ``int3_lloyd_max`` streams: a page row's payload is whole
    32-bit words).

    Every count above (and ``LoopStorage.sparse_rows_per_page``) must be a
    Python ``int``: a float or a bool raises ``TypeError``, a value out of
    range ``ValueError`` (the cache indexes pages, slots and tokens with
    int32, so every count and ``max_pages_per_sequence * page_size`` must be
    below 2**31).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    max_sequences: int
    max_pages_per_sequence: int
    loops: tuple[LoopStorage, ...] = (LoopStorage(),)
    page_size: int = 64
    sink_tokens: int = 4
    recent_tokens: int | None = None
    window_dtype: str = "bfloat16"
    layer_loops: tuple[tuple[LoopStorage, ...], ...] | None = None

    def __post_init__(self):
        if self.recent_tokens is None:
            _check_int("CacheConfig.page_size", self.page_size)
            object.__setattr__(self, "recent_tokens", self.page_size)
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_pages", "max_sequences",
                     "max_pages_per_sequence", "page_size", "sink_tokens", "recent_tokens"):
            _check_int(f"CacheConfig.{name}", getattr(self, name))
            if getattr(self, name) > INT32_MAX:
                raise ValueError(f"CacheConfig.{name} must be < 2**31 (the cache indexes with int32), "
                                 f"got {getattr(self, name)}")
        if self.max_pages_per_sequence * self.page_size > INT32_MAX:
            raise ValueError(
                "CacheConfig.max_pages_per_sequence * page_size must be < 2**31 (lengths are int32), got "
                f"{self.max_pages_per_sequence * self.page_size}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_pages", "max_sequences",
                     "max_pages_per_sequence"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 8:
            raise ValueError(
                f"CacheConfig.head_dim must be a multiple of 8 (pages store 8 codes per "
                f"32-bit word), got {self.head_dim}"
            )
        if self.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"CacheConfig.page_size must be one of {SUPPORTED_PAGE_SIZES}, got {self.page_size}")
        if not 0 <= self.sink_tokens < self.page_size:
            raise ValueError(
                f"CacheConfig.sink_tokens must be in [0, page_size={self.page_size}), got {self.sink_tokens}"
            )
        if self.recent_tokens < 0:
            raise ValueError(f"CacheConfig.recent_tokens must be >= 0, got {self.recent_tokens}")
        if self.window_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"CacheConfig.window_dtype must be bfloat16, float16 or float32, got {self.window_dtype!r}")
        self._check_loops(self.loops, "CacheConfig.loops")
        if self.layer_loops is not None:
            if not isinstance(self.layer_loops, tuple) or len(self.layer_loops) != self.num_layers:
                raise ValueError(f"CacheConfig.layer_loops must be None or a tuple of num_layers={self.num_layers} "
                                 "tuples of LoopStorage")
            for layer, loops in enumerate(self.layer_loops):
                name = f"CacheConfig.layer_loops[{layer}]"
                if not isinstance(loops, tuple) or len(loops) != len(self.loops):
                    raise ValueError(f"{name} must be a tuple of {len(self.loops)} LoopStorage (as many as loops)")
                self._check_loops(loops, name)

    def _check_loops(self, loops, name: str) -> None:
        """One layer's loop policy: LoopStorage entries, a dense base, codecs that fit the pages."""
        if not isinstance(loops, tuple) or not loops:
            raise ValueError(f"{name} must be a non-empty tuple of LoopStorage")
        for index, loop in enumerate(loops):
            if not isinstance(loop, LoopStorage):
                raise TypeError(f"{name}[{index}] must be a LoopStorage, got {type(loop).__name__}")
            if loop.sparse_rows_per_page is not None:
                _check_int(f"{name}[{index}].sparse_rows_per_page", loop.sparse_rows_per_page)
            if not isinstance(loop.direct, bool):
                raise TypeError(f"{name}[{index}].direct must be a bool, got {type(loop.direct).__name__}")
            if loop.direct and loop.is_sparse:
                raise ValueError(f"{name}[{index}]: a direct loop is stored whole, so it must be dense")
            if loop.prediction is not None:
                if not isinstance(loop.prediction, LoopPrediction):
                    raise TypeError(f"{name}[{index}].prediction must be a LoopPrediction or None, got "
                                    f"{type(loop.prediction).__name__}")
                if index == 0 or loop.direct:
                    raise ValueError(f"{name}[{index}]: only a residual loop (not the base, not direct) is predicted "
                                     "from the loop before it")
                shape = (loop.prediction.num_kv_heads, loop.prediction.head_dim)
                if shape != (self.num_kv_heads, self.head_dim):
                    raise ValueError(f"{name}[{index}].prediction maps {shape[0]} KV heads of head_dim {shape[1]}; "
                                     f"the cache has {self.num_kv_heads} of {self.head_dim}")
            elif loop.sparse_rows_per_page == 0:
                raise ValueError(f"{name}[{index}]: a loop with no rows (sparse_rows_per_page=0) needs a prediction "
                                 "(without one it would only repeat the loop before it)")
        if loops[0].is_sparse:
            raise ValueError(f"{name}[0] (the base) must be dense")
        for index, loop in enumerate(loops):
            for role, spec in (("key_spec", loop.key_spec), ("value_spec", loop.value_spec)):
                where = f"{name}[{index}].{role}"
                if not isinstance(spec, CodecSpec):
                    raise TypeError(f"{where} must be a CodecSpec, got {type(spec).__name__}")
                try:
                    spec.check_shape((1, self.num_kv_heads, self.head_dim))
                except ValueError as error:
                    raise ValueError(f"{where}: {error}") from None
                if spec.format == "int_mixed" and spec.row_bits % 32:
                    raise ValueError(f"{where}: int_mixed pages need each head's widths to sum to a multiple of 32 "
                                     f"bits (a row in whole 32-bit words), got {spec.row_bits}")
                if spec.format in ("int2", "int2_lloyd_max", "e8") and self.head_dim % 16:
                    raise ValueError(f"{where}: {spec.format} pages need head_dim divisible by 16")
                if spec.format in ("int3", "int3_lloyd_max") and self.head_dim % 32:
                    raise ValueError(f"{where}: {spec.format} pages need head_dim divisible by 32 (a row's "
                                     "3 * head_dim / 8 bytes in whole 32-bit words)")
                if spec.axis == "channel" and loop.is_sparse:
                    raise ValueError(f"{where}: a sparse loop must group per token (axis='token')")
                if spec.axis == "channel" and self.page_size % spec.group_size:
                    raise ValueError(
                        f"{where}: channel-axis group_size {spec.group_size} must divide the "
                        f"page size {self.page_size} so no group spans two pages"
                    )
            if loop.is_sparse and not 0 <= loop.sparse_rows_per_page <= self.page_size:
                raise ValueError(
                    f"{name}[{index}].sparse_rows_per_page must be in [1, {self.page_size}] (0 for a predicted "
                    f"loop), got {loop.sparse_rows_per_page}"
                )

    @property
    def num_loops(self) -> int:
        return len(self.loops)

    @property
    def window_tokens(self) -> int:
        """Capacity of each sequence's ring of recent unquantized tokens.

        It holds the recent window and the page still being filled (a K group
        needs all of its rows before it can be encoded).
        """
        return max(self.recent_tokens, self.page_size)

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.max_pages_per_sequence * self.page_size

    def layer(self, index: int) -> CacheConfig:
        """The config of layer ``index``'s pages: its loops as ``loops``, uniform (static, cached)."""
        if self.layer_loops is None:
            return self
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {index}")
        return _layer_config(self, index)

    def with_layer_loops(self, per_layer) -> CacheConfig:
        """This config storing layer ``i``'s loops as ``per_layer[i]`` (sequences of :class:`LoopStorage`, one per
        layer): ``layer_loops`` None when every layer's are equal."""
        per_layer = tuple(tuple(loops) for loops in per_layer)
        if len(per_layer) != self.num_layers:
            raise ValueError(f"with_layer_loops needs one sequence of LoopStorage per layer ({self.num_layers}), "
                             f"got {len(per_layer)}")
        uniform = all(loops == per_layer[0] for loops in per_layer)
        return dataclasses.replace(self, loops=per_layer[0], layer_loops=None if uniform else per_layer)

    @property
    def is_uniform(self) -> bool:
        """Whether every layer stores its loops alike."""
        return self.layer_loops is None or all(loops == self.loops for loops in self.layer_loops)

    def chain_start(self, loop: int) -> int:
        """The loop whose stream starts loop ``loop``'s chain (0-based): the last loop ``<= loop`` that is
        loop 0 or ``direct``. Loop ``loop`` reconstructs from the streams of loops ``chain_start(loop)``
        to ``loop``."""
        starts = self.chain_starts()
        return max(i for i in range(loop + 1) if starts[i])

    def chain_starts(self) -> tuple[bool, ...]:
        """Per loop, whether it starts a chain (loop 0 and the ``direct`` loops)."""
        return tuple(i == 0 or loop.direct for i, loop in enumerate(self.loops))

    def rows(self, loop: int) -> int:
        """Stored rows per page of loop ``loop`` (0-based)."""
        storage = self.loops[loop]
        return storage.sparse_rows_per_page if storage.is_sparse else self.page_size

    @classmethod
    def flashloop(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        max_sequences: int,
        max_pages_per_sequence: int,
        num_loops: int = 4,
        page_size: int = 64,
        sparse_fractions: tuple[float, ...] = (0.25, 0.10),
        direct_loop: bool = False,
        row_spec: CodecSpec = INT4_VALUES,
        **kwargs,
    ) -> CacheConfig:
        """FlashLoop's default policy for a looped model.

        Loop 0: INT4 base (K per channel over the page's 64 tokens, V per token
        over 64 channels); loop 1: dense INT4 residual; loops 2, 3, ...: compact
        sparse INT4 residuals (per token) for 25% and 10% of each page's tokens
        (rounded up to whole rows: 16 and 7 of 64), stored with ``row_spec``
        (K and V; per token, default INT4 G64).

        ``direct_loop``: loop 1 stored on its own (:attr:`LoopStorage.direct`) rather than as a residual
        against loop 0, in the same bytes; loops 2, 3, ... are then residuals against it, and reading
        loop ``r >= 1`` reads loops ``1..r`` only (loop 0's stream not again). The recommended layout for
        looped models: on the shipped looped checkpoint 3.6% less KL than FlashLoop's chain and the same
        attention error (``bench/LOOPS.md``), and a looped model's decode step 1.62x four BF16 caches'
        speed at batch 8 and 16K tokens against 1.23x (``bench/E2E.md``).
        """
        if num_loops < 1:
            raise ValueError(f"num_loops must be >= 1, got {num_loops}")
        if direct_loop and num_loops < 2:
            raise ValueError("direct_loop stores loop 1 on its own: it needs num_loops >= 2")
        key_spec = CodecSpec("int4", "channel", min(64, page_size))
        loops = [LoopStorage(key_spec, INT4_VALUES)]
        if num_loops >= 2:
            loops.append(LoopStorage(key_spec, INT4_VALUES, direct=direct_loop))
        for loop_index in range(2, num_loops):
            fraction = sparse_fractions[min(loop_index - 2, len(sparse_fractions) - 1)]
            loops.append(sparse_loop(fraction, page_size, row_spec))
        return cls(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            num_pages=num_pages, max_sequences=max_sequences,
            max_pages_per_sequence=max_pages_per_sequence, loops=tuple(loops),
            page_size=page_size, **kwargs,
        )

    @classmethod
    def compact_loops(cls, *, num_loops: int = 4, page_size: int = 64, **kwargs) -> CacheConfig:
        """The compact cross-loop policy: INT4 base, loop 1 dense INT4 stored on its own
        (``direct_loop``), loops 2, 3, ...: affine INT2 G64 rows (``CodecSpec("int2", "token", 64)``)
        for 37.5 % and 15 % of each page's tokens (24 and 10 of 64).

        Same arguments as :meth:`flashloop` (but the policy's own). On the shipped looped checkpoint
        (``bench/LOOPS.md``): 2,652.5 bytes a token, 6.18x less than four BF16 loop caches (FlashLoop's
        policy: 6.02x), with 13 % less teacher-forced KL than FlashLoop's policy and an attention error
        at most its in every loop. The Gluon decode kernel reads every loop of it (GPU; loops 2, 3, ...
        take more instructions a page than :meth:`flashloop` with ``direct_loop``: its 24 rows pad to a
        32-row tile); the Pallas kernel does not read INT2 rows (``NotImplementedError``; the automatic
        choice falls back).

        Returns:
          The :class:`CacheConfig`; its sparse loops' tiles hold uint32 ``[H, pool, rows, D/16]`` words and
          float16 ``[H, pool, rows, D/64]`` scales and minimums.

        Raises:
          ValueError: ``num_loops < 2``, or what :meth:`flashloop` and the config's checks raise (INT2 pages
          need ``head_dim`` divisible by 16).
        """
        if num_loops < 2:
            raise ValueError(f"compact_loops stores a direct loop 1: it needs num_loops >= 2, got {num_loops}")
        return cls.flashloop(num_loops=num_loops, page_size=page_size, sparse_fractions=(0.375, 0.15),
                             direct_loop=True, row_spec=CodecSpec("int2", "token", 64), **kwargs)

    @classmethod
    def predicted_loops(cls, *, predictions, num_layers: int, page_size: int = 64, **kwargs) -> CacheConfig:
        """The predicted cross-loop policy: INT4 base, loop 1 dense INT4 stored on its own (``direct_loop``), and
        every later loop predicted from the loop before it with no rows stored (:attr:`LoopStorage.prediction`,
        ``sparse_rows_per_page=0``): the cache stores two loops' pages for any number of loops.

        On the shipped looped checkpoint, with predictions fitted on calibration text (``bench/LOOPS.md``,
        "Loops predicted from the loop before"): 2,304 bytes a token, 7.11x less than four BF16 loop caches
        (FlashLoop's policy: 6.02x), with less teacher-forced KL than FlashLoop's policy and less attention error
        in every loop. The fused kernels read loop 1's stream for the predicted loops (the query and the loop's
        own windows moved into loop 1's basis, :func:`jflashloop.ops._decode_attention.predicted_inputs`).

        Args:
          predictions: per layer, a sequence of :class:`~jflashloop.LoopPrediction` (one per loop after loop 1,
            the same count in every layer), e.g. :func:`jflashloop.fitting.fitted_prediction` of each layer's loop
            from the reconstruction of the loop before it.
          num_layers, page_size, **kwargs: as for :meth:`flashloop` (``num_loops`` comes from ``predictions``).
        Raises:
          ValueError: ``predictions`` not one non-empty sequence per layer of equal lengths, or what the
            config's checks raise (a prediction of another shape).
        """
        predictions = tuple(tuple(layer) for layer in predictions)
        if len(predictions) != num_layers or not predictions[0] or len({len(p) for p in predictions}) != 1:
            raise ValueError(f"predictions must hold one non-empty sequence of LoopPrediction per layer "
                             f"({num_layers}), all of one length")
        base = cls.flashloop(num_layers=num_layers, num_loops=2, page_size=page_size, direct_loop=True, **kwargs)
        per_layer = tuple((*base.loops, *(LoopStorage(INT4_VALUES, INT4_VALUES, 0, prediction=prediction)
                                          for prediction in layer)) for layer in predictions)
        return base.with_layer_loops(per_layer)

    @classmethod
    def for_sequences(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        max_sequences: int = 1,
        **layout,
    ) -> CacheConfig:
        """A cache whose pool holds ``max_sequences`` sequences of ``max_tokens`` tokens.

        Each sequence gets ``ceil(max_tokens / page_size)`` pages and the pool
        exactly that many per sequence.

        Args:
          num_layers, num_kv_heads, head_dim: model shape.
          max_tokens: tokens per sequence.
          max_sequences: sequence slots.
          **layout: the other fields (``loops``, ``page_size``, ``sink_tokens``,
            ``recent_tokens``, ``window_dtype``), defaults as in :class:`CacheConfig`.
        """
        pages_per_sequence = math.ceil(max_tokens / layout.get("page_size", cls.page_size))
        return cls(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            num_pages=pages_per_sequence * max_sequences, max_sequences=max_sequences,
            max_pages_per_sequence=pages_per_sequence, **layout,
        )


@dataclasses.dataclass(frozen=True)
class Policy:
    """A named one-loop cache layout: a :class:`CacheConfig` factory for any model shape.

    Attributes:
      name: label used in tables and plots.
      key_spec, value_spec: the codecs.
      sink_tokens, recent_tokens: unquantized windows.
      page_size: tokens per page.
      layer_specs: None (every layer uses ``key_spec``/``value_spec``), or one
        ``(key_spec, value_spec)`` pair per layer of the model
        (``CacheConfig.layer_loops``).

    The defaults are :class:`CacheConfig`'s (its recommended layout: INT4 G64,
    K per channel, V per token, 64-token pages, 4 sink tokens and a recent
    window of one page); ``recent_tokens=None`` is resolved to ``page_size``.
    """

    name: str
    key_spec: CodecSpec = LoopStorage.key_spec
    value_spec: CodecSpec = LoopStorage.value_spec
    sink_tokens: int = CacheConfig.sink_tokens
    recent_tokens: int | None = CacheConfig.recent_tokens
    page_size: int = CacheConfig.page_size
    layer_specs: tuple[tuple[CodecSpec, CodecSpec], ...] | None = None

    def __post_init__(self):
        if self.recent_tokens is None:
            object.__setattr__(self, "recent_tokens", self.page_size)

    def cache_config(
        self, *, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, max_sequences: int = 1
    ) -> CacheConfig:
        """A :class:`CacheConfig` holding ``max_sequences`` sequences of ``max_tokens`` tokens.

        Raises:
          ValueError: ``layer_specs`` does not hold ``num_layers`` pairs.
        """
        layer_loops = None
        if self.layer_specs is not None:
            if len(self.layer_specs) != num_layers:
                raise ValueError(f"Policy {self.name!r} has layer_specs for {len(self.layer_specs)} layers, "
                                 f"the model has {num_layers}")
            layer_loops = tuple((LoopStorage(key, value),) for key, value in self.layer_specs)
        return CacheConfig.for_sequences(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, max_tokens=max_tokens,
            max_sequences=max_sequences, loops=(LoopStorage(self.key_spec, self.value_spec),),
            page_size=self.page_size, sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens,
            layer_loops=layer_loops,
        )

    def bits_per_element(self, num_kv_heads: int, head_dim: int) -> float:
        """Storage bits per K/V element in full pages (windows excluded).

        Every (page, KV head) tile is encoded on its own, so the figure is that
        of one tile of K and one of V; ``num_kv_heads`` only takes part in the
        configuration's validation.
        """
        config = self.cache_config(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   max_tokens=self.page_size)
        tile = (config.page_size, 1, config.head_dim)
        stored = config.loops[0]
        return (stored.key_spec.bits_per_element(tile) + stored.value_spec.bits_per_element(tile)) / 2


@functools.cache
def _layer_config(config: CacheConfig, index: int) -> CacheConfig:
    return dataclasses.replace(config, loops=config.layer_loops[index], layer_loops=None)
