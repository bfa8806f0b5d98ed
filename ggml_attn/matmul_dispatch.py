"""Which dense matmul runs a model graph's weight on the GPU, and why: :func:`best_matmul`, the
one place that decides (``graph/xp_matmul.py`` asks it per weight and ubatch), from the weight's
type (F16 or one of ggml's blocks), the ubatch's tokens and whether the weight's rows are 16-byte
aligned. Its crossovers were measured with ``tools/dev/gpu_dense_q_bench.py`` (each constant below
says where). The attention kernel's choice is ``dispatch.best_kernel``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

# A GEMV launch reads every weight byte once and decodes it in registers (cuda/dense.cu for F16
# weights, at most kernels.GEMV_MAX_TOKENS tokens; cuda/dense_q.cu and cuda/dense_q8x.cu for ggml's
# weight blocks); the tiled block GEMMs put more tokens on the tensor cores; past them cuBLAS
# (block weights dequantized into an F16 scratch first, a chunk of rows at a time).
@dataclass(frozen=True)
class MatmulChoice:
    path: str      # "gemv" | "gemv-q8x" | "gemm-qw" | "gemm-qr" | "gemm-qs" | "gemm-q8" | "gemm-q" | "gemm"
    reason: str


# Block matrices run QGEMM_MIN_TOKENS .. QGEMM_MAX_TOKENS tokens through the tiled block GEMM
# (dense_gemm_q), fewer through the GEMV, more through dequantize + cuBLAS: the crossovers of
# tools/dev/gpu_dense_q_bench.py on an H100 (bench/results/2026-12-05-56bffb3-h100-dense-q.json,
# one 8B layer): the tiled GEMM is flat from 1 to 64 tokens (Q4_K 342-382 us, Q6_K 511-546,
# Q8_0 514-542), the GEMV grows with the tokens (Q4_K 183 / 225 / 494 us at 1 / 2 / 4 tokens at
# its best block size), dequantize + cuBLAS 566-581 us from 16 to 128 tokens and wins from 128
# (Q8_0 from 16, by 2-5%: one crossover for every type).
QGEMM_MIN_TOKENS = 3
QGEMM_MAX_TOKENS = 64
# Block matrices run up to this many tokens (at most max(Q8X_TOKENS)) through
# the GEMV with 8-bit activations (dense_gemv_q8x_s, llama.cpp's mmvq way) instead of the F32 one
# or a tiled GEMM: on an H100 (one 8B layer, the activations' quantization included) Q4_K 108 /
# 124 / 159 us at 1 / 2 / 4 tokens against the F32 GEMV's 157 / 212 / 439 and dense_gemm_q's ~320
# (bench/results/2026-12-05-4a41e8d-h100-dense-q.json); past 4 tokens the int8 tiled GEMM below
# wins (Q4_K 165 / 167 us at 4 / 8 tokens against this GEMV's 158 / 269, Q8_0 191 / 195 against
# 173 / 310, Q6_K 294 / 297 against 180 / 282: bench/results/2026-12-05-af45317-h100-dense-q.json).
Q8X_MAX_TOKENS = 4
# The types of Q8XV_TYPES (of kernels.Q8XV_TYPES) run that GEMV as dense_gemv_q8x_v at up to
# Q8XV_MAX_TOKENS tokens where their rows are 16-byte aligned: coalesced 16-byte loads (Q4_K / Q5_K
# straight into the lanes' registers, Q6_K and Q8_0 through the warp's shared memory). On an H100
# at 0e3daf1 (bench/results/2026-12-06-0e3daf1-h100-vector-gemv/dense_q.json, one 8B layer, the
# activations' quantization included) against the staged form: at one token Q4_K 98 / 108 us,
# Q8_0 130 / 139, Q6_K 141 / 131 (a loss); at two Q4_K 128 / 123 (a loss), Q8_0 147 / 152, at four
# a loss for every type. End to end (ab_vector_*.json there, tg128, every type routed at 1-4
# tokens): Q4_K_M +1.2%, Q8_0 +2-5%. Q5_K (Q4_K's code with the high bits): one 8B layer 105 /
# 111 us on an H200 at bb0e9e4, tg128 on Q5_K_M 260.3 / 254.7 t/s on an H100 (both rounds ahead;
# bench/results/2026-12-06-bb0e9e4-h100-q5k-q6k/ab_Q5_K_M.json).
Q8XV_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q8_0")
Q8XV_MAX_TOKENS = 1
# The types of Q8XR_TYPES (of kernels.Q8XR_TYPES) run that GEMV at up to Q8XR_MAX_TOKENS tokens as
# dense_gemv_q8x_r (rows 16-byte aligned; ahead of the vector form): the vector form's arithmetic
# over a wave of warps each streaming several rows through a ring of shared-memory slots. On an
# H200 at bb0e9e4 (bench/results/2026-12-06-bb0e9e4-h200-gemv-run/: one 8B layer, one token, with
# the quantization) Q6_K 115 us against the staged form's 126 (vector 134); Q4_K 107 against the
# vector form's 95, Q5_K 120 / 111, Q8_0 120 / 119 (losses); tg128 on Q4_K_M: every type 281
# against 300 t/s, Q6_K alone 293.4 against 287.9 (ab-q6k/).
Q8XR_TYPES: tuple[str, ...] = ("Q6_K",)
Q8XR_MAX_TOKENS = 1
# The 8-bit GEMV launched with programmatic dependent launch on sm_90 (ggml_attn/pdl.py): its
# blocks start while the activations' quantization before it runs, each warp's rows requested
# into L2 before it waits on it (cuda/dense_q8x.cu q8x_enter). Off: tg128 on the 8B-shaped Q4_K_M
# file 287.4 -> 277.8 t/s on the H100 at 0ef699c (bench/results/2026-12-06-0ef699c-h100-gemv-forms/ab_pdl.json).
GEMV_PDL = False
# The types of GEMV_ONE_TYPES run the vector and ring GEMVs (kernels.Q8X_GATED_FORMS) in modes
# 0 / 1 through their one-operand instance (G 0: no second operand's words, so Q4_K NT 1 holds 78
# registers against 122 and 6 blocks fit an SM against 4; the ring's one operand twice the slots)
# instead of the instance for every mode (predicted: tg128 on Q4_K_M +6-10%). On an H100 at
# 31e8025 (bench/results/2026-12-06-31e8025-h100-gemv-one/dense_q.json, one 8B layer at one token,
# without the quantization) the vector form's Q4_K 76.6 against 85.0 us, Q5_K 86.0 / 97.3, Q8_0
# 117.1 / 115.2 (a loss), the ring's Q6_K 116.0 / 106.4 (a loss). tg128 on the 8B-shaped Q4_K_M
# file on an H200 at 6336414 (bench/results/2026-12-06-6336414-h200-gemv-one-rope-store/, 3
# alternating rounds): Q4_K alone 305.6 against 299.4 t/s (+2.1%), every type 301.7; with the
# fused rope and store (model_graph.ROPE_STORE) 309.1. Q5_K from its layer rows only.
GEMV_ONE_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K")
# The types of GEMV_SPLIT_TYPES run the vector GEMV at one token in modes 0 / 1 over matrices of
# at most GEMV_SPLIT_MAX_ROWS rows through its instance with two warps a row (kernels.
# Q8X_SPLIT_TOKENS, G 2): a 4096-row matrix's one-row warps fill 1.3 waves of an SM's slots (wo,
# wd), two warps a row ~1.9 waves of half the work. On an H100 at e3db217
# (bench/results/2026-12-06-e3db217-h100-gemv-split/, without the quantization) wd alone Q4_K 15.5
# against 19.2 us, Q5_K 19.3 / 23.9, Q8_0 24.7 / 27.0; one 8B layer at one token Q4_K 69.1 against
# 75.2, Q5_K 80.8 / 84.7, Q8_0 102.5 / 113.6 (Q6_K's ring 104.9 keeps it). tg128 on the 8B-shaped
# Q4_K_M file (2 alternating rounds) 305.2 -> 314.7 t/s up to 4096 rows, 316.6 up to 8192 (the
# fused Q/K/V matrix too; the gate and up run the gated mode 2). Predicted +3-5%: +3.7%.
GEMV_SPLIT_TYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q8_0")
GEMV_SPLIT_MAX_ROWS = 8192
# With GEMV_PDL: each warp's rows requested into L2 before the wait (off: the wait alone, the
# launch's overlap without the prefetch's instructions and early DRAM traffic; not yet measured).
GEMV_PDL_PREFETCH = True
# A one-token GEMV writes its output's 8-bit form as well where the GEMVs that read it next read
# 8-bit activations too (cuda/dense_q8x.cu q8x_finish: the warp that stores a 32-row group's last
# row quantizes the group; the vector and ring forms' instances with it, kernels.Q8X_QOUT_TOKENS),
# so no dense_quant_q8x launch runs between them: the gated GEMV for the down matrix, and the two
# residual adds (wo, wd) for the RMS norm and matrices after them (each group of x·g quantized
# as it completes, the norm's scale multiplied into the scales once the last group is in) -- three
# of the four quantization launches a layer and token, 3.09 us each in the H100's one-token step
# at d650257 (bench/results/2026-12-06-d650257-h100-gemv-regression/step.json: 129 of ~360
# launches a token, 13.5% of its device time). Predicted: tg128 on the 8B-shaped Q4_K_M file
# +6-9%. Measured on the H100 at 695471d: correct (the GPU tests, memcheck, racecheck) but a loss,
# tg128 315.5 -> 263.9 t/s (-16%): 1,615 quantization launches fewer in a 16-token step (-5.0 ms)
# but its GEMVs +14 ms (the gated one 27.4 -> 40.2 us, the residual adds ~10 -> 17.3, Q6_K's
# ring 16 -> 32; bench/results/2026-12-06-695471d-h100-gemv-qout/). Off.
GEMV_QUANT_OUT = False
# The attention writes its output's 8-bit form as well where the O projection runs the 8-bit GEMV
# (flash_attn_ext(q8_out=...), ggml_attn/q8_out.py): the cell-list kernel's epilogue over one
# split (a one-token step's attention) quantizes the values it holds -- no fence, no counter, what
# GEMV_QUANT_OUT lost to -- and every other call quantizes dst in a launch of its own, as the O
# projection's own quantization did. One of the four quantization launches a layer and token fewer
# where the cell-list kernel runs. Predicted (H100, tg128 on the 8B-shaped Q4_K_M file): 32
# launches of ~3.07 us fewer a token (~98 of ~2,900 us), +3%. Measured on an H100 at 150d310
# (bench/results/2026-12-06-150d310-h100-attn-q8-out/, 3 alternating rounds): 322.7 -> 324.7 t/s
# (+0.6%, every round); the 16-token step 50.54 -> 49.65 ms, 544 quantization launches fewer
# (-1.43 ms) but the attention's epilogue 5.88 -> 6.86 us (+0.53 ms). On.
ATTN_QUANT_OUT = True
# Block matrices run up to this many tokens (past Q8X_MAX_TOKENS) through the tiled GEMM on int8
# tensor cores (dense_gemm_q8: the blocks' integer form times the 8-bit activations, its weight
# tiles staged by cp.async; 64 x 16 tiles up to 16 tokens) instead of dense_gemm_q, where their
# rows are 16-byte aligned. On an H100 at af45317 (bench/results/2026-12-05-af45317-h100-dense-q.json,
# one 8B layer, quantization included) at 16 tokens Q4_K 203 us against dense_gemm_q's 326, Q6_K
# 330 / 484, Q8_0 230 / 489; at 32 Q4_K 295 / 332, Q6_K 417 / 490, Q8_0 315 / 491; at 64 Q4_K 404 /
# 362 and Q6_K 532 / 507 (losses), Q8_0 437 / 499: 32 for every type. (Its first form, each thread
# decoding its row's sub-block from global memory, was no faster than dense_gemm_q anywhere:
# bench/results/2026-12-05-457d60e-h100-dense-q.json.) The staged F16 GEMM below is asked first, so
# this path runs 5-8 tokens, and up to 32 only where QSGEMM_* is set to an empty range.
Q8GEMM_MAX_TOKENS = 32
# Block matrices run QSGEMM_MIN_TOKENS .. QSGEMM_MAX_TOKENS tokens (rows 16-byte aligned) through
# the staged F16 tiled GEMM (dense_gemm_qs: dense_gemm_q's tensor-core product over weight rows
# and x tiles staged by cp.async, decoded from shared memory) ahead of the two above. On an H100
# at f354706 (bench/results/2026-12-05-f354706-h100-dense-qs/dense-q.json, one 8B layer), against
# dense_gemm_q8 (quantization included) and dense_gemm_q: at 8 tokens Q4_K 190 / 169 us (a loss),
# Q6_K 301 / 300, Q8_0 195 / 195; at 16 Q4_K 196 / 204, Q6_K 308 / 331, Q8_0 200 / 231; at 32 Q4_K
# 228 / 295, Q6_K 338 / 416, Q8_0 234 / 316; at 64 Q4_K 357 / 404 / 360, Q6_K 459 / 531 / 507,
# Q8_0 360 / 436 / 500; at 128 Q4_K 606 against dequantize + cuBLAS's ~570 (56bffb3): 9-64.
QSGEMM_MIN_TOKENS = 9
QSGEMM_MAX_TOKENS = 64
# There the types of QRGEMM_TYPES (of kernels.GEMMQR_TYPES) take dense_gemm_qr: the weights decoded into
# the A fragments, the same result (predicted 1.3-1.6x: bench/NOTES.md, ninth session). On an H100
# at 0ef699c (bench/results/2026-12-06-0ef699c-h100-gemv-forms/dense_qr.json, one 8B layer, each
# form's tile as kernels.gemm_qs_bn picks it) against dense_gemm_qs at 16 / 32 / 64 tokens: Q4_K
# 180 / 191 / 225 us against 199 / 230 / 359, Q6_K 198 / 213 / 241 against 309 / 340 / 461, Q8_0
# 187 / 206 / 235 against 202 / 235 / 364; at 822c664 Q5_K 195 / 207 / 236 against 213 / 243 /
# 381, Q4_0 171 / 181 / 215 against 211 / 244 / 375
# (bench/results/2026-12-06-822c664-h100-tests-qr-q5k-q4_0/dense_qr.json).
QRGEMM_TYPES: tuple[str, ...] = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
# ... from QSGEMM_MIN_TOKENS up to QRGEMM_MAX_TOKENS tokens (dense_gemm_qs's QSGEMM_MAX_TOKENS
# bounds the other types): on an H100 at 150d310
# (bench/results/2026-12-06-150d310-h100-gemm-qr-crossover/, one 8B layer) dense_gemm_qr against
# dequantize + cuBLAS at 128 tokens Q4_K 406 / 582 us, Q5_K 433 / 577, Q6_K 440 / 598, Q8_0 427 /
# 525; at 192 603 / 602, 638 / 596, 646 / 616, 626 / 542 (cuBLAS's dequantization costs the same
# at every token count, its GEMM scales better). pp128 on the 8B-shaped Q4_K_M file 5,926 -> 8,100
# t/s (+37%); 512 tokens through it 16,729 -> 10,703 (pp512: cuBLAS stays).
QRGEMM_MAX_TOKENS = 128
# On an sm_90 GPU the types of QRGEMM_TYPES run QWGEMM_MIN_TOKENS tokens and more (rows 16-byte
# aligned) through dense_gemm_qw (cuda/dense_qw.cu): dense_gemm_qr's decode into the A fragments
# feeding wgmma m64n128k16, a decoded value for 128 tokens. None: not routed -- measured on the
# H100 at ac46a49 it loses to dequantize + cuBLAS past 128 tokens (one 8B Q4_K layer at 512 tokens
# 1,327 against 720 us; its best form, qw2h, 1,068; pp512 16,912 -> 10,061..11,793 t/s:
# bench/NOTES.md, twenty-first session). An A/B knob.
QWGEMM_MIN_TOKENS: int | None = None
# Its tile's rows: 128 (dense_gemm_qw), or 256 (dense_gemm_qw2: half the x tile's L2 traffic a
# product) for the types whose stages fit (kernels.GEMMQW2_TYPES): 256 measured 15% faster at 512.
QWGEMM_ROWS = 128
# Its decode: qb_frag8's (F32 arithmetic, each value ggml's rounded to F16) or, True, qb_frag8h's
# (dense_gemm_qwh / qw2h: the integer q an exact half by its bits and one f16 operation a pair
# with the factors rounded to f16 -- ~3 instructions a value against ~6): measured 2-7% faster.
QWGEMM_HALF = False
# dense_gemm_qr's rows a block past its narrow tile's tokens: 128 (dense_gemm_qr) or 256
# (dense_gemm_qrm: two row halves a step, so that the step's x tile -- two thirds of what a
# 64-token step stages, the staging alone 64% of the kernel's time -- serves twice the rows: one
# 8B layer's staged bytes at 64 tokens 341 -> 232 MB; bench/NOTES.md, twenty-fifth session), on
# sm_90 GPUs. Measured slower at every token count (H100, 4191ed9: gate + up of an 8B layer at 64
# tokens 143.7 against 106.8 us, at 16 96.6 against 82.6; batched S_TG on Q4_K_M at B=64 -23%,
# bench/results/2026-12-07-4191ed9-h100-qr-ab-load/): an A/B row.
QRGEMM_ROWS = 128
# A gated FFN's gate and up products at the narrow tile's tokens (9 .. QR_GATED_MAX_TOKENS), where
# both matrices are of one type that takes dense_gemm_qr: one dense_gemm_qrg launch (sm_90 GPUs;
# dense_gemm_qrm's block with the gate's rows in one row half and the up's in the other, one x
# tile staged for both, silu(gate) * up and its F16 form stored by the epilogue or the split's sum)
# in place of two launches, their split sums, the two F32 products written and read back, and the
# activation's launch. One 8B layer's gate + up + silu on an H100 at 4191ed9, us, qr / qrg
# (tools/dev/qrg_ab.py, bench/results/2026-12-07-4191ed9-h100-qr-ab-load/qrg_ab.json): 16 tokens
# Q4_K 82.6 / 77.8, Q6_K 90.1 / 87.8, Q8_0 82.2 / 80.0; 32 tokens 89.1 / 90.9, 99.3 / 99.3, 95.3 /
# 91.9; 64 tokens 106.8 / 118.5, 113.1 / 127.7, 109.4 / 119.5 (qrg's 256-row block the slower past
# 16, as dense_gemm_qrm's). From 9 to 16 tokens both stage a 16-token x tile: 16's rows hold.
QR_GATED = True
QR_GATED_MAX_TOKENS = 16
# dense_gemm_qr's (and qrm's, qrg's) launches split over n_in: True, the last block of each tile
# adds the tile's partial sums in split order (the bits of dense_splitk_sum's sums, read from L2
# just written) and no dense_splitk_sum launch follows -- ~5 such launches an 8B layer at 16-64
# tokens; the program with cuda/dense_q.cu's QR_SPLIT_FINISH 1 (kernels.qr_finish_variant), a
# counter a tile zeroed at build (the last block sets it back). Measured slower (H100, 4191ed9:
# gate + up at 128 tokens, 4 splits, 318.4 against 227.2 us; batched S_TG at B=64 -37% with qrm and
# qrg): one block sums its tile's splits alone at the kernel's end. An A/B row.
QR_SPLIT_FINISH = False
# Past the tiled GEMMs (path ``gemm``, graph/path_gemm.py) block matrices are dequantized into the
# weights' F16 scratch (dense_dequant_f16: a warp's stores in 512-byte runs, 202-252 us an 8B layer
# of any block type on the H100 against 282-456 for the form before it, whose lanes each stored
# their own 64 bytes; pp512 on Q4_K_M 15,990 -> 20,713 t/s) and multiplied by cuBLAS, as many rows
# a chunk as the scratch holds. Measured and not kept (bench/NOTES.md, twenty-third session):
# 4096-row chunks for the chunk's halves to be in L2 when cuBLAS reads them (2.5-5% slower), and
# the dequantizations on a second stream into two scratch slots under the GEMMs (545 against 560
# us at 512 tokens, pp512 +1%: cuBLAS's blocks leave an SM no room for them, for 117 MB more);
# then with room made -- cuBLAS planned for fewer SMs (cublasSetSmCountTarget), the side stream
# of the least priority, the engine's the greatest: pp512 +1.9% with CUDA graphs (16 SMs left to
# the dequantizations; 32 and 48 slower), +3.9% without (a replay runs every node at its launch
# stream's priority), for the same 117 MB: bench/NOTES.md, twenty-fourth session.
# The tiled paths of best_matmul and their kernels (tiled_kernel: the forms chosen above).
TILED_PATHS = {"gemm-q": "dense_gemm_q", "gemm-qs": "dense_gemm_qs", "gemm-qr": "dense_gemm_qr",
               "gemm-qw": "dense_gemm_qw", "gemm-q8": "dense_gemm_q8"}


def gemv_q8x_form(weight_type: str, aligned: bool, n_tokens: int) -> str:
    """Which form of the 8-bit-activation GEMV (``kernels.Q8X_FORMS``) runs ``n_tokens`` tokens
    through a block weight of ``weight_type`` whose rows are (``aligned``) or are not 16-byte
    aligned: ``ring`` for the routed Q8XR_TYPES up to Q8XR_MAX_TOKENS, ``vector`` for the routed
    Q8XV_TYPES up to Q8XV_MAX_TOKENS (each where the form reads the type:
    ``kernels.q8x_form_reads``), ``staged`` for the other aligned rows, else ``plain``. (Two forms
    whose grid was one wave of warps each walking several rows -- the staged arithmetic over a
    shared-memory ring, and the vector form's words through a register ring -- lost to these on
    the H100 and were removed: bench/NOTES.md, twelfth session.)"""
    from .kernels import q8x_form_reads
    if aligned and weight_type in Q8XR_TYPES and n_tokens <= Q8XR_MAX_TOKENS and q8x_form_reads("ring", weight_type):
        return "ring"
    if aligned and weight_type in Q8XV_TYPES and n_tokens <= Q8XV_MAX_TOKENS and q8x_form_reads("vector", weight_type):
        return "vector"
    return "staged" if aligned else "plain"


def qr_two_halves() -> bool:
    """Whether dense_gemm_qr's wide tile runs as dense_gemm_qrm here: QRGEMM_ROWS 256 on an sm_90
    GPU (its stages take up to 207 KB of shared memory). ValueError for another QRGEMM_ROWS."""
    from .gemm_tiles import GEMMQRM_TILE
    if QRGEMM_ROWS not in (128, GEMMQRM_TILE[0]):
        raise ValueError(f"QRGEMM_ROWS is 128 or {GEMMQRM_TILE[0]}, not {QRGEMM_ROWS}")
    return QRGEMM_ROWS == GEMMQRM_TILE[0] and _hopper()


def qr_gated() -> bool:
    """Whether a gated FFN's gate and up products may run as one dense_gemm_qrg launch here
    (gated_kernel says where): QR_GATED on an sm_90 GPU (its stages take up to 207 KB of shared
    memory)."""
    return bool(QR_GATED) and _hopper()


def split_finish(kernel: str, splits: int) -> bool:
    """Whether a launch of tiled block GEMM ``kernel`` split ``splits`` ways over n_in adds its
    splits itself (QR_SPLIT_FINISH, for the dense_gemm_qr family) instead of a dense_splitk_sum
    launch after it."""
    from .gemm_tiles import GEMMQR_FAMILY
    return bool(QR_SPLIT_FINISH) and splits > 1 and kernel in GEMMQR_FAMILY


def gated_kernel(gate_type: str, up_type: str, n_tokens: int, *, aligned: bool = True) -> str | None:
    """The one launch of a gated FFN's gate and up products (weights of ``gate_type`` and
    ``up_type``, rows 16-byte aligned or not: ``aligned``) for ``n_tokens`` tokens on the GPU:
    ``dense_gemm_qrg`` where qr_gated, the types are one and its tiled path is ``gemm-qr``
    (best_matmul with ``gemv=False``: from 9 tokens) up to QR_GATED_MAX_TOKENS; else None (each
    product its own launches, then the activation's)."""
    if gate_type != up_type or gate_type == "F16" or n_tokens > QR_GATED_MAX_TOKENS or not qr_gated():
        return None
    return "dense_gemm_qrg" if best_matmul(gate_type, n_tokens, gemv=False, aligned=aligned).path == "gemm-qr" else None


def tiled_kernel(path: str, weight_type: str, n_tokens: int = 1) -> str:
    """The kernel of tiled path ``path`` (TILED_PATHS) for a weight of ``weight_type`` and
    ``n_tokens`` tokens: the wgmma GEMM's form (gemm_qw_kernel), dense_gemm_qrm past the narrow
    tile's tokens where qr_two_halves, else the path's one kernel."""
    from .gemm_tiles import GEMMQR_NARROW_MAX_TOKENS
    if path == "gemm-qw":
        return gemm_qw_kernel(weight_type)
    if path == "gemm-qr" and qr_two_halves() and n_tokens > GEMMQR_NARROW_MAX_TOKENS:
        return "dense_gemm_qrm"
    return TILED_PATHS[path]


def dequant_chunk(n_out: int, n_in: int, scratch_elements: int) -> int:
    """The rows a chunk of path ``gemm`` takes for a block matrix of ``n_out`` rows of ``n_in``
    values and an F16 scratch of ``scratch_elements`` values: as many as the scratch holds, at
    most ``n_out``. ValueError where not one row fits."""
    if scratch_elements < n_in:
        raise ValueError(f"an F16 scratch of {scratch_elements} values holds no row of {n_in}")
    return min(n_out, scratch_elements // n_in)


def gemm_qw_kernel(weight_type: str) -> str:
    """The form of the wgmma block GEMM (path ``gemm-qw``) for a weight of ``weight_type``:
    ``dense_gemm_qw2`` (256-row tiles) where QWGEMM_ROWS is 256 and its stages fit, else
    ``dense_gemm_qw``; with QWGEMM_HALF their half-precision decode (``dense_gemm_qw2h``,
    ``dense_gemm_qwh``)."""
    from .kernels import GEMMQW2_TYPES
    return ("dense_gemm_qw2" if QWGEMM_ROWS == 256 and weight_type in GEMMQW2_TYPES else "dense_gemm_qw") + \
        ("h" if QWGEMM_HALF else "")


def gemv_q8x_gated_instance(mode: int, weight_type: str) -> bool:
    """Whether an 8-bit GEMV launch in ``mode`` (0 store, 1 accumulate, 2 gated) over a block
    weight of ``weight_type`` runs its form's instance for every mode (kernels.q8x_name's
    ``gated``) rather than the one-operand instance of modes 0 / 1 (GEMV_ONE_TYPES; forms without
    one ignore it)."""
    return mode == 2 or weight_type not in GEMV_ONE_TYPES


def gemv_q8x_split(weight_type: str, form: str, n_tokens: int, rows: int, mode: int) -> bool:
    """Whether an 8-bit GEMV launch over ``rows`` output rows (its segments' together) of
    ``weight_type`` blocks in ``form`` at ``n_tokens`` tokens in ``mode`` runs a row on two warps
    (GEMV_SPLIT_TYPES up to GEMV_SPLIT_MAX_ROWS, modes 0 / 1, where the form has such instances:
    ``kernels.Q8X_SPLIT_TOKENS``)."""
    from .kernels import Q8X_SPLIT_TOKENS
    return (weight_type in GEMV_SPLIT_TYPES and mode != 2 and rows <= GEMV_SPLIT_MAX_ROWS
            and n_tokens <= max(Q8X_SPLIT_TOKENS.get(form, (0,))))


def gemv_quant_out(choices) -> bool:
    """Whether a GEMV writes its output's 8-bit form for the GEMVs that read it next
    (GEMV_QUANT_OUT, every one ``gemv-q8x``): ``choices``, an iterable of the producer's path and
    then the readers' (at least one), looked at only with GEMV_QUANT_OUT on (a generator: no
    choice is made when it is off)."""
    if not GEMV_QUANT_OUT:
        return False
    paths = [c.path for c in choices]
    return len(paths) > 1 and all(p == "gemv-q8x" for p in paths)


def attn_quant_out(choice: MatmulChoice) -> bool:
    """Whether the attention hands its output to the O projection in 8-bit form (ATTN_QUANT_OUT,
    ``choice`` the O projection's path: the 8-bit GEMV)."""
    return ATTN_QUANT_OUT and choice.path == "gemv-q8x"


def gemv_pdl() -> int:
    """How the 8-bit GEMV is launched (``GemvQ8Params.pdl``): 0 plainly; with programmatic
    dependent launch where GEMV_PDL is on, on an sm_90 or later GPU (``kernels.device_arch``,
    asked only then): 1 with its rows' L2 prefetch (GEMV_PDL_PREFETCH), 2 without."""
    if not GEMV_PDL:
        return 0
    from .kernels import device_arch
    if int(device_arch().removeprefix("sm_").rstrip("a")) < 90:
        return 0
    return 1 if GEMV_PDL_PREFETCH else 2


def _hopper() -> bool:
    """Whether the current GPU runs the sm_90a programs (kernels.device_arch is sm_90)."""
    from .kernels import HOPPER_ARCH, device_arch
    return device_arch() + "a" == HOPPER_ARCH


def best_matmul(weight_type: str, n_tokens: int, *, gemv: bool = True, aligned: bool = True) -> MatmulChoice:
    """How ``n_tokens`` tokens multiply a weight of ``weight_type`` (``"F16"`` or a block type of
    ``block_types``) on the GPU: ``gemv`` (few tokens), ``gemv-q8x`` (block weights, the GEMV with
    8-bit activations), ``gemm-qw`` (block weights, the staged tiled GEMM on wgmma, sm_90), ``gemm-qr`` /
    ``gemm-qs`` (block weights, the staged tiled GEMM on F16
    tensor cores, decoded into the fragments / from shared memory), ``gemm-q8`` (block weights, the
    tiled GEMM on int8 tensor cores), ``gemm-q`` (block weights, the tiled block GEMM on F16
    decodes) or ``gemm`` (cuBLAS; block weights dequantized to F16 first). ``gemv=False``: the
    caller cannot run a GEMV here (its launch refused the arrays, e.g. rows not 16-byte aligned past
    the plain GEMV's tokens): the best of the others. ``aligned``: the weight's rows start 16-byte
    aligned (the staged kernels' cp.async units: ``graph.q8_matmul.rows_aligned``); without, the
    8-bit GEMV only up to its plain form's tokens and no staged tiled GEMM. ValueError for a type no
    kernel reads (the loader makes every other matrix F16)."""
    from .block_types import is_block_type
    from .kernels import GEMMQR_TYPES, GEMV_MAX_TOKENS, GEMVQ_MAX_TOKENS, Q8X_FORMS
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    if weight_type == "F16":
        limit, what = GEMV_MAX_TOKENS, "F16 GEMV (dense_gemv)"
    elif is_block_type(weight_type):
        limit, what = GEMVQ_MAX_TOKENS, f"{weight_type} block GEMV (dense_gemv_q, decoded in registers)"
    else:
        raise ValueError(f"no GPU matmul reads {weight_type!r} weights (F16 and the block types of "
                         f"ggml_attn.block_types)")
    if gemv and weight_type != "F16":
        kernel, tokens, _ = Q8X_FORMS[gemv_q8x_form(weight_type, aligned, n_tokens)]
        if n_tokens <= min(Q8X_MAX_TOKENS, max(tokens)):
            return MatmulChoice("gemv-q8x", f"{weight_type} GEMV with 8-bit activations ({kernel}, IDP4A): "
                                            f"{n_tokens} <= {Q8X_MAX_TOKENS} tokens")
    qr = weight_type in QRGEMM_TYPES and weight_type in GEMMQR_TYPES
    if weight_type != "F16" and aligned and qr and QWGEMM_MIN_TOKENS is not None and n_tokens >= QWGEMM_MIN_TOKENS \
            and _hopper():
        return MatmulChoice("gemm-qw", f"{weight_type} staged tiled GEMM on wgmma (dense_gemm_qw, decoded into the "
                                       f"A fragments, sm_90): {n_tokens} >= {QWGEMM_MIN_TOKENS} tokens")
    if weight_type != "F16" and aligned and qr and QSGEMM_MIN_TOKENS <= n_tokens <= QRGEMM_MAX_TOKENS:
        return MatmulChoice("gemm-qr", f"{weight_type} staged tiled GEMM on F16 tensor cores (dense_gemm_qr, "
                                       f"decoded into the fragments): {QSGEMM_MIN_TOKENS} <= {n_tokens} <= "
                                       f"{QRGEMM_MAX_TOKENS} tokens")
    if weight_type != "F16" and aligned and not qr and QSGEMM_MIN_TOKENS <= n_tokens <= QSGEMM_MAX_TOKENS:
        return MatmulChoice("gemm-qs", f"{weight_type} staged tiled GEMM on F16 tensor cores (dense_gemm_qs, "
                                       f"decoded from shared memory): {QSGEMM_MIN_TOKENS} <= {n_tokens} <= "
                                       f"{QSGEMM_MAX_TOKENS} tokens")
    if weight_type != "F16" and aligned and n_tokens <= Q8GEMM_MAX_TOKENS:
        return MatmulChoice("gemm-q8", f"{weight_type} tiled GEMM on int8 tensor cores (dense_gemm_q8, 8-bit "
                                       f"activations): {n_tokens} <= {Q8GEMM_MAX_TOKENS} tokens")
    lo = QGEMM_MIN_TOKENS if gemv else 1
    if weight_type != "F16" and lo <= n_tokens <= QGEMM_MAX_TOKENS:
        return MatmulChoice("gemm-q", f"{weight_type} tiled block GEMM (dense_gemm_q, decoded into shared memory, "
                                      f"mma.sync): {lo} <= {n_tokens} <= {QGEMM_MAX_TOKENS} tokens")
    if gemv and n_tokens <= limit:
        return MatmulChoice("gemv", f"{what}: {n_tokens} <= {limit} tokens")
    how = "cuBLAS F16 GEMM" if weight_type == "F16" else f"{weight_type} dequantized to F16 scratch + cuBLAS GEMM"
    return MatmulChoice("gemm", f"{how}: {n_tokens} > {limit} tokens")

