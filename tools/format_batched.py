"""Output of ``ggml-attn-batched-bench`` in llama-batched-bench's formats: md and jsonl.

Columns are llama-batched-bench's (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s,
T s, S t/s) plus ``split`` (the batching strategy), ``KVU`` (unified KV or not) and
``UB`` (ubatches the prompt phase used); :data:`TERMS` defines them. jsonl keeps llama-batched-bench's keys (pp, tg, pl, n_kv, t_pp, speed_pp,
t_tg, speed_tg, t, speed) and adds ``split``, ``ub`` and the rest of ours.

With ragged prompts PP is the range of prompt lengths (``1-10``) in md, and ``pp`` is
null in jsonl; ``prompt_tokens`` always holds the number of prompt tokens of the row.
"""
from __future__ import annotations

import json

COLUMNS = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s",
           "split", "KVU", "UB"]
_W = [7, 6, 4, 6, 8, 8, 8, 8, 8, 8, -7, 3, 4]  # llama-batched-bench's widths (PP one wider for ragged ranges), then ours
FORMATS = ("md", "jsonl")

# jsonl keys in order: llama-batched-bench's, then ours
JSONL_KEYS = ["n_kv_max", "n_batch", "n_ubatch", "flash_attn", "is_pp_shared", "n_gpu_layers",
              "n_threads", "n_threads_batch", "pp", "tg", "pl", "n_kv", "t_pp", "speed_pp",
              "t_tg", "speed_tg", "t", "speed",
              "split", "ub", "ub_tg", "n_pad", "prompt_tokens", "kv_unified", "type_k", "type_v", "model",
              "device", "kernel", "layer"]


# what ours mean; --help prints this, README repeats it
TERMS = (
    "Ours, beyond llama-batched-bench's columns and keys. split: the ubatch split strategy of "
    "the row. KVU: (jsonl kv_unified) 1 when the row ran on one KV buffer for all sequences, "
    "0 with one stream per sequence; simple always runs unified. UB: (jsonl ub) ubatches the "
    "prompt phase was cut into, one graph evaluation each. ub_tg: ubatches of all TG decode "
    "steps together. n_pad: pad rows the prompt's ubatches carried (padded and auto splits; "
    "computed, then dropped). prompt_tokens: prompt tokens of the row. --plan shows each ubatch "
    "as n_seqs x n_seq_tokens, llama.cpp's ubatch shape: simple, N tokens -> Nx1; equal or "
    "padded, B sequences of T tokens -> BxT; seq -> 1xT; 2*10x1 is two 10x1 ubatches.")


def _kvu(value) -> str:
    return "per row (KVU)" if value is None else str(int(bool(value)))


def pp_label(row) -> str:
    lens = row.get("prompt_lens")
    if lens and min(lens) != max(lens):
        return f"{min(lens)}-{max(lens)}"
    return str(row["pp"])


def _cells(row):
    return [pp_label(row), str(row["tg"]), str(row["pl"]), str(row["n_kv"]),
            f"{row['t_pp']:.3f}", f"{row['speed_pp']:.2f}", f"{row['t_tg']:.3f}",
            f"{row['speed_tg']:.2f}", f"{row['t']:.3f}", f"{row['speed']:.2f}",
            str(row["split"]), str(int(bool(row["kv_unified"]))), str(row["ub"])]


def _md_line(cells):
    out = []
    for i, (text, w) in enumerate(zip(cells, _W)):
        cell = f"{text:<{-w}}" if w < 0 else f"{text:>{w}}"
        out.append(("|" if i == 0 else " | ") + cell)
    return "".join(out) + " |\n"


def finish_row(row: dict) -> dict:
    """Derive n_kv, speeds and totals as llama-batched-bench does; returns ``row``.

    Needs pp (or prompt_lens), tg, pl, is_pp_shared, t_pp, t_tg (seconds).
    """
    lens = row.get("prompt_lens")
    if lens:
        prompt_tokens = sum(lens) if not row["is_pp_shared"] else max(lens)
    else:
        prompt_tokens = row["pp"] if row["is_pp_shared"] else row["pl"] * row["pp"]
    row["prompt_tokens"] = prompt_tokens
    # llama-batched-bench: is_pp_shared ? pp + pl*tg : pl*(pp + tg)
    row["n_kv"] = prompt_tokens + row["pl"] * row["tg"]
    t_pp, t_tg = row["t_pp"], row["t_tg"]
    row["t"] = t_pp + t_tg
    row["speed_pp"] = prompt_tokens / t_pp if t_pp > 0 else 0.0
    row["speed_tg"] = row["pl"] * row["tg"] / t_tg if t_tg > 0 else 0.0
    row["speed"] = row["n_kv"] / row["t"] if row["t"] > 0 else 0.0
    return row


class MarkdownPrinter:
    def __init__(self, out, info: dict):
        self.out = out
        self.info = info

    def header(self):
        i = self.info
        self.out.write(
            "\n"
            f"main: n_kv_max = {i['n_kv_max']}, n_batch = {i['n_batch']}, n_ubatch = {i['n_ubatch']}, "
            f"flash_attn = {i['flash_attn']}, is_pp_shared = {i['is_pp_shared']}, "
            f"kv_unified = {_kvu(i['kv_unified'])}, type_k = {i.get('type_k', 'f16')}, "
            f"type_v = {i.get('type_v', 'f16')}, n_threads = {i['n_threads']}, "
            f"model = {i['model']}, device = {i['device']}, kernel = {i['kernel']}, layer = {i['layer']}\n"
            "\n")
        self.out.write(_md_line(COLUMNS))
        self.out.write("|" + "-|-".join("-" * abs(w) for w in _W) + "-|\n")
        self.out.flush()

    def row(self, row):
        self.out.write(_md_line(_cells(row)))
        self.out.flush()

    def footer(self):
        self.out.write("\n")
        self.out.flush()


class JsonlPrinter:
    def __init__(self, out, info: dict):
        self.out = out
        self.info = info

    def header(self):
        pass

    def row(self, row):
        obj = {}
        for k in JSONL_KEYS:
            v = row.get(k, self.info.get(k))
            if k == "pp" and row.get("prompt_lens") and min(row["prompt_lens"]) != max(row["prompt_lens"]):
                v = None
            obj[k] = v
        if row.get("prompt_lens"):
            obj["prompt_lens"] = list(row["prompt_lens"])
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def footer(self):
        pass


def make_printer(fmt: str, out, info: dict):
    if fmt == "md":
        return MarkdownPrinter(out, info)
    if fmt == "jsonl":
        return JsonlPrinter(out, info)
    raise ValueError(f"unknown output format {fmt}")
