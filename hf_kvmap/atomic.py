"""Saves that a kill cannot tear: whatever instant a saving process dies at, the destination holds the previous
artifact or the complete new one, and loading needs no later save to repair it.

- [`write_file_atomically`]: a file is written as a hidden temporary file beside it and renamed over it (one
  `rename(2)`).
- [`write_folder_atomically`]: a folder is written as a hidden `.<name>.pid<pid>.<random>.saving` folder beside it
  and exchanged with the previous folder in one `renameat2(RENAME_EXCHANGE)` (Linux), so the destination never stops
  existing. Where the system cannot exchange two folders, the previous folder is moved aside into
  `.<name>.pid<pid>.<random>.old/folder` and the new one moved in (two renames); a kill between them leaves no folder
  at the destination for an instant, and [`recover_folder`] (which every loader calls first) puts the previous one
  back.
- [`stale_leftovers`]: what a killed save left beside a destination (its pid is no longer running), for the next
  save to remove.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_PID = re.compile(r"\.pid(\d+)\.")
#: how long a loader waits for a live save that is between its two renames before putting the previous folder back
RECOVERY_WAIT_S = 2.0


def staging_prefix(name: str) -> str:
    """The prefix of this process's temporary files and folders beside `name` (its pid tells a stale one)."""
    return f".{name}.pid{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(parent: Path, name: str, suffixes: Sequence[str], *, stale_only: bool = True) -> list[Path]:
    """Hidden `.{name}.*{suffix}` entries in `parent` left by saves; with `stale_only`, only those whose pid is not
    running (or that record none, written before the pid was)."""
    if not parent.is_dir():
        return []
    found = []
    for entry in parent.iterdir():
        if not entry.name.startswith(f".{name}.") or not entry.name.endswith(tuple(suffixes)):
            continue
        match = _PID.search(entry.name[len(name) + 1 :])
        if not stale_only or match is None or not _alive(int(match.group(1))):
            found.append(entry)
    return sorted(found)


def stale_leftovers(parent: Path, name: str, suffixes: Sequence[str]) -> list[Path]:
    """Hidden `.{name}.*{suffix}` entries in `parent` left by a save that died: those whose pid is not running (or
    that record none, written before the pid was)."""
    return leftovers(parent, name, suffixes)


def fresh(parent: Path, prefix: str, suffix: str, *, folder: bool) -> Path:
    """Create a new hidden file or folder `parent/{prefix}{random}{suffix}` with the permissions the process's umask
    gives (`tempfile`'s are private, and a saved artifact should read like any file the user writes)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            if folder:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {parent}", str(parent / prefix))


def remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def unwritable(path: str | os.PathLike, *, append: bool = False, inside: bool = False) -> str | None:
    """What keeps this process from writing `path` (`None`: nothing), found without writing anything: the folder a
    save creates its entries in (the nearest existing one above `path`, where a save writes beside the destination
    and renames; `path` itself with `inside`, for a folder written into) must take new entries, which a read-only
    mount or a folder without write permission does not; with `append`, an existing file must take writes itself."""
    path = Path(os.path.abspath(path))
    start = path if inside and path.is_dir() else path.parent
    folder = next((parent for parent in (start, *start.parents) if parent.is_dir()), start)
    if not os.access(folder, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only(folder) else "no write permission"
        return f"{path}: cannot write in {folder} ({why}); name a path in a folder you can write."
    if append and path.is_file() and not os.access(path, os.W_OK):
        return f"{path}: cannot append to this file (no write permission or a read-only file system); pass another."
    return None


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


# ------------------------------------------------------------------------------------------------------ files


def write_file_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(temporary)` on a new hidden file beside `path` (`.<name>.pid<pid>.<random>.tmp`), then rename it
    over `path`: a kill or an error at any point leaves `path` as it was or complete. Temporary files of killed
    saves are removed first. `write` must not rely on the file's suffix (pass a format explicitly).

    A symbolic link is followed: the file it points to is replaced and the link kept (as folder saves follow links).

    Returns:
        `Path`: the file written (a link's target where `path` is a link).
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{path} is a folder; name a file to write", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_leftovers(path.parent, path.name, (".tmp",)):
        remove(stale)
    tmp = fresh(path.parent, staging_prefix(path.name), ".tmp", folder=False)
    try:
        if path.exists():  # the new file keeps the permissions of the one it replaces
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """`write_file_atomically` of UTF-8 text."""
    return write_file_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------- folders

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (`renameat2(RENAME_EXCHANGE)`); `False` where the system or the file
    system cannot (not Linux, an old C library, a file system without the flag), leaving both as they were."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def recover_folder(destination: str | os.PathLike) -> bool:
    """Put back the previous folder that a save killed between its two renames moved aside
    (`.<name>.*.old/folder`), when nothing is at `destination`; a save still running there gets `RECOVERY_WAIT_S`
    to finish first. Returns whether a folder was put back."""
    destination = Path(os.path.abspath(os.path.expanduser(destination)))
    deadline = time.monotonic() + RECOVERY_WAIT_S
    while not os.path.lexists(destination):
        moved = leftovers(destination.parent, destination.name, (".old",), stale_only=False)
        moved = [entry / "folder" for entry in moved if (entry / "folder").is_dir()]
        if not moved:
            return False
        stale = set(stale_leftovers(destination.parent, destination.name, (".old",)))
        if not stale.intersection(folder.parent for folder in moved) and time.monotonic() < deadline:
            time.sleep(0.05)  # a live save between its two renames: let it move its new folder in
            continue
        newest = max(moved, key=lambda folder: folder.stat().st_mtime)
        try:
            os.rename(newest, destination)
        except OSError:  # another loader or a save got there first
            return False
        remove(newest.parent)
        return True
    return False


def clean_stale_saves(destination: Path) -> None:
    """Put back a previous folder a killed save moved aside ([`recover_folder`]), then remove what killed saves
    left beside `destination`: incomplete new folders (`.saving`) and folders moved aside (`.old`)."""
    recover_folder(destination)
    for entry in stale_leftovers(destination.parent, destination.name, (".saving", ".old")):
        remove(entry)


def write_folder_atomically(destination: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(folder)` on a new hidden folder beside `destination`, then swap it in (see the module): a kill at
    any instant leaves the previous folder or the complete new one at `destination` (or, on a system that cannot
    exchange folders, the previous one where `recover_folder` puts it back), and an error in `write` leaves
    `destination` as it was. What killed saves left beside it is cleaned first.

    Returns:
        `Path`: the resolved `destination` ("." or a link: the folder itself is swapped, beside it).
    """
    destination = Path(destination).resolve()
    clean_stale_saves(destination)
    if destination.exists() and not destination.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{destination} exists and is not a folder", str(destination))
    destination.parent.mkdir(parents=True, exist_ok=True)
    prefix = staging_prefix(destination.name)
    staging = fresh(destination.parent, prefix, ".saving", folder=True)
    try:
        write(staging)
        cwd = Path.cwd()
        if not destination.exists():
            os.replace(staging, destination)
        elif exchange(staging, destination):  # `staging` now holds the previous folder
            _stay(cwd, destination)
        else:
            previous = fresh(destination.parent, prefix, ".old", folder=True)
            os.replace(destination, previous / "folder")
            try:
                os.replace(staging, destination)
            except BaseException:
                os.replace(previous / "folder", destination)
                remove(previous)
                raise
            _stay(cwd, destination)
            os.rename(previous / "folder", staging)  # never put back once the new one is in (removed below)
            remove(previous)
    finally:
        remove(staging)  # the incomplete new folder, or the previous one after an exchange
    return destination


def folder_version(folder: str | os.PathLike) -> tuple:
    """What changes whenever a save replaces `folder` or a file in it: the folder's inode and each entry's name,
    inode, size and modification time (`()` where no folder is there). Two equal versions around a read mean the
    read saw one version."""
    try:
        top = os.stat(folder)
        entries = sorted(
            (entry.name, info.st_ino, info.st_size, info.st_mtime_ns)
            for entry in os.scandir(folder)
            for info in (entry.stat(),)
        )
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return (top.st_dev, top.st_ino, tuple(entries))


def _stay(cwd: Path, destination: Path) -> None:
    """A process standing in the replaced folder moves to the same path in the new one."""
    if cwd == destination or destination in cwd.parents:
        os.chdir(cwd if cwd.is_dir() else destination)


__all__ = [
    "clean_stale_saves",
    "exchange",
    "folder_version",
    "recover_folder",
    "remove",
    "stale_leftovers",
    "staging_prefix",
    "unwritable",
    "write_file_atomically",
    "write_folder_atomically",
    "write_text_atomically",
]
