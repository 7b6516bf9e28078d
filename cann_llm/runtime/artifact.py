"""The `.om` artifact: ATC's header and partition table around an ONNX graph, raw weights and metadata.

Layout (little-endian; shared/reference/ATC.md §2.1):

    [256-byte ModelFileHeader: magic "IMOD", headsize 256, version 0x20000000, ...]
    [partition table: u32 count, 4 pad, count × {u32 type, u32 crc32, u64 offset, u64 size}]
    [MODEL_DEF: ONNX ModelProto, initializers ≥ 1 KiB stored as external data at "@weights"]
    [WEIGHTS_DATA: raw tensor bytes, each 64-byte aligned]
    [METADATA: JSON]  [TOKENIZER: JSON {file name: text}, optional]

Offsets are relative to the end of the table, as in ATC; every partition starts 64-byte aligned in the
file so weights can be mapped as numpy views. ATC's 4 padding bytes in a table entry hold the partition's
CRC32, and the header's checksum field holds the SHA-256 of the table, which covers every CRC. The file
is written to a temporary name and renamed, so a failed compile never leaves a partial `.om`.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from cann_llm.runtime.errors import AtcError
from cann_llm.runtime.safe_files import atomic_writer

MAGIC = 0x444F4D49
HEADER_SIZE = 256
MODEL_VERSION = 0x20000000
FORMAT_VERSION = 2  # 2: paged attention is cann::PagedAttention, not FusedAttention(paged=1)
ALIGN = 64
WEIGHTS_LOCATION = "@weights"
EXTERNAL_MIN_BYTES = 1024

# packed two (or four) to a byte: no numpy dtype describes their storage, so views of them are raw bytes
SUB_BYTE_BITS = {getattr(onnx.TensorProto, name): bits for name, bits in
                 (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)) if hasattr(onnx.TensorProto, name)}
SUB_BYTE_TYPES = frozenset(SUB_BYTE_BITS)

_HEADER = struct.Struct("<III64sIBBBB32sI32sII20sB3xQBB62s")
_TABLE_HEAD = struct.Struct("<I4x")
_ENTRY = struct.Struct("<IIQQ")
assert _HEADER.size == HEADER_SIZE and _ENTRY.size == 24


class Partition(IntEnum):
    """Partition types: ATC's numbers where ATC has the concept, ours from 100 up."""

    MODEL_DEF = 0
    WEIGHTS_DATA = 1
    METADATA = 100
    TOKENIZER = 101


@dataclass(frozen=True)
class Header:
    """The fields of the 256-byte header that mean something here."""

    name: str
    model_length: int
    checksum: bytes
    soc_version: str
    is_dynamic: bool
    format_version: int


def _align(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


def _tensor_bytes(tensor: onnx.TensorProto) -> bytes:
    return tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()


def _array_bytes(array: np.ndarray) -> memoryview:
    # through uint8: the buffer protocol does not know ml_dtypes' types (bfloat16)
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _externalize(model: onnx.ModelProto, detached: dict) -> list[tuple[onnx.TensorProto, object, int, int]]:
    """Move large initializers' bytes out of the graph; returns (tensor, source, offset, length) in file order.
    A tensor named in `detached` is a stub whose bytes are that array's (borrowed, not copied), or computed
    from its deferred values (anything with `nbytes` and `__array__`) only when written."""
    placed, offset = [], 0
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.STRING:
            continue
        if tensor.name in detached:
            data = detached[tensor.name]
            length = data.nbytes
        else:
            data = _tensor_bytes(tensor)
            length = len(data)
        if length < EXTERNAL_MIN_BYTES:
            if tensor.name in detached:  # a stub too small to place: its bytes go back into the graph
                tensor.raw_data = bytes(_array_bytes(np.asarray(data)))
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
            continue
        offset = _align(offset)
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(field)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", WEIGHTS_LOCATION), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        placed.append((tensor, data, offset, length))
        offset += length
    return placed


def write_artifact(path: str | os.PathLike, model: onnx.ModelProto, metadata: dict,
                   tokenizer_files: dict[str, str] | None = None, detached: dict[str, np.ndarray] | None = None) -> int:
    """Write `model` (consumed: its initializers become external references) atomically to `path`.

    `detached` holds the bytes of initializers exported as stubs (cann_llm/passes/weight_memory.py). Returns the
    file size. The bytes depend only on the inputs, so equal inputs give identical files.
    """
    path = Path(path)
    placed = _externalize(model, detached or {})
    weights_size = _align(placed[-1][2] + placed[-1][3]) if placed else 0
    blobs: list[tuple[Partition, bytes | None, int]] = [
        (Partition.MODEL_DEF, model.SerializeToString(deterministic=True), 0),
        (Partition.WEIGHTS_DATA, None, weights_size),
        (Partition.METADATA, json.dumps(metadata, sort_keys=True, ensure_ascii=False).encode(), 0),
    ]
    if tokenizer_files:
        blobs.append((Partition.TOKENIZER, json.dumps(tokenizer_files, sort_keys=True, ensure_ascii=False).encode(), 0))
    table_end = HEADER_SIZE + _TABLE_HEAD.size + _ENTRY.size * len(blobs)
    data_start = _align(table_end)
    with atomic_writer(path) as file:
        handle = _WholeChunks(file, WRITE_CHUNK)
        handle.write(b"\0" * data_start)
        entries = []
        for kind, data, size in blobs:
            start = _align(handle.tell())
            handle.write(b"\0" * (start - handle.tell()))
            if data is None:
                crc = _write_weights(handle, placed, start, size)
            else:
                handle.write(data)
                crc, size = zlib.crc32(data), len(data)
            entries.append(_ENTRY.pack(kind, crc, start - table_end, size))
        handle.flush()
        end = file.tell()
        table = _TABLE_HEAD.pack(len(entries)) + b"".join(entries)
        header = _pack_header(metadata, end - HEADER_SIZE, hashlib.sha256(table).digest())
        file.seek(0)
        file.write(header + table)
    return path.stat().st_size


class _WholeChunks:
    """A file, written from its start, written in whole chunks of `chunk` bytes (the last one as it ends). A
    filesystem with large folios (ext4 on Linux 6.16 and later, XFS) caches a write of a huge page's bytes at a
    huge page's offset in one huge folio, which a mapping of the file maps with one TLB entry; written tensor by
    tensor, most of the artifact's weights stayed in small pages (docs/performance.md#weights-in-huge-pages).
    Only the bytes short of a whole chunk are copied."""

    def __init__(self, file, chunk: int):
        self._file, self._chunk, self._pending = file, chunk, bytearray()

    def tell(self) -> int:
        return self._file.tell() + len(self._pending)

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._pending:
            take = min(self._chunk - len(self._pending), len(view))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < self._chunk:
                return
            self._file.write(self._pending)
            self._pending.clear()
        whole = len(view) - len(view) % self._chunk
        if whole:
            self._file.write(view[:whole])
        self._pending += view[whole:]

    def flush(self) -> None:
        """Write what is left, short of a chunk."""
        self._file.write(self._pending)
        self._pending.clear()


def _write_weights(handle, placed, start: int, size: int) -> int:
    crc, position = 0, 0
    for _, source, offset, length in placed:
        # a deferred weight is computed here, written, and dropped before the next
        data = source if isinstance(source, (bytes, memoryview)) else _array_bytes(np.asarray(source))
        pad = b"\0" * (offset - position)
        crc = zlib.crc32(data, zlib.crc32(pad, crc))
        handle.write(pad)
        handle.write(data)
        position = offset + length
        del data
    tail = b"\0" * (size - position)
    handle.write(tail)
    return zlib.crc32(tail, crc)


def _pack_header(metadata: dict, model_length: int, checksum: bytes) -> bytes:
    name = metadata.get("name", "")[:31].encode()
    soc = metadata.get("soc_version", "")[:19].encode()
    return _HEADER.pack(
        MAGIC, HEADER_SIZE, MODEL_VERSION, checksum.ljust(64, b"\0"), model_length & 0xFFFFFFFF,
        0, 1, 1, 0,  # is_encrypt, is_checksum, modeltype (standard), genmode (offline)
        name, 0, b"cann-llm".ljust(32, b"\0"), FORMAT_VERSION, 1, soc, 0, model_length,
        0, 1 if metadata.get("is_dynamic") else 0, b"",
    )


CRC_CHUNK = 64 << 20  # bytes checked (and released) at a time
# bytes written at a time, at offsets that are multiples of it: a huge page on x86-64 (and on arm64 with 4 KB
# pages), so that the page cache holds the artifact in huge folios (`_WholeChunks`); no larger where the huge
# page is (512 MB with 64 KB pages), since every byte short of a chunk is copied before it is written
WRITE_CHUNK = 2 << 20


class OmFile:
    """A `.om` opened for reading: memory-mapped, validated, partitions exposed as zero-copy views."""

    def __init__(self, path: str | os.PathLike, verify_weights: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise AtcError("E13001", self.path, "Is a directory" if self.path.is_dir() else "No such file or directory")
        with open(self.path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < HEADER_SIZE:
                raise AtcError("E13015", self.path, f"the file has {size} bytes, less than the {HEADER_SIZE}-byte header")
            self._mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        # before the first read: pages read from disk through an advised mapping come in huge folios (as `atc`
        # leaves them in the page cache), which a mapping of the file then maps whole; read once without the
        # advice (the header, the weights' CRC), the file stayed in small ones. Ignored without huge pages.
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # not Linux, or a sandbox's filter
            pass
        self.header = self._read_header(size)
        self._partitions = self._read_table(size)
        for kind in (Partition.MODEL_DEF, Partition.WEIGHTS_DATA, Partition.METADATA):
            if kind not in self._partitions:
                raise AtcError("E13015", self.path, f"the {kind.name} partition is missing")
        for kind, (start, length, crc) in self._partitions.items():
            if kind == Partition.WEIGHTS_DATA and not verify_weights:
                continue
            if self._crc(start, length) != crc:
                raise AtcError("E13015", self.path, f"the {kind.name} partition is corrupted (CRC32 mismatch)")

    def _crc(self, start: int, length: int) -> int:
        """CRC32 of a span, read in chunks whose pages are released as soon as they are summed: checking
        the weights must not hold them all resident before onnxruntime has made its copy."""
        crc = 0
        with memoryview(self._mm) as view:
            for chunk in range(start, start + length, CRC_CHUNK):
                end = min(chunk + CRC_CHUNK, start + length)
                crc = zlib.crc32(view[chunk:end], crc)
                self._release_span(chunk, end)
        return crc

    def _release_span(self, start: int, end: int) -> None:
        # the mapping is read-only and file-backed: a released page is read again from the page cache if
        # anything touches it later, so releasing is always safe, only the resident size changes
        first = start - start % mmap.PAGESIZE
        if end > first:
            self._mm.madvise(mmap.MADV_DONTNEED, first, end - first)

    def release(self, view: np.ndarray) -> None:
        """Drop the pages of `view` (an array from `weights`) from this process's resident memory, once a copy
        of it is made: touched again, they are read back from the page cache."""
        start = self.file_offset(view)
        self._release_span(start, start + view.nbytes)

    def file_offset(self, view: np.ndarray) -> int:
        """Where in the file the bytes of `view` (an array from `weights`) begin."""
        base = np.frombuffer(self._mm, np.uint8, count=0).__array_interface__["data"][0]
        return view.__array_interface__["data"][0] - base

    def _read_header(self, size: int) -> Header:
        fields = _HEADER.unpack_from(self._mm, 0)
        magic, headsize, version = fields[:3]
        if magic != MAGIC:
            # an ONNX ModelProto opens with its ir_version, field 1 as a varint: 0x08, then a small number
            if self._mm[0] == 0x08 and 3 <= self._mm[1] <= 32:
                raise AtcError("E13015", self.path, "it is an ONNX model, not an offline model: compile it with atc "
                                                    "first (atc --model=MODEL.onnx --framework=5 --output=NAME)")
            raise AtcError("E13015", self.path, f"it is not an offline model: magic {magic:#010x}, expected {MAGIC:#010x}")
        if headsize != HEADER_SIZE or version != MODEL_VERSION:
            raise AtcError("E13015", self.path, f"unsupported header (size {headsize}, version {version:#x})")
        format_version, model_length = fields[12], fields[16]
        if format_version != FORMAT_VERSION:
            raise AtcError("E13015", self.path, f"format version {format_version} is not {FORMAT_VERSION}; recompile it")
        if HEADER_SIZE + model_length != size:
            raise AtcError("E13015", self.path, f"the file is truncated or extended: the header says "
                                                f"{HEADER_SIZE + model_length} bytes, the file has {size}")
        return Header(name=fields[9].rstrip(b"\0").decode(errors="replace"), model_length=model_length,
                      checksum=fields[3][:32], soc_version=fields[14].rstrip(b"\0").decode(errors="replace"),
                      is_dynamic=bool(fields[18]), format_version=format_version)

    def _read_table(self, size: int) -> dict[Partition, tuple[int, int, int]]:
        (count,) = _TABLE_HEAD.unpack_from(self._mm, HEADER_SIZE)
        table_end = HEADER_SIZE + _TABLE_HEAD.size + _ENTRY.size * count
        if count == 0 or count > 64 or table_end > size:
            raise AtcError("E13015", self.path, f"the partition table is invalid ({count} partitions)")
        if hashlib.sha256(self._mm[HEADER_SIZE:table_end]).digest() != self.header.checksum:
            raise AtcError("E13015", self.path, "the partition table is corrupted (checksum mismatch)")
        partitions, spans = {}, []
        for index in range(count):
            kind, crc, offset, length = _ENTRY.unpack_from(self._mm, HEADER_SIZE + _TABLE_HEAD.size + _ENTRY.size * index)
            start = table_end + offset
            if start + length > size:
                raise AtcError("E13015", self.path, f"partition {kind} runs past the end of the file "
                                                    f"(offset {offset}, size {length}, file {size} bytes)")
            if start % ALIGN:
                raise AtcError("E13015", self.path, f"partition {kind} starts at byte {start}, not {ALIGN}-byte aligned")
            spans.append((start, start + length, kind))
            if kind in Partition._value2member_map_:
                if Partition(kind) in partitions:
                    raise AtcError("E13015", self.path, f"the {Partition(kind).name} partition appears twice")
                partitions[Partition(kind)] = (start, length, crc)
        spans.sort()
        for (_, end, kind), (start, _, other) in zip(spans, spans[1:]):
            if start < end:
                raise AtcError("E13015", self.path, f"partitions {kind} and {other} overlap")
        return partitions

    def partition(self, kind: Partition) -> memoryview:
        """The bytes of one partition, without copying."""
        start, length, _ = self._partitions[kind]
        return memoryview(self._mm)[start:start + length]

    def partition_sizes(self) -> dict[str, int]:
        """Size in bytes of each partition present."""
        return {kind.name: length for kind, (_, length, _) in self._partitions.items()}

    @property
    def metadata(self) -> dict:
        """The metadata partition, parsed (its schema is cann_llm/runtime/artifact_schema.py's, checked by the loader)."""
        return self._json(Partition.METADATA)

    def graph(self) -> onnx.ModelProto:
        """The graph with weights still external (references into the weights partition)."""
        model = onnx.ModelProto()
        try:
            model.ParseFromString(bytes(self.partition(Partition.MODEL_DEF)))
        except Exception as error:  # protobuf's DecodeError, or a RuntimeWarning-turned-error on recursion
            raise AtcError("E13015", self.path, f"the MODEL_DEF partition is not an ONNX model ({error})") from None
        return model

    def tokenizer_files(self) -> dict[str, str]:
        """The tokenizer partition (file name → text); empty if the model was compiled without one."""
        if Partition.TOKENIZER not in self._partitions:
            return {}
        files = self._json(Partition.TOKENIZER)
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise AtcError("E13015", self.path, "the TOKENIZER partition is not an object of file names to texts")
        return files

    def _json(self, kind: Partition):
        try:
            return json.loads(bytes(self.partition(kind)))
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise AtcError("E13015", self.path, f"the {kind.name} partition is not JSON ({error})") from None

    def weights(self, model: onnx.ModelProto) -> dict[str, np.ndarray]:
        """Read-only numpy views into the mapped weights for every external initializer of `model`.

        Sub-byte tensors (SUB_BYTE_TYPES) come as flat uint8 views of their packed bytes.
        """
        base, length, _ = self._partitions[Partition.WEIGHTS_DATA]
        views = {}
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            offset, nbytes, dtype = self._external_reference(tensor, length)
            views[tensor.name] = np.frombuffer(self._mm, dtype=dtype, count=nbytes // dtype.itemsize, offset=base + offset)
            if tensor.data_type not in SUB_BYTE_TYPES:
                views[tensor.name] = views[tensor.name].reshape(tuple(tensor.dims))
        return views

    def _external_reference(self, tensor: onnx.TensorProto, partition_length: int) -> tuple[int, int, np.dtype]:
        """(offset, length, storage dtype) of an external tensor, each checked against the tensor and the
        weights partition; sub-byte tensors are stored as packed uint8."""
        info = {entry.key: entry.value for entry in tensor.external_data}
        where = f"tensor {tensor.name}"
        if info.get("location") != WEIGHTS_LOCATION:
            raise AtcError("E13015", self.path, f"{where}: external data location {info.get('location')!r} is not "
                                                f"{WEIGHTS_LOCATION}")
        try:
            offset, nbytes = int(info["offset"]), int(info["length"])
        except (KeyError, ValueError):
            raise AtcError("E13015", self.path, f"{where}: external data offset and length must be integers") from None
        if offset < 0 or nbytes < 0 or offset + nbytes > partition_length:
            raise AtcError("E13015", self.path, f"{where}: external data [{offset}, {offset + nbytes}) is outside the "
                                                f"weights partition ({partition_length} bytes)")
        if offset % ALIGN:
            raise AtcError("E13015", self.path, f"{where}: external data offset {offset} is not {ALIGN}-byte aligned")
        if any(d < 0 for d in tensor.dims):
            raise AtcError("E13015", self.path, f"{where}: negative dims {list(tensor.dims)}")
        count = int(np.prod(tensor.dims, dtype=object)) if tensor.dims else 1
        if tensor.data_type in SUB_BYTE_TYPES:
            dtype, expected = np.dtype(np.uint8), -(-count * SUB_BYTE_BITS[tensor.data_type] // 8)
        else:
            try:
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            except (KeyError, TypeError, ValueError):
                raise AtcError("E13015", self.path, f"{where}: data_type {tensor.data_type} has no storage") from None
            if dtype.kind == "O":  # strings: no fixed-size storage to map
                raise AtcError("E13015", self.path, f"{where}: data_type {tensor.data_type} cannot be external")
            expected = count * dtype.itemsize
        if nbytes != expected:
            raise AtcError("E13015", self.path, f"{where}: external data length {nbytes} is not the {expected} bytes "
                                                f"of dims {list(tensor.dims)}")
        return offset, nbytes, dtype
