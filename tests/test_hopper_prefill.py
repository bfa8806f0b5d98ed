"""ggml_attn.hopper_prefill's checks, without a GPU: what the sm_90a prefills take."""
from __future__ import annotations

from ggml_attn import hopper_prefill as hp
from ggml_attn import wgmma_shape as ws
from ggml_attn.cuda_backend import AttnDims
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32
from ggml_attn.tensor import TensorDesc


def _t(ptr=256, nb1=256):
    return TensorDesc(ptr, GGML_TYPE_F16, (128, 64, 2, 1), (2, nb1, nb1 * 64, nb1 * 128))


def test_takes_its_head_size_f16_aligned():
    sh = AttnDims(128, 128, 64, 8, 2, 1, 64, GGML_TYPE_F16)
    assert hp.why_not(sh, _t(), _t(), _t()) is None
    assert "takes D 72, 80, 96, 112, 128 " in hp.why_not(AttnDims(64, 64, 64, 8, 2, 1, 64, GGML_TYPE_F16), _t(), _t(), _t())
    assert hp.why_not(AttnDims(64, 64, 64, 8, 2, 1, 64, GGML_TYPE_F16), _t(), _t(), _t(), d=64) is None
    assert "takes D 192, 256 " in hp.why_not(sh, _t(), _t(), _t(), d=256)
    assert "f16" in hp.why_not(AttnDims(128, 128, 64, 8, 2, 1, 64, GGML_TYPE_BF16), _t(), _t(), _t())
    assert "aligned" in hp.why_not(sh, _t(ptr=260), _t(), _t())
    assert "aligned" in hp.why_not(sh, _t(), _t(nb1=264), _t())
    assert "dst" in hp.why_not(sh, _t(), _t(), _t(), TensorDesc(4, 0, (128, 2, 64, 1), (4, 512, 1024, 65536)))


def test_kv_map_rejects_strides_tma_cannot_take():
    """kv_map's tensor map: a stride that is not a multiple of 16 bytes is refused with a message
    naming it (before the driver, which answers only "invalid value")."""
    import pytest
    with pytest.raises(ValueError, match="f16 or bf16"):
        hp.kv_map(TensorDesc(256, 0, (128, 64, 2, 1), (4, 512, 512 * 64, 512 * 128)))   # f32
    with pytest.raises(ValueError, match="stride of dim 2"):
        hp.kv_map(TensorDesc(256, GGML_TYPE_F16, (128, 64, 2, 1), (2, 256, 256 * 64 + 8, 256 * 128 + 16)))


def test_ws_configs_fit_shared_memory():
    """Why the rings are as deep as they are. Each instance's own fit (its C++ ws::smem_bytes, the
    size the launch reads from its program) and the rings one stage deeper that do not fit:
    tests/test_kernels_compile.py test_dynamic_shared_memory_fits."""
    # D 256: 64-cell chunks (a 128-cell chunk and Q leave no room for 2 stages)
    assert 1024 + 2 * 2 * 128 * 256 * 2 + 128 * 256 * 2 > 227 * 1024
    # Q's f32 rows through TMA: none at D 256 (no room even for 1 stage)
    assert not any(c.q_tma for c in hp.WS_CONFIGS.values() if c.d == 256)


def test_instance_names_are_their_template_instances():
    """Each configuration's name is cuda/fattn_wgmma.cu's template with the configuration's K/V
    type, tile width, ring depth, ping-pong, probe mode, persistence, Q path, softmax variant and
    output path (so that no name can run a D 128 kernel on D 64 memory), compiled in a program of
    its own; names are distinct."""
    from ggml_attn import kernels as K
    assert hp.WS_CONFIGS["pp-persistent-qtma-bf16-d64"].name == \
        "fattn_wgmma_ws<__nv_bfloat16, 64, 3, true, 0, true, true, 0, 0>"
    assert hp.WS_CONFIGS["nopp"].name == "fattn_wgmma_ws<__half, 128, 3, false, 0, false, false, 0, 0>"
    assert hp.WS_CONFIGS["pp-persistent-d256"].name == "fattn_wgmma_ws<__half, 256, 2, true, 0, true, false, 0, 0>"
    assert hp.WS_DIAG["diag-nostore-qtma"].name == "fattn_wgmma_ws<__half, 128, 2, true, 3, true, true, 0, 0>"
    assert hp.WS_CONFIGS["pp-persistent-qtma-lazy-otma"].name == \
        "fattn_wgmma_ws<__half, 128, 2, true, 0, true, true, 1, 1>"
    every = {**hp.WS_CONFIGS, **hp.WS_DIAG}
    names = [c.name for c in every.values()]
    assert len(set(names)) == len(names)
    assert all(K.wgmma_variant(n).names == (n,) for n in names)
    assert {v.names[0] for v in K.hopper_variants() if v.family == "wgmma"} == set(names)


# ---- dispatch: when auto runs the sm_90a prefill ("prefill-wgmma") -- without a GPU
def _f(**kw):
    from ggml_attn.dispatch import CallFacts
    base = dict(n_batch=4096, gqa=4, n_kv=4096, head_dim_k=128, head_dim_v=128, kv_type=GGML_TYPE_F16, arch="sm_90")
    base.update(kw)
    return CallFacts(**base)


def test_auto_prefers_wgmma_on_sm90_for_plain_calls():
    from ggml_attn.dispatch import best_kernel
    c = best_kernel("auto", _f())
    assert c.kernel == "prefill-wgmma" and "wgmma" in c.reason
    assert best_kernel("auto", _f(mask_tiles="plain")).kernel == "prefill-wgmma"
    assert best_kernel("auto", _f(kv_type=GGML_TYPE_BF16)).kernel == "prefill-wgmma"


def test_auto_keeps_mma_where_wgmma_does_not_apply():
    """Another architecture, other head sizes or K/V type, sinks/softcap/ALiBi, a mask with
    MASKED/HIDDEN tiles (or not measured), few tokens, decode shapes, unaligned K/V."""
    from ggml_attn.dispatch import WGMMA_MIN_BATCH, best_kernel
    for kw in (dict(arch="sm_80"), dict(arch=""), dict(head_dim_k=192, head_dim_v=128),
               dict(plain=False), dict(mask_tiles="masked"), dict(n_batch=WGMMA_MIN_BATCH - 1)):
        assert best_kernel("auto", _f(**kw)).kernel == "prefill", kw
    assert best_kernel("auto", _f(kv_type=GGML_TYPE_F32)).kernel != "prefill-wgmma"
    assert best_kernel("auto", _f(head_dim_k=128, head_dim_v=64)).kernel != "prefill-wgmma"
    assert best_kernel("auto", _f(n_batch=1)).kernel == "decode-tc"   # (the sm_90a decode: tests/test_decode_tma.py)
    assert best_kernel("auto", _f(kv_aligned=False)).kernel == "reference"


def test_wgmma_by_name_says_why_not():
    import pytest

    from ggml_attn.dispatch import best_kernel
    # asked for by name: any size, any mask (MASKED tiles are read from the mask: slow, right)
    assert best_kernel("prefill-wgmma", _f(n_batch=64)).kernel == "prefill-wgmma"
    assert best_kernel("prefill-wgmma", _f(mask_tiles="masked")).kernel == "prefill-wgmma"
    for kw, words in ((dict(arch="sm_89"), "compute capability 9.0"), (dict(head_dim_k=48, head_dim_v=48), "D 40, 64, 72, 80, 96, 112, 128, 192, 256"),
                      (dict(head_dim_k=256, head_dim_v=128), r"head_dim_k = head_dim_v"),
                      (dict(kv_type=GGML_TYPE_F32), "f16/bf16"), (dict(plain=False), "sinks")):
        with pytest.raises(ValueError, match=words):
            best_kernel("prefill-wgmma", _f(**kw))


def test_wgmma_launch_config(monkeypatch):
    """One fixed shape: 384 threads, 128-token blocks (the plan's tile map for them), 64-cell plan
    tiles counted for the live lists, no split; by default the persistent instance of the call's
    K/V type with one block per SM (at most one per tile; f16's with the lazy reference maximum
    and the TMA epilogue); WGMMA_CONFIG="pp": one block per tile,
    heads fastest in the grid."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    for kv_type, name in ((GGML_TYPE_F16, "fattn_wgmma_ws<__half, 128, 2, true, 0, true, true, 1, 1>"),
                          (GGML_TYPE_BF16, "fattn_wgmma_ws<__nv_bfloat16, 128, 2, true, 0, true, true, 0, 0>")):
        cfg = L.launch_config("prefill-wgmma", L.AttnDims(128, 128, 300, 32, 8, 2, 1000, kv_type))
        assert (cfg.block, cfg.q_tile_tokens, cfg.n_q_tiles, cfg.n_kv_tiles, cfg.n_splits) == (384, 128, 3, 16, 1)
        assert cfg.name == name and cfg.grid == (132, 1, 1)
    assert L.launch_config("prefill-wgmma", L.AttnDims(128, 128, 100, 1, 1, 1, 1000, GGML_TYPE_F16)).grid == (1, 1, 1)
    monkeypatch.setattr(L, "WGMMA_CONFIG", "pp")
    cfg = L.launch_config("prefill-wgmma", L.AttnDims(128, 128, 300, 32, 8, 2, 1000, GGML_TYPE_F16))
    assert cfg.name == "fattn_wgmma_ws<__half, 128, 3, true, 0, false, false, 0, 0>" and cfg.grid == (32, 3, 2)


def test_ws_config_matches_the_kv_type():
    """Every K/V type dispatch lets through has an instance of its own type; an override for
    another type, or an unknown one, is refused."""
    import pytest
    for kv_type in (GGML_TYPE_F16, GGML_TYPE_BF16):
        for d in ws.HEAD_SIZES_WS:
            c = hp.WS_CONFIGS[ws.ws_config(kv_type, d=d)]
            assert (c.kv_type, c.d, c.persistent) == (kv_type, ws.tile_width(d), True)
    with pytest.raises(ValueError, match="another K/V type"):
        ws.ws_config(GGML_TYPE_F16, "pp-bf16")
    with pytest.raises(ValueError, match="another K/V type or head size"):
        ws.ws_config(GGML_TYPE_F16, "pp-persistent", d=64)   # a D 128 kernel on D 64 memory
    with pytest.raises(ValueError, match="runs head sizes"):
        ws.ws_config(GGML_TYPE_F16, d=48)
    with pytest.raises(ValueError, match="no wgmma prefill instance"):
        ws.ws_config(GGML_TYPE_F32)


def test_auto_takes_wgmma_at_every_head_size_not_decode_tma():
    """The sm_90a prefill has D 64 and 256 instances (f16 and bf16) and runs 40, 72-112 and 192
    padded (each measured ahead of mma.sync); the sm_90a decode only D 128."""
    from ggml_attn.dispatch import best_kernel, decode_tma_why_not
    for d in (40, 64, 72, 80, 96, 112, 192, 256):
        for kv_type in (GGML_TYPE_F16, GGML_TYPE_BF16):
            c = best_kernel("auto", _f(head_dim_k=d, head_dim_v=d, kv_type=kv_type))
            assert c.kernel == "prefill-wgmma" and f"D {d}" in c.reason, (d, kv_type)
        assert "D 128" in decode_tma_why_not(_f(head_dim_k=d, head_dim_v=d))
    assert decode_tma_why_not(_f()) is None


def test_tile_width_is_the_smallest_instance_that_holds_the_head():
    """Head sizes below a tile width run on it padded (TMA's zero fill past the head): the
    smallest width that holds them, never one that would cut them; other sizes are refused."""
    import pytest
    assert [ws.tile_width(d) for d in ws.HEAD_SIZES_WS] == [64, 64, 128, 128, 128, 128, 128, 256, 256]
    for d in ws.HEAD_SIZES_WS:
        assert d % 8 == 0 and d <= ws.tile_width(d)   # rows of whole 16-byte chunks (TMA, Q's loads)
    for d in (32, 48, 100, 320):
        with pytest.raises(ValueError, match="runs head sizes"):
            ws.tile_width(d)


def test_hopper_prefill_why_not_names_the_padded_sizes():
    """run_ws's check: a head size runs on the instance of its tile width only."""
    for d, width, ok in ((96, 128, True), (96, 64, False), (40, 64, True), (192, 256, True), (192, 128, False),
                         (64, 128, False)):
        sh = AttnDims(d, d, 300, 8, 2, 1, 1000, GGML_TYPE_F16)
        t = TensorDesc(256, GGML_TYPE_F16, (d, 1000, 2, 1), (2, 2 * d, 2 * d * 1000, 2 * d * 2000))
        q = TensorDesc(256, GGML_TYPE_F32, (d, 300, 8, 1), (4, 4 * d, 4 * d * 300, 4 * d * 2400))
        why = hp.why_not(sh, q, t, t, None, GGML_TYPE_F16, width)
        assert (why is None) == ok, (d, width, why)
        if not ok:
            assert f"D {', '.join(str(x) for x in ws.HEAD_SIZES_WS if ws.tile_width(x) == width)}" in why


def test_wgmma_launch_config_per_head_size(monkeypatch):
    """D 64 and 256 calls launch their own instance with its shared memory (2 stages of 64-cell
    chunks at D 256); the plan's tiles stay 128 tokens by 64 cells."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    for d, kv_type, name in ((64, GGML_TYPE_F16, "fattn_wgmma_ws<__half, 64, 3, true, 0, true, true, 0, 0>"),
                             (64, GGML_TYPE_BF16, "fattn_wgmma_ws<__nv_bfloat16, 64, 3, true, 0, true, true, 0, 0>"),
                             (40, GGML_TYPE_F16, "fattn_wgmma_ws<__half, 64, 3, true, 0, true, true, 0, 0>"),
                             (96, GGML_TYPE_F16, "fattn_wgmma_ws<__half, 128, 2, true, 0, true, true, 1, 1>"),
                             (80, GGML_TYPE_BF16, "fattn_wgmma_ws<__nv_bfloat16, 128, 2, true, 0, true, true, 0, 0>"),
                             (256, GGML_TYPE_F16, "fattn_wgmma_ws<__half, 256, 2, true, 0, true, false, 0, 0>"),
                             (192, GGML_TYPE_F16, "fattn_wgmma_ws<__half, 256, 2, true, 0, true, false, 0, 0>"),
                             (256, GGML_TYPE_BF16, "fattn_wgmma_ws<__nv_bfloat16, 256, 2, true, 0, true, false, 0, 0>")):
        cfg = L.launch_config("prefill-wgmma", L.AttnDims(d, d, 300, 32, 8, 2, 1000, kv_type))
        assert cfg.name == name and cfg.grid == (132, 1, 1)
        assert (cfg.block, cfg.q_tile_tokens, cfg.n_q_tiles, cfg.n_kv_tiles) == (384, 128, 3, 16)


def test_persistent_grid():
    """Persistent blocks: at most one per SM, never more than the tiles; the plain grid otherwise."""
    from ggml_attn.wgmma_shape import ws_grid
    assert ws_grid(4096, 32, 1, 132) == (132, 1, 1)
    assert ws_grid(100, 2, 1, 132) == (2, 1, 1)
    assert ws_grid(300, 32, 2) == (32, 3, 2)


def test_wgmma_config_knob_checks_the_kv_type(monkeypatch):
    """A WGMMA_CONFIG for bf16 on an f16 call is refused (it would run bf16 wgmma on f16 bits);
    WGMMA_PERSISTENT_BLOCKS caps a persistent grid."""
    import pytest

    from ggml_attn import cuda_launch as L
    sh = L.AttnDims(128, 128, 4096, 32, 8, 1, 4096, GGML_TYPE_F16)
    monkeypatch.setattr(L, "WGMMA_CONFIG", "pp-bf16")
    with pytest.raises(ValueError, match="K/V type"):
        L.launch_config("prefill-wgmma", sh)
    monkeypatch.setattr(L, "WGMMA_CONFIG", "pp-persistent")
    monkeypatch.setattr(L, "WGMMA_PERSISTENT_BLOCKS", 5)
    assert L.launch_config("prefill-wgmma", sh).grid == (5, 1, 1)


def test_packed_tiles_launch_config(monkeypatch):
    """Tiles of several query heads: WGMMA_RAGGED_PACK of them (at most gqa's power-of-2 part)
    when the plan is not wide, on an instance with Q through TMA and a mask of one head plane;
    128 / pack tokens a tile (the plan's map for them), the grid over head groups; one head a tile
    otherwise (no plan verdict, a wide plan, mask planes per head, gqa 1, per-tile Q loads)."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    sh = L.AttnDims(128, 128, 1000, 32, 8, 1, 2048, GGML_TYPE_F16)
    for pack in (2, 4, 8):
        monkeypatch.setattr(L, "WGMMA_RAGGED_PACK", pack)
        cfg = L.launch_config("prefill-wgmma", sh, wide=False)
        want = min(pack, 4)   # gqa 4
        assert (cfg.pack, cfg.q_tile_tokens, cfg.n_q_tiles) == (want, 128 // want, -(-1000 // (128 // want)))
        assert cfg.rows == 128 and cfg.grid == (132, 1, 1)
    monkeypatch.setattr(L, "WGMMA_RAGGED_PACK", 2)
    assert L.launch_config("prefill-wgmma", sh, wide=False).grid == (132, 1, 1)
    for kw, shape in ((dict(wide=None), sh), (dict(wide=True), sh),
                      (dict(wide=False), L.AttnDims(128, 128, 1000, 32, 8, 1, 2048, GGML_TYPE_F16, 32)),
                      (dict(wide=False), L.AttnDims(128, 128, 1000, 8, 8, 1, 2048, GGML_TYPE_F16))):
        cfg = L.launch_config("prefill-wgmma", shape, **kw)
        assert (cfg.pack, cfg.q_tile_tokens) == (1, 128), kw
    monkeypatch.setattr(L, "WGMMA_CONFIG", "pp-persistent")   # Q loaded per tile: one head a tile
    assert L.launch_config("prefill-wgmma", sh, wide=False).pack == 1


def test_packed_tile_shapes():
    """A warpgroup's 64 rows as the Q map's box lands them: 64 tokens of one head for 1 or 2 heads
    a tile, 128 / pack tokens of 64 / that many heads beyond; the grid over n_head / pack groups."""
    from ggml_attn.wgmma_shape import ws_grid, ws_q_tiles, ws_rows_tokens
    import pytest
    assert [ws_rows_tokens(p) for p in (1, 2, 4, 8)] == [64, 64, 32, 16]
    with pytest.raises(ValueError, match="one of"):
        ws_rows_tokens(16)   # a warp's 16 rows would span two heads
    assert ws_q_tiles(1000, 1) == 8 and ws_q_tiles(1000, 2) == 16 and ws_q_tiles(1000, 8) == 63
    assert ws_grid(1000, 32, 2, 0, 4) == (8, 32, 2)
    assert ws_grid(1000, 32, 2, 132, 4) == (132, 1, 1)
    assert ws_grid(10, 8, 1, 132, 8) == (1, 1, 1)


def test_q_map_refuses_what_tma_cannot_take():
    """q_map's tensor map: f32 Q only; a token stride that is not a multiple of 16 bytes is refused
    with a message naming the dimension (before the driver is asked)."""
    import pytest
    with pytest.raises(ValueError, match="f32 only"):
        hp.q_map(TensorDesc(256, GGML_TYPE_F16, (128, 64, 8, 1), (2, 256, 256 * 64, 256 * 512)), 128)
    with pytest.raises(ValueError, match="stride of dim 1"):
        hp.q_map(TensorDesc(256, GGML_TYPE_F32, (80, 64, 8, 1), (4, 324, 324 * 64, 324 * 512)), 128)


def test_o_map_boxes_a_warpgroups_rows(monkeypatch):
    """o_map: an instance with the TMA epilogue stores a warpgroup's 64 rows through boxes of 32 f32
    values x 64 / tw heads x tw tokens of dst (the staging order of cuda/fattn_wgmma.cuh
    wg_stage_rows), 128-byte swizzled, over dst's own shape and strides; f32 dst only; any other
    instance gets a zero map (the driver not asked)."""
    import pytest
    from ggml_attn import tma
    seen = []
    monkeypatch.setattr(tma, "encode_tiled", lambda *a: seen.append(a) or tma.TmaMap())
    dst = TensorDesc(512, GGML_TYPE_F32, (96, 32, 300, 2), (4, 384, 384 * 32, 384 * 32 * 300))
    otma = ws.WS_CONFIGS["pp-persistent-qtma-otma"].name
    assert not any(ws.o_map(dst, ws.WS_CONFIGS["pp-persistent-qtma"].name).words) and not seen
    for pack, box in ((1, (32, 1, 64, 1)), (2, (32, 1, 64, 1)), (4, (32, 2, 32, 1)), (8, (32, 4, 16, 1))):
        ws.o_map(dst, otma, pack)
        assert seen[-1] == (tma.DTYPE_F32, 512, dst.ne, dst.nb[1:], box, tma.SWIZZLE_128B)
    with pytest.raises(ValueError, match="f32 only"):
        ws.o_map(TensorDesc(512, GGML_TYPE_F16, (96, 32, 300, 2), (2, 192, 192 * 32, 192 * 32 * 300)), otma)
    assert all(c.q_tma and c.diag == 0 for c in ws.WS_CONFIGS.values() if c.epilogue)   # (the kernel's assert)
    assert not any(any(ws.o_map(dst, ws.WS_CONFIGS[k].name).words)
                   for k in ("pp-persistent-d256", "pp-persistent-qtma-lazy"))
