"""A GGUF file's header, read without the ``gguf`` package: the metadata and the tensor infos.

The ``gguf`` package's reader makes numpy views of every value, so a real model's tokenizer
arrays (128k token strings and 280k merges for llama-3) take seconds to parse; here a string
array is only walked past (its strings are decoded when asked for), numbers are read with
``struct``; the tensor types' block sizes are ggml's own (``ggml_attn.quant.type_info``).

Format (GGUF v2 and v3, little endian): ``"GGUF"``, u32 version, u64 tensor count, u64 metadata
count; each metadata entry a string key, a u32 value type and the value (string: u64 length +
UTF-8 bytes; array: u32 item type, u64 count, the items); each tensor info a string name, u32
n_dims, n_dims u64 ``ne`` (ggml order), u32 ggml type, u64 offset from the data section, which
starts at the header's end rounded up to ``general.alignment`` (default 32).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

from ggml_attn.quant import type_info

__all__ = ["GGUFError", "GGUFHeader", "TensorInfo", "StringArray", "read_header"]

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> struct format (the scalars)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where)."""


class StringArray:
    """A metadata array of strings, decoded on use: ``len()`` is free, items decode on access."""

    def __init__(self, buf, offsets: list[int]):
        self._buf, self._offsets = buf, offsets

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> str:
        at = self._offsets[i]
        n = struct.unpack_from("<Q", self._buf, at)[0]
        return bytes(self._buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ``ne`` in ggml order as the file lists it, ``offset`` from the file's start."""
    name: str
    type: int
    ne: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """ggml's name of the type, upper case (``"Q4_K"``, ``"BF16"``)."""
        return type_info(self.type).name.upper()

    @property
    def n_elements(self) -> int:
        n = 1
        for x in self.ne:
            n *= x
        return n


@dataclass(eq=False)
class GGUFHeader:
    """What :func:`read_header` read: ``fields`` maps each key to its value (int, float, bool,
    str, a list of numbers, or a :class:`StringArray`); ``tensors`` in file order."""
    path: str
    version: int
    fields: dict = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0
    file_size: int = 0


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.at, self.path, self.n = buf, 0, path, len(buf)

    def need(self, k: int, what: str) -> None:
        if self.at + k > self.n:
            raise GGUFError(f"'{self.path}': the file ends inside the header ({what} at byte {self.at})")

    def scalar(self, fmt: str, what: str):
        k = struct.calcsize(fmt)
        self.need(k, what)
        v = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += k
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        s = bytes(self.buf[self.at:self.at + n])
        self.at += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str):
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype, count = self.scalar("<I", what), self.scalar("<Q", what)
            if itype == _STRING:
                offsets = []
                for _ in range(count):
                    offsets.append(self.at)
                    self.need(8, what)
                    n = struct.unpack_from("<Q", self.buf, self.at)[0]
                    self.at += 8 + n
                self.need(0, what)
                return StringArray(self.buf, offsets)
            fmt = _SCALARS.get(itype)
            if fmt is None:
                raise GGUFError(f"'{self.path}': {what} is an array of value type {itype}, which GGUF does not define")
            k = struct.calcsize(fmt)
            self.need(k * count, what)
            vals = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.at))
            self.at += k * count
            return vals
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise GGUFError(f"'{self.path}': {what} has value type {vtype}, which GGUF does not define")
        return self.scalar(fmt, what)


# headers read, by the file's identity (device, inode, size, modification time): a CLI reads one
# file's header three times (its shapes, the loader's check, the load), 0.07 s each for a 128k
# vocabulary on the H100's machine; a changed or replaced file is read again. (The header keeps
# its file mapped.)
_HEADERS: dict[tuple, "GGUFHeader"] = {}
_HEADERS_MAX = 4


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read the header of GGUF file ``path`` (memory-mapped; no tensor data is touched), or the
    one read before from the same unchanged file (the same object: treat it as read-only).
    :class:`GGUFError` for a file that is not GGUF v2/v3 or whose header is cut short or names
    a value type or ggml type that does not exist; OSError when it cannot be opened."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        h = _HEADERS.get(key)
        if h is None:
            h = _read_header(path, f, st.st_size)
            if len(_HEADERS) >= _HEADERS_MAX:
                _HEADERS.pop(next(iter(_HEADERS)))
            _HEADERS[key] = h
    return h


def _read_header(path: str, f, size: int) -> GGUFHeader:
    """:func:`read_header`'s parse of the open file ``f`` of ``size`` bytes."""
    if size < 24:
        raise GGUFError(f"'{path}': {size} bytes is too short for a GGUF file")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(memoryview(buf), path)
    if bytes(c.buf[:4]) != _MAGIC:
        raise GGUFError(f"'{path}' is not a GGUF file (it starts with {bytes(c.buf[:4])!r}, not b'GGUF')")
    c.at = 4
    version = c.scalar("<I", "version")
    if version not in (2, 3):
        raise GGUFError(f"'{path}': GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.scalar("<Q", "tensor count"), c.scalar("<Q", "metadata count")
    # the least bytes a pair (key length, type, a one-byte value) and a tensor's info (name length,
    # n_dims, one ne, type, offset) take: counts past them are a corrupt header, which read on
    # as what followed them (a key "appearing twice", a tensor of 0 dimensions)
    if n_kv > (size - c.at) // 13 or n_tensors > (size - c.at) // 32:
        raise GGUFError(f"'{path}': its header counts {n_kv} metadata pairs and {n_tensors} tensors, more than "
                        f"its {size} bytes can hold (a truncated or corrupt file)")
    h = GGUFHeader(path, version, file_size=size)
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        vtype = c.scalar("<I", f"the type of {key}")
        if key in h.fields:   # llama.cpp's gguf reader refuses the file too
            raise GGUFError(f"'{path}': metadata key {key} appears twice")
        h.fields[key] = c.value(vtype, key)
    names = set()
    for i in range(n_tensors):
        name = c.string(f"tensor name {i}")
        if name in names:
            raise GGUFError(f"'{path}': tensor {name} appears twice")
        names.add(name)
        n_dims = c.scalar("<I", f"n_dims of {name}")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"'{path}': tensor {name} has {n_dims} dimensions (1..4)")
        ne = tuple(c.scalar("<Q", f"ne of {name}") for _ in range(n_dims))
        gtype = c.scalar("<I", f"type of {name}")
        off = c.scalar("<Q", f"offset of {name}")
        traits = type_info(gtype)
        if traits is None or traits.blck_size < 1:
            raise GGUFError(f"'{path}': tensor {name} has ggml type {gtype}, which this ggml does not know")
        blck, tsize = traits.blck_size, traits.type_size
        if ne[0] % blck:
            raise GGUFError(f"'{path}': tensor {name}: ne[0] = {ne[0]} is not a multiple of its type's "
                            f"block size {blck}")
        n_rows = 1
        for x in ne[1:]:
            n_rows *= x
        h.tensors.append(TensorInfo(name, gtype, ne, off, ne[0] // blck * tsize * n_rows))
    align = h.fields.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise GGUFError(f"'{path}': general.alignment is {align!r}; expected a power of two")
    h.data_start = -(-c.at // align) * align
    expected = 0   # as llama.cpp's reader: tensors back to back in file order, each padded to the alignment
    for t in h.tensors:
        if t.offset != expected:
            why = ("not a multiple of the alignment " + str(align) if t.offset % align else
                   "overlapping the tensor before it" if t.offset < expected else "leaving a gap after the tensor before it")
            raise GGUFError(f"'{path}': tensor {t.name} has data offset {t.offset}, expected {expected} ({why}); "
                            f"the tensors' data must lie back to back in file order, each padded to {align} bytes")
        expected += -(-t.nbytes // align) * align
        object.__setattr__(t, "offset", h.data_start + t.offset)
        if t.offset + t.nbytes > size:
            raise GGUFError(f"'{path}': tensor {t.name}'s data (bytes {t.offset}..{t.offset + t.nbytes}) "
                            f"runs past the end of the file ({size} bytes)")
    return h
