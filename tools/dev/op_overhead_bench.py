"""Host cost of the op's callback fast path, without a GPU: a ggml graph of ``n`` op nodes
(decode shapes: one query token, 32 q / 8 KV heads, D 128) whose nodes are bound to a no-op
launch, computed by ggml's graph loop on one thread. Prints microseconds per op node for a
plain ``ggml_graph_compute_with_ctx`` and inside ``ggml_attn.runtime.computing`` (error
bookkeeping). What the GPU adds on top is the launches themselves (``tools/dev/gpu_graph_bench.py``).

Usage: python tools/dev/op_overhead_bench.py [-n 32] [--reps 200]
"""
from __future__ import annotations

import argparse
import ctypes
import time


def run(n: int = 32, reps: int = 200, plan: bool = True, mask: bool = True) -> dict:
    """Microseconds per op node of the two computes; ``plan``/``mask``: the nodes are built with
    ``plan=`` (needs a mask) and with a mask, as ggml's own signature allows."""
    import ggml

    import ggml_attn
    from ggml_attn import op, runtime

    class _Plan:   # the op asks a plan only whether it fits the mask
        def matches(self, mask, n_batch):
            return True

    class _NoLaunch:
        launches = 0

        @staticmethod
        def launch():
            _NoLaunch.launches += 1

    class _Stream:
        ptr = 0

    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=64 << 20, mem_buffer=None))
    saved = op._current_stream
    try:
        D, H, HKV, NKV = 128, 32, 8, 256
        the_plan = _Plan() if plan else None
        q = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, D, 1, H, 1)
        mask_t = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, NKV, 1, 1, 1)
        gf = ggml.ggml_new_graph_custom(ctx, 4 * n, False)
        for _ in range(n):
            k = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, D, NKV, HKV, 1)
            v = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, D, NKV, HKV, 1)
            out = ggml_attn.flash_attn_ext(ctx, q, k, v, mask_t if mask else None, 0.1, plan=the_plan)
            ggml.ggml_build_forward_expand(gf, out)
            spec = op.spec_of(out)
            if not spec.per_node:   # a plan-less node gets its own spec at its first bind
                spec = op._node_spec(op.userdata_of(out), spec)
            spec.bound = op.fast_record(ctypes.addressof(out.contents), 3 + bool(mask), _NoLaunch.launch, 0)
        op._current_stream = _Stream

        def plain():
            ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)

        def computing():
            with runtime.computing(gf):
                ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
        res = {}
        for name, fn in (("plain", plain), ("computing", computing)):
            fn()
            _NoLaunch.launches = 0
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            res[name] = (time.perf_counter() - t) / reps / n * 1e6
            assert _NoLaunch.launches == reps * n, "every node must take the fast path"
        return res
    finally:
        op._current_stream = saved
        ggml.ggml_free(ctx)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=32, help="op nodes in the graph (default 32)")
    ap.add_argument("--reps", type=int, default=200, help="computes timed (default 200)")
    a = ap.parse_args(argv)
    for label, kw in (("mask + plan", dict(plan=True)), ("mask, no plan", dict(plan=False)),
                      ("no mask, no plan", dict(plan=False, mask=False))):
        for name, us in run(a.n, a.reps, **kw).items():
            print(f"{label:17s} {name:10s} {us:6.2f} us per op node")


if __name__ == "__main__":
    main()
