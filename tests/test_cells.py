"""Cell-list decode ("cells") without a GPU: the host mirror of the cell-list builder against
the mask, the dispatch rule, the launch configuration and the kernel name lists. The device
side is checked in tests/test_gpu_kernels.py (marked gpu)."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_attn import dispatch
from ggml_attn import kernels as K
from ggml_attn.cuda_launch import launch_config
from ggml_attn.dispatch import call_facts as facts
from ggml_attn.validate import AttnDims
from ggml_attn.reference import cell_lists_host
from ggml_attn.dispatch import CallFacts, best_kernel
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32
from gpu_batched_attn_bench import CELLS_SWEEP   # tools/dev/ (conftest puts it on the path)


def _check_lists(mask, cells, cnt, n_batch):
    for idx in np.ndindex(mask.shape[0], mask.shape[1], n_batch):
        row = mask[idx]
        vis = np.flatnonzero(row.view(np.uint16) != 0xFC00)   # not -inf (NaN, +inf, -0 listed)
        n = int(cnt[idx])
        assert n == len(vis), idx
        assert (cells[idx][:n, 0] == vis).all(), idx
        want = row[vis].astype(np.float32)
        got = cells[idx][:n, 1].view(np.float32)
        assert np.array_equal(got, want, equal_nan=True), idx


@pytest.mark.parametrize("n_kv", [1, 7, 8, 9, 2047, 2048, 2049, 4100])
def test_cell_lists_host_match_mask(n_kv):
    rng = np.random.default_rng(n_kv)
    ne33, ne32, rows, n_batch = 2, 3, 5, 4
    m = np.where(rng.random((ne33, ne32, rows, n_kv)) < 0.2,
                 rng.uniform(-2, 2, (ne33, ne32, rows, n_kv)), -np.inf).astype(np.float16)
    m[0, 0, 0] = -np.inf                    # a fully masked row: empty list
    m[0, 1, 1] = 0.0                        # a fully visible row
    m[1, 2, 2, :: 3] = np.nan               # NaN cells are visible
    m[1, 0, 3, -1:] = np.float16(-0.0)
    m[1, 1, 0, : n_kv // 2] = np.inf
    cells, cnt = cell_lists_host(m, n_batch)
    assert cells.shape == (ne33, ne32, n_batch, n_kv, 2) and cnt.shape == (ne33, ne32, n_batch)
    _check_lists(m, cells, cnt, n_batch)
    assert cnt[0, 0, 0] == 0 and cnt[0, 1, 1] == n_kv


def test_cell_lists_host_small_blocks_interleaved_decode():
    """Interleaved decode cells (cell c belongs to sequence c % 64) and a builder block of a
    few threads (many passes): every row lists exactly its sequence's cells, in order."""
    n_seq, n_kv = 64, 64 * 40 + 13
    seq_of = np.arange(n_kv) % n_seq
    m = np.where(seq_of[None, :] == np.arange(n_seq)[:, None], 0.0, -np.inf).astype(np.float16)
    m = m.reshape(1, 1, n_seq, n_kv)
    for threads in (1, 3, 32, K.CELL_LIST_THREADS):
        cells, cnt = cell_lists_host(m, threads=threads)
        _check_lists(m, cells, cnt, n_seq)
        assert (cells[0, 0, 5, :cnt[0, 0, 5], 0] % n_seq == 5).all()


def test_dispatch_names_and_support():
    assert "cells" in dispatch.KERNELS and "cells" in dispatch.GPU_KERNELS
    for dk in (64, 128, 256):
        for t in (GGML_TYPE_F16, GGML_TYPE_BF16):
            assert dispatch.supports("cells", dk, dk, t) is None
            assert K.cells_variant(dk, dk, t) in K.all_variants()
    assert "not compiled" in dispatch.supports("cells", 512, 512, GGML_TYPE_F16)
    assert "has no GPU kernel" in dispatch.supports("cells", 128, 128, GGML_TYPE_F32)
    from tools import runner
    assert "cells" in runner.KERNELS and "cells" in runner.GPU_KERNELS


def _facts(n_batch=64, gqa=4, n_kv=13056, d=128, kv=GGML_TYPE_F16, planes=1, reads=None):
    cr, tr = reads or (None, None)
    return CallFacts(n_batch, gqa, n_kv, d, d, kv, True, planes, cr, tr)


def test_auto_picks_cells_only_from_plan_reads():
    # without the plan's counts: the tile kernels as before
    assert best_kernel("auto", _facts()).kernel == "prefill"
    assert best_kernel("auto", _facts(n_batch=1)).kernel == "decode-tc"
    # the batched bench's case: ~150 cells per row, the prefill kernel reads every tile
    c = best_kernel("auto", _facts(reads=(150.0, 816.0)))
    assert c.kernel == "cells" and "150" in c.reason and "816" in c.reason and "prefill" in c.reason
    # gain below the threshold, or rows that see everything (B=1 causal): not cells
    assert best_kernel("auto", _facts(reads=(500.0, 816.0))).kernel == "prefill"
    assert best_kernel("auto", _facts(n_batch=1, reads=(4096.0, 4096.0))).kernel == "decode-tc"
    # not decode-shaped, too large lists, head size or type without an instance
    assert best_kernel("auto", _facts(n_batch=dispatch.CELLS_MAX_BATCH + 1, reads=(1, 1000))).kernel == "prefill"
    assert best_kernel("auto", _facts(n_kv=1 << 20, n_batch=64, reads=(1, 1000))).kernel == "prefill"
    assert best_kernel("auto", _facts(d=512, reads=(1, 1000))).kernel != "cells"
    assert best_kernel("auto", _facts(kv=GGML_TYPE_F32, reads=(1, 1000))).kernel == "reference"
    # unaligned K/V: the reference, as for every kernel
    f = CallFacts(64, 4, 13056, 128, 128, GGML_TYPE_F16, False, 1, 150.0, 816.0)
    assert best_kernel("auto", f).kernel == "reference"


def test_cells_by_name():
    assert best_kernel("cells", _facts()).kernel == "cells"
    assert best_kernel("cells", _facts(n_batch=1)).reason == "kernel 'cells' requested"
    # asked for by name, a prompt-sized call runs (auto never picks it there: decode-shaped only)
    assert best_kernel("cells", _facts(n_batch=4096, n_kv=4096)).kernel == "cells"
    assert best_kernel("auto", _facts(n_batch=4096, n_kv=4096, reads=(1, 1000))).kernel != "cells"
    with pytest.raises(ValueError, match="MiB"):
        best_kernel("cells", _facts(n_batch=256, n_kv=1 << 20))
    with pytest.raises(ValueError, match="not compiled"):
        best_kernel("cells", _facts(d=512))


def test_facts_carry_mask_planes_and_reads():
    sh = AttnDims(128, 128, 64, 32, 8, 1, 13056, GGML_TYPE_F16, 2, 3)
    f = facts(sh, kv_aligned=True, reads=(1.0, 2.0))
    assert f.mask_planes == 6 and (f.cell_reads, f.tile_reads) == (1.0, 2.0)
    assert facts(sh).cell_reads is None


def test_launch_config_cells():
    sh = AttnDims(128, 128, 64, 32, 8, 1, 13056, GGML_TYPE_F16)
    c = launch_config("cells", sh, blocks_per_sm=3, max_cells=200)
    # one block per (token, KV head): the 4 heads of a GQA group share the token's list
    assert c.pack == 4 and c.q_tile_tokens == 1 and c.grid == (64, 8, 1) and c.n_splits == 1
    assert c.name == "fattn_cells<128, 128, __half, 4, 2, 1, 0>" and c.variant.family == "cells"
    assert not c.finishes_splits(1 << 20)   # fattn_combine merges its splits, whatever its shared memory
    # one row with a long list: splits of >= 256 list entries to fill the GPU
    sh1 = AttnDims(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16)
    c1 = launch_config("cells", sh1, blocks_per_sm=3, max_cells=32768)
    assert c1.grid[:2] == (1, 8) and 1 < c1.n_splits <= 32768 // 256
    assert launch_config("cells", sh1, blocks_per_sm=3, max_cells=300).n_splits == 1
    # mask head planes: one head per block (each head may have its own list)
    shp = AttnDims(128, 128, 2, 8, 8, 3, 300, GGML_TYPE_F16, 2, 1)
    assert launch_config("cells", shp, blocks_per_sm=2).pack == 1
    # gqa 8 (70B-like), D 64 and 256
    assert launch_config("cells", AttnDims(128, 128, 64, 64, 8, 1, 4096, GGML_TYPE_BF16), blocks_per_sm=2).pack == 8
    assert launch_config("cells", AttnDims(64, 64, 3, 6, 2, 1, 4096, GGML_TYPE_F16), blocks_per_sm=2).pack == 1
    assert launch_config("cells", AttnDims(256, 256, 3, 8, 2, 1, 4096, GGML_TYPE_F16), blocks_per_sm=2).pack == 4


# ---------------------------------------------------------------------------------------
# the v2 sweep (tools/dev/gpu_batched_attn_bench.py CELLS_SWEEP, selected by cuda_launch.CELLS_TUNE):
# launch configuration, names, labels, and every sweep instance compiled (not in all_variants())
def test_cells_tune_labels_round_trip():
    labels = [t.label for t in CELLS_SWEEP]
    assert labels[0] == "" and CELLS_SWEEP[0] == K.CELLS_DEFAULT
    assert len(set(labels)) == len(labels) and len(set(CELLS_SWEEP)) == len(CELLS_SWEEP)
    for t in CELLS_SWEEP:
        assert K.CellsTune.parse(t.label) == t == K.CellsTune.parse("cells-" + t.label)
    assert K.CellsTune.parse("default") == K.CellsTune.parse("cells") == K.CELLS_DEFAULT
    assert K.CellsTune.parse("u8-pf1-minb3-r2") == K.CellsTune(u=8, pf=1, minb=3, rmax=2)
    for bad in ("u3", "pf3", "x1", "r3", "minb9", "u2pf1"):
        with pytest.raises(ValueError):
            K.CellsTune.parse(bad)


def test_cells_tune_from_environment(monkeypatch):
    from ggml_attn import cuda_launch
    monkeypatch.setenv("GGML_ATTN_CELLS_TUNE", "u4-pf0")
    assert cuda_launch.cells_tune_from_env() == K.CellsTune(u=4, pf=0)
    monkeypatch.delenv("GGML_ATTN_CELLS_TUNE")
    assert cuda_launch.cells_tune_from_env() == K.CELLS_DEFAULT


def test_cells_default_program_unchanged():
    """The default tune is the only cells program in all_variants() (CI compile time), with the
    instances R 1, 2, 4, 8 at D 128, U 2, prefetch depth 1, no hint (the sweep's keeper)."""
    v = K.cells_variant(128, 128, GGML_TYPE_F16)
    assert v == K.cells_variant(128, 128, GGML_TYPE_F16, K.CELLS_DEFAULT) and v.family == "cells"
    assert v.names == tuple(f"fattn_cells<128, 128, __half, {r}, 2, 1, 0>" for r in (1, 2, 4, 8))
    fams = [x.family for x in K.all_variants()]
    assert "cells-x" not in fams and fams.count("cells") == 2 * len(K.CELLS_HEADS)


@pytest.mark.parametrize("tune", CELLS_SWEEP, ids=lambda t: t.label or "default")
def test_launch_config_cells_tune(tune, monkeypatch):
    """Each sweep variant at the batched bench's shapes (64 tokens, 32 q / 8 KV heads, D 128):
    R = min(gqa 4, rmax) heads per block, grid (tokens, heads / R, splits), the tune's instance
    name in its own program, the R-dependent shared memory, one split when the grid fills the GPU."""
    from ggml_attn import cuda_launch
    monkeypatch.setattr(cuda_launch, "CELLS_TUNE", tune)
    sh = AttnDims(128, 128, 64, 32, 8, 1, 8960, GGML_TYPE_F16)
    c = launch_config("cells", sh, blocks_per_sm=3, max_cells=230)
    r = min(4, tune.rmax)
    assert c.pack == r and c.rows == r and c.q_tile_tokens == 1
    assert c.grid == (64, 32 // r, 1) and c.n_splits == 1 and c.block == 128
    assert c.name == f"fattn_cells<128, 128, __half, {r}, {tune.u}, {tune.pf}, {tune.minb}>"
    assert c.name in c.variant.names and c.variant.source == "fattn_cells.cu"
    assert c.variant.family == ("cells" if tune == K.CELLS_DEFAULT else "cells-x")
    assert not c.finishes_splits(1 << 20)
    assert all(int(n.split(",")[3]) <= tune.rmax for n in c.variant.names)
    # gqa 8 (bf16): R capped by the tune; mask head planes: R 1
    c8 = launch_config("cells", AttnDims(128, 128, 64, 64, 8, 1, 4096, GGML_TYPE_BF16), blocks_per_sm=2)
    assert c8.pack == min(8, tune.rmax) and c8.name.startswith("fattn_cells<128, 128, __nv_bfloat16, ")
    assert launch_config("cells", AttnDims(128, 128, 2, 8, 8, 3, 300, GGML_TYPE_F16, 2, 1), blocks_per_sm=2).pack == 1
    # one long row: splits of >= CELLS_MIN_PER_SPLIT entries as before
    c1 = launch_config("cells", AttnDims(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16), blocks_per_sm=3,
                       max_cells=32768)
    assert c1.grid[:2] == (1, 32 // r) and 1 < c1.n_splits <= 32768 // 256


def _compile_tune(args):
    tune, dk, kv_type = args
    v = K.cells_variant(dk, dk, kv_type, tune)
    c = K.compile_variant(v, "sm_90", use_disk_cache=False, extra_options=("-Xptxas=-v",))
    inv = {m: n for n, m in c.lowered.items()}
    return v.names, {inv.get(k, k): u for k, u in K.resource_usage(c.log).items()}


@pytest.mark.skipif(not K.nvrtc_available(), reason="NVRTC library not installed (pip install .[nvrtc])")
@pytest.mark.parametrize("kv_type", [GGML_TYPE_F16, pytest.param(GGML_TYPE_BF16, marks=pytest.mark.compile_all)],
                         ids=["f16", "bf16"])
def test_cells_sweep_compiles(kv_type):
    """Every sweep variant compiles for sm_90 at D 128 (f16, bf16: the sweep's case) without
    spills (the GPU tests compile D 64 and 256 too; those may spill a little, bench/NOTES.md).
    bf16 is part of the exhaustive compile (``-m compile_all``, .ci/run's second line)."""
    import os
    from concurrent.futures import ProcessPoolExecutor
    jobs = [(t, 128, kv_type) for t in CELLS_SWEEP if t != K.CELLS_DEFAULT]
    with ProcessPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
        results = list(ex.map(_compile_tune, jobs))
    for (tune, dk, _), (names, usage) in zip(jobs, results):
        assert set(usage) == set(names), (tune, dk)
        for name, u in usage.items():
            assert u["registers"] <= 255, (name, u)
            assert u["spill_stores"] == 0 and u["spill_loads"] == 0, (name, u)


def test_a_bad_cells_tune_in_the_environment_is_one_line_not_a_traceback(monkeypatch, capsys):
    """$GGML_ATTN_CELLS_TUNE naming no tune: one stderr line and the default (it raised at import,
    so every CLI, --version included, ended in a traceback); a good label still selects its tune."""
    import subprocess
    import sys

    from ggml_attn import cuda_launch
    monkeypatch.setenv("GGML_ATTN_CELLS_TUNE", "garbage")
    assert cuda_launch.cells_tune_from_env() == K.CELLS_DEFAULT
    assert capsys.readouterr().err.count("ignoring GGML_ATTN_CELLS_TUNE='garbage'") == 1
    label = next(t.label for t in CELLS_SWEEP if t != K.CELLS_DEFAULT)
    monkeypatch.setenv("GGML_ATTN_CELLS_TUNE", label)
    assert cuda_launch.cells_tune_from_env().label == label
    r = subprocess.run([sys.executable, "-m", "ggml_attn.cli.bench", "--version"], capture_output=True, text=True,
                       env={**__import__("os").environ, "GGML_ATTN_CELLS_TUNE": "garbage"}, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-1000:]
