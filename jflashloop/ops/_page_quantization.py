"""Page quantization: encoding whole page tiles as the cache writes them (quantize on write).

Two functions, each with the same two paths (:mod:`._dispatch` resolves
``implementation`` once; a kernel that cannot take the tiles raises
``NotImplementedError`` and the codec path runs instead):

* :func:`encode_tiles`: one stream's tiles, ``[pages, rows, kv_heads,
  head_dim]`` -> :class:`~jflashloop.cache._layout.PagedStream`;
* :func:`encode_pages`: the K and V tiles of whole pages, with the sink rows
  of a sequence's first page masked (:func:`mask_sink_rows`) -> two streams.

With ``implementation="pallas"`` (the default on a GPU, where it is the
bit-exact path) INT4 and NVFP4 tiles go through the Pallas quantize-on-write
kernels (``jflashloop_pallas_kernels.quantize``: one program per tile, or
one per (head, page) reading K and V in place); every other format, and
every tile the kernels cannot read, goes through the jittable codecs
(:func:`jflashloop.encode`, vmapped over tiles), which are the reference:
both paths give the same bits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jflashloop_pallas_kernels import quantize as quantize_kernel

from ..cache._layout import PagedStream, stored_words, words_from_bytes
from ..codecs import CodecSpec, encode
from ..codecs._packed import Packed
from . import _dispatch

KERNEL_FORMATS = ("int4", "nvfp4")


def _tile_format(spec: CodecSpec) -> quantize_kernel.TileFormat:
    """The kernel's static descriptor of a stream's codec."""
    return quantize_kernel.TileFormat(spec.format, spec.axis, spec.group_size)


def _check_kernel_reads(spec: CodecSpec, rows: int, head_dim: int, *, pages_in_place: bool = False) -> None:
    """Raise ``NotImplementedError`` unless the quantize kernels read tiles of this shape and codec."""
    if spec.format not in KERNEL_FORMATS:
        raise NotImplementedError(f"the quantize kernels encode {KERNEL_FORMATS} tiles, not {spec.format!r}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise NotImplementedError(f"the quantize kernels need a power-of-two head_dim >= 16, got {head_dim}")
    if rows < 1 or (pages_in_place and rows & (rows - 1)):
        raise NotImplementedError(f"the page kernel needs a power-of-two number of rows, got {rows}")


def mask_sink_rows(x: jax.Array, page_numbers: jax.Array, sink_tokens: int) -> jax.Array:
    """Replace rows ``< sink_tokens`` of page 0 by row ``sink_tokens``.

    The sink rows live in the unquantized sink window, so they neither widen
    a K group's range nor take a sparse row.

    Args:
      x: ``[..., pages, page_size, kv_heads, head_dim]``.
      page_numbers: int32 ``[pages]``: each page's index within its sequence.
    """
    if sink_tokens == 0:
        return x
    page_size = x.shape[-3]
    rows = jnp.arange(page_size)
    source = jnp.where((page_numbers[:, None] == 0) & (rows[None, :] < sink_tokens), sink_tokens, rows)
    source = source.reshape((1,) * (x.ndim - 4) + source.shape + (1, 1))
    return jnp.take_along_axis(x, source, axis=-3)


def _stream(outputs: dict, spec: CodecSpec, rows: int, head_dim: int) -> PagedStream:
    """The quantize kernels' outputs (codec byte order) as a stream."""
    return PagedStream(
        payload=stored_words(outputs["payload"], spec),
        scale=outputs["scale"],
        minimum=outputs.get("minimum"),
        global_scale=outputs.get("global_scale"),
        spec=spec,
        rows=rows,
        head_dim=head_dim,
    )


def _encode_tiles_kernel(x: jax.Array, spec: CodecSpec, interpret: bool) -> PagedStream:
    """The Pallas quantize-on-write kernel, one program per tile."""
    pages, rows, heads, head_dim = x.shape
    _check_kernel_reads(spec, rows, head_dim)
    padded_rows = 1 << (rows - 1).bit_length()
    tiles = jnp.transpose(x, (2, 0, 1, 3)).reshape(heads * pages, rows, head_dim)
    if padded_rows != rows:  # only token-axis (sparse) streams: rows are independent
        tiles = jnp.pad(tiles, ((0, 0), (0, padded_rows - rows), (0, 0)))
    encoded = quantize_kernel.encode_tiles(tiles, _tile_format(spec), interpret=interpret)
    meta_rows = rows // spec.group_size if spec.axis == "channel" else rows
    kept_rows = {"payload": rows, "scale": meta_rows, "minimum": meta_rows}
    per_tile = {
        name: leaf.reshape(heads, pages, *leaf.shape[1:])[:, :, : kept_rows[name]] if name in kept_rows
        else leaf.reshape(heads, pages)
        for name, leaf in encoded.items()
    }
    return _stream(per_tile, spec, rows, head_dim)


def each_head(function, tiles, spec: CodecSpec):
    """``function(tiles[h], spec.for_head(h))`` for every kv head ``h``, stacked on a leading head axis.

    ``tiles``: a pytree whose leaves lead with the head axis. One vmapped call when the spec is the same for
    every head; a fitted format's heads (:data:`~jflashloop.codecs._spec.FITTED_FORMATS`: per-head tables, static)
    one call each. Returns the stacked array leaves of ``function``'s results (a pytree of arrays, or of
    :class:`~jflashloop.codecs.Packed` whose ``spec`` is ``spec``).
    """
    if spec.fitted_shape is None:
        return jax.vmap(lambda head_tiles: function(head_tiles, spec))(tiles)
    heads = jax.tree.leaves(tiles)[0].shape[0]
    results = [function(jax.tree.map(lambda leaf, h=h: leaf[h], tiles), spec.for_head(h)) for h in range(heads)]
    if isinstance(results[0], Packed):  # the heads' specs differ: stack the leaves under the whole spec
        results = [dataclasses.replace(result, spec=spec, shape=results[0].shape) for result in results]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *results)


def encode_tiles_with_codec(x: jax.Array, spec: CodecSpec, implementation) -> PagedStream:
    """The reference path: :func:`jflashloop.encode` of each ``[rows, 1, head_dim]`` tile."""
    _, rows, _, head_dim = x.shape
    tiles = jnp.transpose(x, (2, 0, 1, 3))[:, :, :, None, :]  # [heads, pages, rows, 1, D]
    packed = each_head(lambda head_tiles, head_spec: jax.vmap(
        lambda tile: encode(tile, head_spec, implementation=implementation))(head_tiles), tiles, spec)

    def drop_head_axis(leaf):
        return None if leaf is None else leaf[:, :, :, 0, :]

    return PagedStream(
        payload=stored_words(words_from_bytes(drop_head_axis(packed.payload)), spec),
        scale=drop_head_axis(packed.scale),
        minimum=drop_head_axis(packed.minimum),
        global_scale=packed.global_scale,
        spec=spec,
        rows=rows,
        head_dim=head_dim,
    )


def encode_tiles(
    x: jax.Array, spec: CodecSpec, implementation: str | _dispatch.Implementation | None = None
) -> PagedStream:
    """Encode pages ``x`` float32 ``[pages, rows, kv_heads, head_dim]`` tile by tile.

    Returns a :class:`~jflashloop.cache._layout.PagedStream` of ``pages``
    tiles (NVFP4 tensor scale from each tile's own amax). ``implementation``:
    ``"pallas"`` (the default on GPU) uses the quantize-on-write kernel where
    it reads the tiles, ``"xla"`` the jittable codec; both give the same bits.
    """
    head_dim = x.shape[-1]
    if head_dim % 8:
        raise ValueError(f"paged streams need head_dim divisible by 8, got {head_dim}")
    implementation = _dispatch.resolve(implementation)
    attempts = [lambda: encode_tiles_with_codec(x, spec, implementation)]
    if implementation.backend == "pallas":
        attempts.insert(0, lambda: _encode_tiles_kernel(x, spec, implementation.interpret))
    return _dispatch.first_supported(*attempts)


def _encode_pages_kernel(keys, values, page_numbers, key_spec, value_spec, sink_tokens, interpret):
    """The Pallas page kernel: K and V of each (head, page) read in place, the sink rows masked inside."""
    _, rows, _, head_dim = keys.shape
    for spec in (key_spec, value_spec):
        _check_kernel_reads(spec, rows, head_dim, pages_in_place=True)
    key_outputs, value_outputs = quantize_kernel.encode_page_pairs(
        keys, values, page_numbers, _tile_format(key_spec), _tile_format(value_spec),
        sink_tokens=sink_tokens, interpret=interpret,
    )
    return _stream(key_outputs, key_spec, rows, head_dim), _stream(value_outputs, value_spec, rows, head_dim)


def encode_pages(
    keys: jax.Array,
    values: jax.Array,
    page_numbers: jax.Array,
    key_spec: CodecSpec,
    value_spec: CodecSpec,
    sink_tokens: int,
    implementation: str | _dispatch.Implementation | None = None,
) -> tuple[PagedStream, PagedStream]:
    """Encode the K and V tiles of whole pages, the sink rows of page 0 masked.

    Args:
      keys, values: float32 ``[pages, rows, kv_heads, head_dim]``.
      page_numbers: int32 ``[pages]``, each page's index in its sequence.
      key_spec, value_spec: the two streams' codecs.
      sink_tokens: rows ``< sink_tokens`` of a sequence's page 0 are replaced
        by row ``sink_tokens`` before encoding (:func:`mask_sink_rows`).
      implementation: as for :func:`encode_tiles`; with ``"pallas"`` one
        kernel encodes both streams where it reads them.
    Returns:
      ``(key_stream, value_stream)``: the bits of :func:`encode_tiles` of the
      masked pages, on every path.
    """
    implementation = _dispatch.resolve(implementation)

    def one_stream_at_a_time():
        return tuple(
            encode_tiles(mask_sink_rows(x, page_numbers, sink_tokens), spec, implementation)
            for x, spec in ((keys, key_spec), (values, value_spec))
        )

    attempts = [one_stream_at_a_time]
    if implementation.backend == "pallas":
        attempts.insert(0, lambda: _encode_pages_kernel(keys, values, page_numbers, key_spec, value_spec,
                                                        sink_tokens, implementation.interpret))
    return _dispatch.first_supported(*attempts)
