"""GPU benchmark: ggml-attn's CUDA kernels against cuDNN, FlashAttention-2 and FA2 varlen, in
one process on the same inputs. 32 query heads, 8 KV heads, D=128, f16 K/V (ggml's layout for
ours: f32 Q and output).

Device time, not host time: each batch of calls is queued behind a long sleep kernel, so the
host has enqueued every call before the GPU reaches the first one; CUDA events around the
batch then time the GPU alone (a batch whose first event had already fired when the host
finished enqueuing is re-run with a longer sleep). Median of 3 batches of 30 calls. Decode
K/V is rotated over distinct copies (>= 256 MB in all) so that the 60 MB L2 cannot hold it.
Host cost of our entry point (``flash_attn_ext_device``, plan reused as for every layer of
a ubatch) is measured apart, with a host clock over many calls.

Writes a JSON file (GPU, versions, commit, date, every row) and prints a short table last.

Usage: python tools/dev/gpu_bench.py [--quick] [--out FILE] [--only SUBSTR]

``WS_AB=key,key`` (wgmma_shape.WS_CONFIGS keys): each causal prefill row and the ragged prompts'
rows also run through the op with those sm_90a instances (WGMMA_CONFIG) where the K/V type and
tile width match, as rows ``ours-ws-<key>``: the A/B of an instance not yet routed (#48's lazy
maximum, the output through TMA).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess

import numpy as np

from gpu_timing import copies_for, device_us, host_us, knobs, wall_us
from ggml_attn.conformance import block_causal_mask

H, HKV, D = 32, 8, 128
SCALE = 1.0 / math.sqrt(D)


def _git_commit():
    env = os.environ.get("GGML_ATTN_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def _desc(t, ggml_type):
    """torch tensor (numpy axis order) -> TensorDesc (ggml order)."""
    from ggml_attn.tensor import TensorDesc
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    strides = (0,) * (4 - t.dim()) + tuple(t.stride())
    es = t.element_size()
    ne = tuple(reversed(shape))
    nb = [s * es for s in reversed(strides)]
    for i in range(4):
        if ne[i] == 1:
            nb[i] = nb[i - 1] * ne[i - 1] if i else es
    return TensorDesc(t.data_ptr(), ggml_type, ne, tuple(nb))


# ---------------------------------------------------------------------------------------
# timing






# ---------------------------------------------------------------------------------------
# problems
class Ours:
    """One attention problem as the op sees it (ggml layouts on the GPU): ``copies`` K/V sets
    used in rotation."""

    def __init__(self, ne3, n_batch, n_kv, mask_np=None, seed=0, copies=1, bf16=False):
        import torch
        from ggml_attn import cuda_backend as cb
        from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32
        g = torch.Generator(device="cuda").manual_seed(seed)
        kv_dtype, kv_type = (torch.bfloat16, GGML_TYPE_BF16) if bf16 else (torch.float16, GGML_TYPE_F16)
        self.q = torch.rand((ne3, H, n_batch, D), device="cuda", generator=g) * 2 - 1
        self.kv = [((torch.rand((ne3, HKV, n_kv, D), device="cuda", generator=g) * 2 - 1).to(kv_dtype),
                    (torch.rand((ne3, HKV, n_kv, D), device="cuda", generator=g) * 2 - 1).to(kv_dtype))
                   for _ in range(copies)]
        self.dst = torch.empty((ne3, n_batch, H, D), device="cuda")
        self.mask = None
        if mask_np is not None:   # numpy order: [rows, n_kv], or [ne33, ne32, rows, n_kv] (planes)
            m = torch.from_numpy(np.ascontiguousarray(mask_np)).cuda()
            self.mask = m if m.dim() == 4 else m.reshape(1, 1, m.shape[-2], m.shape[-1])
        self.dq, self.dd = _desc(self.q, GGML_TYPE_F32), _desc(self.dst, GGML_TYPE_F32)
        self.dkv = [(_desc(k, kv_type), _desc(v, kv_type)) for k, v in self.kv]
        self.dm = _desc(self.mask, GGML_TYPE_F16) if self.mask is not None else None
        self.cb = cb
        self.stream = torch.cuda.current_stream().cuda_stream
        self.plan = None
        if self.mask is not None:
            self.plan = cb.make_plan(self.dm, n_batch, H, HKV, head_dim_k=D, kv_type=GGML_TYPE_F16,
                                     ne3=ne3, stream=self.stream)

    def fns(self, kernel="auto", n_splits=None):
        def make(dk, dv):
            return lambda: self.cb.flash_attn_ext_device(
                self.dq, dk, dv, self.dm, None, self.dd, SCALE, kernel=kernel, plan=self.plan,
                stream=self.stream, n_splits=n_splits)
        return [make(dk, dv) for dk, dv in self.dkv]

    def kernel(self, kernel="auto"):
        """The kernel a call of this problem runs (cuda_backend.bind's choice)."""
        k, v = self.dkv[0]
        return self.cb.bind(self.dq, k, v, self.dm, None, self.dd, SCALE, kernel=kernel, plan=self.plan,
                            stream=self.stream).kern

    def tile_classes(self, kernel="auto"):
        if self.plan is None:
            return None
        from ggml_attn.dtypes import GGML_TYPE_F16
        sh = self.cb.AttnDims(D, D, self.q.shape[2], H, HKV, self.q.shape[0], self.kv[0][0].shape[2],
                              GGML_TYPE_F16, 1, 1)
        if kernel == "auto":   # the family by shapes alone (no architecture: not the sm_90a kernels)
            kernel = self.cb.decide("auto", sh, arch="").kernel
        cfg = self.cb.launch_config(kernel, sh)
        return self.plan.tile_classes(cfg.q_tile_tokens, self.stream)

    def plan_build(self):
        from ggml_attn.dtypes import GGML_TYPE_F16
        self.cb.make_plan(self.dm, self.dst.shape[1], H, HKV, head_dim_k=D, kv_type=GGML_TYPE_F16,
                          ne3=self.dst.shape[0], stream=self.stream)


def torch_qkv(B, L, S, seed=1, copies=1, bf16=False):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16 if bf16 else torch.float16
    q = (torch.rand((B, H, L, D), device="cuda", generator=g) * 2 - 1).to(dt)
    kv = [((torch.rand((B, HKV, S, D), device="cuda", generator=g) * 2 - 1).to(dt),
           (torch.rand((B, HKV, S, D), device="cuda", generator=g) * 2 - 1).to(dt))
          for _ in range(copies)]
    return q, kv


def sdpa_fns(q, kv, mask=None, causal=False):
    import torch
    f = torch.nn.functional.scaled_dot_product_attention
    return [lambda k=k, v=v: f(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, scale=SCALE)
            for k, v in kv]


def varlen_fns(lens, window=None, seed=2):
    """FA2 varlen on packed [T, H, D] f16 with cu_seqlens (the serving stacks' ragged kernel)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = (torch.rand((T, H, D), device="cuda", generator=g) * 2 - 1).half()
    k = (torch.rand((T, HKV, D), device="cuda", generator=g) * 2 - 1).half()
    v = (torch.rand((T, HKV, D), device="cuda", generator=g) * 2 - 1).half()
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")
    mx = max(lens)
    kw = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
    op = torch.ops.aten._flash_attention_forward
    return [lambda: op(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=SCALE, **kw)]


def varlen_decode_fns(lens, seed=3):
    """FA2 varlen for one decode token per sequence: q [B, H, D], packed K/V [sum(lens), HKV, D]
    (cu_seqlens_q 0..B, cu_seqlens_k the lengths' prefix sums), not causal."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, T = len(lens), sum(lens)
    q = (torch.rand((B, H, D), device="cuda", generator=g) * 2 - 1).half()
    k = (torch.rand((T, HKV, D), device="cuda", generator=g) * 2 - 1).half()
    v = (torch.rand((T, HKV, D), device="cuda", generator=g) * 2 - 1).half()
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device="cuda")
    op = torch.ops.aten._flash_attention_forward
    return [lambda: op(q, k, v, cu_q, cu_k, 1, max(lens), 0.0, False, False, scale=SCALE)]


def stream_lengths_mask(lens, n_kv):
    """Per-stream decode masks, numpy [ne33 = len(lens), 1, 1, n_kv]: stream s sees its first lens[s] cells."""
    m = np.full((len(lens), 1, 1, n_kv), -np.inf, np.float16)
    for s, n in enumerate(lens):
        m[s, 0, 0, :n] = 0
    return m


def prompt_lengths(n, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(16, 201, n)]


def window_mask(n, window):
    m = np.full((n, n), -np.inf, dtype=np.float16)
    for i in range(n):
        m[i, max(0, i - window + 1):i + 1] = 0
    return m


def narrow_prefill():
    return knobs(PREFILL_WIDE_MIN_BATCH=1 << 62)


class heads:
    """Context: the problem's query heads, KV heads and head size (the module's H, HKV, D and
    SCALE, read by Ours, torch_qkv and sdpa_fns at call time) set for some rows."""

    def __init__(self, h, hkv, d):
        self.new = dict(H=h, HKV=hkv, D=d, SCALE=1.0 / math.sqrt(d))

    def __enter__(self):
        g = globals()
        self.saved = {k: g[k] for k in self.new}
        g.update(self.new)

    def __exit__(self, *exc):
        globals().update(self.saved)










# ---------------------------------------------------------------------------------------
def run(quick=False, only=None, log=print):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []

    def want(case):
        return not only or any(o in case for o in only.split(","))

    def add(case, impl, fns, flops=None, nbytes=None, note="", ctx=None, **extra):
        try:
            if ctx is not None:
                with ctx:
                    med, lo, hi = device_us(fns)
            else:
                med, lo, hi = device_us(fns)
        except Exception as e:  # a backend that cannot run the case
            rows.append(dict(case=case, impl=impl, us=None, note=f"n/a: {type(e).__name__}: {str(e)[:120]}"))
            log(f"{case:40s} {impl:22s}      n/a  {str(e)[:80]}")
            return None
        r = dict(case=case, impl=impl, us=round(med, 2), us_min=round(lo, 2), us_max=round(hi, 2), note=note)
        if flops:
            r["tflops"] = round(flops / med / 1e6, 1)
        if nbytes:
            r["tbps"] = round(nbytes / med / 1e6, 2)
        r.update(extra)
        rows.append(r)
        log(f"{case:40s} {impl:22s} {med:9.1f}  {r.get('tflops', '')} {r.get('tbps', '')} {note}")
        return med

    def ws_ab(case, ours, fl, d, bf16):
        """WS_AB's instances on this case (those of its K/V type and tile width)."""
        from ggml_attn import wgmma_shape as wsh   # noqa: PLC0415
        from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16   # noqa: PLC0415
        kv_type = GGML_TYPE_BF16 if bf16 else GGML_TYPE_F16
        for key in filter(None, os.environ.get("WS_AB", "").split(",")):
            c = wsh.WS_CONFIGS[key]
            if c.kv_type == kv_type and c.d == wsh.tile_width(d):
                with knobs(WGMMA_CONFIG=key):
                    add(case, f"ours-ws-{key}", ours.fns("prefill-wgmma"), fl)

    cudnn = lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)   # noqa: E731
    fa2 = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)     # noqa: E731

    # ---- prefill, one sequence
    for n in ((2048,) if quick else (2048, 8192)):
        case = f"prefill N={n} causal"
        if want(case):
            fl = 4 * H * D * n * n / 2
            ours = Ours(1, n, n, block_causal_mask([n], n))
            # "ours": what auto runs (the sm_90a wgmma prefill on an H200, persistent blocks);
            # "ours-mma": mma.sync
            add(case, "ours", ours.fns("auto"), fl, note=f"auto: {ours.kernel()}")
            with knobs(WGMMA_CONFIG="pp"):   # the wgmma prefill with one block per query tile
                add(case, "ours-wgmma-pp", ours.fns("prefill-wgmma"), fl)
            with knobs(WGMMA_CONFIG="pp-persistent"):   # Q loaded per tile by the consumers (3 stages)
                add(case, "ours-wgmma-qld", ours.fns("prefill-wgmma"), fl)
            ws_ab(case, ours, fl, D, False)
            add(case, "ours-mma", ours.fns("prefill"), fl, tiles=ours.tile_classes("prefill"))
            with narrow_prefill():
                add(case, "ours-64row", ours.fns("prefill"), fl)
            rows.append(dict(case=case, impl="ours-plan-build", host_us=round(wall_us(ours.plan_build), 1),
                             note="wall time of make_plan (once per ubatch), synchronized"))
            q, kv = torch_qkv(1, n, n)
            add(case, "cudnn", sdpa_fns(q, kv, causal=True), fl, ctx=cudnn())
            add(case, "fa2", sdpa_fns(q, kv, causal=True), fl, ctx=fa2())
            del ours, q, kv
    # ---- causal 4096 at other shapes (#31's rows): bf16 K/V, 64/8 heads (70B-style GQA), D 64,
    # D 256 with 16/4 heads (Gemma-style); D 80, 96, 112 and 192 (run padded to the next tile width)
    n = 4096
    for h, hkv, d, bf16 in ((32, 8, 128, True), (64, 8, 128, False), (32, 8, 64, False), (16, 4, 256, False),
                            (32, 8, 80, False), (32, 8, 96, False), (32, 8, 112, False), (16, 4, 192, False)):
        case = f"prefill N={n} causal, {h}/{hkv} heads, D {d}" + (", bf16" if bf16 else "")
        if quick or not want(case):
            continue
        with heads(h, hkv, d):
            fl = 4 * H * D * n * n / 2
            ours = Ours(1, n, n, block_causal_mask([n], n), bf16=bf16)
            add(case, "ours", ours.fns("auto"), fl, note=f"auto: {ours.kernel()}")
            if d != 128:   # the mma.sync kernel, which auto ran there before the sm_90a instances
                add(case, "ours-mma", ours.fns("prefill"), fl)
            ws_ab(case, ours, fl, d, bf16)
            q, kv = torch_qkv(1, n, n, bf16=bf16)
            add(case, "cudnn", sdpa_fns(q, kv, causal=True), fl, ctx=cudnn())
            add(case, "fa2", sdpa_fns(q, kv, causal=True), fl, ctx=fa2())
            del ours, q, kv
    # ---- without a mask: 8192 tokens (a #12 target), and bf16 K/V against cuDNN's bf16
    for n, bf16 in ((8192, False), (4096, True)):
        case = f"prefill N={n} no mask" + (", bf16" if bf16 else "")
        if not quick and want(case):
            fl = 4 * H * D * n * n
            ours = Ours(1, n, n, bf16=bf16)
            add(case, "ours", ours.fns("auto"), fl, note=f"auto: {ours.kernel()}")
            q, kv = torch_qkv(1, n, n, bf16=bf16)
            add(case, "cudnn", sdpa_fns(q, kv), fl, ctx=cudnn())
            del ours, q, kv
    n = 4096
    case = f"prefill N={n} no mask"
    if want(case) or want("mask tile") or want("window"):
        fl = 4 * H * D * n * n
        ours = Ours(1, n, n)
        # "ours": what auto runs (the sm_90a prefill on an H200); "ours-mma": the mma.sync
        # kernel, the base of the mask tile and window ratios below (#8's stage-1 targets)
        t_auto = add(case, "ours", ours.fns("auto"), fl, note=f"auto: {ours.kernel()}")
        t_nomask = add(case, "ours-mma", ours.fns("prefill"), fl)
        with narrow_prefill():
            add(case, "ours-64row", ours.fns("prefill"), fl)
        q, kv = torch_qkv(1, n, n)
        add(case, "cudnn", sdpa_fns(q, kv), fl, ctx=cudnn())
        add(case, "fa2", sdpa_fns(q, kv), fl, ctx=fa2())
        # the sm_90a prefill ("n/a" off compute capability 9.0), each f16 instance, then its
        # speed-of-light probe (wrong results by design: the time without the softmax)
        from ggml_attn import hopper_prefill   # noqa: PLC0415
        from ggml_attn.dtypes import GGML_TYPE_F16   # noqa: PLC0415
        f16_configs = [c for c, wc in hopper_prefill.WS_CONFIGS.items() if wc.kv_type == GGML_TYPE_F16 and wc.d == D]
        for config in (*f16_configs, *hopper_prefill.WS_DIAG):   # no mask: run_ws on f16 K/V
            ws = [lambda dk=dk, dv=dv, c=config: hopper_prefill.run_ws(ours.dq, dk, dv, ours.dd, SCALE,
                                                                       ours.stream, config=c)
                  for dk, dv in ours.dkv]
            add(case, f"ours-wgmma-ws-{config}", ws, fl)
        # every tile MASKED (random finite values): the cost of loading and applying mask tiles
        rng = np.random.default_rng(7)
        rand = rng.uniform(-1, 1, (n, n)).astype(np.float16)
        with knobs(FINITE_MASK_TILES=False):   # every MASKED tile through the -inf select
            ours_r = Ours(1, n, n, rand)
        t_rand = add(f"prefill N={n} random mask (every tile MASKED)", "ours-select", ours_r.fns("prefill"), fl,
                     tiles=ours_r.tile_classes("prefill"))
        if t_nomask and t_rand:
            rows.append(dict(case="mask tile cost: random-mask / no-mask time, same tiles", impl="ours-select",
                             ratio=round(t_rand / t_nomask, 3)))
        del ours_r
        # the same bias mask with its tiles marked FINITE (the default: added with no -inf
        # select), and one -inf cell in 64 at random (every tile MASKED, none FINITE)
        holes = rand.copy()
        holes[rng.random((n, n)) < 1 / 64] = -np.inf
        for case, ratio_case, m, impl in (
                (f"prefill N={n} random mask (every tile MASKED)",
                 "mask tile cost: random-mask / no-mask time, same tiles", rand, "ours"),
                (f"prefill N={n} random mask, 1/64 cells -inf (every tile MASKED)",
                 "mask tile cost: random-mask with -inf cells / no-mask time, same tiles", holes, "ours")):
            ours_r = Ours(1, n, n, m)
            t = add(case, impl, ours_r.fns("prefill"), fl, tiles=ours_r.tile_classes("prefill"))
            del ours_r
            if t_nomask and t:
                rows.append(dict(case=ratio_case, impl=impl, ratio=round(t / t_nomask, 3)))
        add(f"prefill N={n} no mask", "ours-mma-again", ours.fns("prefill"), fl,
            note="the first row again, after the others: run-to-run spread")
        # sliding window 512, causal: live fraction f of the cells
        w = 512
        wm = window_mask(n, w)
        f = float(np.isfinite(wm).mean())
        ours_w = Ours(1, n, n, wm)
        t_win = add(f"prefill N={n} window {w}", "ours-mma", ours_w.fns("prefill"), 4 * H * D * n * n * f,
                    note=f"live fraction {f:.3f}", tiles=ours_w.tile_classes("prefill"))
        t_win_auto = add(f"prefill N={n} window {w}", "ours", ours_w.fns("auto"), 4 * H * D * n * n * f,
                         note=f"auto: {ours_w.kernel()}")
        t_win_ws = add(f"prefill N={n} window {w}", "ours-wgmma", ours_w.fns("prefill-wgmma"), 4 * H * D * n * n * f,
                       note="the sm_90a prefill by name (auto runs it when the plan is wide)")
        with narrow_prefill():
            add(f"prefill N={n} window {w}", "ours-64row", ours_w.fns("prefill"), 4 * H * D * n * n * f)
        add(f"prefill N={n} window {w}", "fa2-varlen-window", varlen_fns([n], window=w), 4 * H * D * n * n * f)
        for impl, t_w, t_all in (("ours-mma", t_win, t_nomask), ("ours", t_win_auto, t_auto),
                                 ("ours-wgmma", t_win_ws, t_auto)):
            if t_all and t_w:
                rows.append(dict(case=f"prefill N={n} window {w}: time / all-live time ({impl})", impl=impl,
                                 ratio=round(t_w / t_all, 3), target=round(f + 0.1, 3)))
        del ours, ours_w, q, kv

    # ---- ragged prompts in one unified ubatch (block-diagonal causal mask)
    for n_prompts in (16, 64):
        lens = prompt_lengths(n_prompts, seed=n_prompts)
        total = sum(lens)
        case = f"{n_prompts} prompts 16-200 ({total} tok)"
        if not want(case):
            continue
        useful = sum(4 * H * D * L * L / 2 for L in lens)
        n_kv = -(-total // 256) * 256
        ours = Ours(1, total, n_kv, block_causal_mask(lens, n_kv))
        add(case, "ours-unified", ours.fns(), useful, note=f"n_kv {n_kv}; auto: {ours.kernel()}",
            tiles=ours.tile_classes())
        with narrow_prefill():
            add(case, "ours-unified-64row", ours.fns(), useful)
        # the sm_90a prefill by name (what auto runs on an H200): WGMMA_RAGGED_PACK query heads per
        # tile, other packs, Q loaded per tile (one head a tile)
        add(case, "ours-unified-wgmma", ours.fns("prefill-wgmma"), useful)
        for pk in (1, 2, 8):
            with knobs(WGMMA_RAGGED_PACK=pk):
                add(case, f"ours-unified-wgmma-pack{pk}", ours.fns("prefill-wgmma"), useful)
        with knobs(WGMMA_CONFIG="pp-persistent"):
            add(case, "ours-unified-wgmma-qld", ours.fns("prefill-wgmma"), useful)
        ws_ab(case, ours, useful, D, False)
        rows.append(dict(case=case, impl="ours-plan-build", host_us=round(wall_us(ours.plan_build), 1),
                         note="wall time of make_plan (once per ubatch), synchronized"))
        for pk in (1, 8):
            with knobs(PREFILL_PACK=pk):
                add(case, f"ours-unified-pack{pk}", ours.fns(), useful)
        add(case, "fa2-varlen", varlen_fns(lens), useful)
        Lmax = max(lens)
        q, kv = torch_qkv(n_prompts, Lmax, Lmax)
        pm = torch.full((n_prompts, 1, Lmax, Lmax), float("-inf"), device="cuda", dtype=torch.float16)
        for i, L in enumerate(lens):
            pm[i, 0, :L, :L] = torch.triu(torch.full((L, L), float("-inf"), device="cuda"), 1).half()
        pm[:, :, :, 0] = 0  # padded query rows see one cell (no NaN rows)
        add(case, "cudnn-padded", sdpa_fns(q, kv, mask=pm), useful, ctx=cudnn())
        del ours, q, kv, pm

    # ---- two long sequences in one unified ubatch
    for L in ((1024,) if quick else (1024, 4096)):
        case = f"2 seqs x {L} unified"
        if not want(case):
            continue
        useful = 2 * 4 * H * D * L * L / 2
        ours = Ours(1, 2 * L, 2 * L, block_causal_mask([L, L], 2 * L))
        add(case, "ours-unified", ours.fns(), useful, tiles=ours.tile_classes(), note=f"auto: {ours.kernel()}")
        add(case, "ours-unified-mma", ours.fns("prefill"), useful)
        add(case, "ours-unified-wgmma", ours.fns("prefill-wgmma"), useful)
        add(case, "fa2-varlen", varlen_fns([L, L]), useful)
        q, kv = torch_qkv(2, L, L)
        add(case, "cudnn-batch2", sdpa_fns(q, kv, causal=True), useful, ctx=cudnn())
        del ours, q, kv

    # ---- decode (K/V rotated over copies larger than L2)
    decode_cases = [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (16, 32768), (64, 32768), (1, 131072)]
    if quick:
        decode_cases = [(1, 32768), (16, 4096)]
    for B, S in decode_cases:
        case = f"decode B={B} kv={S}"
        if not want(case):
            continue
        nbytes = 2 * B * HKV * S * D * 2
        c = copies_for(nbytes)
        ours = Ours(B, 1, S, copies=c)
        # "ours-auto" (on an H200 the sm_90a decode, decode-tma), the stage-1 kernels by name
        # (their split-count sweeps: bench/results of 2026-11-30 and before), decode-tma's ring
        # depths and its block count
        for kern in ("auto", "decode-tc", "decode-tma", "decode"):
            add(case, f"ours-{kern}", ours.fns(kern), None, nbytes, note=f"{c} K/V copies")
        for cfg in ("s4", "split-s4"):
            with knobs(DECODE_TMA_CONFIG=cfg):
                add(case, f"ours-decode-tma-{cfg}", ours.fns("decode-tma"), None, nbytes)
        with knobs(DECODE_TMA_ALIGN=0):   # one block per slot, not aligned to the row groups
            add(case, "ours-decode-tma-sms", ours.fns("decode-tma"), None, nbytes)
        if (B, S) == (1, 4096):
            rows.append(dict(case=case, impl="ours-host", host_us=round(host_us(ours.fns()[0]), 2),
                             note="host time of one flash_attn_ext_device call"))
        del ours
        q, kv = torch_qkv(B, 1, S, copies=c)
        add(case, "cudnn", sdpa_fns(q, kv), None, nbytes, ctx=cudnn())
        add(case, "fa2", sdpa_fns(q, kv), None, nbytes, ctx=fa2())
        del q, kv
        torch.cuda.empty_cache()

    # ---- per-stream decode under a mask (a plan: FULL tiles, a PARTIAL tail; split by the plan
    # rule: unsplit was 95.6 us against 80.2, bench/NOTES.md "ninth session")
    B, S = 16, 4096
    case = f"decode B={B} kv={S}, causal mask (plan)"
    if want(case):
        nbytes = 2 * B * HKV * S * D * 2
        m = np.zeros((1, S), np.float16)
        m[:, S - 100:] = -np.inf   # the last cells not yet written: a PARTIAL tail tile
        ours = Ours(B, 1, S, m, copies=copies_for(nbytes))
        add(case, "ours-auto", ours.fns(), None, nbytes, note=f"auto: {ours.kernel()}")
        add(case, "ours-decode-tc", ours.fns("decode-tc"), None, nbytes)
        add(case, "ours-decode-tma", ours.fns("decode-tma"), None, nbytes)
        with knobs(DECODE_TMA_ALIGN=0):   # equal shares, groups cut anywhere
            add(case, "ours-decode-tma-shares", ours.fns("decode-tma"), None, nbytes)
        add(case, "ours-decode-tc-again", ours.fns("decode-tc"), None, nbytes,
            note="after the others: run-to-run spread")
        del ours

    # ---- ragged decode: B streams of different lengths (per-stream KV, one mask plane each),
    # against FA2 varlen on the packed K/V (one query token per sequence) and cuDNN padded
    for B in (16, 64):
        S = 8192
        case = f"decode B={B} ragged 512-{S} (per-stream plan)"
        if not want(case):
            continue
        lens = [int(x) for x in np.random.default_rng(B).integers(512, S + 1, B)]
        nbytes = 2 * HKV * sum(lens) * D * 2
        m = stream_lengths_mask(lens, S)
        ours = Ours(B, 1, S, m, copies=copies_for(2 * B * HKV * S * D * 2))
        note = f"{sum(lens)} cells live of {B * S}"
        add(case, "ours-auto", ours.fns(), None, nbytes, note=f"auto: {ours.kernel()}; {note}")
        add(case, "ours-decode-tc", ours.fns("decode-tc"), None, nbytes)
        add(case, "ours-decode-tma", ours.fns("decode-tma"), None, nbytes)
        with knobs(DECODE_TMA_ALIGN=0):
            add(case, "ours-decode-tma-shares", ours.fns("decode-tma"), None, nbytes)
        with knobs(DECODE_TMA_CAP_SLACK=100.0):   # cut on group boundaries whenever the blocks fit
            add(case, "ours-decode-tma-capped", ours.fns("decode-tma"), None, nbytes)
        del ours
        add(case, "fa2-varlen", varlen_decode_fns(lens), None, nbytes)
        q, kv = torch_qkv(B, 1, S)
        pm = torch.from_numpy(m).cuda()
        add(case, "cudnn-padded", sdpa_fns(q, kv, mask=pm), None, nbytes, ctx=cudnn())
        del q, kv, pm
        torch.cuda.empty_cache()

    # ---- the full block's weight reads at decode (dense.cu's GEMV vs cuBLAS)
    if want("dense:"):
        import gpu_dense_bench  # noqa: PLC0415
        try:
            rows.extend(gpu_dense_bench.run(device_us, log=log))
        except Exception as e:  # noqa: BLE001 - report, keep the other rows
            rows.append(dict(case="dense:", impl="ours", us=None, note=f"n/a: {type(e).__name__}: {str(e)[:160]}"))
            log(f"dense bench failed: {e!r}")

    # ---- host path: the op in a device-resident ggml graph, plain and replayed as a CUDA graph
    if want("graph:"):
        import gpu_graph_bench  # noqa: PLC0415 (run as a script too)
        try:
            rows.extend(gpu_graph_bench.run(device_us, log=log))
        except Exception as e:  # noqa: BLE001 - report, keep the other rows
            rows.append(dict(case="graph: 32 decode ops", impl="ours", us=None,
                             note=f"n/a: {type(e).__name__}: {str(e)[:160]}"))
            log(f"graph bench failed: {e!r}")

    # ---- one layer's attention of a 64-sequence decode step over a unified cache, per kernel
    if want("batched decode"):
        import gpu_batched_attn_bench  # noqa: PLC0415 (run as a script too)
        try:
            res = gpu_batched_attn_bench.run(timer=device_us)
            for r in res["rows"]:
                rows.append(dict(case=res["case"], impl=f"ours-{r['kernel']}", us=r.get("us"),
                                 note=r.get("error", f"floor {res['floor_us_kv_once']} us (K/V read once); "
                                                     f"live fraction {res['live_fraction']}")))
                log(f"{res['case']:44s} ours-{r['kernel']:14s} {r.get('us', r.get('error'))}")
        except Exception as e:  # noqa: BLE001 - report, keep the other rows
            rows.append(dict(case="batched decode step", impl="ours", us=None,
                             note=f"n/a: {type(e).__name__}: {str(e)[:160]}"))
            log(f"batched decode bench failed: {e!r}")

    # ---- decode with a fraction of the KV live
    S, f = 32768, 1 / 8
    case = f"decode B=1 kv={S}, first {f:.3f} live"
    if want(case):
        nbytes = 2 * HKV * S * D * 2
        c = copies_for(nbytes)
        m = np.full((1, S), -np.inf, dtype=np.float16)
        m[:, :int(S * f)] = 0
        full = Ours(1, 1, S, np.zeros((1, S), np.float16), copies=c)
        part = Ours(1, 1, S, m, copies=c)
        for impl, kern in (("ours-auto", "auto"), ("ours-decode-tc", "decode-tc")):
            t_all = add(f"decode B=1 kv={S}, all live (zero mask)", impl, full.fns(kern), None, nbytes,
                        note=f"auto: {full.kernel()}" if kern == "auto" else "")
            t_part = add(case, impl, part.fns(kern), None, nbytes * f)
            if t_all and t_part:
                rows.append(dict(case=f"{case}: time / all-live time ({impl})", impl=impl,
                                 ratio=round(t_part / t_all, 3), target=round(f + 0.1, 3)))
        del full, part
    return rows


# ---------------------------------------------------------------------------------------
def summary(rows):
    """Short table: ours vs the best peer per case. "ours" is the configuration the op runs by
    default (row ``ours``, ``ours-auto`` or ``ours-unified``), not the best of the comparison
    rows (other split counts, finishes, tile shapes), which stay in the JSON and the log."""
    by_case: dict[str, dict] = {}
    for r in rows:
        if r.get("us") is not None:
            by_case.setdefault(r["case"], {})[r["impl"]] = r["us"]
    lines = [f"{'case':44s} {'ours us':>9s} {'best peer':>18s} {'peer us':>9s} {'ours/peer':>9s}"]
    for case, impls in by_case.items():
        mine = {k: v for k, v in impls.items() if k.startswith("ours") and k != "ours-plan-build"}
        peers = {k: v for k, v in impls.items() if not k.startswith("ours")}
        if not mine:
            continue
        default = next((k for k in ("ours", "ours-auto", "ours-unified") if k in mine), None)
        best_ours = mine[default] if default else min(mine.values())
        if peers:
            pk = min(peers, key=peers.get)
            lines.append(f"{case:44s} {best_ours:9.1f} {pk:>18s} {peers[pk]:9.1f} {best_ours / peers[pk]:9.2f}")
        else:
            lines.append(f"{case:44s} {best_ours:9.1f}")
    for r in rows:
        if "ratio" in r:
            lines.append(f"{r['case']:60s} {r['ratio']:.3f}" + (f" (target <= {r['target']})" if "target" in r else ""))
        if "host_us" in r:
            lines.append(f"{r['case']:44s} {r['impl']} host {r['host_us']:.1f} us")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None,
                    help="run only cases whose name contains this (a comma-separated list: any of them)")
    a = ap.parse_args(argv)
    import torch
    from ggml_attn import kernels as K
    rows = run(a.quick, a.only)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), nvrtc=list(K.nvrtc_version()),
                python=platform.python_version(), commit=_git_commit(),
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                heads=f"{H}q/{HKV}kv", d=D, kv="f16", quick=a.quick,
                method="device time: batches of 30 calls queued behind a sleep kernel, median of 3; "
                       "decode K/V rotated over >= 256 MB of copies")
    try:
        import cupy
        meta["cupy"] = cupy.__version__
    except Exception:
        pass
    doc = dict(meta=meta, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"\n{meta['gpu']} torch {meta['torch']} cudnn {meta['cudnn']} commit {meta['commit']}")
    print(summary(rows))


if __name__ == "__main__":
    main()
