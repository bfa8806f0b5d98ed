"""Bounds of batches and the KV cache: positions and token ids are int32 (as llama.cpp's
``llama_pos`` / ``llama_token``), sequence ids below ``MAX_SEQ`` (256, llama.cpp's
LLAMA_MAX_SEQ). Out-of-range or non-integer values raise ValueError naming the argument;
nothing is truncated, wrapped or silently freed."""
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache, split_ubatches
from ggml_attn.graph.batch import MAX_SEQ, validate_batch

I32 = 2**31 - 1


def filled(n_seq=2, lengths=(5, 3), unified=True):
    c = KVCache(512, n_seq, unified=unified)
    for ub in split_ubatches(Batch.from_lengths(list(lengths)), 512, "simple" if unified else "equal"):
        c.free_pads(c.place(ub))
    return c


def cells(c):
    return c.pos.copy(), c.seqs.copy(), c.pad.copy(), list(c.head)


def unchanged(c, before):
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(cells(c), before))


# ------------------------------------------------------------------ seq_add and friends
@pytest.mark.parametrize("shift", [I32, I32 - 3, 2**31, 2**40, 2**63])
def test_seq_add_past_int32_is_refused_not_wrapped(shift):
    c = filled()
    before = cells(c)
    with pytest.raises(ValueError, match=r"shift.*int32|int32.*shift"):
        c.seq_add(0, -1, -1, shift)
    assert unchanged(c, before)


def test_seq_add_to_the_int32_maximum_and_below_zero():
    c = filled()
    c.seq_add(0, -1, -1, I32 - 4)  # positions 0..4 -> I32-4 .. I32: fits
    assert c.seq_pos_max(0) == I32 and c.n_used(0) == 8
    c.seq_add(0, -1, -1, -(2**40))  # far below zero: the cells are removed (llama.cpp's rule)
    assert c.seq_pos_max(0) == -1 and c.seq_pos_max(1) == 2


@pytest.mark.parametrize("call", [
    lambda c: c.seq_add(0, -1, -1, 1.5), lambda c: c.seq_add(0, 0.5, -1, 1), lambda c: c.seq_add(0, -1, 2.5, 1),
    lambda c: c.seq_rm(0, 1.5, -1), lambda c: c.seq_rm(0.0, -1, -1), lambda c: c.seq_cp(0, 1, 0.5, -1),
    lambda c: c.seq_keep(1.0), lambda c: c.seq_pos_max(True), lambda c: c.seq_add(0, -1, -1, "3"),
], ids=["shift-float", "p0-float", "p1-float", "rm-p0", "rm-seq-float", "cp-p0", "keep-float", "bool-seq",
        "shift-str"])
def test_seq_ops_refuse_non_integers(call):
    c = filled()
    before = cells(c)
    with pytest.raises(ValueError, match="integer"):
        call(c)
    assert unchanged(c, before)


@pytest.mark.parametrize("p", [2**31, 2**40])
def test_seq_ops_with_bounds_past_int32_mean_open(p):
    c = filled()
    c.seq_rm(0, 2, p)          # [2, huge): everything from 2 on
    assert c.seq_pos_max(0) == 1
    c.seq_add(1, 1, p, 10)     # positions 1, 2 of seq 1 -> 11, 12
    assert c.sequence_contents(1)[0].tolist() == [0, 11, 12]


# ------------------------------------------------------------------ batches
@pytest.mark.parametrize("tokens", [[2**31, 5], [2**32, 5], np.array([2**32, 5]), [-1, 5], [1.5, 5],
                                    np.array([1.0, np.nan])], ids=["2^31", "2^32", "2^32-int64", "negative",
                                                                   "float", "nan"])
def test_token_ids_outside_int32_or_not_integers_are_refused(tokens):
    with pytest.raises(ValueError, match=r"tokens\[0\]|tokens\[1\]"):
        Batch(tokens, [0, 1], ((0,), (0,)))


@pytest.mark.parametrize("positions", [[0.5, 1.7], np.array([0.0, 1.5]), [0, 2**31], np.array([0, 2**32]),
                                       [0, np.inf], [True, False]],
                         ids=["floats", "float-array", "2^31", "2^32-int64", "inf", "bool"])
def test_positions_outside_int32_or_not_integers_are_refused(positions):
    with pytest.raises(ValueError, match=r"positions"):
        Batch([1, 2], positions, ((0,), (0,)))


def test_integral_floats_are_exact():
    b = Batch(np.array([3.0, 4.0]), np.array([7.0, 8.0]), ((0,), (0,)))
    assert b.tokens.tolist() == [3, 4] and b.positions.tolist() == [7, 8]


@pytest.mark.parametrize("start", [2**31, 2**31 - 2, 2**40])
def test_start_position_past_int32_is_not_called_negative(start):
    with pytest.raises(ValueError, match=r"start_pos") as e:
        Batch.from_lengths([3], start_pos=start)
    assert "negative" not in str(e.value)
    with pytest.raises(ValueError, match=r"start_pos"):
        Batch.from_lengths([3, 3], start_pos=[0, start])
    with pytest.raises(ValueError, match=r"start_pos"):
        Batch.from_lengths([3, 3], start_pos={1: start})


@pytest.mark.parametrize("start", [-1, 1.5, "3"])
def test_bad_start_positions(start):
    with pytest.raises(ValueError, match=r"start_pos"):
        Batch.from_lengths([3], start_pos=start)


@pytest.mark.parametrize("lengths", [[2.5], [np.float64(2.5)], ["3"]])
def test_lengths_must_be_integers(lengths):
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        Batch.from_lengths(lengths)


@pytest.mark.parametrize("ids", [((1.5,), (0,)), ((0,), (2**31,)), ((0,), (-1,)),
                                 ((0,),) * 19 + ((2**31,),), tuple((i,) for i in range(19)) + ((2**70,),)],
                         ids=["float", "2^31", "neg", "prompt-2^31", "step-2^70"])
def test_seq_ids_integers_in_range(ids):
    """Ids that are not ints in range are refused by name: in a short batch, and past the sizes
    whose checks read the ids as an int32 array (a prompt, a decode step of 20 sequences)."""
    with pytest.raises(ValueError, match=r"seq_id|sequence id"):
        b = Batch(list(range(len(ids))), list(range(len(ids))), ids)
        validate_batch(b, 4, unified=True)


def test_padded_split_pads_past_int32_are_refused():
    b = Batch.from_lengths([1, 3], start_pos=[I32, 0])
    with pytest.raises(ValueError, match="int32"):
        split_ubatches(b, 512, "padded")


# ------------------------------------------------------------------ sequences
def test_sequences_are_capped_like_llama_cpp():
    assert MAX_SEQ == 256
    KVCache(256 * 256, MAX_SEQ, unified=False)  # the cap itself is fine
    for unified in (True, False):
        with pytest.raises(ValueError, match=r"n_seq_max=257.*256"):
            KVCache(1024, MAX_SEQ + 1, unified=unified)
        with pytest.raises(ValueError, match=r"n_seq_max=4096.*256"):
            KVCache(4096 * 256, 4096, unified=unified)
    with pytest.raises(ValueError, match=r"n_seq_max.*256"):
        validate_batch(Batch.from_lengths([1]), 1000, unified=True)


@pytest.mark.parametrize("kw", [dict(n_ctx=1000.5), dict(n_seq_max=2.5), dict(n_layer=1.5), dict(n_head_kv="2"),
                                dict(head_dim_k=64.5), dict(head_dim_v=3.5)])
def test_cache_sizes_must_be_integers(kw):
    args = dict(n_ctx=1024, n_seq_max=2)
    args.update(kw)
    with pytest.raises(ValueError, match=next(iter(kw))):
        KVCache(args.pop("n_ctx"), args.pop("n_seq_max"), **args)


def test_cli_more_sequences_than_the_cap_is_one_line(capsys):
    """-npl past 256: the CLI says so on one line (exit 2), no traceback."""
    from ggml_attn.cli import batched_bench
    rc = batched_bench.main(["-npp", "1", "-ntg", "1", "-npl", "300", "-t", "1", "--n-layer", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "256" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
