"""Parsing of llama-bench style lists and ranges, and the one-line error contract."""
import re

import pytest

from ggml_attn.cli.args import (Parser, add_list, choice_list, combinations, int_range, parse_bool_list,
                                parse_int_range, parse_pair_list)
from ggml_attn.cli.errors import UserError, run_cli


@pytest.mark.parametrize("text, expected", [
    ("512", [512]),
    ("1,2,3", [1, 2, 3]),
    ("1-4", [1, 2, 3, 4]),
    ("64-256+64", [64, 128, 192, 256]),
    ("128-1024*2", [128, 256, 512, 1024]),
    ("1-10*3", [1, 3, 9]),
    ("0,16-32*2,100", [0, 16, 32, 100]),
    ("5-3", []),  # empty range, as llama-bench
])
def test_int_range(text, expected):
    assert parse_int_range(text) == expected


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "1--3", "1-4/2", "1-8*1", "0-8*2", "1-4+0",
                                  "1,,2", "1.5", "1-4+2+3"])
def test_int_range_rejects(text):
    with pytest.raises(UserError):
        parse_int_range(text)


@pytest.mark.parametrize("text, msg", [
    ("1-10001", "'1-10001' gives 10001 values; a list holds at most 10000"),
    ("0-2000000000+100000", "gives 20001 values"),
    ("5,1-10000", "'1-10000' gives 10000 values (after 1)"),
    ("2147483648", "2147483648 is more than 2147483647"),
    ("1-2147483648", "2147483648 is more than 2147483647"),
    ("3-4000000000*2", "3221225472 is more than 2147483647"),
])
def test_int_range_sizes_checked_before_expanding(text, msg):
    """Counted from the bounds and refused above the limits; the old parser built every value
    first (-p 1-100000000: minutes and GBs before an error)."""
    with pytest.raises(UserError, match=re.escape(msg)):
        parse_int_range(text)
    assert len(parse_int_range("1-10000")) == 10000 and parse_int_range("2147483647") == [2147483647]
    assert parse_int_range("1-2147483647*2")[-1] == 2**30


def test_int_range_limit_of_a_flag(capsys):
    p = Parser(prog="t")
    add_list(p, "-npl", type=int_range(256, ": at most 256 sequences"), default=[1], help="B")
    assert p.parse_args(["-npl", "1-256*2"]).npl == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(SystemExit):
        p.parse_args(["-npl", "1-2000000000"])
    assert "argument -npl: 2000000000 is more than 256: at most 256 sequences" in capsys.readouterr().err


def test_pairs_and_bools():
    assert parse_pair_list("512,128") == [(512, 128)]
    assert parse_pair_list("512,128;64,16") == [(512, 128), (64, 16)]
    with pytest.raises(UserError):
        parse_pair_list("512")
    assert parse_bool_list("on,off,1,0,true") == [True, False, True, False, True]
    with pytest.raises(UserError):
        parse_bool_list("maybe")


def _parser():
    p = Parser(prog="t")
    add_list(p, "-p", type=parse_int_range, default=[512], help="prompt")
    add_list(p, "--split", type=choice_list(["simple", "equal"]), default=["equal"], help="split")
    return p


def test_repeated_flag_extends_and_replaces_default():
    ns = _parser().parse_args(["-p", "1,2", "-p", "8-16*2"])
    assert ns.p == [1, 2, 8, 16]
    assert ns.explicit == {"p"}
    ns = _parser().parse_args([])
    assert ns.p == [512] and ns.split == ["equal"] and ns.explicit == set()


def test_parser_error_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["-p", "1-x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid range format" in err and err.startswith("t: error:")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--split", "diagonal"])
    assert "choose from simple, equal" in capsys.readouterr().err


def test_combinations_order():
    rows = combinations({"a": [1, 2], "b": ["x", "y"]})
    assert rows == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]


def test_run_cli_maps_user_error(capsys):
    def boom(argv):
        raise UserError("bad\nthing")
    assert run_cli("tool", boom) == 2
    assert capsys.readouterr().err == "tool: error: bad thing\n"
