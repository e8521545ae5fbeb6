"""The one safe-file layer for files surgeon reads or writes outside the patch state (issue 36).

A data set, a cache restored by CI, or a careless ``-o`` can put a symbolic link, a FIFO, a device
or a huge file where surgeon expects a small regular file. Followed or read blindly, a link makes
a plain ``surgeon audit`` overwrite ``~/.bashrc``, a FIFO hangs the command, ``/dev/zero`` reads until
memory runs out. So every such file goes through here:

* opened with ``O_NONBLOCK`` (a FIFO is refused, never waited on) and ``O_NOFOLLOW`` where surgeon
  chooses the name (its state, report and cache files), then checked on the open descriptor
  (``fstat``): only a regular file is read or written, whatever was swapped in after a check;
* reads are bounded (``limit`` bytes): a larger file is refused before it is read;
* writes of new files never follow a link and never replace an existing file unless asked;
  replacing is atomic (:mod:`surgeon.core.atomicfile`), which replaces a link rather than
  writing through it;
* :func:`untrusted_dir` says why a directory must not be trusted (a link, owned by another user,
  writable by group or others), for caches whose content decides answers.

Every refusal is :class:`UnsafeFile` (bad input, exit 2), one line naming the path.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from surgeon.core.atomicfile import atomic_write
from surgeon.core.errors import BadInput

__all__ = ["UnsafeFile", "check_writable", "describe_mode", "open_append", "open_regular", "read_bytes", "read_text",
           "untrusted_dir", "write_file"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeFile(BadInput):
    """A file surgeon refuses to read or write as it stands (a link where surgeon chose the name, a
    FIFO, a device, a directory, too large, already there); the message is one line."""


def describe_mode(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "an unknown kind of file"


def _open(path: Path, flags: int, *, follow: bool, what: str, mode: int = 0o644) -> int:
    """``os.open`` without blocking on a FIFO (and without following a link unless ``follow``),
    then the descriptor checked to be a regular file and set back to blocking."""
    try:
        fd = os.open(path, flags | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW), mode)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise UnsafeFile(f"{path}: {what} is a symbolic link; surgeon does not follow links here "
                             "(remove the link or name the target)") from None
        if e.errno == errno.ENXIO:  # O_WRONLY|O_NONBLOCK on a FIFO without a reader
            raise UnsafeFile(f"{path}: {what} is a FIFO, not a regular file") from None
        raise UnsafeFile(f"{path}: cannot open {what} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path}: {what} is {describe_mode(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike, *, follow: bool = True, what: str = "the file") -> int:
    """A read-only descriptor on the regular file ``path`` (``FileNotFoundError`` when absent)."""
    return _open(Path(path), os.O_RDONLY, follow=follow, what=what)


def read_bytes(path: str | os.PathLike, *, limit: int, follow: bool = True, what: str = "the file") -> bytes:
    """The bytes of regular file ``path``, refused when over ``limit`` bytes (checked on the
    descriptor, and again while reading: a file growing under us is cut at limit + 1 and refused)."""
    p = Path(path)
    fd = _open(p, os.O_RDONLY, follow=follow, what=what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeFile(f"{p}: {what} has {size} bytes, over surgeon's limit of {limit} for it")
        chunks: list[bytes] = []
        got = 0
        while got <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - got))):
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise UnsafeFile(f"{p}: {what} grew past surgeon's limit of {limit} bytes while being read")
        return b"".join(chunks)
    except OSError as e:
        raise UnsafeFile(f"{p}: cannot read {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, *, limit: int, follow: bool = True, what: str = "the file",
              encoding: str = "utf-8") -> str:
    data = read_bytes(path, limit=limit, follow=follow, what=what)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise UnsafeFile(f"{path}: {what} is not {encoding} text (byte {e.start})") from None


def open_append(path: str | os.PathLike, *, what: str = "the file", mode: int = 0o644):
    """A binary append handle on ``path`` (created if absent), never through a link, never a FIFO."""
    fd = _open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, follow=False, what=what, mode=mode)
    return os.fdopen(fd, "ab")


def write_file(path: str | os.PathLike, data: bytes, *, overwrite: bool = False, what: str = "the output",
               mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically, never through a link at ``path``: an existing regular
    file is replaced only with ``overwrite``; a link, FIFO, device or directory there is refused."""
    p = Path(path)
    check_writable(p, overwrite=overwrite, what=what)
    try:
        atomic_write(p, data, mode)
    except OSError as e:
        raise UnsafeFile(f"{p}: cannot write {what} ({e.strerror or e})") from None


def check_writable(path: str | os.PathLike, *, overwrite: bool = False, what: str = "the output") -> None:
    """Refuse now what :func:`write_file` would refuse later (a link, FIFO, device or directory at
    ``path``; an existing file unless ``overwrite``): for commands that should fail before their work."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UnsafeFile(f"{p}: cannot inspect {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{p}: {what} is {describe_mode(st.st_mode)}; refusing to write there")
    if not overwrite:
        raise UnsafeFile(f"{p}: {what} already exists; refusing to overwrite it")


def untrusted_dir(path: str | os.PathLike) -> str | None:
    """Why directory ``path`` must not be trusted (None: it may be): a link, not a directory,
    owned by another user (root excepted), or writable by group or others."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{p}: cannot inspect it ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{p}: is {describe_mode(st.st_mode)}, not a directory"
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        return f"{p}: owned by uid {st.st_uid}, not by you (uid {euid}) or root"
    if st.st_mode & 0o022:
        return f"{p}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
