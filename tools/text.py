"""Text from files and users, made safe for a terminal line."""
from __future__ import annotations

__all__ = ["printable"]


def printable(text) -> str:
    """``text`` safe for a terminal and one line: whitespace runs (newlines, tabs) folded to one
    space, other control characters (C0, DEL, C1: ESC, BEL, CSI...) written as ``\\xNN`` escapes,
    so that a string from a file (a model's name, a path) cannot move the cursor, recolor or ring."""
    out = []
    for ch in " ".join(str(text).split()):
        o = ord(ch)
        out.append(f"\\x{o:02x}" if o < 0x20 or 0x7f <= o < 0xa0 else ch)
    return "".join(out)
