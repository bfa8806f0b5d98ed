"""Reading NVRTC's cubins (ELF64, little-endian) on the host, no GPU or CUDA driver needed: the
last byte CuPy drops put back (:func:`whole_cubin`), the sections (:func:`sections`), and the
bytes of a ``__device__`` variable by its mangled name (:func:`symbol_bytes`, :func:`symbol_int`:
how ``kernels.Compiled`` reads each kernel instance's dynamic shared memory from the program).
"""
from __future__ import annotations

import struct

_SHT_SYMTAB, _SHT_NOBITS = 2, 8


def whole_cubin(data: bytes) -> bytes:
    """The cubin ``data`` with its last byte back: CuPy's ``nvrtc.getCUBIN`` returns one byte less
    than ``nvrtcGetCUBINSize`` (it drops a final NUL, as of PTX text), which leaves the ELF's
    program header table one byte short (the driver read the byte past the buffer, CPython's
    hidden NUL; nvdisasm refuses the file). The table's end, from the ELF header, says whether
    the byte is missing (0, the high byte of the last entry's alignment)."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return data
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return data + b"\0" if end == len(data) + 1 else data


def _headers(elf: bytes) -> list[tuple[int, int, int, int, int]]:
    """(name offset, type, file offset, size, link) of every section header of ELF64 LE ``elf``."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file (a cubin)")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    out = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link = struct.unpack_from("<IIQQQQI", elf, shoff + i * shentsize)
        out.append((name, typ, off, size, link))
    if not 0 <= shstrndx < len(out):
        raise ValueError("cubin without a section name table")
    return out


def _cstr(elf: bytes, at: int) -> str:
    return elf[at:elf.index(b"\0", at)].decode()


def sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> its bytes (b"" for NOBITS sections: shared memory, zero-initialized data)."""
    hdr = _headers(elf)
    shstr = hdr[struct.unpack_from("<H", elf, 0x3E)[0]][2]
    return {_cstr(elf, shstr + n): (b"" if t == _SHT_NOBITS else elf[o:o + s]) for n, t, o, s, _ in hdr}


def symbol_bytes(elf: bytes, name: str) -> bytes:
    """The initial bytes of the variable (object symbol) ``name`` (a mangled name, e.g. from
    ``nvrtcGetLoweredName``) in cubin ``elf``: its size from the symbol table, at its value's offset
    in its section (zeros in a NOBITS section). KeyError when no symbol of that name exists."""
    hdr = _headers(elf)
    want = name.encode()
    for _n, typ, off, size, link in hdr:
        if typ != _SHT_SYMTAB:
            continue
        strtab = hdr[link][2]
        for at in range(off, off + size, 24):   # Elf64_Sym: name, info, other, shndx, value, size
            st_name, _info, _other, shndx, value, st_size = struct.unpack_from("<IBBHQQ", elf, at)
            if elf[strtab + st_name:strtab + st_name + len(want) + 1] != want + b"\0":
                continue
            if not 0 < shndx < len(hdr):
                raise ValueError(f"symbol {name} is not defined in a section of the cubin")
            _, styp, soff, ssize, _ = hdr[shndx]
            if value + st_size > ssize:
                raise ValueError(f"symbol {name} lies past the end of its section")
            return bytes(st_size) if styp == _SHT_NOBITS else elf[soff + value:soff + value + st_size]
    raise KeyError(f"no symbol {name} in the cubin")


def symbol_int(elf: bytes, name: str) -> int:
    """The value of the 4-byte ``int`` variable ``name`` (a mangled name) in cubin ``elf``."""
    b = symbol_bytes(elf, name)
    if len(b) != 4:
        raise ValueError(f"symbol {name} has {len(b)} bytes, not an int's 4")
    return struct.unpack("<i", b)[0]
