"""Surgeon's state directory (``<root>/.surgeon``) opened without following links or trusting strangers.

An engine tree unpacked from an archive, or a shared install, can carry a symlink at
``.surgeon``, ``.surgeon/lock`` or ``.surgeon/originals``; followed, a ``sudo surgeon status``
would truncate whatever the lock links to and an apply would write its state wherever the link
points. So every node of the state directory is checked from the engine root down before use:

* ``lstat`` of each component: a symlink, or a node of the wrong kind (a directory where a file
  is expected, a FIFO, a device, a socket) is refused, naming it;
* owner and mode: a node owned by another user (root excepted) or writable by group or others is
  refused (whoever could write it could swap it between our check and our use);
* files are opened with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, so a FIFO is refused instead of
  hanging), then checked again on the open descriptor (``fstat``), which is what is read.

Every refusal is a :class:`PatchError` (exit 2) naming the path. Writes go through
:func:`surgeon.core.atomicfile.atomic_write`: ``mkstemp`` (``O_EXCL``) then ``os.replace``, which
replaces a link rather than following it, in a directory checked here first.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from surgeon.core.errors import BadInput
from surgeon.core.safefile import describe_mode

__all__ = ["PatchError", "check_node", "ensure_dir", "open_file", "read_file", "describe_mode"]


class PatchError(BadInput):
    """A patch operation refused or failed; the message is one line."""


def _trust(path: Path, st: os.stat_result, want: str) -> None:
    """Refuse ``st`` unless it is a ``want`` ('file' or 'dir') owned by us (or root) and not
    writable by group or others."""
    if stat.S_ISLNK(st.st_mode):
        raise PatchError(f"{path}: is a symbolic link; surgeon never follows links in its state directory "
                         f"(remove the link)")
    ok = stat.S_ISDIR(st.st_mode) if want == "dir" else stat.S_ISREG(st.st_mode)
    if not ok:
        raise PatchError(f"{path}: is {describe_mode(st.st_mode)} where surgeon keeps a "
                         f"{'directory' if want == 'dir' else 'regular file'}; refusing to use it")
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        raise PatchError(f"{path}: owned by uid {st.st_uid}, not by you (uid {euid}) or root; refusing to trust it")
    if st.st_mode & 0o022:
        raise PatchError(f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                         f"refusing to trust it (chmod go-w)")


def check_node(path: Path, want: str) -> os.stat_result | None:
    """``lstat`` ``path``: None when absent, else its stat once trusted (see :func:`_trust`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PatchError(f"{path}: cannot inspect it ({e.strerror or e})") from None
    _trust(path, st, want)
    return st


def ensure_dir(path: Path) -> None:
    """Create directory ``path`` (mode 0755) unless there, then check it (never through a link)."""
    if check_node(path, "dir") is None:
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass  # created meanwhile: checked below
        except OSError as e:
            raise PatchError(f"{path}: cannot create it ({e.strerror or e})") from None
        check_node(path, "dir")


def open_file(path: Path, flags: int, mode: int = 0o644) -> int | None:
    """``os.open`` with ``O_NOFOLLOW | O_NONBLOCK``, then the descriptor checked; None when the
    file is absent (and ``O_CREAT`` not given)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PatchError(f"{path}: is a symbolic link; surgeon never follows links in its state directory "
                             f"(remove the link)") from None
        raise PatchError(f"{path}: cannot open it ({e.strerror or e})") from None
    try:
        _trust(path, os.fstat(fd), "file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: Path) -> bytes | None:
    """The bytes of state file ``path`` (never through a link); None when it does not exist."""
    fd = open_file(path, os.O_RDONLY)
    if fd is None:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as e:
        raise PatchError(f"{path}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)
