"""Data preparation throughput and memory, side by side in one run; JSON + PNG under bench/results/.

    python -m bench.data                      # bench/results/data.json, data.png
    python -m bench.data --copies 4 --rss_tokens 10e6,100e6

Throughput: tokens/s of `prepare_data` (end to end: read, tokenize, write, manifest) at 1 and 2 workers
against `datasets.map(batched=True, num_proc=N)` with the same tokenizer on the same corpus (the demo
stdlib JSONL repeated `--copies` times); map is timed alone (its JSON -> Arrow load is reported apart), so
the comparison favours datasets. Each point is the best of `--rounds` runs, the two systems alternated. Two tokenizers: the demo sentencepiece model and a Hugging Face fast BPE
tokenizer trained here from the same corpus with `tokenizers` (no hub). TOKENIZERS_PARALLELISM=false:
one core per process on both sides. Memory: peak RSS of prepare_data's whole process tree (polled) when
preparing corpora of each `--rss_tokens` size with the demo sentencepiece model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
from bench.harness import ROOT, result_path, write_json
from data.corpus import build_demo_corpus


def build_hf_tokenizer(jsonl: str, out: str, vocab: int = 2000) -> str:
    """A byte-level BPE PreTrainedTokenizerFast folder trained on the corpus (tokenizers library, offline)."""
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    def texts():
        with open(jsonl) as fh:
            for line in fh:
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>").save_pretrained(out)
    return out


def make_corpus(src: str, dst: str, copies: int) -> str:
    with open(dst, "wb") as out:
        for _ in range(copies):
            with open(src, "rb") as fh:
                shutil.copyfileobj(fh, out)
    return dst


def run_prepare(corpus: str, tok: str, workers: int, tmp: str) -> dict:
    from data.prepare_data import prepare

    out = os.path.join(tmp, f"prep-w{workers}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    m = prepare([corpus], out, tok, workers=workers, log=lambda _: None)
    dt = time.perf_counter() - t0
    shutil.rmtree(out)
    return {"tokens": m["n_tokens"], "seconds": dt, "tokens_per_s": m["n_tokens"] / dt}


class _Encode:
    """datasets.map function: loads the tokenizer once per process, encodes a batch of texts."""

    def __init__(self, path: str):
        self.path, self.tok = path, None

    def __call__(self, batch):
        if self.tok is None:
            from data.tokenizer import Tokenizer

            self.tok = Tokenizer(self.path)
        return {"input_ids": self.tok.encode_batch(batch["text"])}


def run_datasets(corpus: str, tok: str, num_proc: int, tmp: str) -> dict:
    import datasets

    cache = tempfile.mkdtemp(dir=tmp)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = ds.map(_Encode(tok), batched=True, batch_size=256, num_proc=num_proc if num_proc > 1 else None,
                 remove_columns=ds.column_names)
    n = sum(len(x) for b in out.iter(batch_size=4096) for x in b["input_ids"]) + len(out)  # + EOS, as prepare
    dt = time.perf_counter() - t0
    shutil.rmtree(cache)
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "load_seconds": t_load}


def peak_rss(corpus: str, tok: str, workers: int, tmp: str) -> dict:
    """Run prepare_data as a subprocess; poll the RSS of its process tree every 20 ms."""
    import psutil

    out = os.path.join(tmp, "rss")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "prepare_data.py"), "--input", corpus, "--output", out,
           "--tokenizer_name_or_path", tok, "--workers", str(workers)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    proc, peak = psutil.Process(p.pid), 0
    while p.poll() is None:
        try:
            rss = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            rss = 0
        peak = max(peak, rss)
        time.sleep(0.02)
    assert p.returncode == 0, cmd
    with open(os.path.join(out, "manifest.json")) as fh:
        n = json.load(fh)["n_tokens"]
    shutil.rmtree(out)
    return {"tokens": n, "seconds": time.perf_counter() - t0, "peak_rss_mib": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4, help="demo corpus repetitions for the throughput runs")
    ap.add_argument("--rss_tokens", default="10e6,100e6", help="corpus sizes (tokens, approx.) for peak RSS")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--rounds", type=int, default=2, help="throughput runs per point (best kept), systems alternated")
    ap.add_argument("--out", default=result_path("data.json"))
    ap.add_argument("--tmp", default=None)
    a = ap.parse_args()
    tmp = a.tmp or tempfile.mkdtemp(prefix="bench_data_")
    jsonl, spm = build_demo_corpus()
    hf = build_hf_tokenizer(jsonl, os.path.join(ROOT, ".cache", "demo", "hf_bpe"))
    corpus = make_corpus(jsonl, os.path.join(tmp, "corpus.jsonl"), a.copies)
    workers = [int(w) for w in a.workers.split(",")]
    res = {"corpus_bytes": os.path.getsize(corpus), "cpu_count": os.cpu_count(), "throughput": [], "rss": []}
    runs = []
    for rnd in range(a.rounds):  # alternate the systems, round after round: a shared machine's load hits both
        for name, tok in (("sentencepiece", spm), ("hf_fast_bpe", hf)):
            for w in workers:
                order = (("prepare_data", run_prepare), ("datasets.map", run_datasets))
                for system, fn in order if rnd % 2 == 0 else order[::-1]:
                    r = {"round": rnd, "tokenizer": name, "system": system, "workers": w, **fn(corpus, tok, w, tmp)}
                    print(json.dumps(r), flush=True)
                    runs.append(r)
    res["runs"] = runs
    for key in sorted({(r["tokenizer"], r["system"], r["workers"]) for r in runs}, key=lambda k: (k[0], k[1], k[2])):
        best = max((r for r in runs if (r["tokenizer"], r["system"], r["workers"]) == key), key=lambda r: r["tokens_per_s"])
        res["throughput"].append({**best, "rounds": a.rounds})  # best of the rounds: the least disturbed run
    per_copy = next(r["tokens"] for r in runs if r["system"] == "prepare_data" and r["tokenizer"] == "sentencepiece") / a.copies
    for target in (float(x) for x in a.rss_tokens.split(",")):
        copies = max(1, round(target / per_copy))
        big = make_corpus(jsonl, os.path.join(tmp, "rss.jsonl"), copies)
        r = {"target_tokens": target, "copies": copies, "workers": max(workers), **peak_rss(big, spm, max(workers), tmp)}
        os.remove(big)
        print(json.dumps(r), flush=True)
        res["rss"].append(r)
    if len(res["rss"]) >= 2:
        res["rss_ratio_largest_to_smallest"] = res["rss"][-1]["peak_rss_mib"] / res["rss"][0]["peak_rss_mib"]
    write_json(a.out, res)
    plot(res, a.out[: -len(".json")] + ".png")
    print(table(res))
    shutil.rmtree(tmp, ignore_errors=True)


def table(res: dict) -> str:
    """docs/results/data.md's table: M tokens/s (best of the rounds) per tokenizer, system and worker count."""
    best = {(r["tokenizer"], r["system"], r["workers"]): r["tokens_per_s"] / 1e6 for r in res["throughput"]}
    workers = sorted({k[2] for k in best})
    lines = ["| tokenizer | system | " + " | ".join(f"{w} worker{'s' * (w > 1)}" for w in workers)
             + f" | {workers[-1]} / {workers[0]} |", "|---" * (len(workers) + 3) + "|"]
    for tok in ("sentencepiece", "hf_fast_bpe"):
        for system in ("prepare_data", "datasets.map"):
            row = [best.get((tok, system, w), float("nan")) for w in workers]
            lines.append(f"| {tok} | {system} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {row[-1] / row[0]:.2f} |")
    for r in res["rss"]:
        lines.append(f"peak RSS {r['peak_rss_mib']:.0f} MiB for {r['tokens'] / 1e6:.1f}M tokens")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for tok, style in (("sentencepiece", "-"), ("hf_fast_bpe", "--")):
        for system, marker in (("prepare_data", "o"), ("datasets.map", "s")):
            pts = [(r["workers"], r["tokens_per_s"] / 1e6) for r in res["throughput"]
                   if r["tokenizer"] == tok and r["system"] == system]
            ax.plot(*zip(*pts), style, marker=marker, label=f"{system} ({tok})")
    ax.set(xlabel="worker processes", ylabel="M tokens/s", title="tokenization throughput (same corpus)")
    ax.legend(fontsize=8)
    bx.bar([f"{r['tokens'] / 1e6:.0f}M tokens" for r in res["rss"]], [r["peak_rss_mib"] for r in res["rss"]])
    bx.set(ylabel="peak RSS of the process tree (MiB)", title="prepare_data memory vs corpus size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
