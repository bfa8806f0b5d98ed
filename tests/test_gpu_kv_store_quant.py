"""q8_0 / q4_0 KV caches on the GPU (#32 items 2-3). GPU only.

* ``dense_kv_store`` (cuda/dense.cu) quantizing F32 rows into q8_0 / q4_0 cache rows, against
  ggml's CPU reference quantization of the same rows (``ggml_attn.quant.quantize``:
  ``ggml_quantize_chunk`` -> ``quantize_row_q8_0_ref`` / ``quantize_row_q4_0_ref``): random rows,
  all-zero rows (+0 and -0), a row with one huge value, rows of equal |values| of both signs
  (q4_0 keeps the first), tiny rows (subnormal F16 scales), D 64 / 128 / 256, destination rows
  scattered over a poisoned cache (other rows untouched);
* an attention-only device graph over a q8_0 / q4_0 CuPy cache against the same graph on a host
  cache of that type (ggml_set_rows writes it): outputs and cache bytes;
* the CLI's CUDA engine with ``-ctk/-ctv q8_0|q4_0``: its attention output against the numpy
  reference over the dequantized cache, and both tools' tables naming the types.

Bit-exactness: the kernel computes what the C reference computes, one IEEE operation at a time
(``__fdiv_rn`` / ``__fmul_rn`` / ``__fadd_rn``: no FMA contraction), so the bytes are expected equal.
Two CPU sides may round differently from that reference, and only there a difference of 1 in a
few quantized values (never in a scale) is allowed, bounded by :func:`_assert_blocks_match`:
ggml's CPU ``set_rows`` quantizes q8_0 with its SIMD ``quantize_row_q8_0`` (x86 AVX: ``x * (127 /
amax)`` instead of ``x * (1 / (amax / 127))``, ties to even), and a C compiler that contracts
``x * id + 8.5f`` into one FMA (e.g. aarch64 GCC) shifts q4_0's truncation at exact boundaries.
"""
import ctypes

import numpy as np
import pytest

import ggml_attn
from ggml_attn.dtypes import GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
from ggml_attn.quant import dequantize_rows, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]

GTYPE = {"q8_0": GGML_TYPE_Q8_0, "q4_0": GGML_TYPE_Q4_0}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}   # f16 scale + 32 int8 / 16 bytes of nibbles
STORE_ID = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}   # ggml type ids: dense.cu's KV_TYPE_*
NMSE_MAX = 5e-4


# ------------------------------------------------------------------------------ helpers
def _quants(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 ``(n_blocks, block_bytes)`` -> int ``(n_blocks, 32)`` quantized values (q4_0: the
    nibbles, low ones first: values 0..15 of block positions 0..15, then 16..31)."""
    body = blocks[:, 2:]
    if qtype == "q8_0":
        return body.view(np.int8).astype(np.int64)
    return np.concatenate([body & 15, body >> 4], axis=1).astype(np.int64)


def _assert_blocks_match(got: np.ndarray, want: np.ndarray, qtype: str, *, off_by_one_frac: float = 0.0) -> None:
    """``got`` and ``want`` uint8 arrays of ``qtype`` rows (same shape, ``(..., row_bytes)``):
    equal bytes, except that up to ``off_by_one_frac`` of the quantized values (at least one
    when nonzero) may differ by exactly 1 (module doc); scales always equal."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.uint8
    if np.array_equal(got, want):
        return
    g = got.reshape(-1, BLOCK_BYTES[qtype])
    w = want.reshape(-1, BLOCK_BYTES[qtype])
    bad_d = np.flatnonzero((g[:, :2] != w[:, :2]).any(axis=1))
    diff = np.abs(_quants(g, qtype) - _quants(w, qtype))
    n_bad, worst = int((diff != 0).sum()), int(diff.max())
    allowed = 0 if off_by_one_frac == 0 else max(1, int(off_by_one_frac * diff.size))
    msg = (f"{qtype}: {bad_d.size} block scale(s) differ (blocks {bad_d[:8].tolist()}), {n_bad} of "
           f"{diff.size} quantized values differ (largest by {worst}; {allowed} off-by-one allowed)")
    assert bad_d.size == 0 and worst <= 1 and n_bad <= allowed, msg


def _store_rows(rng, n_tok: int, n: int) -> np.ndarray:
    """float32 ``(n_tok, n)`` rows with the edge cases first (module doc), then random rows of
    scales from 1e-3 to 1e3."""
    x = rng.standard_normal((n_tok, n)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 3, (n_tok, 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = -0.0
    x[2, 5] = 1e4                                  # one huge value: every other q ~ 0
    x[3] = rng.choice(np.float32([-3, 3]), n)      # equal |values| of both signs: q4_0 keeps the first
    x[3, ::7] = 0.0
    x[4] *= np.float32(1e-6)                       # scales below F16's normal range
    x[5] = np.round(x[5] * 2) / 2                  # many halves: the rounding's ties
    x[6, 40:] = -x[6, :n - 40] if n > 40 else x[6, 40:]
    return x


def _launch_store(src_k, src_v, cache_k, cache_v, rows, type_k: str, type_v: str) -> None:
    """One dense_kv_store launch over CuPy arrays: ``src_*`` float32 ``(n_tok, n)``, ``cache_*``
    ``(n_rows, n)`` float or ``(n_rows, row_bytes)`` uint8, ``rows`` int64 ``(n_tok,)``."""
    import cupy
    from ggml_attn import kernels as K
    p = K.KVStoreParams()
    p.src[0], p.src[1] = src_k.data.ptr, src_v.data.ptr
    p.dst[0], p.dst[1] = cache_k.data.ptr, cache_v.data.ptr
    p.n[0], p.n[1] = src_k.shape[1], src_v.shape[1]
    p.type[0], p.type[1] = STORE_ID[type_k], STORE_ID[type_v]
    p.rows, p.n_tok = rows.data.ptr, rows.shape[0]
    fn = K.get_function(K.dense_variant(), "dense_kv_store")
    args = K.arg_block(p)
    stream = cupy.cuda.get_current_stream()
    fn.launch_raw((rows.shape[0], 2, 1), (128, 1, 1), stream.ptr, ctypes.addressof(args))
    stream.synchronize()


def _empty_cache(rng, type_name: str, n_rows: int, n: int) -> np.ndarray:
    """A poisoned host cache ``(n_rows, n)`` float or ``(n_rows, row_bytes)`` uint8."""
    if type_name in GTYPE:
        return rng.integers(0, 256, (n_rows, n // 32 * BLOCK_BYTES[type_name]), dtype=np.uint8)
    return rng.standard_normal((n_rows, n)).astype(np.float16 if type_name == "f16" else np.float32)


def _stored(cache: np.ndarray, rows: np.ndarray, x: np.ndarray, type_name: str) -> np.ndarray:
    """What the store must leave: ``cache`` with ``rows`` replaced by ``x`` in ``type_name``."""
    want = cache.copy()
    want[rows] = quantize(x, GTYPE[type_name]) if type_name in GTYPE else x.astype(cache.dtype)
    return want


# --------------------------------------------------------------- (a) the store kernel
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("type_k, type_v", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"),
                                            ("f16", "q4_0"), ("q8_0", "f32")])
def test_store_quantizes_as_ggml_reference(d, type_k, type_v):
    import cupy
    rng = np.random.default_rng(d * 7 + len(type_k + type_v))
    n_tok, n_rows = 37, 300
    n_k, n_v = 2 * d, d                               # two K heads, one V head of d values a row
    rows = rng.choice(n_rows, n_tok, replace=False).astype(np.int64)
    k, v = _store_rows(rng, n_tok, n_k), _store_rows(rng, n_tok, n_v)[::-1].copy()
    ck, cv = _empty_cache(rng, type_k, n_rows, n_k), _empty_cache(rng, type_v, n_rows, n_v)
    d_ck, d_cv = cupy.asarray(ck), cupy.asarray(cv)
    _launch_store(cupy.asarray(k), cupy.asarray(v), d_ck, d_cv, cupy.asarray(rows), type_k, type_v)
    for got, cache, x, t in ((d_ck.get(), ck, k, type_k), (d_cv.get(), cv, v, type_v)):
        want = _stored(cache, rows, x, t)
        if t in GTYPE:
            # q8_0 against the C reference: exact; q4_0: an FMA-contracting compiler (module doc)
            _assert_blocks_match(got, want, t, off_by_one_frac=0.0 if t == "q8_0" else 1e-4)
        else:
            assert np.array_equal(got, want), t


def test_store_q4_0_zero_block_scale_is_negative_zero():
    """All-zero q4_0 blocks: ggml's d = +0 / -8 = -0 (F16 0x8000) and every nibble 8; q8_0's d is +0."""
    import cupy
    n = 64
    x = np.zeros((2, n), np.float32)
    x[1] = -0.0
    ck = cupy.zeros((4, n // 32 * 18), np.uint8)
    cv = cupy.zeros((4, n // 32 * 34), np.uint8)
    _launch_store(cupy.asarray(x), cupy.asarray(x), ck, cv, cupy.asarray(np.int64([3, 1])), "q4_0", "q8_0")
    q4, q8 = ck.get(), cv.get()
    assert np.array_equal(q4[[1, 3]], quantize(x[::-1], GGML_TYPE_Q4_0))
    assert np.array_equal(q8[[1, 3]], quantize(x[::-1], GGML_TYPE_Q8_0))
    blk = q4[3].reshape(-1, 18)
    assert (blk[:, 0] == 0x00).all() and (blk[:, 1] == 0x80).all() and (blk[:, 2:] == 0x88).all()   # f16 d: little-endian
    assert not q4[[0, 2]].any() and not q8[[0, 2]].any()


# ------------------------------------------------------ (b) a device graph's q8_0 / q4_0 cache
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("unified, mode", [(False, "equal"), (True, "simple")])
def test_device_graph_over_quantized_cache_matches_host(qtype, unified, mode):
    from ggml_attn.graph import AttnConfig, Batch, KVCache, run_batch
    from ggml_attn.reference import nmse
    cfg = AttnConfig(n_layer=2, n_head=8, n_head_kv=2, head_dim_k=64)

    def cache(xp):
        return KVCache(6 * 512, 6, unified=unified, n_layer=2, n_head_kv=2, head_dim_k=64, xp=xp,
                       type_k=qtype, type_v=qtype)
    host_c, dev_c = cache(None), cache("cupy")
    assert dev_c.k.dtype == np.uint8 and not isinstance(dev_c.k, np.ndarray)
    b = Batch.from_lengths([1, 7, 30, 64, 3, 17])
    ref = run_batch(host_c, b, 512, mode, cfg, compute="ggml")
    got = run_batch(dev_c, b, 512, mode, cfg, compute="ggml")
    assert np.isfinite(got.out).all() and nmse(got.out, ref.out) < NMSE_MAX
    dec = Batch.from_lengths([1] * 6, start_pos=dev_c.next_positions(range(6)))
    d_ref = run_batch(host_c, dec, 512, mode, cfg, compute="ggml")
    d_got = run_batch(dev_c, dec, 512, mode, cfg, compute="ggml")
    assert np.isfinite(d_got.out).all() and nmse(d_got.out, d_ref.out) < NMSE_MAX
    # the cells in use hold the same blocks (the host's q8_0 rows come from ggml-cpu's SIMD
    # quantize_row_q8_0: module doc), the others are untouched zeros on both
    assert np.array_equal(dev_c.pos, host_c.pos)
    used = host_c.pos >= 0   # (n_stream, kv_size)
    for got_b, want_b in ((dev_c.k.get(), host_c.k), (dev_c.v.get(), host_c.v)):
        _assert_blocks_match(got_b[:, used], want_b[:, used], qtype, off_by_one_frac=1e-4)
        assert not got_b[:, ~used].any() and not want_b[:, ~used].any()


# ---------------------------------------------------------------- (c) the CLI's CUDA engine
def _dequantized(cache_rows, qtype: str, n: int) -> np.ndarray:
    """uint8 ``(..., row_bytes)`` of ``qtype`` rows of ``n`` values -> float32 ``(..., n)``."""
    rows = np.ascontiguousarray(cache_rows.reshape(-1, cache_rows.shape[-1]))
    out = dequantize_rows(rows.ctypes.data, GTYPE[qtype], n, rows.shape[0], rows.shape[1])
    return out.reshape(cache_rows.shape[:-1] + (n,))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_cuda_engine_quantized_cache_matches_reference(qtype):
    """The CLI's CUDA engine on a q8_0 / q4_0 cache (a decode step after prompts): its last
    attention output against the numpy reference over the dequantized cache."""
    from ggml_attn import reference
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    m = PRESETS["tiny"]
    lens = [5, 3, 40]
    r = Runner(RunConfig(m, n_ctx=4096, n_seq=len(lens), split="equal", n_ubatch=64, device="cuda",
                         layer="attn", type_k=qtype, type_v=qtype))
    try:
        assert r.cache.type_k == r.cache.type_v == qtype and r.cache.k.dtype == np.uint8
        r.decode(r.prompt_batch(lens))
        r.decode(r.step_batch(list(range(len(lens)))))
        mask, dst, _ = r.engine._keep
        mask, dst = mask.get(), dst.get()
        ns, _, n_tps, n_kv = mask.shape
        q = r.engine.pool.get()[: ns * n_tps * m.n_embd_q].reshape(ns, m.n_head, n_tps, m.head_dim_k)
        s0 = r.engine._last_streams[0]
        k = _dequantized(r.cache.k[m.n_layer - 1].get()[s0:s0 + ns, :n_kv], qtype, m.n_head_kv * m.head_dim_k)
        v = _dequantized(r.cache.v[m.n_layer - 1].get()[s0:s0 + ns, :n_kv], qtype, m.n_head_kv * m.head_dim_v)
        k = k.reshape(ns, n_kv, m.n_head_kv, m.head_dim_k).transpose(0, 2, 1, 3)
        v = v.reshape(ns, n_kv, m.n_head_kv, m.head_dim_v).transpose(0, 2, 1, 3)
        want = reference.flash_attn_ext(q, k, v, mask, 1.0 / np.sqrt(m.head_dim_k))
        assert np.isfinite(dst).all()
        assert reference.nmse(dst, want) < NMSE_MAX
    finally:
        r.close()


def _table(out: str) -> list[dict]:
    """The markdown table of ``out`` as rows of {column: cell}."""
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def test_bench_cli_runs_q8_0_on_the_gpu(capsys):
    from ggml_attn.cli import bench
    rc = bench.main(["-m", "tiny", "--device", "cuda", "-ctk", "q8_0", "-ctv", "q8_0", "-p", "32", "-n", "4",
                     "-r", "1", "--no-warmup"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = _table(out.out)
    assert len(rows) == 2 and all(r["type_k"] == r["type_v"] == "q8_0" for r in rows), out.out
    assert all(float(r["t/s"].split()[0]) > 0 for r in rows)


def test_batched_cli_runs_q4_0_on_the_gpu(capsys):
    import json
    from ggml_attn.cli import batched_bench
    rc = batched_bench.main(["-m", "tiny", "--device", "cuda", "-ctk", "q4_0", "-ctv", "q4_0", "-npp", "16",
                             "-ntg", "4", "-npl", "1,4", "-o", "jsonl"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = [json.loads(ln) for ln in out.out.splitlines()]
    assert len(rows) == 2 and all((r["type_k"], r["type_v"]) == ("q4_0", "q4_0") and r["speed"] > 0 for r in rows)
