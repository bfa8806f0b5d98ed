"""One ggml in the process: ggml-python's. A process that finds another ggml's shared libraries
first (llama.cpp's ``bin/`` on ``LD_LIBRARY_PATH``: its ``libggml-base.so`` has the same name)
runs ggml-python's bindings over a ggml with another op numbering, and every graph fails far
from the cause ("device-resident graph has built-in CPU op(s) ... (CUSTOM)"). Checked once at
import, from the libraries the process has mapped."""
from __future__ import annotations

import os

__all__ = ["foreign_ggml_libraries", "check_one_ggml"]


def foreign_ggml_libraries(maps_text: str, own_dir: str) -> list[str]:
    """The ``libggml*`` files mapped in ``maps_text`` (``/proc/self/maps``' format) that are not in
    ``own_dir`` (ggml-python's library folder), sorted, each once."""
    own = os.path.realpath(own_dir)
    out = set()
    for line in maps_text.splitlines():
        parts = line.split()
        path = parts[-1] if len(parts) >= 6 else ""
        if path.startswith("/") and os.path.basename(path).startswith("libggml"):
            if os.path.dirname(os.path.realpath(path)) != own:
                out.add(path)
    return sorted(out)


def check_one_ggml() -> None:
    """ImportError naming the foreign ``libggml*`` libraries when this process has any loaded
    beside ggml-python's (nothing on systems without ``/proc/self/maps``)."""
    import ggml
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return
    lib = getattr(getattr(ggml, "ggml", None), "lib", None)   # the CDLL ggml-python loaded: its folder is its own
    own = os.path.dirname(getattr(lib, "_name", "") or "") or os.path.join(os.path.dirname(ggml.__file__), "lib")
    bad = foreign_ggml_libraries(maps, own)
    if bad:
        raise ImportError(f"ggml-attn: this process loaded {', '.join(bad)} beside ggml-python's own ggml "
                          f"({own}): another ggml's libraries (llama.cpp's bin/ on LD_LIBRARY_PATH?) with "
                          f"another op numbering; every graph would fail. Keep that folder off "
                          f"LD_LIBRARY_PATH for Python processes (give it to llama.cpp's processes only)")
