"""Structure-aware mutation of `.om` files. `OmImage` splits a file into its header fields, partition table
and partitions (docs/artifact.md, cann_llm/runtime/artifact.py); a mutation changes one of them (a header field, a
table entry, a metadata value, a graph node attribute, tokenizer text, weight bytes) and `OmImage.build`
lays the file out again with every CRC32 and the table's SHA-256 recomputed, so the change gets past the
integrity checks and reaches the validators behind them. A few mutations are left unrepaired on purpose.

The layout is restated here rather than imported, so a reader and its fuzzer cannot share a mistake.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field

import onnx

from fuzz_choices import Choices
from fuzz_onnx import mutate_attribute, mutate_model, mutate_tensor

HEADER_SIZE, ALIGN = 256, 64
HEADER = struct.Struct("<III64sIBBBB32sI32sII20sB3xQBB62s")
HEADER_FIELDS = ("magic", "headsize", "version", "checksum", "length32", "is_encrypt", "is_checksum", "modeltype",
                 "genmode", "name", "ops", "userdefineinfo", "format_version", "platform_type", "soc_version",
                 "reserved_b", "model_length", "reserved_c", "is_dynamic", "reserved")
TABLE_HEAD, ENTRY = struct.Struct("<I4x"), struct.Struct("<IIQQ")
MODEL_DEF, WEIGHTS_DATA, METADATA, TOKENIZER = 0, 1, 100, 101
assert HEADER.size == HEADER_SIZE and len(HEADER_FIELDS) == len(HEADER.unpack(bytes(HEADER_SIZE)))


def _align(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class OmImage:
    """A `.om` as editable parts; `build()` gives the bytes of a consistent file."""

    header: dict
    partitions: list[list]  # [kind, bytes]
    # applied after layout: (header field, value) and (entry index, field, value) overrides
    header_overrides: dict = field(default_factory=dict)
    entry_overrides: list = field(default_factory=list)
    repair_entries: bool = True

    @classmethod
    def parse(cls, data: bytes) -> "OmImage":
        header = dict(zip(HEADER_FIELDS, HEADER.unpack_from(data, 0)))
        (count,) = TABLE_HEAD.unpack_from(data, HEADER_SIZE)
        table_end = HEADER_SIZE + TABLE_HEAD.size + ENTRY.size * count
        partitions = []
        for index in range(count):
            kind, _, offset, size = ENTRY.unpack_from(data, HEADER_SIZE + TABLE_HEAD.size + ENTRY.size * index)
            partitions.append([kind, data[table_end + offset: table_end + offset + size]])
        return cls(header, partitions)

    def part(self, kind: int) -> list | None:
        return next((p for p in self.partitions if p[0] == kind), None)

    def build(self) -> bytes:
        table_end = HEADER_SIZE + TABLE_HEAD.size + ENTRY.size * len(self.partitions)
        body, entries = bytearray(), []
        position = _align(table_end)
        for kind, data in self.partitions:
            position = _align(position)
            entries.append([kind, zlib.crc32(data), position - table_end, len(data)])
            body += b"\0" * (position - table_end - len(body)) + data
            position += len(data)
        blob = bytearray(b"\0" * table_end) + body
        for index, name, value in self.entry_overrides:
            if index < len(entries):
                entries[index][("kind", "crc", "offset", "size").index(name)] = value
                if self.repair_entries and name in ("offset", "size"):
                    start, size = table_end + entries[index][2], entries[index][3]
                    if start + size <= len(blob):
                        entries[index][1] = zlib.crc32(blob[start:start + size])
        # a hostile override is cut to the field's width, as a crafted file would carry it
        widths = (2**32 - 1, 2**32 - 1, 2**64 - 1, 2**64 - 1)
        table = TABLE_HEAD.pack(len(entries)) + b"".join(ENTRY.pack(*(v & m for v, m in zip(e, widths))) for e in entries)
        header = dict(self.header, checksum=hashlib.sha256(table).digest().ljust(64, b"\0"),
                      model_length=len(blob) - HEADER_SIZE, length32=(len(blob) - HEADER_SIZE) & 0xFFFFFFFF)
        header.update(self.header_overrides)
        blob[:table_end] = HEADER.pack(*(header[name] for name in HEADER_FIELDS)) + table
        return bytes(blob)


# ---- JSON values --------------------------------------------------------------------------------------

_DEEP = "__fuzz_deep__"


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value[:16]):
            yield from _paths(item, prefix + (index,))


def _hostile_json(c: Choices, old):
    return c.choice((c.hostile_int(old if isinstance(old, int) and not isinstance(old, bool) else None), c.hostile_float(),
                     c.hostile_string(), None, True, [], {}, [c.hostile_int()], {"": c.hostile_int()}, _DEEP,
                     str(old), [old]))


def mutate_json(value, c: Choices, prefer: tuple = ()) -> str:
    """`value` (parsed JSON) with one leaf or container replaced by a hostile value, removed, or an unknown
    key added; paths under a key in `prefer` are picked first. Returns the JSON text (NaN allowed, as
    Python's json module reads it)."""
    paths = [p for p in _paths(value) if p]
    preferred = [p for p in paths if p[0] in prefer]
    if not paths:
        return c.choice(("null", "[]", "0", '"x"', "[" * 100_000))
    path = c.choice(preferred if preferred and not c.chance(4) else paths)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    action = c.choice(("replace", "replace", "replace", "delete", "add"), f"json {'.'.join(map(str, path))}")
    if action == "delete":
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[c.choice(("fuzz", "", "\ud800"))] = _hostile_json(c, None)
    else:
        parent[path[-1]] = _hostile_json(c, parent[path[-1]])
        c.note(f"-> {parent[path[-1]]!r}"[:120])
    text = json.dumps(value, ensure_ascii=True, allow_nan=True)
    return text.replace(json.dumps(_DEEP), "[" * 100_000 + "]" * 100_000)


# ---- the mutations ------------------------------------------------------------------------------------

def mutate_header(image: OmImage, c: Choices) -> None:
    name = c.choice(("magic", "headsize", "version", "format_version", "model_length", "is_dynamic", "name",
                     "soc_version", "is_encrypt", "length32"), "header")
    if name in ("name", "soc_version"):
        image.header_overrides[name] = c.hostile_string().encode("utf-8", "surrogatepass")[:20]
    elif name == "is_dynamic" or name == "is_encrypt":
        image.header_overrides[name] = c.integer(0, 255)
    else:
        limit = 2**64 - 1 if name == "model_length" else 2**32 - 1
        image.header_overrides[name] = c.hostile_int(image.header.get(name)) & limit


def mutate_table(image: OmImage, c: Choices) -> None:
    action = c.choice(("entry", "entry", "drop", "duplicate", "reorder", "unknown"), "table")
    if action == "entry":
        index = c.integer(0, len(image.partitions) - 1)
        name = c.choice(("kind", "offset", "size", "crc"), "field")
        image.entry_overrides.append((index, name, c.hostile_int()))
    elif action == "drop":
        del image.partitions[c.integer(0, len(image.partitions) - 1)]
    elif action == "duplicate":
        image.partitions.append(list(c.choice(image.partitions)))
    elif action == "reorder":
        image.partitions.reverse()
    else:
        image.partitions.append([c.choice((2, 99, 102, 2**31)), b"\xff" * c.integer(0, 64)])


def mutate_metadata(image: OmImage, c: Choices) -> None:
    part = image.part(METADATA)
    if part is None:
        return
    try:
        value = json.loads(part[1])
    except (ValueError, RecursionError):
        value = {}
    if c.chance(12):
        part[1] = c.choice((b"", b"{", b"\xff\xfe", b"[]", b"null", json.dumps({"a": 1}).encode()), "metadata bytes")
        return
    part[1] = mutate_json(value, c, prefer=("model", "kv_cache", "signature", "is_dynamic", "name")).encode()


def mutate_graph(image: OmImage, c: Choices) -> None:
    """A node attribute of the graph (the `cann` nodes first), an initializer's external reference or dims,
    or any ONNX mutation; the graph re-serialised."""
    part = image.part(MODEL_DEF)
    if part is None:
        return
    model = onnx.ModelProto()
    try:
        model.ParseFromString(part[1])
    except Exception:  # an earlier mutation already broke it: leave it so
        return
    action = c.choice(("cann_attribute", "cann_attribute", "external", "initializer", "any"), "graph")
    if action == "cann_attribute":
        mutate_attribute(model, c, prefer_domain="cann")
    elif action == "external":
        tensors = [t for t in model.graph.initializer if t.external_data]
        if tensors:
            tensor = c.choice(tensors)
            entry = c.choice(list(tensor.external_data), f"external {tensor.name}")
            entry.value = c.choice((str(c.hostile_int()), "-64", "", "1e3", "../weights", "@weights", "0x10"))
            c.note(f"-> {entry.key}={entry.value}")
    elif action == "initializer" and model.graph.initializer:
        mutate_tensor(c.choice(list(model.graph.initializer)), c)
    else:
        model = mutate_model(model, c)
    part[1] = model.SerializeToString()


def mutate_tokenizer(image: OmImage, c: Choices) -> None:
    part = image.part(TOKENIZER)
    if part is None:
        image.partitions.append([TOKENIZER, json.dumps({"tokenizer.json": "{"}).encode()])
        c.note("tokenizer added: broken")
        return
    try:
        files = json.loads(part[1])
    except (ValueError, RecursionError):
        return
    action = c.choice(("inner", "inner", "inner", "truncate", "names", "outer"), "tokenizer")
    if action == "outer":
        part[1] = mutate_json(files, c).encode()
        return
    if action == "names":
        files[c.choice(("../escape.json", "/etc/passwd", "", "tokenizer_config.json", "chat_template.jinja"))] = \
            c.choice(("{", "{{ raise }}", '{"chat_template": "{% for %}"}', "\ud800"))
        if c.chance(2):
            files.pop("tokenizer.json", None)
    elif isinstance(files, dict) and isinstance(files.get("tokenizer.json"), str):
        text = files["tokenizer.json"]
        if action == "truncate":
            files["tokenizer.json"] = text[: c.integer(0, len(text))]
        else:
            try:
                files["tokenizer.json"] = mutate_json(json.loads(text), c, prefer=("model", "decoder", "pre_tokenizer",
                                                                                 "added_tokens", "normalizer"))
            except (ValueError, RecursionError):
                pass
    part[1] = json.dumps(files, ensure_ascii=True).encode()


def mutate_weights(image: OmImage, c: Choices) -> None:
    part = image.part(WEIGHTS_DATA)
    if part is None or not part[1]:
        return
    data = bytearray(part[1])
    for _ in range(c.integer(1, 8)):
        data[c.integer(0, len(data) - 1)] = c.integer(0, 255)
    if c.chance(4):
        data = data[: c.integer(0, len(data))]
        c.note(f"weights cut to {len(data)} bytes")
    part[1] = bytes(data)


MUTATIONS = (mutate_header, mutate_table, mutate_metadata, mutate_metadata, mutate_graph, mutate_graph,
             mutate_tokenizer, mutate_weights)


def mutate_om(data: bytes, c: Choices) -> bytes:
    """The bytes of a mutated copy of the `.om` in `data`: 1 to 3 mutations with checksums repaired, and
    once in 16 a raw byte change left unrepaired."""
    image = OmImage.parse(data)
    for _ in range(c.integer(1, 3)):
        mutation = c.choice(MUTATIONS)
        c.note(mutation.__name__)
        mutation(image, c)
    image.repair_entries = not c.chance(8)
    out = bytearray(image.build())
    if c.chance(16):
        position = c.integer(0, len(out) - 1)
        out[position] ^= 1 << c.integer(0, 7)
        c.note(f"unrepaired bit flip at {position}")
    return bytes(out)
