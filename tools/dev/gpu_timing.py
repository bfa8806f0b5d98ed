"""Device and host timing of GPU calls, as every GPU benchmark here times them, and the
backend's tuning knobs set for a comparison row (:class:`knobs`).

- :func:`device_us`: device time per call -- each batch of calls queued behind a long sleep
  kernel, so that the host has enqueued every call before the GPU reaches the first one; CUDA
  events around the batch time the GPU alone (a batch whose first event had already fired when
  the host finished enqueuing is re-run with a longer sleep); median of 3 batches.
- :func:`host_us` / :func:`wall_us`: host time per call (enqueue only / with the device's work).
- :func:`copies_for`: copies of an input to rotate over so that they exceed the L2 cache
  (decode K/V: each layer of a model reads its own).
Needs torch with CUDA (its sleep kernel and events).
"""
from __future__ import annotations

import time

L2_ROTATE_BYTES = 256 << 20   # >= 4x the H200's 60 MB L2


def device_us(fns, calls=30, batches=3):
    """Median device time (us) of one call; ``fns`` are used in rotation (call i: fns[i % n])."""
    import torch
    for f in fns:
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - t) * 1e3
    sleep_ms = max(5.0, 3.0 * host_ms)
    out = []
    while len(out) < batches:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_ms * 2.0e6))   # ~2 GHz SM clock; longer if the clock is lower
        a.record()
        for i in range(calls):
            fns[i % len(fns)]()
        b.record()
        if a.query():          # the GPU was idle before we finished enqueuing: host-bound batch
            b.synchronize()
            sleep_ms *= 2
            if sleep_ms > 2000:
                raise RuntimeError("host cannot enqueue the batch within 2 s of sleep")
            continue
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    out.sort()
    return out[len(out) // 2], out[0], out[-1]


def host_us(fn, calls=300, *, wait: bool = False):
    """Host time (us) of one call of ``fn``: enqueue only (the GPU runs behind), or with
    ``wait`` until the device finished them (wall time, for per-ubatch work)."""
    import torch
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return dt


def wall_us(fn, calls=20):
    """:func:`host_us` with ``wait``: host wall time including the device's work."""
    return host_us(fn, calls, wait=True)


def copies_for(nbytes):
    return max(1, -(-L2_ROTATE_BYTES // max(nbytes, 1)))


class knobs:
    """Context: tuning knobs of ggml_attn.cuda_launch (or of ``module``, e.g.
    ggml_attn.matmul_dispatch) changed for a comparison row, put back on exit (the call cache
    ggml_attn.cuda_backend._PREPARED cleared on entry and exit)."""

    def __init__(self, module=None, **kw):
        self.module, self.kw = module, kw

    def _module(self):
        from ggml_attn import cuda_launch
        return self.module or cuda_launch

    def __enter__(self):
        from ggml_attn import cuda_backend as cb
        knob = self._module()
        self.saved = {}
        for k, v in self.kw.items():
            cur = getattr(knob, k)
            self.saved[k] = dict(cur) if isinstance(cur, dict) else cur
            if isinstance(cur, dict):
                cur.update(v)
            else:
                setattr(knob, k, v)
        cb._PREPARED.clear()

    def __exit__(self, *exc):
        from ggml_attn import cuda_backend as cb
        knob = self._module()
        for k, v in self.saved.items():
            if isinstance(v, dict):
                getattr(knob, k).update(v)
            else:
                setattr(knob, k, v)
        cb._PREPARED.clear()
