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
* :func:`open_at` is the one open behind every such read and write, and behind the patch state's
  directory handles and the tensor gate (each words its refusals in its own :class:`Voice`);
* :func:`distrust` is the one trust rule (owned by another user, writable by group or others),
  used by :func:`untrusted_dir` for caches whose content decides answers and by the patch state.

Every refusal is :class:`UnsafeFile` (bad input, exit 2), one line naming the path.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from surgeon.core.atomicfile import atomic_write
from surgeon.core.errors import BadInput

__all__ = ["PLAIN", "UnsafeFile", "Voice", "check_writable", "describe_mode", "distrust", "open_append", "open_at",
           "note", "open_regular", "others_may_write", "read_bytes", "read_text", "untrusted_dir", "write_file"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeFile(BadInput):
    """A file surgeon refuses to read or write as it stands (a link where surgeon chose the name, a
    FIFO, a device, a directory, too large, already there); the message is one line."""


def describe_mode(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "an unknown kind of file"


@dataclass(frozen=True)
class Voice:
    """How a caller of :func:`open_at` words what it refuses, each a line after ``<path>: ``."""

    refused: Callable[[str], Exception] = UnsafeFile  # a link, a FIFO, a device, a directory, a check failed
    failed: Callable[[str], Exception] = UnsafeFile  # the system's refusal (permissions, I/O)
    what: str = "the file"  # "<path>: <what> is a FIFO ..."; "" for "<path>: is a FIFO ..."
    not_regular: str = ", not a regular file"  # after "is <kind>"
    link: str = "surgeon does not follow links here (remove the link or name the target)"
    cannot: str = "cannot open {what} ({err})"

    def subject(self) -> str:
        return f"{self.what} " if self.what else ""

    def is_link(self, path: Path) -> Exception:
        return self.refused(f"{path}: {self.subject()}is a symbolic link; {self.link}")

    def is_not_regular(self, path: Path, mode: int) -> Exception:
        return self.refused(f"{path}: {self.subject()}is {describe_mode(mode)}{self.not_regular}")


PLAIN = Voice()


def open_at(name: str | os.PathLike, flags: int, *, dir_fd: int | None = None, follow: bool = True,
            shown: Path | None = None, voice: Voice = PLAIN, mode: int = 0o644,
            check: Callable[[os.stat_result], None] | None = None) -> tuple[int, os.stat_result]:
    """The one safe open of surgeon: ``name`` (relative to ``dir_fd`` when given) opened with
    ``flags``, a descriptor and its ``fstat`` back, or the refusal in ``voice`` naming ``shown``
    (default ``name``). ``FileNotFoundError`` passes through (absent, and not created).

    * seen first without opening (``stat``, through a link only when ``follow``): a link where
      links are not followed, a FIFO, a device, a directory is refused unopened (opening a device
      can have effects; opening a FIFO can wait for a writer);
    * opened with ``O_NONBLOCK`` (whatever was swapped in meanwhile, a FIFO never waits),
      ``O_CLOEXEC`` and, unless ``follow``, ``O_NOFOLLOW``;
    * checked on the descriptor: a regular file, then ``check(st)`` (the caller's identity, owner
      or link-count rule; it raises its own refusal), then set back to blocking; closed on any
      refusal."""
    path = shown if shown is not None else Path(name)
    _seen_first(name, dir_fd, follow, path, voice)
    try:
        fd = os.open(name, flags | _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW), mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise voice.is_link(path) from None
        if e.errno == errno.ENXIO:  # O_WRONLY|O_NONBLOCK on a FIFO without a reader
            raise voice.is_not_regular(path, stat.S_IFIFO) from None
        raise voice.failed(f"{path}: " + voice.cannot.format(what=voice.what, err=e.strerror or e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise voice.is_not_regular(path, st.st_mode)
        if check is not None:
            check(st)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _seen_first(name: str | os.PathLike, dir_fd: int | None, follow: bool, path: Path, voice: Voice) -> None:
    """Refuse ``name`` before opening it when it is already not a regular file (absent, or not to
    be seen: the open says why)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=follow)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise voice.is_link(path)
    if not stat.S_ISREG(st.st_mode):
        raise voice.is_not_regular(path, st.st_mode)


def _open(path: Path, flags: int, *, follow: bool, what: str, mode: int = 0o644) -> int:
    return open_at(path, flags, follow=follow, voice=_voice(what), mode=mode)[0]


def _voice(what: str) -> Voice:
    return Voice(what=what)


def note(message: str, said: set[str] | None = None) -> None:
    """``surgeon: note: <message>`` on stderr: what surgeon did not use or believe, and why (an
    untrusted cache, an entry or release that does not match, a file left out); once per message
    kept in ``said``, when given."""
    if said is not None:
        if message in said:
            return
        said.add(message)
    sys.stderr.write(f"surgeon: note: {message}\n")
    sys.stderr.flush()


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


def distrust(path: str | os.PathLike, st: os.stat_result) -> str | None:
    """The one trust rule, for anything surgeon believes (a cache, its state): why the node whose
    ``stat`` is ``st`` must not be trusted, or None. Whoever else owns it (root excepted), or may
    write it (group or others), could change or swap it between surgeon's check and its use."""
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        return f"{path}: owned by uid {st.st_uid}, not by you (uid {euid}) or root"
    if st.st_mode & 0o022:
        return f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def others_may_write(st: os.stat_result) -> bool:
    """A directory anyone may write into and rename out of: writable by others, no sticky bit
    (the weaker rule for folders surgeon only warns about, such as an engine root)."""
    return bool(st.st_mode & 0o002) and not st.st_mode & stat.S_ISVTX


def untrusted_dir(path: str | os.PathLike) -> str | None:
    """Why directory ``path`` must not be trusted (None: it may be): a link, not a directory, or
    :func:`distrust`'s reason."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{p}: cannot inspect it ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{p}: is {describe_mode(st.st_mode)}, not a directory"
    return distrust(p, st)
