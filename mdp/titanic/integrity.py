"""Start-up checks of a Titanic SQLite store that SQLite itself leaves out: :func:`check_wal` (a WAL
SQLite would silently cut short, or one gone that held commits) and :func:`check_and_repair` (``PRAGMA
integrity_check``: ``quick_check`` does not compare indexes with their table; damage confined to
Titanic's indexes is repaired by rebuilding them, as an index holds nothing its table does not)."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
import sqlite3
import struct
from typing import Optional

from mdp.errors import StoreError

_WAL_MAGIC = {0x377F0682: "<", 0x377F0683: ">"}  # checksums little- or big-endian words
_WAL_HEADER = 32
_FRAME_HEADER = 24
#: What the lock file says while a store is open (a run that did not close it leaves it).
OPEN_MARK = b"open\n"


def _checksum(data: bytes, order: str, s1: int = 0, s2: int = 0) -> tuple[int, int]:
    """SQLite's WAL checksum of *data* (a multiple of 8 bytes), continuing (s1, s2)."""
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    for i in range(0, len(words), 2):
        s1 = (s1 + words[i] + s2) & mask
        s2 = (s2 + words[i + 1] + s1) & mask
    return s1, s2


def wal_damage(wal: bytes) -> Optional[str]:
    """Why SQLite would drop committed transactions of the WAL content *wal*, or None.  SQLite reads frames
    up to the first that fails its cumulative checksum.  The last transaction torn by a crash (its frames
    reach the disk in any order, its commit frame perhaps first) was never acknowledged: damage is a broken
    frame followed by the commit of a later transaction of the same WAL generation."""
    if len(wal) < _WAL_HEADER:
        return None  # SQLite takes it as empty
    magic, _, pageSize, _, salt1, salt2, c1, c2 = struct.unpack(">8I", wal[:_WAL_HEADER])
    order = _WAL_MAGIC.get(magic)
    if order is None or pageSize < 512 or pageSize & (pageSize - 1):
        return None  # not a WAL header: SQLite takes it as empty
    size = _FRAME_HEADER + pageSize
    heads = [struct.unpack_from(">6I", wal, at) for at in range(_WAL_HEADER, len(wal) - size + 1, size)]
    sums = _checksum(wal[:24], order)
    if sums != (c1, c2):
        return f"its header checksum is wrong ({len(heads)} frames would be ignored)" if heads else None
    broken = _first_broken(wal, order, size, heads, (salt1, salt2), sums)
    if broken is None or not _later_commit(heads[broken:], (salt1, salt2)):
        return None
    return (f"frame {broken} (byte {_WAL_HEADER + broken * size}) is damaged and a later "
            "committed transaction follows it")


def _later_commit(heads: list[tuple[int, ...]], salts: tuple[int, int]) -> bool:
    """Whether the frame *heads* from a broken one hold a commit of this generation
    after the one ending its transaction (and the copies of it that pad a sector)."""
    ours = [(page, commit) for page, commit, s1, s2, _, _ in heads if (s1, s2) == salts]
    ends = [n for n, (_, commit) in enumerate(ours) if commit]
    later = itertools.dropwhile(ours[ends[0]].__eq__, ours[ends[0] + 1:]) if ends else ()
    return any(commit for _, commit in later)


def _first_broken(wal: bytes, order: str, size: int, heads: list[tuple[int, ...]],
                  salts: tuple[int, int], sums: tuple[int, int]) -> Optional[int]:
    """The first frame SQLite does not read: of an earlier generation, or failing its checksum."""
    for n, (_, _, s1, s2, f1, f2) in enumerate(heads):
        at = _WAL_HEADER + n * size  # the checksum covers the page number, commit mark and page
        if (s1, s2) != salts or (sums := _checksum(
                wal[at:at + 8] + wal[at + _FRAME_HEADER:at + size], order, *sums)) != (f1, f2):
            return n
    return None


def check_wal(path: str, mark: bytes) -> None:
    """Refuse to open *path* if its WAL is damaged, or gone although the lock file's
    *mark* says the last run did not close the store (StoreError saying what to do)."""
    wal = path + "-wal"
    lock = path + ".lock"
    try:
        file = open(wal, "rb")
    except FileNotFoundError:
        if mark == OPEN_MARK and os.path.exists(path):
            raise StoreError(
                f"Titanic store {path}: its WAL {wal} is missing, but the last run did not "
                f"close the store: requests it acknowledged may be lost. Restore {wal} if "
                f"it was moved. If a SQLite program opened {path} since, it moved them into "
                f"{path} (nothing lost); either way, to start with what {path} holds, delete "
                f"{lock}") from None
        return
    except OSError as e:
        raise StoreError(f"Titanic store {path}: cannot read its WAL {wal}: {e}") from e
    with file, (mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # a WAL may be large
                if os.fstat(file.fileno()).st_size else contextlib.nullcontext(b"")) as content:
        why = wal_damage(content)
    if why is not None:
        raise StoreError(
            f"Titanic store {path}: its WAL {wal} is damaged ({why}); SQLite would drop "
            f"acknowledged requests without a word. Restore {wal} from a backup; to keep "
            f"what SQLite reads of it, open {path} once with sqlite3 and run "
            f"`PRAGMA wal_checkpoint`, then delete {lock}")


_INDEX_PROBLEM = re.compile(r"(missing from index|wrong # of entries in index|"
                            r"non-unique entry in index) (\S+)")


def check_and_repair(db: sqlite3.Connection, path: str) -> list[str]:
    """``PRAGMA integrity_check``: rebuilds the indexes of the requests table that disagree with it (returns
    their names), raises StoreError for any other damage.  An index that misses a row must be rebuilt even
    where the row is the side that changed: SQLite cannot update or delete a row its index misses."""
    problems = [row[0] for row in db.execute("PRAGMA integrity_check")]
    if problems == ["ok"]:
        return []
    indexes = {name for (name,) in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'requests'")}
    found = [match.group(2) for match in map(_INDEX_PROBLEM.search, problems) if match]
    if len(found) < len(problems) or not indexes.issuperset(found):
        raise StoreError(f"Titanic store {path} is damaged: {problems[0]} (of {len(problems)} "
                         "problems); restore it from a backup")
    rebuilt = sorted(set(found))
    for index in rebuilt:
        db.execute(f'REINDEX "{index}"')
    return rebuilt
