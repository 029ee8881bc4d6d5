"""An on-disk cache of what a start-up computes from a model file: its config, its tokenizer
and the weights as the model holds them after loading (a GGUF's blocks repacked into the
kernels' panels, bf16 panels, float32 norms), so that the second start of the same file
reads them into place instead of parsing and repacking again (issue 27: the parse, the
tokenizer build and the dequantization took ~15 s of a 135M model's start).

Where: $AIOENGINE_CACHE_DIR, else $XDG_CACHE_HOME/aioengine, else ~/.cache/aioengine (the
C kernels' builds live beside it, under kernels/), in `weights/` and `tokenizer/`.

Keyed by content, not by name: an entry's name is the sha256 of the model file's bytes
(0.13 s for the bundled 98 MB file; remembered per file identity in `digests/`), what
the entry holds (`kind`, e.g. the float32 weight stream, or the tokenizer with the
transformers version that built it) and FORMAT_VERSION.
A file edited in place, copied elsewhere or replaced under the same name never meets a
stale entry.

Safe against a partial write and a damaged file: an entry is a directory built under a
temporary name and renamed into place whole (os.rename of a directory is atomic; a second
process that loses the race keeps the winner's entry), and its manifest.json lists every
file's size and xxh3_128 digest, checked before anything is read (0.03 s per 100 MB).
An entry that fails the check is removed and rebuilt. A cache that cannot be written
(read-only home, full disk) only logs: the start-up goes on without it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from aioengine import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Bump when what an entry contains, or how it is laid out, changes.
FORMAT_VERSION = 1
CACHE_DIR_ENV = "AIOENGINE_CACHE_DIR"
MANIFEST = "manifest.json"
_CHUNK = 8 << 20
_SETTLE_S = 2.0  # a file changed more recently than this is hashed at every start
_MAX_DIGESTS = 256  # remembered file digests (64 bytes each), the newest kept

_digest_memo: dict[tuple[str, int, int, int, int, int], str] = {}
_memo_lock = threading.Lock()


class CacheEntryError(OSError):
    """A cache entry is missing a file, or a file's size or digest is not its manifest's."""


def cache_root() -> Path:
    """The start-up cache's root: envs.cache_root() ($AIOENGINE_CACHE_DIR, else
    $XDG_CACHE_HOME/aioengine, else ~/.cache/aioengine)."""
    return envs.cache_root()


def file_digest(path: str) -> str:
    """sha256 of a file's bytes: the content key of everything cached from it. Memoized by
    the file's identity (`_identity`: path, device, inode, size, mtime and ctime in ns), in
    the process and on disk (`digests/`), so a warm start does not read the whole file
    (4.7 GB for an 8B Q4_K_M: ~5 s). A write to the file moves its ctime, so an edited file
    is hashed again; a file changed in the last _SETTLE_S is not remembered on disk, since
    a write within the same timestamp tick (ms) would not move it (ccache's rule)."""
    identity = _identity(path)
    with _memo_lock:
        if identity in _digest_memo:
            return _digest_memo[identity]
    memo = cache_root() / "digests" / hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    digest = _read_digest(memo)
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        if time.time() - max(identity[4], identity[5]) / 1e9 > _SETTLE_S:
            _write_digest(memo, digest)
    with _memo_lock:
        _digest_memo[identity] = digest
    return digest


def _identity(path: str) -> tuple[str, int, int, int, int, int]:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns)


def _read_digest(memo: Path) -> str | None:
    try:
        digest = memo.read_text().strip()
    except OSError:
        return None
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None


def _write_digest(memo: Path, digest: str) -> None:
    """Written whole or not at all (a temp file renamed); a cache that cannot be written
    only costs the next start a hash."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
        memos = sorted(memo.parent.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        for stale in memos[:-_MAX_DIGESTS]:
            stale.unlink(missing_ok=True)
    except OSError as e:
        logger.debug("cannot remember the digest of a model file in %s: %s", memo.parent, e)


def entry_name(file_sha256: str, kind: str) -> str:
    """The directory name of the entry of `kind` for the file of that digest."""
    ident = json.dumps([file_sha256, kind, FORMAT_VERSION]).encode()
    return hashlib.sha256(ident).hexdigest()[:32]


def _checksum(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(entry: Path, kind: str) -> None:
    files = {p.name: {"size": p.stat().st_size, "xxh3_128": _checksum(p)}
             for p in sorted(entry.iterdir()) if p.is_file() and p.name != MANIFEST}
    with open(entry / MANIFEST, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "kind": kind, "files": files}, f)


def verify_entry(entry: Path) -> None:
    """Raises CacheEntryError unless every file the manifest lists is there, whole."""
    try:
        with open(entry / MANIFEST) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CacheEntryError(f"{entry}: no readable manifest ({e})") from e
    if manifest.get("format_version") != FORMAT_VERSION or not files:
        raise CacheEntryError(f"{entry}: manifest of another format")
    for name, want in files.items():
        path = entry / name
        if not path.is_file() or path.stat().st_size != want["size"]:
            raise CacheEntryError(f"{entry}: {name} is missing or has the wrong size")
        if _checksum(path) != want["xxh3_128"]:
            raise CacheEntryError(f"{entry}: {name} does not match its digest")


def lookup(section: str, name: str) -> Path | None:
    """The verified entry directory, or None (absent; a damaged one is removed)."""
    entry = cache_root() / section / name
    if not entry.is_dir():
        return None
    try:
        verify_entry(entry)
    except CacheEntryError as e:
        logger.warning("start-up cache entry is damaged, rebuilding it: %s", e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    os.utime(entry)  # most recently used: the last one _prune would drop
    return entry


# Entries kept per section, the most recently used; older ones are removed as one is added.
MAX_ENTRIES = 4


def _prune(parent: Path, keep: int = MAX_ENTRIES) -> None:
    entries = sorted((p for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def store(section: str, name: str, kind: str, write: Callable[[Path], None]) -> Path | None:
    """Builds an entry: `write(tmp_dir)` fills a temporary directory, the manifest is added
    and the directory renamed into place. Returns the entry, or None where the cache could
    not be written (logged; the caller already holds what it computed)."""
    parent = cache_root() / section
    tmp: str | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=parent)
        write(Path(tmp))
        _write_manifest(Path(tmp), kind)
        final = parent / name
        try:
            os.rename(tmp, final)
        except OSError:  # another process stored it first (or a damaged one is in the way)
            if lookup(section, name) is None:
                os.rename(tmp, final)
        _prune(parent)
        return final
    except OSError as e:
        logger.warning("cannot write the start-up cache under %s: %s", parent, e)
        return None
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# ---- tensors ---------------------------------------------------------------------------

TENSORS_FILE = "tensors.safetensors"


def save_tensors(entry: Path, tensors: dict[str, "torch.Tensor"],
                 metadata: dict[str, str]) -> None:
    """Writes `tensors` (contiguous CPU tensors) and string `metadata` into an entry being
    built (`store`'s write callback)."""
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in tensors.items()}, str(entry / TENSORS_FILE),
              metadata=metadata)


def read_metadata(entry: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(entry / TENSORS_FILE), framework="pt") as f:
        return dict(f.metadata() or {})


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "U8": "uint8",
                       "I8": "int8", "I32": "int32", "I64": "int64"}


def iter_tensors(entry: Path, prefix: str) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name without `prefix`, tensor) for every tensor of a verified entry whose name
    starts with `prefix`: views of one mapping of the file, mapped with MAP_POPULATE (its
    pages are in the page cache after the digest check: one call maps them all, where
    faulting them in 4 KB at a time as the model copies them took 0.6 s of 1.6 here). The
    mapping is copy-on-write and lives as long as any view."""
    import mmap
    import struct

    import torch

    path = entry / TENSORS_FILE
    populate = getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE | populate,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    (header_len,) = struct.unpack("<Q", mapping[:8])
    header = json.loads(mapping[8:8 + header_len])
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__" or not name.startswith(prefix):
            continue
        start, end = info["data_offsets"]
        dtype = getattr(torch, _SAFETENSORS_DTYPES[info["dtype"]])
        raw = torch.frombuffer(mapping, dtype=torch.uint8, offset=base + start,
                               count=end - start) if end > start else torch.empty(0, dtype=torch.uint8)
        yield name[len(prefix):], raw.view(dtype).view(info["shape"])


def write_tensors(path: Path, tensors: list[tuple[str, "torch.Tensor"]],
                  metadata: dict[str, str]) -> None:
    """Writes contiguous CPU tensors as a safetensors file, streaming each tensor's bytes
    from where it lives (safetensors' save_file serializes the whole file in memory first:
    a second copy of a model)."""
    import struct

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    names = {str(v): k for k, v in _torch_dtypes().items()}
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            if t.numel():
                f.write(memoryview(t.contiguous().view(-1).view(torch_uint8()).numpy()))


def torch_uint8() -> "torch.dtype":
    import torch

    return torch.uint8


def _torch_dtypes() -> dict[str, "torch.dtype"]:
    import torch

    return {k: getattr(torch, v) for k, v in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of an entry's safetensors file lies."""
    dtype: "torch.dtype"
    shape: tuple[int, ...]
    offset: int  # from the file's start
    nbytes: int


def tensor_index(entry: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(name -> TensorInfo, metadata) of a verified entry's tensors file, from its header
    alone (nothing else read)."""
    import struct

    with open(entry / TENSORS_FILE, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    dtypes = _torch_dtypes()
    base = 8 + header_len
    index = {name: TensorInfo(dtypes[info["dtype"]], tuple(info["shape"]),
                              base + info["data_offsets"][0],
                              info["data_offsets"][1] - info["data_offsets"][0])
             for name, info in header.items() if name != "__metadata__"}
    return index, dict(header.get("__metadata__") or {})


def read_tensor_into(entry: Path, info: TensorInfo, out: "torch.Tensor") -> "torch.Tensor":
    """Reads one tensor straight into `out` (contiguous, of its dtype and shape) with one
    positioned read: the bytes go from the page cache to their place, nothing mapped."""
    if out.dtype != info.dtype or tuple(out.shape) != info.shape or not out.is_contiguous():
        raise ValueError(f"cached tensor {info.dtype}{list(info.shape)} does not fit "
                         f"{out.dtype}{list(out.shape)}")
    if info.nbytes == 0:
        return out
    view = memoryview(out.view(-1).view(torch_uint8()).numpy())
    fd = os.open(entry / TENSORS_FILE, os.O_RDONLY)
    try:
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n <= 0:
                raise CacheEntryError(f"{entry}: short read of a cached tensor")
            done += n
    finally:
        os.close(fd)
    return out


# ---- tokenizer -------------------------------------------------------------------------


def cached_tokenizer(gguf_path: str, build: Callable[[], Any]) -> Any:
    """The tokenizer a GGUF describes: read from its entry (tokenizer.json and friends, as
    transformers' save_pretrained writes them: 0.2 s), else `build()` (transformers parses
    the whole file again: ~6 s for SmolLM2's 49k-token vocabulary) and stored. Keyed by
    the file's bytes and the transformers version that built it."""
    import transformers
    from transformers import AutoTokenizer

    kind = f"tokenizer:transformers-{transformers.__version__}"
    name = entry_name(file_digest(gguf_path), kind)
    entry = lookup("tokenizer", name)
    if entry is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(entry), trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("cached tokenizer %s unreadable, rebuilding it: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            tokenizer.name_or_path = os.path.dirname(gguf_path)  # as the GGUF build names it
            logger.debug("tokenizer read from the start-up cache (%s)", entry)
            return tokenizer
    tokenizer = build()
    store("tokenizer", name, kind, lambda tmp: tokenizer.save_pretrained(str(tmp)))
    return tokenizer
