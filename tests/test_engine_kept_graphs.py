"""graph/engine.py's kept built graphs: which are freed when (counts, the bytes their builds took,
prompt structures before decode steps), a build that runs out of device memory, and the serve
bench's count of graphs built."""
import json
from pathlib import Path

import pytest

from ggml_attn.cli import serve_bench
from ggml_attn.graph import engine as E
from ggml_attn.graph.kv_cache import KVCache

SAMPLE = Path(__file__).resolve().parents[1] / "bench" / "traces" / "sample.jsonl"


class _G:
    """A stand-in for a built graph: records that it was freed."""

    def __init__(self, freed, name):
        self.freed, self.name = freed, name

    def free(self):
        self.freed.append(self.name)


def _engine():
    return E.Engine(KVCache(256, 1, unified=True, n_head_kv=1, head_dim_k=4), None, device=False)


def _keep(e, freed, entries):
    """Kept entries (name, decode, nbytes) in use order, oldest first."""
    for name, decode, nbytes in entries:
        e._graphs[name] = E._Cached(_G(freed, name), decode, nbytes)


def test_prompt_structures_go_first_then_the_oldest():
    e, freed = _engine(), []
    _keep(e, freed, [("d0", True, 0), ("p0", False, 0), ("d1", True, 0), ("p1", False, 0), ("p2", False, 0)])
    e._evict(4, 2, None)   # 3 prompt structures, room for 2: the oldest prompt one goes, not d0
    assert freed == ["p0"] and list(e._graphs) == ["d0", "d1", "p1", "p2"]
    e._evict(3, 2, None)   # then the oldest of any
    assert freed == ["p0", "d0"]


def test_bytes_bound_the_kept_graphs_and_prompt_structures_take_at_most_three_quarters():
    e, freed = _engine(), []
    _keep(e, freed, [("d0", True, 100), ("p0", False, 300), ("p1", False, 300), ("d1", True, 100),
                     ("p2", False, 200)])
    e._evict(99, 99, 1000)   # all 1000 fit; prompt ones 800 > 750: p0 goes
    assert freed == ["p0"]
    e._evict(99, 99, 1000)   # nothing more to do
    assert freed == ["p0"]
    e._evict(99, 99, 400)    # prompt share 300: p1 goes (p2's 200 fits it); then 400 in all fits
    assert freed == ["p0", "p1"] and list(e._graphs) == ["d0", "d1", "p2"]
    e._evict(99, 99, 150)    # prompt share 112: p2 goes; then 200 > 150: the oldest, d0
    assert freed == ["p0", "p1", "p2", "d0"] and list(e._graphs) == ["d1"]


def test_host_engines_keep_few_graphs_and_no_byte_bound_device_ones_many():
    assert E.MAX_GRAPHS[False] == (4, 4) and E.GRAPH_BYTES[False] is None
    n_all, n_other = E.MAX_GRAPHS[True]
    assert n_all > n_other >= 128 and E.GRAPH_BYTES[True] >= 1 << 30


def _fake_xp(free, pool_free):
    import types
    rt = types.SimpleNamespace(memGetInfo=lambda: (free, 80 << 30))
    pool = types.SimpleNamespace(free_bytes=lambda: pool_free)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt), get_default_memory_pool=lambda: pool)


@pytest.mark.parametrize("free, pool_free, want", [
    (56 << 30, 4 << 30, 15 << 30),   # an H100 with the 8B F16 file and its cache in: a quarter of 60 GiB
    (200 << 30, 0, 16 << 30),        # capped at GRAPH_BYTES_MAX
    (3 << 30, 1 << 30, 2 << 30),     # a full device keeps the floor, GRAPH_BYTES[True]
])
def test_device_graph_bytes_grow_with_the_free_memory(free, pool_free, want):
    assert E.graph_bytes_budget(_fake_xp(free, pool_free)) == want


def test_the_device_engine_sizes_its_byte_bound_at_the_first_kept_graph(monkeypatch):
    """The bound is read once, when the first graph is kept (the weights and the cache are in by
    then), not at the engine's start; a host engine has none."""
    e, freed = _engine(), []
    calls = []
    monkeypatch.setattr(E, "graph_bytes_budget", lambda xp: calls.append(xp) or (9 << 30))
    e._bytes_sized = False   # (as a device engine starts)
    assert e.max_graph_bytes is None
    for i in range(2):
        key = ("p", i)
        e._graphs[key] = E._Cached(_G(freed, key), False, 1)
        e._size_bytes_once()
    assert e.max_graph_bytes == 9 << 30 and len(calls) == 1


def test_a_build_out_of_memory_frees_the_kept_graphs_and_tries_once_more():
    e, freed = _engine(), []
    _keep(e, freed, [("d0", True, 10), ("p0", False, 10)])
    tries = []

    def make():
        tries.append(1)
        if len(tries) == 1:
            raise MemoryError("out of memory")
        return "graph"
    assert e._build(make) == ("graph", 0) and len(tries) == 2 and freed == ["p0", "d0"] and not e._graphs
    assert e.builds == 1

    def never():
        raise MemoryError("out of memory")
    with pytest.raises(MemoryError):   # nothing kept to free: the error stands
        e._build(never)
    assert e.builds == 1


class CUDARuntimeError(RuntimeError):
    """CuPy's ``cupy_backends.cuda.api.runtime.CUDARuntimeError`` as the engine sees it (its class
    name and ``status``; CuPy is not installed without a GPU)."""

    def __init__(self, status):
        super().__init__(f"status {status}")
        self.status = status


class _Pool:
    def __init__(self):
        self.freed = 0

    def free_all_blocks(self):
        self.freed += 1


class _XP:
    def __init__(self):
        self.pool = _Pool()

    def get_default_memory_pool(self):
        return self.pool


def test_out_of_device_memory_knows_cupys_errors_and_the_capture_errors_they_raise():
    from ggml_attn.graph.capture import CaptureError
    oom, other = CUDARuntimeError(2), CUDARuntimeError(700)   # cudaErrorMemoryAllocation, an illegal address
    assert E.out_of_device_memory(oom) and E.out_of_device_memory(MemoryError())
    assert not E.out_of_device_memory(other) and not E.out_of_device_memory(RuntimeError("x"))
    try:
        raise CaptureError("CUDA graph capture failed") from oom
    except CaptureError as e:
        assert E.out_of_device_memory(e)


def test_a_graph_launch_out_of_device_memory_gives_cupys_cached_blocks_back_and_launches_again():
    """On an 80 GB H100 a CUDA graph's first launch failed with cudaErrorMemoryAllocation while
    CuPy's pool kept the device's free memory for itself: the engine gives the pool's cached
    blocks back and launches once more, then frees the other kept graphs and tries a last time;
    another error, or a third failure, propagates."""
    e = _engine()
    e.device, e.xp = True, _XP()
    freed = []
    _keep(e, freed, [("d0", True, 10), ("p0", False, 10)])
    calls = []

    def launch(errors):
        def call():
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return "launched"
        return call
    assert e._retry_out_of_memory(launch([CUDARuntimeError(2)])) == "launched"
    assert len(calls) == 2 and e.xp.pool.freed == 1 and not freed   # the pool's blocks were enough
    assert e._retry_out_of_memory(launch([CUDARuntimeError(2), MemoryError()])) == "launched"
    assert len(calls) == 5 and e.xp.pool.freed == 3 and freed == ["p0", "d0"] and not e._graphs
    calls.clear()
    with pytest.raises(CUDARuntimeError):      # three times out of memory: the third error stands
        e._retry_out_of_memory(launch([CUDARuntimeError(2)] * 3))
    assert len(calls) == 3 and e.xp.pool.freed == 5
    calls.clear()
    with pytest.raises(CUDARuntimeError):      # not a memory error: not retried
        e._retry_out_of_memory(launch([CUDARuntimeError(700)]))
    assert len(calls) == 1 and e.xp.pool.freed == 5
    e.device = False                           # the host has no pool to free
    with pytest.raises(MemoryError):
        e._retry_out_of_memory(launch([MemoryError()]))


@pytest.mark.parametrize("error, clear", [(CUDARuntimeError(2), True), (MemoryError("out of memory"), True),
                                          (CUDARuntimeError(700), False)])
def test_a_ubatch_out_of_device_memory_is_a_clear_error_and_the_cache_keeps_the_rest(error, clear):
    """The runner (every CLI's) turns a ubatch that ran out of device memory -- a graph launch's
    cudaErrorMemoryAllocation, CuPy's OutOfMemoryError -- into one clear line (OutOfMemory: which
    ubatch, its shape, the split and the cache's size) instead of a CUDA traceback; the cache
    keeps the ubatches before it (the batch's rollback); any other error stays itself."""
    from ggml_attn.cli.errors import OutOfMemory
    from ggml_attn.cli.models import ModelShape
    from ggml_attn.cli.runner import RunConfig, Runner
    m = ModelShape("small", n_layer=1, n_head=2, n_head_kv=1, head_dim_k=32, n_embd=64, n_ff=96)
    r = Runner(RunConfig(m, n_ctx=256, n_seq=2, kv_unified=True, split="simple", n_ubatch=4, device="cpu",
                         n_threads=1))
    real, calls = r.engine.run_ubatch, []

    def run_ubatch(plan):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(plan)
    r.engine.run_ubatch = run_ubatch
    try:
        with pytest.raises(OutOfMemory if clear else CUDARuntimeError) as e:
            r.decode(r.prompt_batch([5, 3]))
        if clear:
            msg = str(e.value)
            assert msg.startswith("the device ran out of memory running ubatch 1 of 2 (") and "split simple" in msg
            assert "256 cells" in msg and "\n" not in msg
        assert r.cache.n_used(0) == 4   # the first ubatch's 4 tokens stay, nothing of the second
    finally:
        r.close()


def test_serve_bench_closes_each_strategys_runner_before_the_next_is_made(capsys, monkeypatch):
    """Every strategy's runner (KV cache, kept graphs) is made, serves every rate, and is closed
    before the next strategy's is made (with all five of an 8B F16 model kept, a graph launch ran
    out of memory on an 80 GB H100)."""
    from ggml_attn.cli import runner as R
    events = []
    made, closed = R.Runner.__init__, R.Runner.close

    def init(self, cfg, *a, **k):
        events.append(("make", cfg.split))
        made(self, cfg, *a, **k)

    def close(self):
        events.append(("close", self.cfg.split))
        closed(self)
    monkeypatch.setattr(R.Runner, "__init__", init)
    monkeypatch.setattr(R.Runner, "close", close)
    assert serve_bench.main(["--device", "cpu", "-t", "2", "-o", "jsonl", "--split", "simple,equal", "--rate", "50,100",
                             "--n-requests", "6", "--prompt-dist", "4-12", "--gen-dist", "2-4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["split"], r["rate"]) for r in rows] == [("simple", 50), ("simple", 100), ("equal", 50), ("equal", 100)]
    opened = 0
    for what, _ in events:
        opened += 1 if what == "make" else -1
        assert 0 <= opened <= 1
    assert events[::2] == [("make", "simple"), ("make", "equal")] and opened == 0


def _serve_rows(capsys, *args):
    assert serve_bench.main(["--trace", str(SAMPLE), "--device", "cpu", "-t", "2", "-o", "jsonl", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_serve_counts_the_graphs_built_and_room_for_a_servers_structures_stops_the_churn(capsys, monkeypatch):
    """The serve bench's graph_builds. Per-stream KV under arrivals walks through ~100 ubatch
    structures: with the host's 4 kept graphs they are built again and again (~1,100 builds for
    the sample trace's 64 requests), with the device's limits about once each."""
    (few,) = _serve_rows(capsys, "--split", "auto")
    monkeypatch.setitem(E.MAX_GRAPHS, False, E.MAX_GRAPHS[True])
    (many,) = _serve_rows(capsys, "--split", "auto")
    assert few["kv_unified"] is False and many["steps"] > 0
    assert few["graph_builds"] > 3 * many["graph_builds"] and many["graph_builds"] < many["steps"] // 2


def test_bucket_pads_edge_cases():
    """split.pad_to_bucket: rows per bucket; a decode step's pads take free sequence ids at their
    next positions, skipping a sequence at the last int32 position (and not padding at all with
    too few ids); a prompt ubatch's pads continue its last sequence; equal sets of several rows,
    coupled tokens and a bucket past the ubatch size stay as split."""
    import numpy as np

    from ggml_attn.graph.batch import INT32_MAX
    from ggml_attn.graph.split import UBatch, bucket_rows, pad_to_bucket
    assert [bucket_rows(n) for n in (1, 3, 5, 9, 64, 65, 250, 257, 1000, 1025)] == \
        [1, 4, 8, 16, 64, 80, 256, 288, 1024, 1088]
    step = UBatch("simple", np.arange(3), np.array([5, 9, 2], dtype=np.int32), ((0,), (2,), (4,)), 3, False)
    nxt = {1: INT32_MAX + 1, 3: 7, 5: 0, 6: 0}   # seq 1 holds the last position
    got = pad_to_bucket(step, 8, lambda s: nxt.get(s, 0), 512)
    assert got.n_tokens == 4 and got.decode_step and got.token_seq_ids[-1] == (3,) and got.positions[-1] == 7
    assert got.token_idx[-1] == -1 and got.n_seqs == 4
    assert pad_to_bucket(step, 4, lambda s: INT32_MAX + 1, 512) is step   # no id left for the pad
    prompt = UBatch("simple", np.arange(5), np.array([0, 1, 2, 0, 1], dtype=np.int32),
                    ((0,), (0,), (0,), (1,), (1,)), 5, False)
    got = pad_to_bucket(prompt, 4, lambda s: 0, 512)
    assert got.n_tokens == 8 and got.token_seq_ids[5:] == ((1,),) * 3 and got.positions[5:].tolist() == [2, 3, 4]
    assert pad_to_bucket(prompt, 4, lambda s: 0, 5) is prompt   # the bucket would pass the ubatch size
    sets = UBatch("equal", np.arange(6), np.array([0, 1, 2, 0, 1, 2], dtype=np.int32),
                  ((0,),) * 3 + ((1,),) * 3, 2, True)
    assert pad_to_bucket(sets, 4, lambda s: 0, 512) is sets
    coupled = UBatch("simple", np.arange(3), np.zeros(3, dtype=np.int32), ((0, 1), (2,), (3,)), 3, False)
    assert pad_to_bucket(coupled, 8, lambda s: 0, 512) is coupled
