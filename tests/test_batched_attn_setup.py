"""tools/gpu_batched_attn_bench.py's setup, without a GPU: the decode step it times is the one
ggml-attn-batched-bench -npl 64 -kvu makes (one row per sequence, each seeing only its own
cells), and the steps' cells interleave so that every KV tile past the prompts holds a live cell
of every row -- the case the benchmark is about."""
import numpy as np

from ggml_attn.cli import gpu_batched_attn_bench as b


def test_step_plan_rows_see_their_own_cells_and_decode_tiles_interleave():
    seqs, steps = 16, 8
    plan, n_prompt = b.step_plan(seqs, steps)
    mask = np.asarray(plan.mask).reshape(-1, plan.mask.shape[-1])[:plan.ubatch.n_tokens]
    live = mask == 0
    assert plan.ubatch.n_tokens == seqs and live.shape[1] == plan.n_kv
    per_row = live.sum(axis=1)
    assert (per_row > 0).all() and per_row.sum() == n_prompt + seqs * (steps + 1)   # each cell seen by one row
    assert (live.sum(axis=0) <= 1).all()
    decode = live[:, n_prompt:n_prompt + seqs * steps]          # the steps' cells, in tiles of `seqs`
    tiles = decode.reshape(seqs, steps, seqs).any(axis=2)
    assert tiles.all(), "every step's block holds a live cell of every row"
