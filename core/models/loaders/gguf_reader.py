"""A small GGUF v2/v3 reader: metadata and memory-mapped tensor data, checked.

gguf.GGUFReader builds a numpy view per metadata item, which takes seconds
for a 49k-token vocabulary; this walks the header with struct instead.

Every count, size and offset of the header is checked before it is used, as
llama.cpp's gguf.cpp does, so a damaged file is one ModelLoadError naming the
field or tensor instead of weights read from the wrong bytes. Tensor data
must lie as every GGUF writer puts it (gguf-py, llama.cpp): in header order,
each tensor starting where the previous one ends, rounded up to
``general.alignment``. That one rule refuses a moved offset (which loaded and
generated empty text), a misaligned one and overlapping tensors.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from paged.core.models.loaders import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_CORRUPT = "the file is corrupt: download or convert it again"


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (rows first)
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw uint8 bytes (a view of the memory-mapped file)


@dataclass
class _TensorInfo:
    name: str
    dims: list[int]  # GGUF order (row length first)
    qtype: GGMLQuantizationType
    offset: int  # from the start of the data section
    n_bytes: int


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, problem)

    def need(self, n_bytes: int, what: str) -> None:
        if self.pos + n_bytes > len(self.buf):
            raise self.error(f"{what}: truncated GGUF header ({n_bytes} bytes needed at offset {self.pos}, "
                             f"the file has {len(self.buf)})")

    def unpack(self, fmt: str, what: str = "value"):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.array(what)
        raise self.error(f"{what}: unknown GGUF value type {vtype} at offset {self.pos}; {_CORRUPT}")

    def array(self, what: str) -> list:
        itype, count = self.unpack("<I", what), self.unpack("<Q", what)
        # checked before reading, so a huge count fails at once
        min_item = np.dtype(_NUMPY[itype]).itemsize if itype in _NUMPY else 8
        self.need(count * min_item, f"{what} ({count} items)")
        if itype not in _NUMPY:
            return [self.value(itype, what) for _ in range(count)]
        dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
        self.pos += count * dt.itemsize
        return arr.tolist()


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Parse a GGUF v2/v3 file: (metadata, tensors with memory-mapped data)."""
    cur = _Cursor(_map(path), path)
    n_tensors, n_kv = _read_counts(cur)
    meta = _read_metadata(cur, n_kv)
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    _check_unique(cur, [t.name for t in infos], "tensor")
    align = _alignment(cur, meta)
    data_start = (cur.pos + align - 1) // align * align
    _check_layout(cur, infos, align, data_start)
    return meta, [GGUFTensor(t.name, tuple(reversed(t.dims)), t.qtype,
                             np.frombuffer(cur.buf, np.uint8, t.n_bytes, data_start + t.offset))
                  for t in infos]


def _map(path: Path):
    try:
        with open(path, "rb") as f:
            empty = f.seek(0, 2) == 0
            buf = None if empty else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot read file ({e})") from e
    if empty:
        raise ModelLoadError(path, "the file is empty (0 bytes), expected a GGUF model")
    magic = bytes(buf[:4])
    if not b"GGUF".startswith(magic):
        raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    if len(buf) < _HEADER_BYTES:
        raise ModelLoadError(path, f"truncated GGUF file: {len(buf)} bytes, "
                                   f"a GGUF header alone needs {_HEADER_BYTES}")
    return buf


def _read_counts(cur: _Cursor) -> tuple[int, int]:
    """The version, then the tensor and metadata counts, each checked
    against what the rest of the file could hold."""
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise cur.error(f"GGUF version: expected 2 or 3, got {version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    room = len(cur.buf) - cur.pos
    for what, count, least in (("tensor count", n_tensors, _MIN_TENSOR_INFO_BYTES),
                               ("metadata count", n_kv, _MIN_KV_BYTES)):
        if count * least > room:
            raise cur.error(f"GGUF header {what}: expected at most {room // least} in a file of "
                            f"{len(cur.buf)} bytes, got {count}; {_CORRUPT}")
    return n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in meta:
            raise cur.error(f"metadata key {key!r} appears twice; {_CORRUPT}")
        meta[key] = cur.value(cur.unpack("<I", f"metadata {key!r}"), f"metadata {key!r}")
    return meta


def _read_tensor_info(cur: _Cursor) -> _TensorInfo:
    name = cur.string("tensor name")
    what = f"tensor {name!r}"
    n_dims = cur.unpack("<I", what)
    if n_dims > _MAX_DIMS:
        raise cur.error(f"{what} dimension count: expected at most {_MAX_DIMS}, got {n_dims}; {_CORRUPT}")
    dims = [cur.unpack("<Q", what) for _ in range(n_dims)]
    qtype, offset = cur.unpack("<I", what), cur.unpack("<Q", what)
    try:
        qt = GGMLQuantizationType(qtype)
        block, type_size = GGML_QUANT_SIZES[qt]
    except (ValueError, KeyError):
        raise cur.error(f"tensor {name!r} has unknown GGML type {qtype}") from None
    if dims and dims[0] % block:
        raise cur.error(f"{what} row length: expected a multiple of {qt.name}'s block of {block}, "
                        f"got {dims[0]}; {_CORRUPT}")
    numel = int(np.prod(dims, dtype=object)) if dims else 1  # object: no int64 overflow
    return _TensorInfo(name, dims, qt, offset, numel // block * type_size)


def _check_unique(cur: _Cursor, names: list[str], kind: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise cur.error(f"{kind} {name!r} appears twice; {_CORRUPT}")
        seen.add(name)


def _alignment(cur: _Cursor, meta: dict[str, Any]) -> int:
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise cur.error(f"general.alignment: expected a power of two, got {align!r}; {_CORRUPT}")
    return align


def _check_layout(cur: _Cursor, infos: list[_TensorInfo], align: int, data_start: int) -> None:
    """Each tensor starts where the one before it ends (padded to ``align``)
    and the last one ends inside the file."""
    expected, previous = 0, None
    for t in infos:
        if t.offset != expected:
            raise cur.error(f"tensor {t.name!r} data offset: expected {expected}, got {t.offset} "
                            f"({_misplaced(t.offset, expected, align, previous)}); {_CORRUPT}")
        end = data_start + t.offset + t.n_bytes
        if end > len(cur.buf):
            raise cur.error(f"truncated: tensor {t.name!r} needs bytes {data_start + t.offset}..{end} "
                            f"but the file has {len(cur.buf)}")
        expected = (t.offset + t.n_bytes + align - 1) // align * align
        previous = t.name


def _misplaced(offset: int, expected: int, align: int, previous: str | None) -> str:
    if offset % align:
        return f"not a multiple of general.alignment {align}"
    if offset < expected:
        return f"overlaps tensor {previous!r}"
    after = f"the end of tensor {previous!r}" if previous else "the start of the data"
    return f"{offset - expected} bytes past {after}"
