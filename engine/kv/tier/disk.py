"""DiskBackend: a directory of KV block files, bounded in bytes, least recently used evicted first.

    <root>/                       0700, owned by the server's user
      <namespace hex>/            one per model and KV format (tier.namespace)
        <hash[:1 byte] hex>/      256 fan-out folders
          <block hash hex>.kv     one block (format.py), 0600

Writes go to a hidden temporary file in the same folder, renamed over the final name when complete
(atomic on POSIX), so a reader sees a whole file or none; a crash leaves at most a temporary file,
swept at the next start. Nothing is fsynced: a file torn by a crash fails its checksum and is a miss.

The index (name -> size, least recently used first) is an OrderedDict under a lock: O(1) lookups for the
engine thread, O(1) move-to-end on a hit, O(1) eviction from the front; it is rebuilt from the directory at
start (ordered by modification time, which every hit refreshes), so the LRU order outlives the process.
Files of every namespace count towards the byte bound; lookups see only this one's.

Shared (`shared=True`): other processes write and delete in the same directory. `scan()` then runs again
every few seconds (tier.py's writer thread) and lists only the fan-out folders whose modification time
moved; a file another process deleted is found missing on read (a miss). Each process evicts by its own
view of the LRU order; the bound can be passed by what the others wrote since the last scan.

Faults are counted, never raised: `missing` (the index named a file that is gone), `corrupt` (a checksum,
size or format that does not match), `foreign` (a file of this name holding another block: other tokens,
another parent), `io` (any other OS error: the directory gone, EIO, EACCES), `nospace` (ENOSPC, EDQUOT
or EFBIG on write). A corrupt or foreign file is deleted.

NOTE: thread-safe. The engine thread calls `contains`/`touch`; the tier's loader and writer threads do the
file I/O; only the index is shared, under `_lock`. Standard library only.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from engine.kv.tier.format import BadBlockFile, Header, checksum, decode_header, header_bytes

log = logging.getLogger(__name__)
_NOSPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
LOG_EVERY_S = 10.0
_STALE_TMP_S = 600.0        # a shared directory's temporary files older than this are leftovers of a crash


def prepare_root(root: Path, create: bool = True) -> None:
    """The tier's directory, 0700 and ours: created if missing (when `create`), tightened if group or others
    may read it; ValueError if it belongs to another user or is not a directory."""
    try:
        if create:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.stat()
    except OSError as exc:
        raise ValueError(f"KV tier directory {str(root)!r}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"KV tier directory {str(root)!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"KV tier directory {str(root)!r} belongs to uid {st.st_uid}, not to this server's user "
                         f"({os.geteuid()}): its files would hold prompts")
    if st.st_mode & 0o077:
        log.warning("KV tier directory %s was readable by others (mode %o): set to 0700", root, st.st_mode & 0o777)
        root.chmod(0o700)


class DiskBackend:
    def __init__(self, root: Path, namespace: bytes, max_bytes: int, *, shared: bool = False,
                 name: str = "local") -> None:
        self.root = Path(root)
        self.name = name
        self.shared = shared
        self.max_bytes = max_bytes
        self.ns = namespace.hex()
        prepare_root(self.root)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()   # "<ns>/<fan>/<hash>.kv" -> bytes, LRU first
        self._bytes = 0
        self._dir_mtime: dict[str, int] = {}                 # fan-out folder -> mtime_ns at its last listing
        self.faults = {"missing": 0, "corrupt": 0, "foreign": 0, "io": 0, "nospace": 0}
        self.evicted_files = 0
        self._logged: dict[str, float] = {}                  # fault kind -> when it was last logged
        self.scan()

    # -- names --------------------------------------------------------------------------------
    def _rel(self, block_hash: bytes) -> str:
        h = block_hash.hex()
        return f"{self.ns}/{h[:2]}/{h}.kv"

    # -- the index (any thread) ---------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        return self._rel(block_hash) in self._index        # NOTE: a dict read: atomic under the GIL

    def touch(self, block_hash: bytes) -> None:
        """A use: the block becomes the most recently used."""
        with self._lock:
            rel = self._rel(block_hash)
            if rel in self._index:
                self._index.move_to_end(rel)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def num_files(self) -> int:
        return len(self._index)

    def _lost(self) -> None:
        """The directory is gone (deleted, an unmounted volume): so is everything the index named in it."""
        with self._lock:
            self._index.clear()
            self._bytes = 0
        self._dir_mtime.clear()

    def _drop(self, rel: str) -> None:
        with self._lock:
            size = self._index.pop(rel, None)
            if size is not None:
                self._bytes -= size

    def _fault(self, kind: str, rel: str, why: object) -> None:
        """Counts a fault; logs it, at most once per LOG_EVERY_S per kind (a volume that went away fails every
        write: the count says how many, the log says why)."""
        self.faults[kind] += 1
        now = time.monotonic()
        if now - self._logged.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[kind] = now
            log.warning("KV tier %s: %s fault on %s: %s (%d %s faults so far)", self.name, kind, rel, why,
                        self.faults[kind], kind)

    # -- scanning (I/O threads) -------------------------------------------------------------------
    def scan(self) -> None:
        """Brings the index in line with the directory: fan-out folders whose modification time moved are
        listed again (all of them the first time). Files new to the index go in as the most recently used, in
        the order of their modification times (at start: the whole LRU order; later: blocks other replicas
        just wrote). A leftover temporary file is removed (in a local directory: all, in a shared one: those
        older than 10 minutes)."""
        started = time.time()
        found: list[tuple[float, str, int]] = []
        listed: set[str] = set()
        try:
            namespaces = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            if not self.root.is_dir():
                self._lost()
            self._fault("io", ".", exc)
            return
        for ns in namespaces:
            try:
                fans = [e for e in os.scandir(ns.path) if e.is_dir(follow_symlinks=False)]
            except OSError as exc:
                self._fault("io", ns.name, exc)
                continue
            for fan in fans:
                rel_dir = f"{ns.name}/{fan.name}"
                try:
                    mtime = fan.stat(follow_symlinks=False).st_mtime_ns
                except OSError:
                    continue
                if self._dir_mtime.get(rel_dir) == mtime:
                    continue
                if self._list(rel_dir, fan.path, started, found):
                    listed.add(rel_dir + "/")
                    # NOTE: a folder changed within the last second may change again within the same clock
                    # tick, keeping its mtime: it is listed again next time (git's "racy" rule)
                    self._dir_mtime[rel_dir] = mtime if started - mtime / 1e9 > 1.0 else -1
        found.sort()
        present = {rel for _, rel, _ in found}
        with self._lock:
            for rel in [r for r in self._index if r not in present and r[:r.rindex("/") + 1] in listed]:
                self._bytes -= self._index.pop(rel)
            for _, rel, size in found:
                if rel not in self._index:        # known ones keep their place (this process's own use)
                    self._index[rel] = size
                    self._bytes += size
        self._evict()

    def _list(self, rel_dir: str, path: str, now: float, found: list[tuple[float, str, int]]) -> bool:
        try:
            entries = list(os.scandir(path))
        except OSError as exc:
            self._fault("io", rel_dir, exc)
            return False
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if e.name.startswith("."):
                if not self.shared or now - st.st_mtime > _STALE_TMP_S:
                    _unlink(e.path)
            elif e.name.endswith(".kv") and stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, f"{rel_dir}/{e.name}", st.st_size))
        return True

    # -- files (I/O threads) ----------------------------------------------------------------------
    def write(self, header: Header, payload: memoryview) -> int:
        """Stores one block (atomically: temporary file, then rename); the bytes written, 0 if it was not
        (a fault, counted; or a block larger than the bound)."""
        rel = self._rel(header.block_hash)
        head = header.encode()
        size = len(head) + len(payload)
        if size > self.max_bytes:
            return 0
        path = self.root / rel
        tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self._mkdirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, [head, payload])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(str(tmp))
            self._fault("nospace" if exc.errno in _NOSPACE else "io", rel, exc)
            return 0
        with self._lock:
            old = self._index.pop(rel, None)
            self._bytes += size - (old or 0)
            self._index[rel] = size
        self._evict()
        return size

    def _mkdirs(self, folder: Path) -> None:
        """The namespace and fan-out folders (0700). A shared root is never made again once gone (it may be
        an unmounted volume: files would go to the mount point); a local one is."""
        if folder.is_dir():
            return
        if not self.root.is_dir():
            self._lost()
            if self.shared:
                raise FileNotFoundError(errno.ENOENT, "the shared KV tier directory is gone", str(self.root))
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.parent.mkdir(mode=0o700, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)

    def _evict(self) -> None:
        """Least recently used files out until the bound holds."""
        victims = []
        with self._lock:
            while self._bytes > self.max_bytes and self._index:
                rel, size = self._index.popitem(last=False)
                self._bytes -= size
                victims.append(rel)
        for rel in victims:
            _unlink(str(self.root / rel))
            self.evicted_files += 1

    def read(self, block_hash: bytes, num_tokens: int, out: memoryview) -> Header | None:
        """Reads one block's payload into `out` (exactly its size); its header if the file is whole and is the
        block asked for (namespace, hash, size, checksum), else None (a miss; the fault counted)."""
        rel = self._rel(block_hash)
        path = self.root / rel
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(header_bytes(num_tokens))
                header = decode_header(head)
                if header.namespace.hex() != self.ns or header.block_hash != block_hash or \
                        len(header.token_ids) != num_tokens:
                    self._reject(rel, "foreign", "another block in this file")
                    return None
                if header.payload_bytes != len(out) or f.readinto(out) != len(out) or f.read(1):
                    self._reject(rel, "corrupt", "size does not match")
                    return None
        except FileNotFoundError as exc:
            if rel in self._index:                  # the index named it: deleted behind our back
                self._drop(rel)
                self._fault("missing", rel, exc)
                if not self.root.is_dir():
                    self._lost()
            return None
        except BadBlockFile as exc:
            self._reject(rel, "corrupt", exc)
            return None
        except OSError as exc:
            self._fault("io", rel, exc)
            return None
        if checksum(out) != header.digest:
            self._reject(rel, "corrupt", "checksum does not match")
            return None
        self.touch(block_hash)
        try:
            os.utime(path)              # the LRU order, for a restart and for the other replicas
        except OSError:
            pass
        return header

    def reject(self, block_hash: bytes, why: str) -> None:
        """The caller found the file is not its block (other tokens or parent under this hash)."""
        self._reject(self._rel(block_hash), "foreign", why)

    def _reject(self, rel: str, kind: str, why: object) -> None:
        self._fault(kind, rel, why)
        self._drop(rel)
        _unlink(str(self.root / rel))

    def delete(self, block_hash: bytes) -> bool:
        rel = self._rel(block_hash)
        self._drop(rel)
        return _unlink(str(self.root / rel))


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "write returned nothing")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


__all__ = ["DiskBackend", "prepare_root"]
