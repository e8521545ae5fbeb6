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
  hanging), then checked again on the open descriptor (``fstat``), which is what is read; a file
  opened for writing in place (the lock) with more than one hard link is refused (a hard link
  made to a file outside would have it written).

Directories are held open (:class:`DirHandle`): once checked, every open, write, rename, unlink
and listing inside one goes through its descriptor (``dir_fd``), never through its path again,
so a directory swapped for a link between the check and the use cannot redirect a write. Atomic
writes stay atomic relative to the descriptor: temp file (``O_EXCL``), fsync, ``os.replace``
with ``src_dir_fd``/``dst_dir_fd``, fsync of the directory.

Every refusal is a :class:`PatchError` (exit 2) naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from surgeon.core.atomicfile import TMP_SUFFIX
from surgeon.core.errors import BadInput
from surgeon.core.safefile import Voice, describe_mode, distrust, open_at, others_may_write

__all__ = ["PatchError", "DirHandle", "check_node", "open_dir", "describe_mode", "others_may_write"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PatchError(BadInput):
    """A patch operation refused or failed; the message is one line."""


# how the state directory words what core.safefile.open_at refuses
_VOICE = Voice(refused=PatchError, failed=PatchError, what="",
               not_regular=" where surgeon keeps a regular file; refusing to use it",
               link="surgeon never follows links in its state directory (remove the link)",
               cannot="cannot open it ({err})")


def _link_refused(path: Path) -> PatchError:
    return PatchError(str(_VOICE.is_link(path)))


def _trust(path: Path, st: os.stat_result, want: str) -> None:
    """Refuse ``st`` unless it is a ``want`` ('file' or 'dir') owned by us (or root) and not
    writable by group or others."""
    if stat.S_ISLNK(st.st_mode):
        raise _link_refused(path)
    ok = stat.S_ISDIR(st.st_mode) if want == "dir" else stat.S_ISREG(st.st_mode)
    if not ok:
        raise PatchError(f"{path}: is {describe_mode(st.st_mode)} where surgeon keeps a "
                         f"{'directory' if want == 'dir' else 'regular file'}; refusing to use it")
    why = distrust(path, st)
    if why is not None:
        raise PatchError(f"{why}; refusing to trust it (chown it, or chmod go-w)")


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


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_dir(path: Path) -> DirHandle:
    """The engine root (or any directory the user named) held open; links in ``path`` are the
    user's to make, so it is opened as named (the state directory inside it never follows one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise PatchError(f"{path}: cannot open the engine root ({e.strerror or e})") from None
    return DirHandle(fd, path)


class DirHandle:
    """A checked directory held open: every name in it is reached through its descriptor."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stat(self) -> os.stat_result:
        return os.fstat(self.fd)

    # -- nodes -------------------------------------------------------------------------------
    def check(self, name: str, want: str) -> os.stat_result | None:
        """``lstat`` of ``name`` in this directory: None when absent, else its trusted stat."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PatchError(f"{self.path / name}: cannot inspect it ({e.strerror or e})") from None
        _trust(self.path / name, st, want)
        return st

    def still_named(self, parent: DirHandle, name: str) -> bool:
        """Whether ``name`` in ``parent`` is still this very directory (not moved, not swapped)."""
        try:
            return _same(os.stat(name, dir_fd=parent.fd, follow_symlinks=False), self.stat())
        except OSError:
            return False

    def sub(self, name: str, *, create: bool = False) -> DirHandle | None:
        """Subdirectory ``name`` held open (created, mode 0755, when ``create``); None when absent."""
        seen = self.check(name, "dir")
        if seen is None:
            if not create:
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
            except FileExistsError:
                pass  # created meanwhile: checked below
            except OSError as e:
                raise PatchError(f"{self.path / name}: cannot create it ({e.strerror or e})") from None
            seen = self.check(name, "dir")
            if seen is None:
                raise PatchError(f"{self.path / name}: vanished while surgeon created it")
        return self._open_sub(name, seen)

    def _open_sub(self, name: str, seen: os.stat_result) -> DirHandle:
        path = self.path / name
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(path) from None
            raise PatchError(f"{path}: cannot open it ({e.strerror or e})") from None
        handle = DirHandle(fd, path)
        try:
            st = handle.stat()
            _trust(path, st, "dir")
            if not _same(st, seen):
                raise PatchError(f"{path}: replaced while surgeon checked it; refusing to use it")
        except BaseException:
            handle.close()
            raise
        return handle

    # -- files -------------------------------------------------------------------------------
    def open(self, name: str, flags: int, mode: int = 0o644) -> int | None:
        """``name`` here through :func:`~surgeon.core.safefile.open_at` (never through a link,
        never waiting on a FIFO, a regular file on the descriptor), the descriptor then trusted
        (see :func:`_trust`; a file opened for writing must have one link only); None when absent
        (and ``O_CREAT`` not given). Never truncates: ``O_TRUNC`` is not allowed."""
        assert not flags & os.O_TRUNC
        path = self.path / name

        def trusted(st: os.stat_result) -> None:
            _trust(path, st, "file")
            if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
                raise PatchError(f"{path}: has {st.st_nlink} hard links; surgeon writes it in place and never "
                                 f"through a hard link (remove it: surgeon creates it again)")

        try:
            return open_at(name, flags, dir_fd=self.fd, follow=False, shown=path, voice=_VOICE, mode=mode,
                           check=trusted)[0]
        except FileNotFoundError:
            return None

    def read(self, name: str) -> bytes | None:
        """The bytes of file ``name`` here (never through a link); None when it does not exist."""
        fd = self.open(name, os.O_RDONLY)
        if fd is None:
            return None
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        except OSError as e:
            raise PatchError(f"{self.path / name}: cannot read it ({e.strerror or e})") from None
        finally:
            os.close(fd)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def unlink(self, name: str) -> None:
        """Remove ``name`` here (unlink never follows a link); absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def write_atomic(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Replace ``name`` here by ``data``: temp file (``O_EXCL``), fsync, ``os.replace`` relative
        to this descriptor, fsync of the directory. An ``OSError`` names ``name``'s path and leaves
        the old file as it was (the temp file removed)."""
        tmp = f".{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=self.fd)
        except OSError as e:
            raise self._named(e, name) from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as e:
            self.unlink(tmp)
            if isinstance(e, OSError):
                raise self._named(e, name) from None
            raise
        self.fsync()

    def _named(self, e: OSError, name: str) -> OSError:
        """``e`` naming ``name``'s path (the temp file's name means nothing to the user)."""
        return type(e)(e.errno, e.strerror or str(e), str(self.path / name)) if e.errno is not None else e
