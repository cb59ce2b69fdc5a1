"""Byte-level text from the Python standard library, split into training and held-out files.

Every ``.py`` file of a standard-library folder (by default the running
interpreter's, ``sysconfig.get_paths()["stdlib"]``), skipping
``site-packages``, ``dist-packages`` and ``__pycache__``, sorted by relative
path and concatenated as raw bytes (tokens 0..255). Files whose sorted index
is a multiple of :data:`HELD_OUT_EVERY` (about 5 %) are held out. The corpus
therefore depends on the Python version; :attr:`Corpus.description` records
the version, the file counts and a SHA-256 of both byte streams.

``bench/train_ouro.py`` trains the tiny looped model on this split and
:mod:`jflashloop.apps.loops` evaluates it on the held-out part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

HELD_OUT_EVERY = 20
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Byte streams for training and evaluation and how they were made.

    Attributes:
      train: uint8 ``[train_bytes]``.
      held_out: uint8 ``[held_out_bytes]``.
      description: JSON-serializable provenance (source, counts, checksums).
    """

    train: np.ndarray
    held_out: np.ndarray
    description: dict[str, Any]


def default_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def standard_library_sources(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside third-party folders, sorted by relative path."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_FOLDERS]
        found.extend(Path(folder) / name for name in files if name.endswith(".py"))
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def load_corpus(root: Path) -> Corpus:
    """Concatenate the standard library's sources; every 20th file is held out."""
    paths = standard_library_sources(root)
    train_parts, held_out_parts = [], []
    for index, path in enumerate(paths):
        (held_out_parts if index % HELD_OUT_EVERY == 0 else train_parts).append(path.read_bytes())
    train = np.frombuffer(b"".join(train_parts), np.uint8)
    held_out = np.frombuffer(b"".join(held_out_parts), np.uint8)
    description = {
        "source": "Python standard library .py files, raw bytes, sorted by relative path",
        "stdlib_path": str(root),
        "python_version": sys.version.split()[0],
        "held_out_rule": f"sorted file index % {HELD_OUT_EVERY} == 0",
        "train_files": len(train_parts),
        "held_out_files": len(held_out_parts),
        "train_bytes": int(train.size),
        "held_out_bytes": int(held_out.size),
        "train_sha256": hashlib.sha256(train.tobytes()).hexdigest(),
        "held_out_sha256": hashlib.sha256(held_out.tobytes()).hexdigest(),
    }
    return Corpus(train=train, held_out=held_out, description=description)


def evaluation_windows(held_out: np.ndarray, count: int, length: int) -> np.ndarray:
    """``count`` evenly spaced held-out windows: int32 ``[count, length]``."""
    if held_out.size < length:
        raise ValueError(f"held-out data ({held_out.size} bytes) is shorter than a window")
    starts = np.linspace(0, held_out.size - length, count).astype(np.int64)
    return np.stack([held_out[start:start + length] for start in starts]).astype(np.int32)
