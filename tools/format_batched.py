"""Output of ``ggml-attn-batched-bench`` in llama-batched-bench's formats: md and jsonl.

Columns are llama-batched-bench's (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s,
T s, S t/s) plus ``split`` (the batching strategy), ``KVU`` (unified KV or not), ``UB``
(ubatches the prompt phase used), ``PAD`` (pad rows they carried) and ``path`` (what computed
attention: numpy, CUDA kernels, ggml FA, ggml mul_mat); :data:`TERMS` defines them. jsonl keeps
llama-batched-bench's keys (pp, tg, pl, n_kv, t_pp, speed_pp, t_tg, speed_tg, t, speed) and adds
``split``, ``ub`` and the rest of ours.

With ragged prompts PP is the range of prompt lengths (``1-10``) in md; in jsonl ``pp`` is the
mean prompt length (``prompt_tokens / pl``, so ``pl * pp`` is the prompt tokens as with uniform
prompts, what llama-batched-bench's own S_PP divides), with ``pp_min``, ``pp_max`` and
``prompt_lens`` for the distribution; ``prompt_tokens`` always holds the row's prompt tokens.
"""
from __future__ import annotations

import json
import statistics

COLUMNS = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s",
           "split", "KVU", "UB", "PAD", "path"]
_W = [7, 6, 4, 6, 8, 8, 8, 8, 8, 8, -7, 3, 4, 5, -12]  # llama-batched-bench's widths (PP one wider for ragged ranges), then ours
FORMATS = ("md", "jsonl")

# jsonl keys in order: llama-batched-bench's, then ours
JSONL_KEYS = ["n_kv_max", "n_batch", "n_ubatch", "flash_attn", "is_pp_shared", "n_gpu_layers",
              "n_threads", "n_threads_batch", "pp", "tg", "pl", "n_kv", "t_pp", "speed_pp",
              "t_tg", "speed_tg", "t", "speed",
              "is_tg_separate", "split", "ub", "ub_tg", "n_pad", "prompt_tokens", "pp_min", "pp_max", "kv_unified",
              "repetitions", "speed_pp_stddev", "speed_tg_stddev", "speed_stddev", "t_pp_samples",
              "t_tg_samples", "type_k", "type_v", "model",
              "device", "path", "kernel", "layer"]


# what ours mean; --help prints this, docs/cli.md repeats it
TERMS = (
    "Ours, beyond llama-batched-bench's columns and keys. split: the ubatch split strategy of "
    "the row. KVU: (jsonl kv_unified) 1 when the row ran on one KV buffer for all sequences, "
    "0 with one stream per sequence; simple always runs unified. UB: (jsonl ub) ubatches the "
    "prompt phase was cut into, one graph evaluation each. ub_tg: ubatches of all TG decode "
    "steps together. n_pad: pad rows the prompt's ubatches carried (padded and auto splits; "
    "computed, then dropped); PAD in md. path: what computed attention (numpy: ggml_attn's CPU "
    "path; CUDA kernels; ggml FA: ggml's own flash attention, --kernel ggml; ggml mul_mat: -fa off). "
    "prompt_tokens: prompt tokens of the row. pp in jsonl, ragged prompts (--prompt-lens, "
    "--prompt-dist): the mean prompt length, prompt_tokens / pl (so pl * pp is the prompt tokens, "
    "as with uniform prompts); pp_min, pp_max and prompt_lens give the distribution; md's PP shows "
    "MIN-MAX. is_tg_separate: 1 with -tgs (llama.cpp's main line has it, its jsonl not). "
    "kv_cells (main line): the KV cells the cache holds, when other than n_kv_max (with -c 0 "
    "n_kv_max is the model's training context, as llama.cpp's, and the cache holds what the "
    "largest row needs). --plan shows each ubatch "
    "as n_seqs x n_seq_tokens, llama.cpp's ubatch shape: simple, N tokens -> Nx1; equal or "
    "padded, B sequences of T tokens -> BxT; seq -> 1xT; 2*10x1 is two 10x1 ubatches.")


def _kvu(value) -> str:
    return "per row (KVU)" if value is None else str(int(bool(value)))


def pp_label(row) -> str:
    lens = row.get("prompt_lens")
    if lens and min(lens) != max(lens):
        return f"{min(lens)}-{max(lens)}"
    return str(row["pp"])


def _speed(row, key, reps: int) -> str:
    if reps > 1:
        return f"{row[key]:.2f} ± {row[key + '_stddev']:.2f}"
    return f"{row[key]:.2f}"


def _cells(row, reps: int = 1):
    return [pp_label(row), str(row["tg"]), str(row["pl"]), str(row["n_kv"]),
            f"{row['t_pp']:.3f}", _speed(row, "speed_pp", reps), f"{row['t_tg']:.3f}",
            _speed(row, "speed_tg", reps), f"{row['t']:.3f}", _speed(row, "speed", reps),
            str(row["split"]), str(int(bool(row["kv_unified"]))), str(row["ub"]), str(row.get("n_pad", 0)),
            str(row.get("path", ""))]


_SPEED_COLUMNS = (5, 7, 9)


def _widths(reps: int) -> list[int]:
    """Column widths; with -r the t/s columns hold ``mean ± stddev`` (llama-bench's 20)."""
    return [20 if (reps > 1 and i in _SPEED_COLUMNS) else w for i, w in enumerate(_W)]


def _md_line(cells, widths=_W):
    out = []
    for i, (text, w) in enumerate(zip(cells, widths)):
        cell = f"{text:<{-w}}" if w < 0 else f"{text:>{w}}"
        out.append(("|" if i == 0 else " | ") + cell)
    return "".join(out) + " |\n"


def _mean(values):
    return sum(values) / len(values) if values else 0.0


def _stdev(values):
    """Sample standard deviation (n - 1), 0 for fewer than two values, as llama-bench."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def finish_row(row: dict) -> dict:
    """Derive n_kv, speeds and totals as llama-batched-bench does; returns ``row``.

    Needs pp (or prompt_lens), tg, pl, is_pp_shared, kv_unified (with is_pp_shared), and t_pp,
    t_tg (seconds) or, with ``-r``,
    ``t_pp_samples`` / ``t_tg_samples`` (one per repetition): times are then means, and each
    speed is the mean of the per-repetition speeds with its sample stddev (``*_stddev``), as
    llama-bench computes t/s.
    """
    lens = row.get("prompt_lens")
    if lens:
        prompt_tokens = sum(lens) if not row["is_pp_shared"] else max(lens)
    else:
        prompt_tokens = row["pp"] if row["is_pp_shared"] else row["pl"] * row["pp"]
    row["prompt_tokens"] = prompt_tokens
    row["pp_min"], row["pp_max"] = (min(lens), max(lens)) if lens else (row["pp"], row["pp"])
    # llama-batched-bench's n_kv (its n_ctx_req): is_pp_shared ? (kv_unified ? pp : pl*pp) + pl*tg
    # : pl*(pp + tg) -- a shared prompt is one set of cells in a unified cache, a copy in each
    # sequence's stream otherwise; the tokens processed (S t/s) count it once either way
    n_tokens = prompt_tokens + row["pl"] * row["tg"]
    shared_copies = row["is_pp_shared"] and not row.get("kv_unified", True)
    row["n_kv"] = (row["pl"] * prompt_tokens + row["pl"] * row["tg"]) if shared_copies else n_tokens
    tp = list(row.get("t_pp_samples") or [row["t_pp"]])
    tt = list(row.get("t_tg_samples") or [row["t_tg"]])
    row["t_pp_samples"], row["t_tg_samples"] = tp, tt
    row["t_pp"], row["t_tg"] = _mean(tp), _mean(tt)
    row["t"] = row["t_pp"] + row["t_tg"]
    speeds = {
        "speed_pp": [prompt_tokens / t if t > 0 else 0.0 for t in tp],
        "speed_tg": [row["pl"] * row["tg"] / t if t > 0 else 0.0 for t in tt],
        "speed": [n_tokens / (a + b) if a + b > 0 else 0.0 for a, b in zip(tp, tt)],
    }
    for key, values in speeds.items():
        row[key] = _mean(values)
        row[f"{key}_stddev"] = _stdev(values)
    return row


def main_line(i: dict, reps: int = 1) -> str:
    """llama-batched-bench's ``main:`` line, its fields in its order (flash_attn its integer,
    -1 for auto), then ours: the KV cells the cache holds (``kv_cells``, when other than n_kv_max:
    with ``-c 0`` the cache is sized for the rows that run), kv_unified, cache types, model,
    device, kernel, layer (and repetitions with ``-r``)."""
    cells = i.get("kv_cells", i["n_kv_max"])
    return (f"main: n_kv_max = {i['n_kv_max']}, n_batch = {i['n_batch']}, n_ubatch = {i['n_ubatch']}, "
            f"flash_attn = {i['flash_attn']}, is_pp_shared = {i['is_pp_shared']}, "
            f"is_tg_separate = {i.get('is_tg_separate', 0)}, n_gpu_layers = {i['n_gpu_layers']}, "
            f"n_threads = {i['n_threads']}, n_threads_batch = {i.get('n_threads_batch', i['n_threads'])}, "
            + (f"kv_cells = {cells}, " if cells != i["n_kv_max"] else "")
            + f"kv_unified = {_kvu(i['kv_unified'])}, type_k = {i.get('type_k', 'f16')}, "
            f"type_v = {i.get('type_v', 'f16')}, model = {i['model']}, device = {i['device']}, "
            f"kernel = {i['kernel']}, layer = {i['layer']}"
            + (f", repetitions = {reps}" if reps > 1 else ""))


class MarkdownPrinter:
    def __init__(self, out, info: dict):
        self.out = out
        self.info = info
        self.reps = int(info.get("repetitions", 1))
        self.widths = _widths(self.reps)

    def header(self):
        i = self.info
        self.out.write("\n" + main_line(i, self.reps) + "\n\n")
        self.out.write(_md_line(COLUMNS, self.widths))
        self.out.write("|" + "-|-".join("-" * abs(w) for w in self.widths) + "-|\n")
        self.out.flush()

    def row(self, row):
        self.out.write(_md_line(_cells(row, self.reps), self.widths))
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
                v = row["prompt_tokens"] / row["pl"]   # the mean prompt length (module doc)
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
