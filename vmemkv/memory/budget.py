"""One budget of KV memory shared by the engines (processes) of a machine: :class:`SharedKVBudget`.

Each engine's pool backs a block with memory only while it is used or cached, and gives free
memory back (``KVCacheManager.release_free_memory``). With a shared budget the engines draw
those bytes from one number instead of each reserving its worst case: an engine *takes* bytes
before its pool backs more blocks and *gives* them back with the memory.

The accounting is a small file in ``/dev/shm`` (shared memory) that every member maps:

* a header (magic, total bytes) and one row per member: its process id and the bytes it holds;
* one lock over it, ``flock`` on the file, which the kernel drops when its holder dies, so a
  ``kill -9`` inside ``take`` cannot wedge the others;
* each member holds an exclusive ``flock`` on a file of its own (``<name>.member<i>``) for its
  lifetime. A member whose lock can be taken is dead: its row, and the bytes it held, come back
  to the budget (reaped when another member's ``take`` finds the budget short, and by ``stats``);
  so do the bytes of a free row (pid 0), which no live member can hold.

A pool file that is not a pool (too short, another magic), a budget that cannot pay for one block
of the joining engine, and a size that does not fit the header are refused with a ``ConfigError``
that names the file and what to do; a refused create leaves no pool behind.

The budget counts bytes only; each engine's pages stay in its own memory (its own memfd or CUDA
allocations), so no engine can read another's KV.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import struct
from pathlib import Path

from vmemkv.errors import ConfigError, VmemkvError

MAX_MEMBERS = 64
_MAGIC = b"vmemkvB1"
_HEADER = struct.Struct("<8sQ")  # magic, total bytes
_ROW = struct.Struct("<QQ")  # pid (0: free row), bytes held
_SIZE = _HEADER.size + MAX_MEMBERS * _ROW.size
MAX_TOTAL_BYTES = 2**64 - 1  # the header's field
DEFAULT_DIRECTORY = "/dev/shm"  # or $VMEMKV_KV_POOL_DIR


class BudgetFullError(VmemkvError):
    """No free member row in a shared KV budget."""


class SharedKVBudget:
    """``SharedKVBudget(name, total_bytes=None, directory=None, block_bytes=1)``: join the budget
    ``name``, creating it with ``total_bytes`` if it does not exist (joining an existing one, give
    its total or None); a budget smaller than ``block_bytes`` (what one block of the joining engine
    costs it) is refused, since no request could ever run on it. ``take(want, need)`` grants
    between ``need`` and ``want`` bytes or nothing; ``give(n)`` returns bytes; ``close()`` gives
    back what this member holds and leaves. Its files live in ``directory`` (default
    ``$VMEMKV_KV_POOL_DIR`` or ``/dev/shm``) and stay there, a few bytes each, after the last
    member leaves: the next engine to use the name joins them."""

    def __init__(self, name: str, total_bytes: int | None = None, directory: str | None = None,
                 block_bytes: int = 1):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ConfigError(f"kv_pool name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
        self.name = name
        directory = directory or os.environ.get("VMEMKV_KV_POOL_DIR") or DEFAULT_DIRECTORY
        self.path = Path(directory) / f"vmemkv-kv-pool-{name}"
        if total_bytes is not None:  # checked before any file is made: a refused create leaves none
            self._check_size(total_bytes, block_bytes)
        self._fd = self._open(total_bytes is not None)
        self._member_fd: int | None = None
        self._map = None
        self.held = 0  # bytes this member holds
        try:
            with self._locked():
                size = os.fstat(self._fd).st_size
                if size == 0:
                    self._create(total_bytes)
                else:
                    self._map = self._map_existing(size, total_bytes, block_bytes)
                self.total_bytes = _HEADER.unpack_from(self._map, 0)[1]
                try:
                    self.index = self._join()
                except BaseException:
                    if size == 0:  # back to "does not exist yet": the next engine creates it afresh
                        os.ftruncate(self._fd, 0)
                    raise
        except BaseException:
            self._close_files()
            raise

    def _check_size(self, total_bytes, block_bytes: int) -> None:
        """A new pool's size: a positive int that the header's 64 bits hold and that pays for at
        least one block."""
        if type(total_bytes) is not int or not 0 < total_bytes <= MAX_TOTAL_BYTES:
            raise ConfigError(f"kv_pool_bytes (--kv-pool-bytes) must be a whole number of bytes from 1 "
                              f"to {MAX_TOTAL_BYTES} (2**64 - 1), got {total_bytes!r}")
        if total_bytes < block_bytes:
            raise ConfigError(f"kv_pool_bytes (--kv-pool-bytes) {total_bytes} for KV pool {self.name!r} "
                              f"({self.path}) is less than one KV block of this engine ({block_bytes} "
                              f"bytes): no request could ever run; give at least {block_bytes}")

    def _create(self, total_bytes: int | None) -> None:
        """Write the header of a new pool (under the lock)."""
        if total_bytes is None:
            raise self._missing()
        os.ftruncate(self._fd, _SIZE)
        self._map = mmap.mmap(self._fd, _SIZE)
        _HEADER.pack_into(self._map, 0, _MAGIC, total_bytes)

    def _open(self, create: bool) -> int:
        """The pool file's descriptor; only an engine that gives the size creates the file."""
        try:
            return os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            if not create and self.path.parent.is_dir():
                raise self._missing() from None
            error = "no such directory"
        except OSError as exc:
            error = exc.strerror
        raise ConfigError(f"cannot open KV pool {self.name!r} at {self.path}: {error}; set "
                          "VMEMKV_KV_POOL_DIR to a directory every engine can write (shared memory: "
                          "/dev/shm)")

    def _missing(self) -> ConfigError:
        return ConfigError(f"KV pool {self.name!r} ({self.path}) does not exist yet; the first engine "
                           "creates it and must give its size (kv_pool_bytes)")

    def _map_existing(self, size: int, total_bytes: int | None, block_bytes: int) -> mmap.mmap:
        """Map an existing pool file after checking its header (under the lock)."""
        remove = (f"remove {self.path} if no engine uses it (the next engine then creates the pool "
                  "with its kv_pool_bytes), or name another kv_pool")
        if size < _SIZE:
            raise ConfigError(f"{self.path} holds {size} bytes, less than a KV pool's {_SIZE}: it is "
                              f"not a vmemkv KV pool, or a damaged one; {remove}")
        magic, total = _HEADER.unpack(os.pread(self._fd, _HEADER.size, 0))
        if magic != _MAGIC:
            raise ConfigError(f"{self.path} is not a vmemkv KV pool (or a damaged one); {remove}")
        if total_bytes is not None and total_bytes != total:
            raise ConfigError(f"KV pool {self.name!r} ({self.path}) holds {total} bytes, not "
                              f"{total_bytes}; join it with its size or none")
        if total < block_bytes:
            raise ConfigError(f"KV pool {self.name!r} ({self.path}) holds {total} bytes, less than one "
                              f"KV block of this engine ({block_bytes} bytes): no request could ever "
                              f"run on it; {remove}, with kv_pool_bytes of at least {block_bytes}")
        return mmap.mmap(self._fd, _SIZE)

    # --- the lock and the rows -------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _row(self, index: int) -> tuple[int, int]:
        return _ROW.unpack_from(self._map, _HEADER.size + index * _ROW.size)

    def _set_row(self, index: int, pid: int, held: int) -> None:
        _ROW.pack_into(self._map, _HEADER.size + index * _ROW.size, pid, held)

    def _member_path(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.member{index}")

    def _is_dead(self, index: int) -> bool:
        """Whether row ``index``'s member is gone: its lock file can be locked (under the lock)."""
        try:
            fd = os.open(self._member_path(index), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # closing drops the lock taken just now, if any
        return True

    def _reap(self) -> int:
        """Free the rows of dead members (under the lock); returns the bytes that came back."""
        freed = 0
        for index in range(MAX_MEMBERS):
            pid, held = self._row(index)
            if index == getattr(self, "index", None):
                continue
            if (pid and self._is_dead(index)) or (not pid and held):  # a free row holds nothing
                self._set_row(index, 0, 0)
                freed += held
        return freed

    def _join(self) -> int:
        """Take a free row (under the lock), reaping dead members' rows first if none is free."""
        for attempt in range(2):
            for index in range(MAX_MEMBERS):
                if self._row(index)[0] == 0 or (attempt and self._is_dead(index)):
                    fd = self._open_member_lock(index)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:  # a member that has not written its row yet
                        os.close(fd)
                        continue
                    self._member_fd = fd
                    self._set_row(index, os.getpid(), 0)
                    return index
        raise BudgetFullError(f"KV pool {self.name!r} has {MAX_MEMBERS} live members already")

    def _open_member_lock(self, index: int) -> int:
        path = self._member_path(index)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise ConfigError(f"cannot open {path}, the lock file of row {index} of KV pool "
                              f"{self.name!r}: {error.strerror}; remove it (no engine can use it), or "
                              "name another kv_pool") from None

    def _used(self) -> int:
        return sum(self._row(index)[1] for index in range(MAX_MEMBERS))

    # --- taking and giving -----------------------------------------------------------------------
    def take(self, want: int, need: int | None = None) -> int:
        """Take up to ``want`` bytes, at least ``need`` (default ``want``), or nothing; returns the
        bytes granted. Dead members' bytes come back first when the budget is short."""
        need = want if need is None else need
        if want <= 0:
            return 0
        with self._locked():
            free = self.total_bytes - self._used()
            if free < want:
                free += self._reap()
            if free < max(need, 1):
                return 0
            granted = min(want, free)
            self.held += granted
            self._set_row(self.index, os.getpid(), self.held)
            return granted

    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what this member holds."""
        if not 0 <= nbytes <= self.held:
            raise ValueError(f"giving back {nbytes} bytes of a KV pool share of {self.held}")
        if nbytes:
            with self._locked():
                self.held -= nbytes
                self._set_row(self.index, os.getpid(), self.held)

    def free_bytes(self) -> int:
        """Bytes no live member holds now (a dead member's count until it is reaped)."""
        with self._locked():
            return self.total_bytes - self._used()

    def stats(self) -> dict:
        """``total_bytes``, ``used_bytes`` (every live member's), ``held_bytes`` (this member's),
        ``members`` (live ones, this one included)."""
        with self._locked():
            self._reap()
            rows = [self._row(index) for index in range(MAX_MEMBERS)]
        return {"total_bytes": self.total_bytes, "used_bytes": sum(held for _, held in rows),
                "held_bytes": self.held, "members": sum(1 for pid, _ in rows if pid)}

    def close(self) -> None:
        """Give back everything this member holds and leave the budget (idempotent)."""
        if self._member_fd is None:
            return
        with self._locked():
            self._set_row(self.index, 0, 0)
            self.held = 0
        self._close_files()

    def _close_files(self) -> None:
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None
        for fd in (self._member_fd, self._fd):
            if fd is not None:
                os.close(fd)
        self._member_fd = self._fd = None

    def __repr__(self) -> str:
        return f"SharedKVBudget({self.name!r}, total_bytes={self.total_bytes}, held={self.held})"
