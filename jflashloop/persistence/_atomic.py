"""Durable, atomic files: write a temporary file next to the target, fsync, rename, fsync the folder."""

from __future__ import annotations

import errno
import os
import re
import secrets
import time

from . import _format


def file_path(path) -> str:
    """``path`` (``str``, ``bytes`` or ``os.PathLike``) as a ``str`` (``os.fsdecode``).

    Raises:
      TypeError: anything else (an int would otherwise open a file descriptor).
    """
    try:
        return os.fsdecode(path)
    except TypeError:
        raise TypeError(f"path must be a str, bytes or os.PathLike, got {type(path).__name__}") from None


TEMPORARY_MARK = ".tmp-"
"""A save writes ``<name>.tmp-<pid>-<8 hex digits>`` next to ``<name>``, then renames it."""
STALE_AFTER_SECONDS = 600.0
"""A leftover temporary file is removed only once it is this old (and its writer is gone)."""


def _temporary_pattern(name: str) -> re.Pattern:
    """Temporary files of target ``name``: ``<name>.tmp-<pid>`` (older versions) or ``<name>.tmp-<pid>-<hex8>``."""
    return re.compile(re.escape(name) + re.escape(TEMPORARY_MARK) + r"(\d+)(?:-[0-9a-f]{8})?")


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine; True whenever that cannot be told.

    Only POSIX can ask without side effects (``os.kill(pid, 0)``; on Windows
    ``os.kill`` terminates the process).
    """
    if os.name != "posix" or pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, owned by another user
        return True
    return True


def remove_stale_temporaries(path) -> list[str]:
    """Remove the temporary files an interrupted save of ``path`` left behind.

    A file next to ``path`` is removed only if all of these hold: its name is
    ``<name>.tmp-<pid>`` or ``<name>.tmp-<pid>-<8 hex digits>`` for this very
    target; no process ``<pid>`` runs on this machine (POSIX; elsewhere
    nothing is removed); and it was last modified at least
    :data:`STALE_AFTER_SECONDS` ago (so a writer on another machine sharing
    the folder, whose PID means nothing here, is not disturbed while it writes).
    Other files, including other targets' temporaries, are never touched.

    Returns:
      The paths removed.
    """
    path = file_path(path)
    directory, name = os.path.split(os.path.abspath(path))
    pattern = _temporary_pattern(name)
    now = time.time()
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or _process_alive(int(match.group(1))):
                continue
            try:
                if not entry.is_file(follow_symlinks=False) or now - entry.stat().st_mtime < STALE_AFTER_SECONDS:
                    continue
                os.remove(entry.path)
            except FileNotFoundError:  # another process cleaned it first
                continue
            removed.append(entry.path)
    return removed


def _fsync_directory(directory: str) -> None:
    """Make a rename inside ``directory`` durable (POSIX; Windows cannot open a folder)."""
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems without folder fsync
            raise
    finally:
        os.close(descriptor)


def write_file(path, kind, config, metadata, arrays) -> None:
    """Write durably and atomically, as databases do.

    Stale temporaries of ``path`` are removed first (:func:`remove_stale_temporaries`).
    The data go to a new temporary file in the same folder, which is flushed
    and fsync'ed, then renamed over ``path`` (``os.replace``: readers see the
    old file or the new one, never a mix); the folder is then fsync'ed so
    the rename survives a power loss. On any error the temporary file is removed.
    """
    path = file_path(path)
    remove_stale_temporaries(path)
    temporary = f"{path}{TEMPORARY_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(temporary, "xb") as stream:
            _format.write(stream, kind, config, metadata, arrays)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
        _fsync_directory(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
