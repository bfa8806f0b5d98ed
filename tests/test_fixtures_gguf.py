"""The GGUF fixtures regenerate byte-identically to the ones the llama.cpp reference logits
in tests/data/llamacpp_ref/ were computed from, read back with the expected tensors, and the
reference files are complete.  No llama.cpp needed."""
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import fixtures_gguf as F  # noqa: E402  (tests/ is on sys.path via conftest)

REF = os.path.join(os.path.dirname(__file__), "data", "llamacpp_ref")
N_GEN = 32


def _manifest():
    with open(os.path.join(REF, "MANIFEST.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_fixtures")


def test_manifest_covers_all_fixtures():
    m = _manifest()
    assert set(m["fixtures"]) == set(F.SPECS)
    assert m["settings"]["flash_attn"] is True
    assert m["logits_dtype"] == "float32"


@pytest.mark.parametrize("name", list(F.SPECS))
def test_fixture_bytes_and_tensors(name, fixture_dir):
    pytest.importorskip("ggml")
    spec = F.SPECS[name]
    path = F.fixture_path(name, fixture_dir)
    assert F.sha256(path) == _manifest()["fixtures"][name]["sha256"], \
        f"{name}: regenerated fixture differs from the one the llama.cpp reference was made from"

    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == spec.arch
    assert r.fields[f"{spec.arch}.block_count"].contents() == spec.n_layer
    assert r.fields[f"{spec.arch}.attention.head_count_kv"].contents() == spec.n_head_kv
    assert r.fields[f"{spec.arch}.rope.freq_base"].contents() == pytest.approx(spec.rope_base)
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == spec.n_vocab
    got = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in r.tensors}
    assert got == F.expected_tensors(spec)
    assert ("output.weight" in got) == (not spec.tied_output)
    assert ("rope_freqs.weight" in got) == spec.rope_freqs
    assert ("blk.0.attn_q.bias" in got) == spec.qkv_bias


@pytest.mark.parametrize("name", list(F.SPECS))
def test_reference_npz(name):
    spec = F.SPECS[name]
    info = _manifest()["fixtures"][name]
    z = np.load(os.path.join(REF, f"{name}.npz"))
    V = spec.n_vocab
    for i in range(5):
        toks, lg = z[f"tokens_{i}"], z[f"logits_{i}"]
        n_p = int(z[f"n_prompt_{i}"])
        assert toks.dtype == np.int32 and lg.dtype == np.float32
        assert toks.shape == (n_p + N_GEN,) and lg.shape == (n_p + N_GEN, V)
        assert np.all(np.isfinite(lg))
        assert toks[:n_p].min() >= 3 and toks.max() < V
        # generated tokens are the greedy choices of the stored logits
        assert np.array_equal(toks[n_p:], np.argmax(lg[n_p - 1:-1], axis=1))
        assert z[f"greedy_margins_{i}"].shape == (N_GEN,)
    for k, n_new in (("rm", 6), ("cp", 5)):
        toks, lg = z[f"tokens_{k}"], z[f"logits_{k}"]
        n_keep = int(z[f"n_keep_{k}"])
        assert toks.shape == (n_keep + n_new,) and lg.shape == (n_keep + n_new, V)
        assert np.array_equal(toks[n_keep:], z[f"new_tokens_{k}"])
        assert np.all(np.isfinite(lg))
    assert np.array_equal(z["tokens_rm"][:10], z["tokens_1"][:10])
    assert np.array_equal(z["tokens_cp"][:7], z["tokens_0"][:7])
    m = float(z["min_greedy_margin"])
    assert m == pytest.approx(info["min_greedy_margin"])
    assert m > 0
    # llama.cpp's own flash-attention on/off noise: <1e-5 for F32/F16 (BF16 ~1.4e-5),
    # 1.6e-4 .. 3.2e-4 for the quantized types (Q8 activation rounding on the CPU)
    assert 0 <= float(z["nmse_fa_on_off"]) < 1e-3
    assert z["greedy_agree_fa_off"].shape == (5,)
    print(f"{name}: min_greedy_margin {m:.4g}  nmse_fa_on_off {float(z['nmse_fa_on_off']):.3g}")


def test_ropefreqs_changes_logits():
    a = np.load(os.path.join(REF, "llama-f32.npz"))["logits_3"]
    b = np.load(os.path.join(REF, "llama-f32-ropefreqs.npz"))["logits_3"]
    assert np.sum((a - b) ** 2) / np.sum(a ** 2) > 1e-3


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q4_0", "Q8_0"])
def test_quantized_preset_has_llama_quantize_types(tmp_path, ftype):
    """write_preset's quantized files: each matrix in the type llama-quantize gives it, whole
    blocks of ggml-quantized values (finite, spread as the F16 pool), loadable."""
    import numpy as np
    from ggml_attn.graph import load_gguf
    path = F.write_preset(tmp_path / f"{ftype}.gguf", "small", n_vocab=512, verbose=False, ftype=ftype)
    m = load_gguf(path)
    base, output, more = F.PRESET_FTYPES[ftype]
    assert m.output.type_name == output and m.tok_embd.type_name == base
    n = m.hp.n_layer
    for il, lw in enumerate(m.layers):
        special = more if more and (il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2) else base
        assert (lw["wv"].type_name, lw["wd"].type_name, lw["wq"].type_name) == (special, special, base)
        v = lw["wg"].to_float()
        assert np.isfinite(v).all() and 0.015 < float(v.std()) < 0.025
    if more:   # of 9 layers: 0 (the first eighth), 7 and 8 (the last), 3 and 6 (every third between)
        assert [lw["wv"].type_name == more for lw in m.layers] == [True, False, False, True, False, False, True,
                                                                  True, True]
