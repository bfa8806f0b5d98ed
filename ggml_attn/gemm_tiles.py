"""The tiled block GEMMs' tiles and grids (``cuda/dense_q.cu``'s dense_gemm_q / _qs / _qr,
``cuda/dense_q8x.cu``'s dense_gemm_q8, ``cuda/dense_qw.cu``'s dense_gemm_qw): each kernel's tile
(the C's constants, mirrored: tests/test_kernels_compile.py), the resident blocks an SM, and the
grid and split over n_in a call takes (:func:`gemm_q_grid`). ``variants.py`` names their
instances; ``kernels.py`` re-exports these names.
"""
from __future__ import annotations

from .block_types import block_layout

GEMMQ_TILE = (64, 64, 64)   # dense_gemm_q's block tile: GQ_BM weight rows, GQ_BN tokens, GQ_BK values a step
GEMMQ_THREADS = 128         # its block (GQ_THREADS: 4 warps)
GEMMQ_BLOCKS_PER_SM = 5     # resident dense_gemm_q blocks an SM (96 registers, 36.9 KB of shared memory: ncu, H100)
GEMMQ_MIN_SPLIT = 256       # values of n_in a split covers at least (4 steps)
GEMMQ8_TILE = (64, 64, 256)  # dense_gemm_q8's wide tile: Q8G_BM, Q8G_BN, Q8G_BK (a step: one K-quant block a row)
GEMMQ8_NARROW = 16           # its narrow tile's tokens (dense_gemm_q8<T, 16>), for calls of at most as many
GEMMQ8_THREADS = 256         # its block (Q8G_THREADS: 8 warps)
GEMMQ8_BLOCKS_PER_SM = {64: 2, 16: 3}   # resident blocks an SM by tile tokens (__launch_bounds__: at most 128 /
                                        # 85 registers; ~100 / ~70 KB of shared memory: Q8gTile::SMEM)
GEMMQ8_MIN_SPLIT = 1024      # values of n_in a split covers at least (4 steps: the first stage's wait amortized)
GEMMQ8_STAGES = 2            # Q8G_STAGES
GEMMQ8_LD = 272              # Q8G_LD: bytes between rows of its int8 tiles
GEMMQS_TILE = (64, 64, 256)  # dense_gemm_qs's wide tile: QS_BM, BN, QS_BK (cuda/dense_q.cu)
GEMMQS_NARROW = 32           # its narrow tile's tokens (dense_gemm_qs<T, 32>), for calls of at most as many
GEMMQS_THREADS = 256         # its block (QS_THREADS: 8 warps)
GEMMQS_BLOCKS_PER_SM = {64: 1, 32: 2}   # resident blocks an SM by tile tokens (shared memory: QsTile::SMEM)
GEMMQS_STAGES = 2            # QS_STAGES
GEMMQS_LD = 264              # QS_LD: halves between rows of its F16 tiles
GEMMQR_TILE = (128, 64, 256)  # dense_gemm_qr's wide tile: QR_BM, BN, QS_BK (its narrow one: GEMMQS_NARROW tokens)
GEMMQR_BLOCKS_PER_SM = {64: 1, 32: 2}   # resident blocks an SM by tile tokens (its __launch_bounds__)
# values of n_in a dense_gemm_qr split covers at least where its tiles split GEMMQ8_MIN_SPLIT-wise
# still leave SMs idle (gemm_q_grid): ncu of an 8B layer at 64 tokens found the 1024-row K and V
# projections at 1024 (4 steps a block) 8 x 4 = 32 blocks on 132 SMs, 15.4 us each against 16.9
# for the 4x larger Q projection (H100, a2d3dc2: bench/results/2026-12-07-a2d3dc2-h100-deq-qrd/
# ncu_dense_gemm_qr.txt). At 256 (a step) they take 16 splits, 128 blocks: one 8B layer at 64 /
# 16 / 8 tokens Q4_K 224.6 -> 211.7 / 181.3 -> 167.4 / 175.6 -> 162.3 us, Q6_K -5..-8% too;
# batched B=16 / 64 S_TG +6.8% / +4.1% (bench/results/2026-12-07-59f97e0-h100-split-deq/).
GEMMQR_MIN_SPLIT = 256
# the block types dense_gemm_qr decodes (cuda/quant_blocks.cuh: QbFrag<T>::OK), and their ggml ids
GEMMQR_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
GEMMQR_TYPE_IDS = tuple(block_layout(t).type_id for t in GEMMQR_TYPES)
# dense_gemm_qrm: dense_gemm_qr's wide tile over two row halves (dense_gemm_qr<T, 64, 2>: QrTile's MI,
# 256 rows, each warp 2 x 16 of them), so that a step's x tile -- most of what a 64-token step
# stages -- serves twice the weight rows (bench/NOTES.md, twenty-fifth session). One block an SM.
GEMMQRM_TILE = (256, 64, 256)
GEMMQR_KERNELS = ("dense_gemm_qr", "dense_gemm_qrm")
# dense_gemm_qrg: dense_gemm_qrm's block over a gated FFN's gate and up matrices (dense_gemm_qr<T, 64,
# 2, 1>): QR_BM rows of the gate's in one row half and the same rows of the up's in the other, one
# x tile for both, silu(gate) * up stored (or, split over n_in, both partial sums for
# dense_splitk_gated). Its tile, as gemm_q_grid counts it: 128 rows of each matrix, 64 tokens.
GEMMQRG_TILE = (128, 64, 256)
GEMMQR_FAMILY = (*GEMMQR_KERNELS, "dense_gemm_qrg")   # the kernels of the dense_gemm_qr template
GEMMQW_TILE = (128, 128, 256)  # dense_gemm_qw (cuda/dense_qw.cu): QW_BM, QW_BN, QW_BK; 256 threads, 1 block an SM, GEMMQR_TYPES
GEMMQW2_TYPES = ("Q4_0", "Q4_K", "Q5_K")   # its 256-row tile (dense_gemm_qw2, <T, 2>): the types whose stages fit
# its forms, by kernel name: (RM, H) of dense_gemm_qw<T, RM, H> -- RM 128-row halves a tile (2: GEMMQW2_TYPES
# only), H 1 the half-precision decode (quant_blocks.cuh qb_frag8h) in place of qb_frag8's
GEMMQW_FORMS = {"dense_gemm_qw": (1, 0), "dense_gemm_qw2": (2, 0), "dense_gemm_qwh": (1, 1), "dense_gemm_qw2h": (2, 1)}


def gemm_q8_bn(n_tok: int) -> int:
    """The tokens of ``dense_gemm_q8``'s tile for a call of ``n_tok`` tokens: the narrow one's
    (GEMMQ8_NARROW) up to its width, else the wide one's."""
    return GEMMQ8_NARROW if n_tok <= GEMMQ8_NARROW else GEMMQ8_TILE[1]


# dense_gemm_qr takes its narrow tile up to this many tokens (dense_gemm_qs up to the tile's
# width): on an H100 at 0ef699c (bench/results/2026-12-06-0ef699c-h100-gemv-forms/dense_qr.json,
# one 8B layer) at 32 tokens the wide tile was faster -- Q4_K 191 / 221 us, Q6_K 213 / 240, Q8_0
# 206 / 225 -- and at 16 even (Q4_K 175 / 180, Q6_K 198 / 198, Q8_0 194 / 187).
GEMMQR_NARROW_MAX_TOKENS = 16


def gemm_qs_bn(n_tok: int, kernel: str = "dense_gemm_qs") -> int:
    """The tokens of the staged tiled GEMM ``kernel``'s tile (``dense_gemm_qs`` or
    ``dense_gemm_qr``) for a call of ``n_tok`` tokens: the narrow one's (GEMMQS_NARROW, two
    blocks an SM) up to its width (dense_gemm_qr: up to GEMMQR_NARROW_MAX_TOKENS), else the wide
    one's."""
    if kernel in ("dense_gemm_qrm", "dense_gemm_qrg"):   # (the wide tile only)
        return GEMMQRM_TILE[1]
    narrow_max = GEMMQR_NARROW_MAX_TOKENS if kernel == "dense_gemm_qr" else GEMMQS_NARROW
    return GEMMQS_NARROW if n_tok <= narrow_max else GEMMQS_TILE[1]


# tiled block GEMMs that stage whole rows (16-byte aligned)
STAGED_GEMMS = ("dense_gemm_q8", "dense_gemm_qs", *GEMMQR_FAMILY, *GEMMQW_FORMS)


def gemm_tiling(kernel: str, n_tok: int, bn: int | None = None) -> tuple[tuple[int, int, int], int, int]:
    """(tile, resident blocks an SM, least values of n_in a split) of tiled block GEMM ``kernel``
    (``dense_gemm_q``, ``dense_gemm_q8``, ``dense_gemm_qs``, GEMMQR_KERNELS, ``dense_gemm_qrg``, GEMMQW_FORMS) for ``n_tok``
    tokens; ``bn``: a ``dense_gemm_qs`` / ``dense_gemm_qr`` tile other than gemm_qs_bn's (the
    benchmark's A/B)."""
    if kernel == "dense_gemm_q":
        return GEMMQ_TILE, GEMMQ_BLOCKS_PER_SM, GEMMQ_MIN_SPLIT
    if kernel in GEMMQW_FORMS:
        return (GEMMQW_TILE[0] * GEMMQW_FORMS[kernel][0], *GEMMQW_TILE[1:]), 1, GEMMQ8_MIN_SPLIT
    if kernel == "dense_gemm_q8":
        bn = gemm_q8_bn(n_tok)
        return (GEMMQ8_TILE[0], bn, GEMMQ8_TILE[2]), GEMMQ8_BLOCKS_PER_SM[bn], GEMMQ8_MIN_SPLIT
    if kernel in ("dense_gemm_qrm", "dense_gemm_qrg"):
        if bn not in (None, GEMMQRM_TILE[1]):
            raise ValueError(f"{kernel} has tiles of {GEMMQRM_TILE[1]} tokens, not {bn}")
        return GEMMQRM_TILE if kernel == "dense_gemm_qrm" else GEMMQRG_TILE, 1, GEMMQ8_MIN_SPLIT
    if kernel in ("dense_gemm_qs", "dense_gemm_qr"):   # (their tiles' tokens: gemm_qs_bn)
        (bm, _, bk), per_sm = ((GEMMQS_TILE, GEMMQS_BLOCKS_PER_SM) if kernel == "dense_gemm_qs" else
                               (GEMMQR_TILE, GEMMQR_BLOCKS_PER_SM))
        bn = gemm_qs_bn(n_tok, kernel) if bn is None else bn
        if bn not in per_sm:
            raise ValueError(f"{kernel} has tiles of {tuple(per_sm)} tokens, not {bn}")
        return (bm, bn, bk), per_sm[bn], GEMMQ8_MIN_SPLIT
    raise ValueError(f"no tiled block GEMM {kernel!r} (dense_gemm_q, dense_gemm_q8, dense_gemm_qs, dense_gemm_qr, "
                     "dense_gemm_qw)")


def gemm_q_grid(rows: int, n_tok: int, n_in: int, n_sm: int,
                kernel: str = "dense_gemm_q", bn: int | None = None) -> tuple[tuple[int, int, int], int]:
    """The grid and ``k_chunk`` of tiled block GEMM ``kernel`` (``dense_gemm_q``, ``dense_gemm_q8``,
    ``dense_gemm_qs``, ``dense_gemm_qr`` or ``dense_gemm_qw``: gemm_tiling; ``dense_gemm_qrg``: ``rows``
    of each of its two matrices) for a ``(rows, n_in)`` weight and ``n_tok`` tokens on
    ``n_sm`` SMs: one block per output tile, the tiles split over ``n_in`` (chunks of
    whole steps, at least the kernel's least split) into at most one wave of its resident blocks
    an SM -- a 4096-row weight is 64 tiles at up to 64 tokens, too few to keep the SMs busy
    without the split -- and, with more tiles than a wave, no split (a split past a whole wave
    left a second wave of a few blocks: 672 blocks for 660 places on the H100, SMs active 71% of
    the time). The staged GEMMs (STAGED_GEMMS) instead take the
    split with the fewest (waves x steps a block),
    the fewer splits on a tie (dense_gemm_qr's where even the least split leaves SMs idle: down to
    GEMMQR_MIN_SPLIT values): its steps are latency-bound, as long with 1 or 3 blocks on an SM
    (ncu at 34847e7), so a block's steps count and partial waves cost a whole one (the 14336-row
    gate at 16 tokens: 224 tiles, 396 places; 3 splits of 6 steps in 2 waves, 12 steps' time,
    where 1 split takes 16). ``grid[2] > 1``: the launch writes partial sums for
    ``dense_splitk_sum``. ``bn``: gemm_tiling's."""
    if min(rows, n_tok, n_in) < 1:
        raise ValueError(f"{kernel} needs rows, tokens and n_in >= 1, got {rows}, {n_tok}, {n_in}")
    (bm, bn, bk), per_sm, min_split = gemm_tiling(kernel, n_tok, bn)
    tiles = -(-rows // bm) * -(-n_tok // bn)
    steps = -(-n_in // bk)
    most = max(1, steps * bk // min_split)
    if kernel in STAGED_GEMMS:
        slots = per_sm * max(1, n_sm)
        if kernel in GEMMQR_FAMILY and tiles * most < slots:   # small matrices: splits of GEMMQR_MIN_SPLIT
            if GEMMQR_MIN_SPLIT < bk or GEMMQR_MIN_SPLIT % bk:
                raise ValueError(f"GEMMQR_MIN_SPLIT must be a positive multiple of {bk}, not {GEMMQR_MIN_SPLIT}")
            most = max(most, steps * bk // GEMMQR_MIN_SPLIT)
        splits = min(range(1, most + 1), key=lambda z: (-(-tiles * z // slots) * -(-steps // z), z))
    else:
        want = per_sm * max(1, n_sm) // tiles   # splits that fit one wave (0: the tiles alone fill it)
        splits = max(1, min(want, most))
    k_chunk = -(-steps // splits) * bk
    return (-(-rows // bm), -(-n_tok // bn), -(-n_in // k_chunk)), k_chunk
