"""DiskBackend: block files in a directory, bounded in bytes, LRU; a bad, missing or foreign file is a miss.

Plain bytes, no torch, no engine: milliseconds each. The engine's side is test_tier_engine.py."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.kv.tier.disk import DiskBackend
from engine.kv.tier.format import FIXED_BYTES, Header, checksum

NS = b"n" * 16
TOKENS = 4
PAYLOAD = 1000
FILE = FIXED_BYTES + 8 * TOKENS + PAYLOAD          # one block file's bytes


def key(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int, ns: bytes = NS, payload: bytes | None = None) -> tuple[Header, memoryview]:
    data = payload if payload is not None else bytes([i % 251]) * PAYLOAD
    return Header(ns, key(i), key(200 + i), tuple(range(i, i + TOKENS)), len(data), checksum(data)), memoryview(data)


def read(backend: DiskBackend, i: int) -> bytes | None:
    out = bytearray(PAYLOAD)
    header = backend.read(key(i), TOKENS, memoryview(out))
    return bytes(out) if header is not None else None


def path_of(root: Path, i: int, ns: bytes = NS) -> Path:
    h = key(i).hex()
    return root / ns.hex() / h[:2] / f"{h}.kv"


def files(root: Path) -> set[int]:
    return {bytes.fromhex(p.stem)[0] for p in root.rglob("*.kv")}


def test_a_block_comes_back_whole_and_private(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    backend = DiskBackend(root, NS, 10 * FILE)
    header, payload = block(1)
    assert backend.write(header, payload) == FILE
    assert backend.contains(key(1)) and not backend.contains(key(2))
    assert read(backend, 1) == bytes(payload)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for folder in (root / NS.hex(), path_of(root, 1).parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(path_of(root, 1).stat().st_mode) == 0o600
    assert not [p for p in root.rglob(".*")]                # no temporary file left
    assert (backend.num_files, backend.num_bytes) == (1, FILE)


def test_an_existing_directory_open_to_others_is_closed(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    DiskBackend(root, NS, FILE)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_least_recently_used_files_go_first_and_the_bound_holds(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path, NS, 3 * FILE)
    for i in (1, 2, 3):
        backend.write(*block(i))
    assert read(backend, 1) is not None                      # 1 is now the most recently used: 2 is the oldest
    backend.write(*block(4))
    assert files(tmp_path) == {1, 3, 4}
    backend.write(*block(5))
    assert files(tmp_path) == {1, 4, 5}
    assert backend.num_bytes == 3 * FILE and backend.evicted_files == 2
    assert read(backend, 2) is None and backend.faults["missing"] == 0   # evicted: not in the index, no fault


def test_the_lru_order_outlives_the_process(tmp_path: Path) -> None:
    first = DiskBackend(tmp_path, NS, 3 * FILE)
    for i in (1, 2, 3):
        first.write(*block(i))
        os.utime(path_of(tmp_path, i), (1000.0 + i, 1000.0 + i))     # distinct ages at the clock's resolution
    assert read(first, 1) is not None                        # a hit refreshes the file's time
    again = DiskBackend(tmp_path, NS, 3 * FILE)              # a restart: the index is the directory's
    assert again.num_files == 3 and again.num_bytes == 3 * FILE
    again.write(*block(4))
    assert files(tmp_path) == {1, 3, 4}                       # 2 was the least recently used


def test_a_restart_sweeps_temporary_files_and_sees_other_namespaces_in_the_bound(tmp_path: Path) -> None:
    first = DiskBackend(tmp_path, NS, 10 * FILE)
    first.write(*block(1))
    other = DiskBackend(tmp_path, b"o" * 16, 10 * FILE)     # another model or KV format in the same directory
    other.write(*block(2, ns=b"o" * 16))
    leftover = path_of(tmp_path, 1).parent / ".torn.tmp"
    leftover.write_bytes(b"half a block")
    again = DiskBackend(tmp_path, NS, 10 * FILE)
    assert not leftover.exists()
    assert again.num_files == 2                              # both count towards the bound
    assert again.contains(key(1)) and not again.contains(key(2))     # only its own are found


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "header"])
def test_a_damaged_file_is_a_miss_counted_and_removed(tmp_path: Path, damage: str) -> None:
    backend = DiskBackend(tmp_path, NS, 10 * FILE)
    backend.write(*block(1))
    path = path_of(tmp_path, 1)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-10] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "extend":
        raw += b"\0"
    else:
        raw[:4] = b"XXXX"
    path.write_bytes(bytes(raw))
    assert read(backend, 1) is None
    assert backend.faults["corrupt"] == 1
    assert not path.exists() and not backend.contains(key(1))


def test_a_foreign_file_under_the_name_is_a_miss(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path, NS, 10 * FILE)
    backend.write(*block(1))
    backend.write(*block(2))
    shutil.copy(path_of(tmp_path, 2), path_of(tmp_path, 1))    # block 2's file under block 1's name
    assert read(backend, 1) is None
    assert backend.faults["foreign"] == 1 and not path_of(tmp_path, 1).exists()
    assert read(backend, 2) is not None


def test_a_deleted_file_and_a_vanished_directory_are_misses(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    backend = DiskBackend(root, NS, 10 * FILE)
    backend.write(*block(1))
    backend.write(*block(2))
    path_of(root, 1).unlink()
    assert read(backend, 1) is None and backend.faults["missing"] == 1
    shutil.rmtree(root)
    assert read(backend, 2) is None and backend.faults["missing"] == 2
    assert backend.write(*block(3)) == FILE                   # a local directory is made again
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and read(backend, 3) is not None
    assert backend.num_files == 1                            # what went with the directory left the index


def test_a_shared_directory_that_is_gone_is_not_made_again(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    backend = DiskBackend(root, NS, 10 * FILE, shared=True)
    backend.write(*block(1))
    root.rename(tmp_path / "unmounted")
    assert backend.write(*block(2)) == 0 and backend.faults["io"] == 1
    assert not root.exists()                                 # an unmounted volume's mount point stays empty
    assert not backend.contains(key(1)) and backend.num_bytes == 0   # what was in it is gone from the index


def test_a_vanished_shared_directory_empties_the_index_at_the_first_miss(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    backend = DiskBackend(root, NS, 10 * FILE, shared=True)
    backend.write(*block(1))
    backend.write(*block(2))
    root.rename(tmp_path / "unmounted")
    assert read(backend, 1) is None and backend.faults["missing"] == 1
    assert not backend.contains(key(2)) and backend.num_files == 0   # no fault per file: one for the directory
    (tmp_path / "unmounted").rename(root)                  # the volume is back: the next scan finds its files
    backend.scan()
    assert backend.contains(key(2)) and read(backend, 2) is not None


def test_a_shared_directory_shows_other_writers_blocks_after_a_scan(tmp_path: Path) -> None:
    a = DiskBackend(tmp_path, NS, 10 * FILE, shared=True, name="shared")
    b = DiskBackend(tmp_path, NS, 10 * FILE, shared=True, name="shared")
    a.write(*block(1))
    assert not b.contains(key(1))
    b.scan()
    assert b.contains(key(1)) and read(b, 1) is not None
    a.delete(key(1))
    b.scan()
    assert not b.contains(key(1)) and b.num_bytes == 0


def test_a_full_disk_is_a_fault_not_a_file(tmp_path: Path) -> None:
    """A real short write: the kernel refuses the file past RLIMIT_FSIZE (EFBIG, counted as no space) in a child
    process, where nothing else is written; nothing half-written stays, the index does not name it."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parents[4])!r})
        from tests.engine.kv.tier.test_disk import DiskBackend, NS, FILE, block, files, read
        root = Path({str(tmp_path)!r})
        backend = DiskBackend(root, NS, 10 * FILE)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE // 2}, resource.RLIM_INFINITY))
        assert backend.write(*block(1)) == 0
        assert backend.faults["nospace"] == 1, backend.faults
        assert not backend.contains(block(1)[0].block_hash) and read(backend, 1) is None
        assert not list(root.rglob("*.kv")) and not list(root.rglob(".*")), list(root.rglob("*"))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_block_larger_than_the_bound_is_not_written(tmp_path: Path) -> None:
    backend = DiskBackend(tmp_path, NS, FILE - 1)
    assert backend.write(*block(1)) == 0
    assert files(tmp_path) == set() and backend.faults == dict.fromkeys(backend.faults, 0)


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(ValueError, match="belongs to uid 12345"):
        DiskBackend(root, NS, FILE)


def test_scanning_a_shared_directory_lists_only_changed_folders(tmp_path: Path) -> None:
    a = DiskBackend(tmp_path, NS, 100 * FILE, shared=True)
    for i in range(1, 6):
        a.write(*block(i))
    old = time.time() - 10
    for folder in (tmp_path / NS.hex()).iterdir():
        os.utime(folder, (old, old))                          # settled: older than the racy second
    b = DiskBackend(tmp_path, NS, 100 * FILE, shared=True)
    assert b.num_files == 5
    listed: list[str] = []
    original = b._list
    b._list = lambda rel, path, now, found: listed.append(rel) or original(rel, path, now, found)  # type: ignore
    a.write(*block(7))
    b.scan()
    assert listed == [f"{NS.hex()}/{key(7).hex()[:2]}"] and b.contains(key(7))
