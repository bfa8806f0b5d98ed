"""Every bad input of flash_attn_ext raises ValueError at graph-build time, naming the
tensor, its shape and what was expected."""
import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_build import new_context

F32, F16, BF16, Q8_0 = ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16, ggml.GGML_TYPE_BF16, ggml.GGML_TYPE_Q8_0


@pytest.fixture
def ctx():
    c = new_context(0)
    yield c
    ggml.ggml_free(c)


def t4(ctx, type_, *ne):
    return ggml.ggml_new_tensor_4d(ctx, type_, *ne)


def good(ctx, **over):
    """q [64, 4, 8, 1], k/v [64, 32, 2, 1] f16, mask [32, 4, 1, 1] f16, sinks [8] f32."""
    a = dict(q=t4(ctx, F32, 64, 4, 8, 1), k=t4(ctx, F16, 64, 32, 2, 1), v=t4(ctx, F16, 64, 32, 2, 1),
             mask=t4(ctx, F16, 32, 4, 1, 1), sinks=ggml.ggml_new_tensor_1d(ctx, F32, 8),
             scale=0.125, max_bias=0.0)
    a.update(over)
    return a


def call(ctx, a):
    return ggml_attn.flash_attn_ext(ctx, a["q"], a["k"], a["v"], a["mask"], a["scale"],
                                    a["max_bias"], 0.0, a["sinks"])


def test_quantized_kv_accepted(ctx):
    out = call(ctx, good(ctx, k=t4(ctx, Q8_0, 64, 32, 2, 1), v=t4(ctx, ggml.GGML_TYPE_Q4_0, 64, 32, 2, 1)))
    assert list(out.contents.ne[:4]) == [64, 8, 4, 1]


def test_good_inputs_build(ctx):
    out = call(ctx, good(ctx))
    assert list(out.contents.ne[:4]) == [64, 8, 4, 1]
    assert out.contents.type == F32


BAD = {
    "q_type": (lambda c: {"q": t4(c, F16, 64, 4, 8, 1)}, r"q .*\[64, 4, 8, 1\].*expected type f32, got f16"),
    "k_quantized_partial_block": (lambda c: {"q": t4(c, F32, 40, 4, 8, 1), "k": t4(c, Q8_0, 40, 32, 2, 1),
                                             "v": t4(c, F16, 40, 32, 2, 1)},
                                  r"k .*q8_0: head size 40 is not a multiple of q8_0's block size 32"),
    "v_type": (lambda c: {"v": t4(c, ggml.GGML_TYPE_I32, 64, 32, 2, 1)},
               r"v .*i32: expected type f32, f16, bf16 or a quantized type ggml can dequantize, got i32"),
    "head_size": (lambda c: {"k": t4(c, F16, 128, 32, 2, 1), "v": t4(c, F16, 128, 32, 2, 1)},
                  r"k .*\[128, 32, 2, 1\].*head size ne\[0\]=128 must equal q's ne\[0\]=64"),
    "gqa": (lambda c: {"k": t4(c, F16, 64, 32, 3, 1), "v": t4(c, F16, 64, 32, 3, 1)},
            r"n_head=8 must be a multiple of n_head_kv=3"),
    "kv_len": (lambda c: {"v": t4(c, F16, 64, 31, 2, 1)}, r"v .*n_kv ne\[1\]=31 must equal k's ne\[1\]=32"),
    "kv_heads": (lambda c: {"v": t4(c, F16, 64, 32, 1, 1)}, r"v .*n_head_kv ne\[2\]=1 must equal k's ne\[2\]=2"),
    "kv_streams": (lambda c: {"v": t4(c, F16, 64, 32, 2, 2)}, r"v .*streams ne\[3\]=2 must equal k's ne\[3\]=1"),
    "q_streams": (lambda c: {"q": t4(c, F32, 64, 4, 8, 2)}, r"k .*streams ne\[3\]=1 must equal q's ne\[3\]=2"),
    "mask_type": (lambda c: {"mask": t4(c, F32, 32, 4, 1, 1)}, r"mask .*\[32, 4, 1, 1\].*expected type f16, got f32"),
    "mask_noncontig": (lambda c: {"mask": ggml.ggml_permute(c, t4(c, F16, 32, 4, 1, 1), 1, 0, 2, 3)},
                       r"mask .*must be contiguous"),
    "mask_nkv": (lambda c: {"mask": t4(c, F16, 33, 4, 1, 1)}, r"mask .*ne\[0\]=33 must equal n_kv=32"),
    "mask_rows": (lambda c: {"mask": t4(c, F16, 32, 3, 1, 1)}, r"mask .*ne\[1\]=3 rows, need at least n_batch=4"),
    "mask_heads": (lambda c: {"mask": t4(c, F16, 32, 4, 3, 1)}, r"mask .*ne\[2\]=3 must divide n_head=8"),
    "mask_streams": (lambda c: {"mask": t4(c, F16, 32, 4, 1, 2)}, r"mask .*ne\[3\]=2 must divide q's ne\[3\]=1"),
    "alibi_without_mask": (lambda c: {"mask": None, "max_bias": 8.0}, r"max_bias=8.0 > 0 \(ALiBi\) requires a mask"),
    "sinks_shape": (lambda c: {"sinks": ggml.ggml_new_tensor_1d(c, F32, 4)}, r"sinks .*\[4, 1, 1, 1\].*expected f32 \[8\]"),
    "sinks_type": (lambda c: {"sinks": ggml.ggml_new_tensor_1d(c, F16, 8)}, r"sinks .*expected f32 \[8\]"),
    "scale_nan": (lambda c: {"scale": float("nan")}, r"scale=nan must be finite"),
    "k_rows_strided": (lambda c: {"k": ggml.ggml_permute(c, t4(c, F16, 32, 64, 2, 1), 1, 0, 2, 3)},
                       r"k .*rows must be contiguous"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_message(ctx, name):
    change, pattern = BAD[name]
    with pytest.raises(ValueError, match=pattern):
        call(ctx, good(ctx, **change(ctx)))


def test_from_array_describes_quantized_rows():
    """from_array(uint8 rows, quantized type): ne[0] the row's values, nb[0] the block bytes,
    byte strides as the array has them (a cache view of a wider buffer too); as_numpy inverts it."""
    from ggml_attn.quant import quantize
    from ggml_attn.tensor import as_numpy, from_array
    x = np.random.default_rng(0).standard_normal((1, 4, 100, 128)).astype(np.float32)
    for t, bsz in ((8, 34), (2, 18)):
        q = quantize(x, t)
        d = from_array(q, t)
        assert d.ne == (128, 100, 4, 1) and d.nb == (bsz, 4 * bsz, 400 * bsz, 1600 * bsz)
        assert np.array_equal(as_numpy(d), q)
        wide = np.zeros(q.shape[:-1] + (q.shape[-1] + bsz,), np.uint8)
        wide[..., :q.shape[-1]] = q
        v = from_array(wide[..., :q.shape[-1]], t)
        assert v.ne == d.ne and v.nb[1] == 5 * bsz and np.array_equal(as_numpy(v), q)
    with pytest.raises(ValueError, match="uint8 rows of whole blocks"):
        from_array(np.zeros((2, 33), np.uint8), 8)
    with pytest.raises(ValueError, match="uint8 rows of whole blocks"):
        from_array(np.zeros((2, 34), np.float32), 8)
