"""Benchmark the CUDA kernels on REFERENCE.md section 5's cases, with torch SDPA (cuDNN and
FlashAttention-2 backends) in the same run. 32 query heads, 8 KV heads, D=128, f16 K/V.

Times are CUDA-event medians (warm-up first; each sample times a loop of calls and divides),
in microseconds, for one attention call. Our calls go through
``cuda_backend.flash_attn_ext_device`` exactly as the op makes them (raw pointers, plan reused
as for every layer of a ubatch). Writes a JSON file (GPU, versions, commit, date, every row)
and prints a short table last.

Usage: python tools/gpu_bench.py [--quick] [--out FILE] [--only SUBSTR]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys

import numpy as np

from ggml_attn.conformance import block_causal_mask

H, HKV, D = 32, 8, 128


def _git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("GGML_ATTN_COMMIT", "unknown")


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


def time_us(fn, reps=10, groups=9, warmup=3):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(groups):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1000.0 / reps)
    samples.sort()
    return samples[len(samples) // 2], samples[0], samples[-1]


class Ours:
    """One attention problem laid out as the op sees it (ggml layouts on the GPU)."""

    def __init__(self, ne3, n_batch, n_kv, mask_np=None, seed=0, mask_streams=1):
        import torch
        from ggml_attn import cuda_backend as cb
        from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_F32
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.q = torch.rand((ne3, H, n_batch, D), device="cuda", generator=g) * 2 - 1
        self.k = (torch.rand((ne3, HKV, n_kv, D), device="cuda", generator=g) * 2 - 1).half()
        self.v = (torch.rand((ne3, HKV, n_kv, D), device="cuda", generator=g) * 2 - 1).half()
        self.dst = torch.empty((ne3, n_batch, H, D), device="cuda")
        self.mask = None
        if mask_np is not None:
            m = torch.from_numpy(mask_np).cuda()
            self.mask = m.reshape(mask_streams, 1, m.shape[-2], m.shape[-1])
        self.d = dict(q=_desc(self.q, GGML_TYPE_F32), k=_desc(self.k, GGML_TYPE_F16),
                      v=_desc(self.v, GGML_TYPE_F16), dst=_desc(self.dst, GGML_TYPE_F32),
                      mask=_desc(self.mask, GGML_TYPE_F16) if self.mask is not None else None)
        self.cb = cb
        self.stream = torch.cuda.current_stream().cuda_stream
        self.plan = None
        if self.mask is not None:
            self.plan = cb.make_plan(self.d["mask"], n_batch, H, HKV, d_k=D, kv_type=GGML_TYPE_F16,
                                     ne3=ne3, stream=self.stream)

    def call(self, kernel="auto"):
        d = self.d
        self.cb.flash_attn_ext_device(d["q"], d["k"], d["v"], d["mask"], None, d["dst"],
                                      1.0 / math.sqrt(D), kernel=kernel, plan=self.plan,
                                      stream=self.stream)

    def plan_build(self):
        """Time to (re)build the plan for the configured tile shape (one per ubatch)."""
        from ggml_attn.dtypes import GGML_TYPE_F16
        self.cb.make_plan(self.d["mask"], self.dst.shape[1], H, HKV, d_k=D, kv_type=GGML_TYPE_F16,
                          ne3=self.dst.shape[0], stream=self.stream)


def sdpa(backend_name, q, k, v, mask=None, causal=False):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend_name]

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    fn()  # raises if the backend cannot run this case
    return fn


def torch_qkv(B, L, S, seed=1):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.rand((B, H, L, D), device="cuda", generator=g) * 2 - 1).half()
    k = (torch.rand((B, HKV, S, D), device="cuda", generator=g) * 2 - 1).half()
    v = (torch.rand((B, HKV, S, D), device="cuda", generator=g) * 2 - 1).half()
    return q, k, v


def prompt_lengths(n, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(16, 201, n)]


def run(quick=False, only=None):
    import torch
    rows = []

    def add(case, impl, fn, flops=None, nbytes=None, note=""):
        if only and only not in case:
            return
        try:
            med, lo, hi = time_us(fn, reps=5 if quick else 10, groups=5 if quick else 9)
        except Exception as e:  # a backend that cannot run the case
            rows.append(dict(case=case, impl=impl, us=None, note=f"n/a: {type(e).__name__}: {str(e)[:120]}"))
            return
        r = dict(case=case, impl=impl, us=round(med, 2), us_min=round(lo, 2), us_max=round(hi, 2), note=note)
        if flops:
            r["tflops"] = round(flops / med / 1e6, 1)
        if nbytes:
            r["tbps"] = round(nbytes / med / 1e6, 2)
        rows.append(r)

    def want(case):
        return not only or only in case

    # ---- prefill, one sequence, causal
    for n in ((512, 2048) if quick else (512, 2048, 8192)):
        case = f"prefill N={n} causal"
        if not want(case):
            continue
        fl = 4 * H * D * n * n / 2
        ours = Ours(1, n, n, block_causal_mask([n], n))
        for kern in ("prefill",):
            add(case, f"ours-{kern}", lambda: ours.call(kern), fl)
        add(case, "ours-plan-build", ours.plan_build)
        q, k, v = torch_qkv(1, n, n)
        for be in ("cudnn", "fa2"):
            try:
                add(case, f"sdpa-{be}", sdpa(be, q, k, v, causal=True), fl)
            except Exception as e:
                rows.append(dict(case=case, impl=f"sdpa-{be}", us=None, note=f"n/a: {e}"[:150]))
        del ours
    if want("prefill N=8192 no mask") and not quick:
        n = 8192
        ours = Ours(1, n, n)
        add("prefill N=8192 no mask", "ours-prefill", lambda: ours.call("prefill"), 4 * H * D * n * n)
        q, k, v = torch_qkv(1, n, n)
        for be in ("cudnn", "fa2"):
            try:
                add("prefill N=8192 no mask", f"sdpa-{be}", sdpa(be, q, k, v), 4 * H * D * n * n)
            except Exception as e:
                rows.append(dict(case="prefill N=8192 no mask", impl=f"sdpa-{be}", us=None, note=f"n/a: {e}"[:150]))
        del ours

    # ---- ragged multi-prompt batches (the project's case): unified KV, block-causal mask
    for n_prompts in (16, 64):
        lens = prompt_lengths(n_prompts, seed=n_prompts)
        total = sum(lens)
        case = f"{n_prompts} prompts 16-200 ({total} tok)"
        if not want(case):
            continue
        useful = sum(4 * H * D * L * L / 2 for L in lens)
        n_kv = -(-total // 256) * 256
        ours = Ours(1, total, n_kv, block_causal_mask(lens, n_kv))
        add(case, "ours-unified", lambda: ours.call("auto"), useful, note=f"n_kv {n_kv}")
        add(case, "ours-plan-build", ours.plan_build)
        del ours
        # peers: padded batch + mask (cuDNN), and one call per prompt (FA2, serial)
        Lmax = max(lens)
        q, k, v = torch_qkv(n_prompts, Lmax, Lmax)
        pm = torch.full((n_prompts, 1, Lmax, Lmax), float("-inf"), device="cuda", dtype=torch.float16)
        for i, L in enumerate(lens):
            pm[i, 0, :L, :L] = torch.triu(torch.full((L, L), float("-inf"), device="cuda"), 1).half()
        pm[:, :, :, 0] = 0  # padded query rows see one cell (no NaN rows)
        for be in ("cudnn", "fa2"):
            try:
                add(case, f"sdpa-{be}-padded", sdpa(be, q, k, v, mask=pm), useful)
            except Exception as e:
                rows.append(dict(case=case, impl=f"sdpa-{be}-padded", us=None, note=f"n/a: {e}"[:150]))
        qs = [torch_qkv(1, L, L, seed=i) for i, L in enumerate(lens)]
        try:
            fns = [sdpa("fa2", *x, causal=True) for x in qs]
            add(case, "sdpa-fa2-serial", lambda: [f() for f in fns], useful)
        except Exception as e:
            rows.append(dict(case=case, impl="sdpa-fa2-serial", us=None, note=f"n/a: {e}"[:150]))

    # ---- two long sequences in one unified ubatch
    for L in ((1024,) if quick else (1024, 2048, 4096)):
        case = f"2 seqs x {L} unified"
        if not want(case):
            continue
        useful = 2 * 4 * H * D * L * L / 2
        ours = Ours(1, 2 * L, 2 * L, block_causal_mask([L, L], 2 * L))
        add(case, "ours-unified", lambda: ours.call("auto"), useful)
        del ours
        q, k, v = torch_qkv(2, L, L)
        for be in ("cudnn", "fa2"):
            try:
                add(case, f"sdpa-{be}-batch2", sdpa(be, q, k, v, causal=True), useful)
            except Exception as e:
                rows.append(dict(case=case, impl=f"sdpa-{be}-batch2", us=None, note=f"n/a: {e}"[:150]))

    # ---- decode
    decode_cases = [(1, 4096), (1, 32768), (16, 4096), (16, 32768), (64, 32768)]
    if quick:
        decode_cases = [(1, 32768), (16, 4096)]
    for B, S in decode_cases:
        case = f"decode B={B} kv={S}"
        if not want(case):
            continue
        nbytes = 2 * B * HKV * S * D * 2
        ours = Ours(B, 1, S)
        for kern in ("auto", "decode", "decode-tc", "prefill"):
            add(case, f"ours-{kern}", lambda: ours.call(kern), None, nbytes)
        del ours
        q, k, v = torch_qkv(B, 1, S)
        for be in ("cudnn", "fa2"):
            try:
                add(case, f"sdpa-{be}", sdpa(be, q, k, v), None, nbytes)
            except Exception as e:
                rows.append(dict(case=case, impl=f"sdpa-{be}", us=None, note=f"n/a: {e}"[:150]))
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    a = ap.parse_args(argv)
    import torch
    from ggml_attn import kernels as K
    rows = run(a.quick, a.only)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), nvrtc=list(K.nvrtc_version()),
                python=platform.python_version(), commit=_git_commit(),
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                heads=f"{H}q/{HKV}kv", d=D, kv="f16", quick=a.quick)
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
    print(f"{'case':36s} {'impl':24s} {'us':>9s} {'TFLOP/s':>8s} {'TB/s':>6s}  note")
    for r in rows:
        us = f"{r['us']:9.1f}" if r.get("us") is not None else "      n/a"
        print(f"{r['case']:36s} {r['impl']:24s} {us} {r.get('tflops', ''):>8} {r.get('tbps', ''):>6}  {r.get('note', '')[:60]}")


if __name__ == "__main__":
    main()
