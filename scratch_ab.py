"""Ad-hoc A/B on the device (not committed)."""
import numpy as np
from ggml_attn.cli.gpu_bench import Ours, copies_for, HKV, D
from ggml_attn.cli.gpu_timing import device_us, knobs
from ggml_attn import cuda_backend as cb

def t(name, fns):
    med, lo, hi = device_us(fns)
    print(f"{name:50s} {med:8.2f} ({lo:.2f}-{hi:.2f})", flush=True)

B, S = 16, 4096
m = np.zeros((1, S), np.float16); m[:, S - 100:] = -np.inf
nbytes = 2 * B * HKV * S * D * 2
ours = Ours(B, 1, S, m, copies=copies_for(nbytes))
for kern in ("auto", "decode-tma", "auto", "decode-tma", "decode-tc", "auto"):
    b = ours.cb.bind(ours.dq, *ours.dkv[0], ours.dm, None, ours.dd, 0.088, kernel=kern, plan=ours.plan, stream=ours.stream)
    print(kern, b.kern, b._grid, b._params.work_cap, b._comb is not None)
    t(f"masked B=16 4k {kern}", ours.fns(kern))
del ours
ours = Ours(B, 1, S, m, copies=copies_for(nbytes))
t("masked B=16 4k fresh, tma first", ours.fns("decode-tma"))
t("masked B=16 4k fresh, auto second", ours.fns("auto"))
del ours
for B, S in ((16, 4096), (64, 32768), (16, 32768)):
    ours = Ours(B, 1, S, copies=copies_for(2 * B * HKV * S * D * 2))
    t(f"nomask B={B} {S} tma capped 132", ours.fns("decode-tma"))
    with knobs(DECODE_TMA_BLOCKS=128):
        t(f"nomask B={B} {S} tma capped 128 blocks", ours.fns("decode-tma"))
    with knobs(DECODE_TMA_ALIGN=0):
        t(f"nomask B={B} {S} tma shares 132", ours.fns("decode-tma"))
    with knobs(DECODE_TMA_ALIGN=0, DECODE_TMA_BLOCKS=128):
        t(f"nomask B={B} {S} tma shares 128 (the old aligned)", ours.fns("decode-tma"))
    t(f"nomask B={B} {S} tma capped 132 again", ours.fns("decode-tma"))
    del ours
