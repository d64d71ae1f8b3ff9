"""Writing files so that a reader finds the old version or the new one, never a part of one; checksums; the lock.

Every file and folder the package writes for a later reader (caches, the tokenizer it trains, the DPO reference,
run.json and the other records of a run, exports, the records of a checkpoint outside its collective save) is
written under a temporary sibling name and renamed into place, through this module:

    write_atomic(path, text)      a small file, whole or not at all
    write_with(path, write)       a file another library writes (numpy's tofile, save_file...) given a path
    atomic_folder(path)           a folder built under a temporary name, published by one rename when complete
    scratch_folder(name)          a process's passing files in the temporary folder, swept if it was killed
    discard_folder(path)          a folder deleted whole: renamed aside first, so a kill leaves it whole or gone

Each writer first removes the temporaries of `path` that writers killed half-way left (SIGKILL runs no cleanup), so
none stays for ever; and a write that fails for want of room (a full disk shows at a write or an fsync, with no file
name, or inside a Rust writer as its own exception) is an OSError naming `path` (`failing_write`), which the command
group turns into one message with the fix.

A temporary name carries the host, the PID and a random part (`.<name>.tmp-<host>-<pid>-<random>`): under PID
namespaces (containers, Kubernetes) the local main ranks of several machines often have equal PIDs, and two of
them writing into one shared cache must never share a temporary file. Files are fsynced before the rename and the
folder after it, so a machine that loses power keeps the old version or the new one.

`FileLock` is the one lock (flock): the run folder's live-run lock and the data cache's build lock. The kernel
releases it when its holder exits or dies, so a crash never leaves a stale lock; its file says who holds it.

The ground floor: imports nothing of the package; no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

TMP_MARK = ".tmp-"
"""Between a file's name and its writer in a temporary name: `.<name>.tmp-<host>-<pid>-<random>`."""


def temporary_sibling(path: Path | str) -> Path:
    """A fresh name in `path`'s folder for writing `path`: no other writer, here or on another machine sharing the
    folder, gets the same one (host, PID and 32 random bits)."""
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def temporaries_of(path: Path | str) -> list[Path]:
    """The temporary siblings of `path` that writers left (a writer killed before its rename)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}{TMP_MARK}*")) if path.parent.is_dir() else []


def temporary_writer(temporary: Path) -> tuple[str, int] | None:
    """(host, PID) of the process that named a temporary sibling, or None for a name this module did not make."""
    _, mark, writer = temporary.name.partition(TMP_MARK)
    parts = writer.rsplit("-", 2)  # a host name may hold dashes; the PID and the random part do not
    if not mark or len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def remove_dead_temporaries(path: Path | str) -> list[Path]:
    """Remove the temporary siblings of `path` whose writer is a process of this host that is gone (killed: no
    cleanup ran). Those of another machine, or of a live process, are left alone. Returns those removed."""
    removed = []
    for temporary in temporaries_of(path):
        writer = temporary_writer(temporary)
        if writer is None or writer[0] != socket.gethostname() or writer[1] == os.getpid():
            continue
        try:
            os.kill(writer[1], 0)
        except ProcessLookupError:
            remove(temporary)
            removed.append(temporary)
        except OSError:
            pass  # alive under another user
    return removed


def remove(path: Path) -> None:
    """A file or a folder, gone (nothing if it is not there)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fsync_dir(path: Path | str) -> None:
    """Make the entries of a folder (a rename into it) durable. Some filesystems refuse: then nothing more can be
    done."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_with(path: Path | str, write: Callable[[Path], object]) -> None:
    """`write(temporary)` writes the file; it is then synced and renamed to `path`. On any failure (Ctrl-C included)
    the temporary file is removed and `path` is as it was; a failure to write (a full disk) is an OSError naming
    `path` (`failing_write`). The temporaries of earlier writers of `path` killed half-way are removed first."""
    path = Path(path)
    remove_dead_temporaries(path)
    temporary = temporary_sibling(path)
    try:
        with failing_write(path):
            write(temporary)
            _fsync_file(temporary)
            os.replace(temporary, path)
    except BaseException:
        remove(temporary)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path | str, data: str | bytes) -> None:
    """Write a small file whole or not at all."""
    payload = data.encode() if isinstance(data, str) else data
    write_with(path, lambda temporary: temporary.write_bytes(payload))


@contextlib.contextmanager
def atomic_folder(path: Path | str, *, sync: bool = True) -> Iterator[Path]:
    """Build a folder under a temporary name (yielded), then publish it as `path` with one rename, replacing a folder
    there. An exception (Ctrl-C included) removes what was built and leaves `path` as it was. `sync`: fsync every file
    before the rename (a cache that is read back for weeks must survive a power loss whole)."""
    temporary = new_temporary_folder(path)
    try:
        with failing_write(path):
            yield temporary
            publish_folder(temporary, Path(path), sync=sync)
    except BaseException:
        remove(temporary)
        raise


def new_temporary_folder(path: Path | str) -> Path:
    """An empty temporary sibling folder of `path` (its parent created), to be published as `path` when complete.
    The temporaries of earlier builders of `path` killed half-way (no cleanup ran) are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path)
    temporary = temporary_sibling(path)
    temporary.mkdir()
    return temporary


@contextlib.contextmanager
def scratch_folder(name: str) -> Iterator[Path]:
    """A private folder in the system's temporary folder for one process's passing files (`name` says whose:
    accel-fsdp-bench), removed when done. Those of processes of this host killed before they removed theirs (SIGKILL
    runs no cleanup; a killed bench leaves its runs' checkpoints) are removed first."""
    import tempfile

    folder = new_temporary_folder(Path(tempfile.gettempdir()) / name)
    os.chmod(folder, 0o700)
    try:
        yield folder
    finally:
        remove(folder)


def publish_folder(temporary: Path, path: Path, *, sync: bool = True) -> None:
    """Rename a complete folder into place (its files fsynced first with `sync`). A folder already at `path` is
    exchanged with it in one step where the system can (`exchange`: a process killed at any instant leaves the old
    folder or the new one), else first renamed aside (readers see the old folder or no folder, never a mix); the old
    one is then removed."""
    if sync:
        for p in temporary.rglob("*"):
            if p.is_file() and not p.is_symlink():
                _fsync_file(p)
    aside = None
    if (path.exists() or path.is_symlink()) and exchange(temporary, path):
        fsync_dir(path.parent)
        remove(temporary)  # the previous folder now; a kill before this leaves it to the next writer's sweep
        return
    if path.exists() or path.is_symlink():
        aside = temporary_sibling(path)
        os.rename(path, aside)
    os.rename(temporary, path)
    fsync_dir(path.parent)
    if aside is not None:
        remove(aside)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100  # linux/fs.h, linux/fcntl.h


def exchange(a: Path, b: Path) -> bool:
    """Swap two entries of one filesystem in one step (Linux renameat2 RENAME_EXCHANGE, glibc 2.28): nobody, and no
    process killed in between, ever finds neither. False where the system or the filesystem cannot (NFS, macOS)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def discard_folder(path: Path | str) -> None:
    """Delete a folder as one step: renamed to a temporary sibling first (atomic), then removed. A process killed
    while removing leaves a whole folder or none at `path` (never one that lost the file that said what it was),
    and its half-removed temporary is swept by the next writer of `path`."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    aside = temporary_sibling(path)
    os.rename(path, aside)
    remove(aside)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""A disk without room, or a quota spent."""
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How Rust's std::io::Error shows an OS error (`Display` of an `Os` error: "<text> (os error 28)"): what the
libraries writing files in Rust raise with it, as their own exception types (safetensors 0.8 `save_file`:
SafetensorError "Error while serializing: I/O error: No space left on device (os error 28)"; tokenizers' `save`)."""


@contextlib.contextmanager
def failing_write(path: Path | str) -> Iterator[None]:
    """A write for `path` that fails for want of room or rights is an OSError naming `path` (the command group turns
    that into one message with the fix, cli/main.py `Commands`): Python's `write()` gives no file name (a full disk
    shows at a write or an fsync, long after the open), a Rust writer an exception of its own, and a name inside a
    temporary would send the user to a file that no longer exists."""
    try:
        yield
    except OSError as e:
        if e.errno is None or (e.filename and TMP_MARK not in str(e.filename)):
            raise  # named already, by a path the user can look at
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except Exception as e:  # noqa: BLE001 - only an OS error a Rust writer met is renamed; the rest go on unchanged
        found = RUST_OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


# ---------------------------------------------------------------------------------------------------- checksums


def crc32_of(path: Path | str, chunk: int = 1 << 22) -> str:
    """The CRC-32 of a file, hex (read in blocks; about 1 GB/s: a read of the file is what it costs)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


class Crc32Writer:
    """A binary file being written, with the CRC-32 of what was written so far (no second read)."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.crc = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.crc = zlib.crc32(data, self.crc)

    def close(self) -> str:
        self.file.close()
        return f"{self.crc:08x}"


# ---------------------------------------------------------------------------------------------------------- lock


class FileLock:
    """A lock on a file (flock), for as long as it is held: exclusive for the run folder's live-run lock and the data
    cache's build lock, shared by the readers of a checkpoint (checkpoint/store.py `reading`), whom rotation's
    exclusive try passes over. On a local disk flock; on NFS Linux turns it into a POSIX byte-range lock, which the
    server arbitrates between machines. The kernel releases it when the holder exits or dies, so a crash never leaves
    a stale lock. An exclusive holder records who it is in the file (host, PID, since when, the command)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self, *, wait: bool, shared: bool = False) -> bool:
        """Take the lock, waiting for it (`wait`) or not; False when another process holds it (exclusively, or at all
        for an exclusive lock) and `wait` is off. A file its holder removed while this waited is opened again: the
        lock is on the file the path names."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
                linked = _same_file(fd, self.path)
            except BaseException:  # held (not waiting), or Ctrl-C while waiting
                os.close(fd)
                if not wait:
                    return False
                raise
            if linked:
                break
            os.close(fd)  # removed by the holder it waited for (`release(remove=True)`): the path's file now
        if not shared:
            info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": " ".join(sys.argv[1:])[:300]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return True

    def release(self, *, remove: bool = False) -> None:
        """`remove`: delete the file first (an exclusive holder whose lock guards nothing any more); a process that
        waits for it opens the path again (`acquire`)."""
        if self._fd is not None:
            if remove:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FileLock:
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> str | None:
        """Who holds the lock right now (host, PID, since when), or None when nobody does. Takes nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_holder(fd)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, named = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"held by PID {info['pid']} on {info['host']} since {info['since']}"
    except (ValueError, KeyError, OSError, UnicodeDecodeError):
        return "held by another process"
