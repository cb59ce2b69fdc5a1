"""Single-file checkpoints of :mod:`jflashloop.models.ouro` parameters.

A checkpoint is one uncompressed ``.npz`` archive:

* one entry per parameter leaf, named by its pytree path joined with ``/``
  (``embedding``, ``layers/0/attention/wq``, ``layers/3/post_mlp_norm``, ...),
  float32, shapes as :func:`jflashloop.models.ouro.init_params` makes them;
* one entry ``__metadata__``: a 0-d unicode string holding JSON with the
  format name and version, the :class:`OuroConfig` fields, the SHA-256 of the
  arrays (see :func:`arrays_sha256`) and a free-form ``info`` dict (seed, step
  count, data description, held-out loss per loop count, ...).

:func:`load_checkpoint` checks names, shapes and dtypes against the stored
config and recomputes the checksum; any mismatch raises :class:`CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .ouro import OuroConfig, Params, init_params

FORMAT_NAME = "jflashloop-ouro-checkpoint"
FORMAT_VERSION = 1
METADATA_ENTRY = "__metadata__"
PARAMETER_DTYPE = np.dtype(np.float32)
PACKAGED_CHECKPOINT = Path(__file__).resolve().parent / "data" / "ouro_tiny.npz"
"""The looped checkpoint shipped with the package (trained by ``bench/train_ouro.py``)."""


class CheckpointError(ValueError):
    """A checkpoint file is unreadable or does not match its own config or checksum."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` returns.

    Attributes:
      params: parameter pytree of float32 ``jax.Array`` leaves.
      config: the model config stored with the parameters.
      info: the free-form JSON dict given to :func:`save_checkpoint`.
      sha256: hex SHA-256 of the arrays (see :func:`arrays_sha256`).
    """

    params: Params
    config: OuroConfig
    info: dict[str, Any]
    sha256: str


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        else:
            raise TypeError(f"unsupported pytree node {entry!r} in parameter path")
    return "/".join(parts)


def flatten_params(params: Params) -> dict[str, np.ndarray]:
    """Parameter leaves as numpy arrays keyed by ``/``-joined pytree paths.

    Args:
      params: nested dicts and lists of arrays.

    Returns:
      ``{name: array}`` with the original dtypes and shapes.
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {_path_name(path): np.asarray(leaf) for path, leaf in leaves}


def expected_shapes(config: OuroConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter of ``config`` (nothing is allocated)."""
    template = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    leaves = jax.tree_util.tree_flatten_with_path(template)[0]
    return {_path_name(path): tuple(leaf.shape) for path, leaf in leaves}


def arrays_sha256(arrays: dict[str, np.ndarray]) -> str:
    """Hex SHA-256 over the arrays in sorted name order.

    Each array contributes its name, dtype string, shape and C-order bytes, so
    renaming, reshaping or retyping an array changes the digest too.
    """
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        header = f"{name}\0{array.dtype.str}\0{array.shape}\0"
        digest.update(header.encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def save_checkpoint(
    path: str | os.PathLike[str],
    params: Params,
    config: OuroConfig,
    info: dict[str, Any] | None = None,
) -> str:
    """Write ``params`` and ``config`` (plus ``info``) to one ``.npz`` file.

    The file is written next to ``path`` and renamed into place, so a reader
    never sees a half-written checkpoint.

    Args:
      path: destination file (parent folders are created).
      params: float32 parameter pytree matching ``config``.
      config: the model config.
      info: JSON-serializable dict stored verbatim (seed, steps, data, losses, ...).

    Returns:
      The hex SHA-256 of the arrays.
    """
    arrays = flatten_params(params)
    _validate_arrays(arrays, config, source="params to save")
    checksum = arrays_sha256(arrays)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "config": dataclasses.asdict(config),
        "arrays_sha256": checksum,
        "info": info or {},
    }
    destination = Path(path)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.with_name(destination.name + ".partial")
    with open(temporary, "wb") as file:
        np.savez(file, **arrays, **{METADATA_ENTRY: np.array(json.dumps(metadata, indent=1))})
    os.replace(temporary, destination)
    return checksum


def _validate_arrays(arrays: dict[str, np.ndarray], config: OuroConfig, source: str) -> None:
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(arrays))
    unexpected = sorted(set(arrays) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: parameter names do not match the config; "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, shape in shapes.items():
        array = arrays[name]
        if array.shape != shape:
            raise CheckpointError(f"{source}: {name} has shape {array.shape}, config needs {shape}")
        if array.dtype != PARAMETER_DTYPE:
            raise CheckpointError(
                f"{source}: {name} has dtype {array.dtype}, expected {PARAMETER_DTYPE}")


def _read_archive(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata dict and all arrays of an archive; any read failure is a CheckpointError."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a zip (.npz) archive")
    try:
        with np.load(path, allow_pickle=False) as archive:
            entries = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as error:
        raise CheckpointError(f"{path}: not a readable .npz checkpoint ({error})") from error
    if METADATA_ENTRY not in entries:
        raise CheckpointError(f"{path}: no {METADATA_ENTRY} entry; not a {FORMAT_NAME} file")
    try:
        metadata = json.loads(str(entries.pop(METADATA_ENTRY)))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: {METADATA_ENTRY} is not valid JSON ({error})") from error
    return metadata, entries


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and validate a checkpoint written by :func:`save_checkpoint`.

    Args:
      path: the ``.npz`` file.

    Returns:
      A :class:`Checkpoint` whose params are bit-identical to the saved ones.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointError: the archive is corrupt, the format/version is unknown,
        the config is invalid, an array's name, shape or dtype disagrees with
        the config, or the SHA-256 of the arrays differs from the stored one.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    metadata, arrays = _read_archive(path)
    if metadata.get("format") != FORMAT_NAME or metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {metadata.get('format')!r} version {metadata.get('format_version')!r}"
            f", expected {FORMAT_NAME!r} version {FORMAT_VERSION}")
    try:
        config = OuroConfig(**metadata["config"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: invalid stored config ({error})") from error
    _validate_arrays(arrays, config, source=str(path))
    checksum = arrays_sha256(arrays)
    if checksum != metadata.get("arrays_sha256"):
        raise CheckpointError(
            f"{path}: SHA-256 of the arrays is {checksum}, but the file records "
            f"{metadata.get('arrays_sha256')}; the checkpoint is corrupt or was modified")
    template = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = [jnp.asarray(arrays[_path_name(leaf_path)]) for leaf_path, _ in paths]
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    return Checkpoint(params=params, config=config, info=metadata.get("info", {}),
                      sha256=checksum)
