"""lowdiff's safetensors files: streaming writer, verifying reader, whole-file checksum.

Every tensor file lowdiff writes is a valid safetensors file (any safetensors reader
can open it) whose ``__metadata__`` also carries:

- ``format = "lowdiff"`` and ``format_version``, so a foreign file is recognised;
- ``kind`` (``"full"``, ``"records"``, ...) and whatever the caller adds;
- ``xxh3``: the xxh3-64 checksum of the *entire* file, computed with these 16 hex digits
  replaced by zeros. Every byte of the file (length prefix, header, padding, data) is
  covered, so any flipped or missing byte is detected.

Tensors are laid out by element size, largest first, so every tensor is naturally
aligned and the data section has no holes (as safetensors requires). The data section
can be prepared in advance as one ``uint8`` buffer (see :func:`plan` and
:func:`view_tensors`): a full checkpoint is staged straight into that layout in shared
memory and written with one write, without building the file in memory twice.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from lowdiff.errors import CorruptCheckpointError, InvalidArgumentError, NewerFormatError
from lowdiff.format.atomic import atomic_open
from lowdiff.format.dtypes import dtype_from_name, dtype_name, itemsize

FORMAT_NAME = "lowdiff"
FORMAT_VERSION = 1


def newer_version_reason(version: object) -> str:
    return (
        f"format version {version} is newer than this lowdiff understands ({FORMAT_VERSION}); "
        "upgrade lowdiff"
    )


_CHECKSUM_KEY = "xxh3"
_PLACEHOLDER = "0" * 16
# A forged length field must not make the reader allocate or parse gigabytes.
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def plan(specs: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[list[TensorEntry], int]:
    """Lay out tensors (largest element size first) and return the entries and data size."""
    items = list(specs)
    names = [n for n, _, _ in items]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("duplicate tensor names in one file")
    # stable sort: callers' order is kept within one element size
    items.sort(key=lambda it: -itemsize(it[1]))
    entries, offset = [], 0
    for name, dtype, shape in items:
        shape_t = tuple(int(s) for s in shape)
        n = 1
        for s in shape_t:
            n *= s
        nbytes = n * itemsize(dtype)
        entries.append(TensorEntry(name, dtype, shape_t, offset, offset + nbytes))
        offset += nbytes
    return entries, offset


def view_tensors(entries: Iterable[TensorEntry], blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy typed views of ``blob`` (a 1-D ``uint8`` tensor) for each entry.

    Entries that lie end to end with one dtype are cut from one typed view by a single
    ``split`` (views made in C++, three to four times faster than a slice and two views
    per entry in Python: every first use of a record slot builds its views)."""
    out: dict[str, torch.Tensor] = {}
    ents = list(entries)
    i, n = 0, len(ents)
    while i < n:
        first, j = ents[i], i + 1
        while j < n and ents[j].dtype == first.dtype and ents[j].start == ents[j - 1].end:
            j += 1
        typed = blob[first.start : ents[j - 1].end].view(first.dtype)
        run = ents[i:j]
        parts = typed.split([e.numel for e in run]) if j - i > 1 else (typed,)
        for e, part in zip(run, parts, strict=True):
            out[e.name] = part if len(e.shape) == 1 else part.view(e.shape)
        i = j
    return out


def pack(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], torch.Tensor]:
    """Copy ``tensors`` into one new ``uint8`` buffer laid out by :func:`plan`."""
    entries, size = plan((n, t.dtype, t.shape) for n, t in tensors.items())
    blob = torch.empty(size, dtype=torch.uint8)
    views = view_tensors(entries, blob)
    for name, t in tensors.items():
        views[name].copy_(t.detach())
    return entries, blob


def _header_bytes(
    entries: Sequence[TensorEntry], metadata: Mapping[str, str], align: int = 8
) -> bytes:
    """The header, padded with spaces so that the data section starts at a multiple of
    ``align`` bytes into the file (after the 8-byte length prefix)."""
    meta = {str(k): str(v) for k, v in metadata.items()}
    meta["format"] = FORMAT_NAME
    meta["format_version"] = str(FORMAT_VERSION)
    meta[_CHECKSUM_KEY] = _PLACEHOLDER
    header: dict[str, object] = {"__metadata__": meta}
    for e in entries:
        header[e.name] = {
            "dtype": dtype_name(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [e.start, e.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-(8 + len(raw)) % align)


def _checksum_field(hexdigest: str) -> bytes:
    return f'"{_CHECKSUM_KEY}":"{hexdigest}"'.encode()


def _as_buffer(blob: torch.Tensor | bytes | bytearray | memoryview) -> memoryview:
    if isinstance(blob, torch.Tensor):
        if blob.dtype != torch.uint8 or blob.dim() != 1 or not blob.is_contiguous():
            raise InvalidArgumentError("data blob must be a contiguous 1-D uint8 tensor")
        return memoryview(blob.numpy()) if blob.numel() else memoryview(b"")  # type: ignore[arg-type]
    return memoryview(blob)


def write(
    path: str | Path,
    entries: Sequence[TensorEntry],
    blob: torch.Tensor | bytes | bytearray | memoryview,
    metadata: Mapping[str, str],
    *,
    progress: Callable[[int], None] | None = None,
    direct: bool = False,
) -> int:
    """Publish a file atomically from a prepared data section; returns its size in bytes.

    ``progress``, when given, is called with the bytes written so far after every chunk of
    :data:`WRITE_CHUNK` bytes (a waiting trainer tells a slow write from a stuck one).

    ``direct=True`` writes a data section of at least :data:`DIRECT_MIN_BYTES` held in
    page-aligned memory (a shared-memory staging buffer) with ``O_DIRECT``: the bytes go
    from that memory to the device without being copied into the page cache, which
    costs the writing process a fraction of the CPU time of a buffered write and leaves
    training's page cache alone. The header is then padded with spaces so that the data
    section starts on a :data:`DIRECT_ALIGN` boundary (still a valid safetensors file).
    Where the file system refuses ``O_DIRECT`` (tmpfs, some network file systems) or the
    memory is not aligned, the file is written the buffered way. The file is the same
    either way but for that padding, and it is fsynced before it is published.

    Example:
        >>> entries, blob = pack({"w": torch.zeros(3)})  # doctest: +SKIP
        >>> write(d / "x.safetensors", entries, blob, {"kind": "full"})  # doctest: +SKIP
    """
    data = _as_buffer(blob)
    size = entries[-1].end if entries else 0
    if data.nbytes != size:
        raise InvalidArgumentError(f"data blob has {data.nbytes} bytes, layout needs {size}")
    direct = direct and _direct_source(blob, data)
    header = _header_bytes(entries, metadata, DIRECT_ALIGN if direct else 8)
    prefix = struct.pack("<Q", len(header))
    h = xxhash.xxh3_64()
    h.update(prefix)
    h.update(header)
    h.update(data)
    final_header = header.replace(_checksum_field(_PLACEHOLDER), _checksum_field(h.hexdigest()), 1)
    parts = [memoryview(prefix), memoryview(final_header), data.cast("B") if data.nbytes else data]
    with atomic_open(path) as f:
        if not (direct and _write_direct(f.name, prefix + final_header, data, progress)):
            _writev_all(f.fileno(), parts, progress)
    return len(prefix) + len(final_header) + data.nbytes


DIRECT_ALIGN = 4096
"""File offset, length and memory alignment of ``O_DIRECT`` writes (a page: enough for
every logical block size in use)."""
DIRECT_MIN_BYTES = 1 << 20
"""Smallest data section :func:`write` writes with ``O_DIRECT``."""


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised 1-D ``uint8`` tensor in page-aligned memory of its own (anonymous
    ``mmap``), which :func:`write` can write with ``O_DIRECT``."""
    buf = mmap.mmap(-1, max(1, nbytes))
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]  # the tensor keeps buf alive


def _direct_source(blob: object, data: memoryview) -> bool:
    """Whether ``blob`` can be written with ``O_DIRECT`` (see :func:`write`)."""
    return (
        hasattr(os, "O_DIRECT")
        and isinstance(blob, torch.Tensor)
        and data.nbytes >= DIRECT_MIN_BYTES
        and blob.data_ptr() % DIRECT_ALIGN == 0
    )


def _write_direct(
    tmp: str, head: bytes, data: memoryview, progress: Callable[[int], None] | None
) -> bool:
    """Write ``head`` (a multiple of DIRECT_ALIGN bytes) and ``data`` into the empty file
    ``tmp`` with O_DIRECT; False, with the file empty again, where the file system or the
    memory does not allow it (the caller then writes it buffered)."""
    a = DIRECT_ALIGN
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return False
    total = len(head) + data.nbytes
    body = data.nbytes - data.nbytes % a
    try:
        # the header and the data's last partial block go through one page-aligned
        # bounce buffer; the body straight from the caller's memory
        bounce = mmap.mmap(-1, max(len(head), a))
        try:
            bounce[: len(head)] = head
            _writev_all(fd, [memoryview(bounce)[: len(head)]])
            # chunks of WRITE_CHUNK (a multiple of the alignment) with a progress callback
            _writev_all(fd, [data[:body]], progress)
            if body < data.nbytes:
                bounce[:a] = bytes(a)
                bounce[: data.nbytes - body] = data[body:]
                _writev_all(fd, [memoryview(bounce)[:a]])
                if progress is not None:
                    progress(data.nbytes)
        finally:
            # after an error, a traceback may still hold a view of it: then GC closes it
            with contextlib.suppress(BufferError):
                bounce.close()
        os.ftruncate(fd, total)  # drop the last block's padding
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        os.ftruncate(fd, 0)  # refused after all: start over buffered
        return False
    finally:
        os.close(fd)
    return True


WRITE_CHUNK = 64 << 20
"""Bytes per system call when a progress callback is given."""


def _writev_all(
    fd: int, parts: list[memoryview], progress: Callable[[int], None] | None = None
) -> None:
    """Write all parts with as few system calls as possible (one, unless the kernel cuts it
    short, or chunks of :data:`WRITE_CHUNK` bytes with a ``progress`` callback)."""
    parts = [p for p in parts if p.nbytes]
    done = 0
    while parts:
        if progress is None:
            n = os.writev(fd, parts)
        else:
            batch, room = [], WRITE_CHUNK
            for p in parts:
                if room <= 0:
                    break
                batch.append(p[:room])
                room -= min(room, p.nbytes)
            n = os.writev(fd, batch)
            done += n
            progress(done)
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def write_tensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> int:
    """Pack ``tensors`` and publish them atomically; returns the file size."""
    entries, blob = pack(tensors)
    return write(path, entries, blob, metadata)


@dataclass
class Header:
    """The parsed, structurally validated header of a lowdiff file."""

    path: Path
    metadata: dict[str, str]
    entries: list[TensorEntry]
    header_len: int
    file_size: int

    @property
    def kind(self) -> str:
        return self.metadata.get("kind", "")


def _parse_header(path: Path, head: bytes, file_size: int) -> Header:
    if file_size < 8 or len(head) < 8:
        raise CorruptCheckpointError(
            path, f"truncated: {file_size} bytes is too short for a header"
        )
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or n > file_size - 8:
        raise CorruptCheckpointError(
            path,
            f"header length field says {n} bytes, file has {file_size} (truncated or not a lowdiff file)",
        )
    raw = head[8 : 8 + n]
    if len(raw) != n:
        raise CorruptCheckpointError(path, "truncated header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(
            path, f"header is not valid JSON ({e.__class__.__name__})"
        ) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(path, "no lowdiff metadata (a foreign safetensors file?)")
    if meta.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(path, f"not a lowdiff file (format={meta.get('format')!r})")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise CorruptCheckpointError(path, "missing or bad format_version") from None
    if version > FORMAT_VERSION:
        raise NewerFormatError(path, newer_version_reason(version))
    entries = []
    try:
        for name, info in header.items():
            dtype = dtype_from_name(info["dtype"])
            # ints only: int() would accept 2.5 as 2 and "7" as 7
            if not all(type(x) is int for x in [*info["shape"], *info["data_offsets"]]):
                raise InvalidArgumentError("shape and data_offsets must be integers")
            shape = tuple(info["shape"])
            start, end = info["data_offsets"]
            if any(s < 0 for s in shape):
                raise InvalidArgumentError("negative dimension")
            entries.append(TensorEntry(str(name), dtype, shape, start, end))
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise CorruptCheckpointError(path, f"bad tensor entry in header ({err})") from None
    entries.sort(key=lambda x: (x.start, x.end))
    data_len = file_size - 8 - n
    pos = 0
    for ent in entries:
        isz = itemsize(ent.dtype)
        if ent.start != pos or ent.end - ent.start != ent.numel * isz or ent.start % isz:
            raise CorruptCheckpointError(path, f"tensor {ent.name!r} has inconsistent offsets")
        pos = ent.end
    if pos != data_len:
        raise CorruptCheckpointError(
            path, f"data section should be {pos} bytes, file has {data_len} (truncated or padded)"
        )
    return Header(path, meta, entries, n, file_size)


def open_regular(path: Path) -> io.BufferedReader:
    """``open(path, "rb")`` of a regular file. Anything else (a named pipe, a device, a
    socket) raises :class:`CorruptCheckpointError` at once instead of blocking a reader
    (opening a named pipe waits for a writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpointError(
                path, "not a regular file (a named pipe, device or socket)"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | Path) -> Header:
    """Read and validate only the header (cheap). Does not verify the checksum."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CorruptCheckpointError(path, f"truncated: {size} bytes")
            (n,) = struct.unpack("<Q", prefix)
            head = prefix + f.read(min(n, MAX_HEADER_BYTES, max(size - 8, 0)))
    except OSError as e:
        raise CorruptCheckpointError(path, f"cannot read: {e.strerror}") from None
    return _parse_header(path, head, size)


def verify_bytes(path: Path, data: bytes | bytearray | memoryview) -> Header:
    """Validate the structure and the whole-file checksum of ``data`` (the file's bytes)."""
    mv = memoryview(data)
    hdr = _parse_header(
        path,
        bytes(mv[: 8 + min(len(mv) - 8, MAX_HEADER_BYTES)]) if len(mv) >= 8 else bytes(mv),
        len(mv),
    )
    expected = hdr.metadata.get(_CHECKSUM_KEY, "")
    raw = bytes(mv[8 : 8 + hdr.header_len])
    field = _checksum_field(expected)
    if len(expected) != 16 or raw.count(field) != 1:
        raise CorruptCheckpointError(path, "checksum field missing or damaged")
    h = xxhash.xxh3_64()
    h.update(mv[:8])
    h.update(raw.replace(field, _checksum_field(_PLACEHOLDER), 1))
    h.update(mv[8 + hdr.header_len :])
    if h.hexdigest() != expected:
        raise CorruptCheckpointError(
            path, f"checksum mismatch (stored {expected}, computed {h.hexdigest()})"
        )
    return hdr


@dataclass
class LoadedFile:
    """A verified file: its header and zero-copy tensor views over its bytes."""

    header: Header
    tensors: dict[str, torch.Tensor]

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata


def read_raw(path: str | Path) -> bytearray:
    """The file's bytes, in one read."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            got = f.readinto(buf)
    except OSError as e:
        raise CorruptCheckpointError(path, f"cannot read: {e.strerror}") from None
    if got != size:
        raise CorruptCheckpointError(path, "file changed size while being read")
    return buf


def decode(path: str | Path, data: bytearray) -> LoadedFile:
    """Verify ``data`` (see :func:`read_raw`) and expose its tensors without copying."""
    path = Path(path)
    hdr = verify_bytes(path, data)
    base = 8 + hdr.header_len
    if hdr.entries:
        flat = torch.frombuffer(data, dtype=torch.uint8, offset=base, count=len(data) - base)
        tensors = view_tensors(hdr.entries, flat)
    else:
        tensors = {}
    return LoadedFile(hdr, tensors)


def read(path: str | Path) -> LoadedFile:
    """Read, verify and decode a file. Raises :class:`CorruptCheckpointError` on any damage."""
    return decode(path, read_raw(path))


def verify(path: str | Path) -> Header:
    """Check a file's structure and checksum without keeping its tensors."""
    path = Path(path)
    return verify_bytes(path, read_raw(path))
