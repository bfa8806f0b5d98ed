"""Host-side bookkeeping of the CUDA backend, checked without a GPU.

A fake ``cupy`` module stands in for the allocations, events and stream calls, so these run
anywhere: split-KV workspaces per (device, stream, thread), staging buffers per (thread,
device), plan tile maps ordered across streams, and the cubin cache (key and stale-cubin
recompile; the latter needs NVRTC).
"""
from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from ggml_attn import cuda_backend as cb
from ggml_attn import cuda_plan
from ggml_attn import cuda_workspace
from ggml_attn import kernels as K
from ggml_attn.tensor import from_array


class _Buf:
    _next = 0x1000

    def __init__(self, n):
        self.size = n
        _Buf._next += 0x1000000
        self.data = types.SimpleNamespace(ptr=_Buf._next)


class _Pinned:
    def __init__(self, n):
        self._n = n
        _Buf._next += 0x1000000
        self.ptr = _Buf._next

    def size(self):
        return self._n


class _Event:
    n = 0

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        _Event.n += 1
        self.ptr = 0xE000 + _Event.n


class _ExternalStream:
    def __init__(self, ptr, device_id=-1):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture
def fake_cupy(monkeypatch):
    calls = []
    rt = types.SimpleNamespace(
        getDevice=lambda: 0,
        eventRecord=lambda ev, st: calls.append(("record", ev, st)),
        streamWaitEvent=lambda st, ev, flags: calls.append(("wait", st, ev, flags)),
    )
    cuda = types.SimpleNamespace(ExternalStream=_ExternalStream, Event=_Event, runtime=rt,
                                 alloc_pinned_memory=lambda n: _Pinned(n))
    mod = types.ModuleType("cupy")
    mod.cuda = cuda
    mod.uint8, mod.int32 = np.uint8, np.int32
    mod.empty = lambda n, dtype=None: _Buf(n)
    monkeypatch.setitem(__import__("sys").modules, "cupy", mod)
    mod.calls = calls
    return mod


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


# ---------------------------------------------------------------------------------------
# C1: split-KV workspace
def test_workspace_per_device_stream_thread(fake_cupy):
    reg = cuda_workspace.Workspaces()
    a, a_buf = reg.workspace(0, 0).partials(4096)
    assert reg.workspace(0, 0).partials(4096)[0] == a, "same device/stream/thread reuses its buffer"
    assert reg.workspace(1, 0).partials(4096)[0] != a, "null stream of another device: another buffer"
    assert reg.workspace(0, 7).partials(4096)[0] != a, "another stream: another buffer"
    assert _in_thread(lambda: reg.workspace(0, 0).partials(4096)[0]) != a, "another thread: another buffer"
    big, big_buf = reg.workspace(0, 0).partials(64 << 20)
    assert big != a and reg.workspaces()[(0, 0, threading.get_ident())]._partials.size >= 64 << 20
    assert a_buf.data.ptr == a, "the old buffer stays valid for whoever holds it (bound calls)"


def test_workspace_lifetime(fake_cupy, monkeypatch):
    """Made on first use, owned by the registry; release()/clear() drop the registry's buffers
    (whoever holds one keeps it) and the next use makes new ones. The backend reads the
    registry from ``cuda_workspace.WORKSPACES`` at call time."""
    fake_cupy.zeros = lambda n, dtype=None: _Buf(n)
    reg = cuda_workspace.Workspaces()
    monkeypatch.setattr(cuda_workspace, "WORKSPACES", reg)
    assert reg.workspaces() == {}
    ws = cuda_workspace.WORKSPACES.workspace(0, 5)
    assert ws.dev == 0 and ws.stream == 5 and list(reg.workspaces()) == [(0, 5, threading.get_ident())]
    p, buf = ws.partials(100)
    c, cnt = ws.counters(10)
    assert ws.partials(100)[0] == p and ws.counters(10)[0] == c
    ws.release()
    assert ws.partials(100)[0] != p and ws.counters(10)[0] != c, "released: new buffers"
    assert buf.data.ptr == p and cnt.data.ptr == c, "held buffers stay valid"
    st = reg.staging(0)
    st.get("q", 10)
    reg.clear()
    assert reg.workspaces() == {} and reg.workspace(0, 5) is not ws
    assert reg.staging(0) is not st, "clear() drops every thread's staging"
    st.release()
    assert st.pinned == {} and st.device == {}


# ---------------------------------------------------------------------------------------
# C2: staging buffers of flash_attn_ext_host
def test_staging_per_thread_and_device(fake_cupy):
    reg = cuda_workspace.Workspaces()
    s0 = reg.staging(0)
    assert reg.staging(0) is s0
    assert reg.staging(1) is not s0
    other = _in_thread(lambda: reg.staging(0))
    assert other is not s0
    hp, dp = s0.get("q", 100)
    assert s0.get("q", 100) == (hp, dp), "a slot is reused while it is large enough"
    assert other.get("q", 100) != (hp, dp), "threads never share staging memory"


# ---------------------------------------------------------------------------------------
# C3: what a plan builds on one stream (row intervals, tile maps, the aligned mask), used on another
def test_plan_orders_other_streams_after_the_build(fake_cupy, monkeypatch):
    builds, rows, copies = [], [], []

    def fake_rows(mask, n_batch, stream):
        rows.append(stream)
        return "lohi"

    def fake_build(mask, n_batch, tq, stream, lohi):
        assert lohi == "lohi"
        builds.append((tq, stream))
        return ("idx", "cnt", "flags", (0x100 + tq, 0x200 + tq, 0x300))

    def fake_copy(mask, n_batch, stream):
        copies.append(stream)
        return ("aligned-desc", "buffer")
    monkeypatch.setattr(cuda_plan, "_build_row_intervals", fake_rows)
    monkeypatch.setattr(cuda_plan, "_build_live_map", fake_build)
    monkeypatch.setattr(cuda_plan, "_aligned_mask_copy", fake_copy)
    mask = from_array(np.zeros((1, 1, 8, 128), dtype=np.float16))
    plan = cb.Plan(mask, 8, 4, 1)
    calls = fake_cupy.calls

    assert plan.live(64, 5) == (0x140, 0x240, 0x300)
    assert builds == [(64, 5)] and rows == [5]
    assert [c[0] for c in calls] == ["record", "record"] and calls[0][2] == calls[1][2] == 5
    ev_rows, ev_map = calls[0][1], calls[1][1]
    plan.live(64, 5)                       # same stream: nothing added
    assert len(calls) == 2 and builds == [(64, 5)]
    plan.live(64, 9)                       # another stream waits for the map's event (recorded
    assert calls[2:] == [("wait", 9, ev_map, 0)] and builds == [(64, 5)]   # after the intervals)
    del calls[:]
    plan.live(16, 7)                       # lazily built map on a third stream: it reads the row
    assert calls[0] == ("wait", 7, ev_rows, 0)   # intervals, so it waits for them first
    assert builds[-1] == (16, 7) and calls[1][0] == "record" and calls[1][2] == 7
    plan.live(16, 7)
    assert len(calls) == 2
    assert rows == [5], "row intervals are built once per plan, shared by every tile size"
    del calls[:]
    assert plan.aligned(5) == "aligned-desc" and copies == [5] and calls[0][0] == "record"
    ev_copy = calls[0][1]
    assert plan.aligned(9) == "aligned-desc" and copies == [5], "the aligned mask is copied once"
    assert calls[1] == ("wait", 9, ev_copy, 0)


# ---------------------------------------------------------------------------------------
# C4: a tile map's buffers: the hidden-column words after the live entries, in one buffer
def test_live_words_layout():
    for ne33, nq, nk, ne32 in [(1, 1, 1, 1), (1, 3, 5, 1), (2, 7, 9, 2), (1, 4, 4, 3)]:
        off, total = cb.live_words(ne33, nq, nk, ne32)
        n = ne33 * nq * nk
        assert off >= n and off % 2 == 0 and off - n <= 1, "entries, then 8-byte aligned words"
        assert total == off + 2 * n * ne32, "one u64 per (entry, mask head plane)"


class _Arr:
    """A device array of the fake cupy: a size, a dtype and a base pointer (views keep it)."""
    _next = 0x10000000

    def __init__(self, n, dtype, ptr=None):
        self.size, self.dtype = n, np.dtype(dtype)
        if ptr is None:
            _Arr._next += 0x1000000
            ptr = _Arr._next
        self.data = types.SimpleNamespace(ptr=ptr)

    def __getitem__(self, sl):
        start, stop, _ = sl.indices(self.size)
        return _Arr(stop - start, self.dtype, self.data.ptr + start * self.dtype.itemsize)


@pytest.mark.parametrize("finite", [False, True])
def test_build_live_map_hands_the_hidden_words_to_scan_and_compact(finite, fake_cupy, monkeypatch):
    """The scan gets the flags, row intervals and hidden words, and whether to mark FINITE tiles
    (cuda_launch.FINITE_MASK_TILES, read at the build); the compaction the same buffers."""
    from ggml_attn import cuda_launch
    monkeypatch.setattr(cuda_launch, "FINITE_MASK_TILES", finite)
    fake_cupy.uint64 = np.uint64
    fake_cupy.empty = lambda n, dtype=None: _Arr(n, dtype)
    launches = []

    class _Fn:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, block, stream, p, *ptrs):
            launches.append((self.name, grid, stream, p.q_tile_tokens, p.n_q_tiles, p.n_kv_tiles,
                             [x.value for x in ptrs]))

        def bound(self, grid, block, stream, *args):
            return lambda: self.launch(grid, block, stream, *args)
    monkeypatch.setattr(K, "get_function", lambda var, name, smem=0: _Fn(name))
    mask = from_array(np.zeros((1, 2, 40, 200), dtype=np.float16))   # n_kv 200, ne32 2
    lohi = _Arr(2 * 40 * 2, np.int32)
    idx, cnt, flags, ptrs, buf, hidden = cuda_plan._build_live_map(mask, 37, 16, 5, lohi)
    n_q, n_kv = 3, 4
    n = n_q * n_kv
    off, total = cb.live_words(1, n_q, n_kv, 2)
    assert idx.size == n and idx.data.ptr == buf.data.ptr and buf.size == total
    assert hidden.size == n * 2 and hidden.dtype == np.uint64
    assert ptrs == (buf.data.ptr, cnt.data.ptr, lohi.data.ptr)
    (scan, sgrid, sst, tq, nq, nk, sargs), (comp, cgrid, cst, *_, cargs) = launches
    assert (scan, comp) == ("fattn_mask_scan", "fattn_mask_compact") and sst == cst == 5
    assert (sgrid, cgrid, tq, nq, nk) == ((n_kv, n_q, 1), (n_q, 1, 1), 16, n_q, n_kv)
    assert sargs == [flags.data.ptr, lohi.data.ptr, hidden.data.ptr, int(finite)]
    assert cargs == [flags.data.ptr, buf.data.ptr, cnt.data.ptr, hidden.data.ptr]


# ---------------------------------------------------------------------------------------
# H1: cubin cache
def test_cache_key_covers_include_dirs_and_header(tmp_path, monkeypatch):
    v = K.util_variant()
    monkeypatch.setattr(K, "_HDR_HASH", {})
    a, b = tmp_path / "a", tmp_path / "b"
    for d, text in ((a, "// fp16 v1\n"), (b, "// fp16 v1\n")):
        d.mkdir()
        (d / "cuda_fp16.h").write_text(text)
    base = ["-std=c++17", "-arch=sm_90"]
    ka = K.cache_key(v, "sm_90", base + [f"-I{a}"], (13, 0))
    assert K.cache_key(v, "sm_90", base + [f"-I{a}"], (13, 0)) == ka
    assert K.cache_key(v, "sm_90", base + [f"-I{b}"], (13, 0)) != ka, "include dir is in the key"
    assert K.cache_key(v, "sm_90", base + ["-O3", f"-I{a}"], (13, 0)) != ka, "every option is"
    c = tmp_path / "c"
    c.mkdir()
    (c / "cuda_fp16.h").write_text("// fp16 v2\n")
    kc = K.cache_key(v, "sm_90", base + [f"-I{c}"], (13, 0))
    monkeypatch.setattr(K, "_HDR_HASH", {})
    (c / "cuda_fp16.h").write_text("// fp16 v1\n")
    assert K.cache_key(v, "sm_90", base + [f"-I{c}"], (13, 0)) != kc, "header content is in the key"


@pytest.mark.skipif(not K.nvrtc_available(), reason="NVRTC library not installed")
def test_unloadable_cached_cubin_is_recompiled(tmp_path, monkeypatch):
    K.ensure_cuda_namespace()
    pytest.importorskip("cupy")
    from cupy.cuda import driver
    monkeypatch.setenv("GGML_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    v = K.util_variant()
    good = K.compile_variant(v, "sm_90")
    (cubin,) = tmp_path.glob("util-*.cubin")
    assert cubin.read_bytes() == good.cubin
    cubin.write_bytes(b"not a cubin")          # stale / corrupt cache entry
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    loaded = []

    def load(data):
        if not bytes(data).startswith(b"\x7fELF"):
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")
        loaded.append(data)
        return 1
    monkeypatch.setattr(driver, "moduleLoadData", load)
    monkeypatch.setattr(driver, "moduleGetFunction", lambda mod, name: name)
    funcs = K._load_module(v, "sm_90")
    assert len(loaded) == 1 and set(funcs) == set(v.names)
    assert cubin.read_bytes().startswith(b"\x7fELF"), "the recompiled cubin replaces the bad one"


def test_unaligned_q_is_copied_before_launch():
    """Q views whose pointer or strides are not 16-byte multiples take an aligned copy."""
    from ggml_attn.cuda_backend import q_needs_aligned_copy
    from ggml_attn.tensor import TensorDesc
    D, nb = 128, 5
    aligned = TensorDesc(1 << 20, 0, (D, nb, 8, 1), (4, 4 * D, 4 * D * nb, 4 * D * nb * 8), "q")
    assert not q_needs_aligned_copy(aligned)
    assert q_needs_aligned_copy(TensorDesc(aligned.ptr + 4, 0, aligned.ne, aligned.nb, "q"))
    odd_rows = TensorDesc(aligned.ptr, 0, (D, nb, 8, 1), (4, 4 * D + 4, (4 * D + 4) * nb, 0), "q")
    assert q_needs_aligned_copy(odd_rows)
    one_row = TensorDesc(aligned.ptr, 0, (D, 1, 8, 1), (4, 4 * D + 4, 4 * D * 2, 4 * D * 16), "q")
    assert not q_needs_aligned_copy(one_row)  # the stride of a 1-long dim is never used


@pytest.mark.parametrize("module, knob, value", [("cuda_launch", "PREFILL_PACK", 8), ("cuda_launch", "_WAVES", {}),
                                                 ("cuda_launch", "FUSED_SPLIT_FINISH", True),
                                                 ("dispatch", "DECODE_MAX_BATCH", {1: 1}),
                                                 ("dispatch", "CELLS_MIN_GAIN", 9.0)])
def test_every_knob_set_rekeys_the_call_cache(monkeypatch, module, knob, value):
    """Setting any knob of cuda_launch or dispatch (a listed one or not: PREFILL_PACK and the
    dispatch thresholds were missing from the hand-made key) gives calls a new key, so they are
    configured again under it; setting it back does too (the earlier entries stay unused)."""
    import importlib
    mod = importlib.import_module(f"ggml_attn.{module}")
    q = from_array(np.zeros((1, 4, 8, 64), np.float32))
    kv = from_array(np.zeros((1, 2, 256, 64), np.float16), 1)
    dst = from_array(np.zeros((1, 4, 8, 64), np.float32))

    def key():
        return cb._call_key(q, kv, kv, None, None, dst, 0.125, 0.0, 0.0, "auto", None, 0)
    before = key()
    assert key() == before
    monkeypatch.setattr(mod, knob, value)
    after = key()
    assert after != before
    monkeypatch.undo()
    assert key() not in (before, after)


def test_reference_on_device_descriptors_copies_on_the_op_stream(fake_cupy):
    """K/V without a GPU kernel (F32) run the numpy reference: its copies down and up go on the
    op's stream (a plain cudaMemcpy runs on the legacy stream, which a non-blocking stream's next
    kernel does not wait for, and returns from a pageable host -> device copy before the DMA is
    done: the flaky logits of the GPU test of xp_rope_store on an F32 cache), and the stream is
    synchronized after the upload (the host buffer goes on return)."""
    import ctypes
    from ggml_attn.reference import flash_attn_ext
    calls = fake_cupy.calls
    rt = fake_cupy.cuda.runtime
    rt.memcpyDeviceToHost, rt.memcpyHostToDevice = 2, 1
    rt.memcpy = lambda *a: calls.append(("memcpy",) + a)

    def memcpy_async(dst, src, n, kind, stream):
        calls.append(("async", kind, stream))
        ctypes.memmove(dst, src, n)
    rt.memcpyAsync = memcpy_async
    rt.streamSynchronize = lambda st: calls.append(("sync", st))
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)      # numpy order (ne3, ne2=n_head, ne1, D)
    k = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    dst = np.full((1, 3, 2, 64), np.nan, np.float32)               # (ne3, n_batch, n_head, D)
    t = [from_array(a) for a in (q, k, v, dst)]
    cb._reference_device(t[0], t[1], t[2], None, None, t[3], 0.125, 0.0, 0.0, 0x5)
    assert not [c for c in calls if c[0] == "memcpy"], calls
    assert all(c[2] == 0x5 for c in calls if c[0] == "async") and calls[0] == ("sync", 0x5)
    assert [c[:2] for c in calls[-2:]] == [("async", 1), ("sync", 0x5)], "the upload, then the wait for it"
    want = flash_attn_ext(q, k, v, None, 0.125, 0.0, 0.0, None, dtype=np.float32)
    np.testing.assert_array_equal(dst, want)
