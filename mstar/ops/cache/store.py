"""The on-disk store under the kernel-cache root: entries that are safe with concurrent processes.

Layout (root = MSTAR_KERNEL_CACHE, default ./kernel_cache):

    <root>/cute/<kernel>/<key>/meta.json      one CuTe kernel compiled ahead of time (see cute.py)
    <root>/cute/<kernel>/<key>/kernel.so
    <root>/triton/  <root>/inductor/  <root>/flashinfer/  <root>/torch_compile/
                                              the toolchains' own caches (see toolchains.py)

An entry is a directory of payload files plus `meta.json`, which is written last and records
the key, the fields it was computed from and a SHA-256 and size per payload file. A reader
trusts an entry only if meta.json parses, names the key it looked for and every file matches
its recorded size and hash; anything else (a half-written entry, a truncated or edited file,
an entry from another key) is a miss, and the builder replaces it rather than loading it.

Writers take an exclusive lock (`<entry>.lock`, flock) for the entry, re-check under the lock
(another process may have just built it), remove a stale meta.json first, write each file to a
temporary name in the same directory and rename it into place, and write meta.json the same
way, last. Readers take no lock: renames are atomic, and a reader that races a rebuild sees a
hash mismatch (a miss) and retries under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mstar import knobs

META = "meta.json"
FORMAT = 1  # bump when the entry layout changes; older entries are then misses
KEEP = {"README.md"}  # committed files in the default root that `clear` leaves alone


def enabled() -> bool:
    return not knobs.value("MSTAR_KERNEL_CACHE_DISABLE")


def root() -> Path:
    """The cache root: MSTAR_KERNEL_CACHE, or ./kernel_cache in the working directory (absolute)."""
    raw = knobs.value("MSTAR_KERNEL_CACHE")
    return Path(raw).expanduser().resolve() if raw else (Path.cwd() / "kernel_cache").resolve()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Entry:
    dir: Path
    meta: dict

    @property
    def key(self) -> str:
        return self.meta["key"]

    def file(self, name: str) -> Path:
        return self.dir / name

    def size(self) -> int:
        return sum(v["size"] for v in self.meta.get("files", {}).values())


def read_entry(entry_dir: Path, key: str | None = None) -> Entry | None:
    """The entry at `entry_dir` if it is complete and intact (and has `key`, if given), else None."""
    try:
        meta = json.loads((entry_dir / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        return None
    if key is not None and meta.get("key") != key:
        return None
    for name, info in meta["files"].items():
        p = entry_dir / name
        try:
            if p.stat().st_size != info["size"] or sha256_file(p) != info["sha256"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    return Entry(entry_dir, meta)


@contextlib.contextmanager
def locked(entry_dir: Path, timeout_s: float = 600.0) -> Iterator[None]:
    """Exclusive lock for building `entry_dir` (a sibling `<name>.lock` file, flock)."""
    entry_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = entry_dir.parent / (entry_dir.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kernel cache: waited {timeout_s:.0f}s for {lock_path}") from None
                time.sleep(0.05)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _atomic_write(dest: Path, data: bytes) -> None:
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)


def write_entry(entry_dir: Path, files: dict[str, Path], meta: dict) -> Entry:
    """Install payload `files` ({name in entry: source path}) and then meta.json. Call under `locked`."""
    entry_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (entry_dir / META).unlink()  # a stale entry stops being valid before its files change
    recorded = {}
    for name, src in files.items():
        data = Path(src).read_bytes()
        _atomic_write(entry_dir / name, data)
        recorded[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for stray in entry_dir.iterdir():  # files of an older build that this one does not have
        if stray.name not in recorded and stray.name != META and stray.is_file():
            stray.unlink()
    full = dict(meta, format=FORMAT, files=recorded,
                created=meta.get("created") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    _atomic_write(entry_dir / META, json.dumps(full, indent=1, sort_keys=True).encode())
    return Entry(entry_dir, full)


# --- inspection and maintenance (the CLI) ----------------------------------------------------
def iter_entries(base: Path | None = None) -> Iterator[Entry | tuple[Path, str]]:
    """Every entry directory under <root>/cute: an Entry, or (dir, 'corrupt') for a broken one."""
    base = (base or root()) / "cute"
    if not base.is_dir():
        return
    for kdir in sorted(p for p in base.iterdir() if p.is_dir()):
        for edir in sorted(p for p in kdir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            e = read_entry(edir)
            yield e if e is not None else (edir, "corrupt")


def dir_size(path: Path) -> tuple[int, int]:
    """(bytes, files) under path."""
    total = n = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
                n += 1
    return total, n


def clear(base: Path | None = None, kinds: list[str] | None = None) -> list[Path]:
    """Remove the cache contents (all of it, or the named top-level kinds); keep README.md."""
    base = base or root()
    removed = []
    if not base.is_dir():
        return removed
    for p in sorted(base.iterdir()):
        if p.name in KEEP or (kinds and p.name not in kinds):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p)
    return removed


def _skip_in_archive(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(".lock") or name.startswith(".tmp-") or name in KEEP


def export_archive(dest: Path, base: Path | None = None, kinds: list[str] | None = None) -> tuple[int, int]:
    """Write the cache (or the named kinds) as one tar.gz; only intact CuTe entries go in.
    Returns (files, bytes)."""
    base = base or root()
    dest = Path(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    nfiles = nbytes = 0
    with tarfile.open(tmp, "w:gz") as tar:
        tops = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) if base.is_dir() else []
        for top in tops:
            if kinds and top.name not in kinds:
                continue
            if top.name == "cute":
                for e in iter_entries(base):
                    if isinstance(e, tuple):
                        continue
                    for name in list(e.meta["files"]) + [META]:
                        p = e.dir / name
                        tar.add(p, arcname=str(p.relative_to(base)), recursive=False)
                        nfiles += 1
                        nbytes += p.stat().st_size
                continue
            for dirpath, _, names in os.walk(top):
                for name in sorted(names):
                    p = Path(dirpath) / name
                    rel = str(p.relative_to(base))
                    if _skip_in_archive(rel) or p.is_symlink():
                        continue
                    tar.add(p, arcname=rel, recursive=False)
                    nfiles += 1
                    nbytes += p.stat().st_size
    os.replace(tmp, dest)
    return nfiles, nbytes


def import_archive(src: Path, base: Path | None = None) -> tuple[int, int]:
    """Unpack an archive made by `export_archive` into the root. CuTe entries are installed
    whole (meta.json last, under the entry lock) and only if intact; other files are copied
    in place. Returns (cute entries installed, other files)."""
    import tempfile

    base = base or root()
    base.mkdir(parents=True, exist_ok=True)
    n_entries = n_files = 0
    with tempfile.TemporaryDirectory(dir=base, prefix=".tmp-import-") as td:
        tdp = Path(td)
        with tarfile.open(src, "r:*") as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                    raise ValueError(f"{src}: refusing archive member {m.name!r}")
                members.append(m)
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links, devices, odd modes too
                tar.extractall(tdp, members=members, filter="data")
            else:
                tar.extractall(tdp, members=members)
        for e in iter_entries(tdp):
            if isinstance(e, tuple):
                continue
            dest = base / e.dir.relative_to(tdp)
            with locked(dest):
                if read_entry(dest, e.key) is None:
                    write_entry(dest, {n: e.dir / n for n in e.meta["files"]},
                                {k: v for k, v in e.meta.items() if k not in ("files", "format")})
                    n_entries += 1
        for top in sorted(p for p in tdp.iterdir() if p.is_dir() and p.name != "cute"):
            for dirpath, _, names in os.walk(top):
                for name in names:
                    p = Path(dirpath) / name
                    dest = base / p.relative_to(tdp)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    _atomic_write(dest, p.read_bytes())
                    n_files += 1
    return n_entries, n_files
