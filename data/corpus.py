"""The built-in demo corpus: this Python's own standard library sources as long code documents,
plus a sentencepiece tokenizer trained on them. Exists on every machine; built once into a cache.

    python -m data.corpus        # build (or show) the cached corpus and tokenizer
"""

from __future__ import annotations

import contextlib
import json
import os
import sysconfig

from base.atomic import tmp_name
from base.env import CACHE_DIR

# the data cache (this demo, data prepared in the job): ULYSSES_CACHE, else this checkout's .cache, which a read-only
# checkout (a container image) cannot hold: base.env.check_writable_defaults refuses that at start, naming the variable
CACHE = os.environ.get("ULYSSES_CACHE") or CACHE_DIR
DEMO_VOCAB = 2000  # fits the tiny presets' 2048-entry embedding
DEMO_MAX_BYTES = 6_000_000


def demo_paths() -> tuple[str, str]:
    d = os.path.join(CACHE, "demo")
    return os.path.join(d, "stdlib.jsonl"), os.path.join(d, "stdlib_sp.model")


def build_demo_corpus(max_bytes: int = DEMO_MAX_BYTES) -> tuple[str, str]:
    """Write the stdlib JSONL and train the tokenizer if missing; return (jsonl_path, spm_model_path)."""
    jsonl, model = demo_paths()
    os.makedirs(os.path.dirname(jsonl), exist_ok=True)
    if not os.path.exists(jsonl):
        root = sysconfig.get_paths()["stdlib"]
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idlelib", "site-packages",
                                                                  "__pycache__", "lib2to3"))
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
        total, tmp = 0, tmp_name(jsonl)  # this process' own: two jobs starting on a fresh cache build it at once
        with _built([(tmp, jsonl)]), open(tmp, "w") as out:
            for path in files:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                if len(text) < 2000:
                    continue
                out.write(json.dumps({"text": text, "source": os.path.relpath(path, root)}) + "\n")
                total += len(text)
                if total >= max_bytes:
                    break
    if not os.path.exists(model):
        import sentencepiece as spm

        def lines():
            with open(jsonl) as fh:
                for line in fh:
                    yield from (x for x in json.loads(line)["text"].splitlines() if x.strip())

        prefix = tmp_name(model[: -len(".model")])  # sentencepiece appends .model / .vocab
        with _built([(prefix + ".vocab", model[: -len(".model")] + ".vocab"), (prefix + ".model", model)]):
            spm.SentencePieceTrainer.train(
                sentence_iterator=lines(), model_prefix=prefix, vocab_size=DEMO_VOCAB, model_type="bpe",
                byte_fallback=True, split_digits=True, remove_extra_whitespaces=False,
                input_sentence_size=300_000, shuffle_input_sentence=False, num_threads=2,
                pad_id=0, unk_id=1, bos_id=2, eos_id=3, user_defined_symbols=["\n", "    "],
                minloglevel=2,
            )
    return jsonl, model


@contextlib.contextmanager
def _built(moves: list[tuple[str, str]]):
    """Around building tmps: then move each onto its target, the last one (what build_demo_corpus looks for) never
    over another's: where another job put it there meanwhile, theirs is kept and taken as done (it may have been read
    already). The tmps never stay, also when the build fails or is interrupted."""
    try:
        yield
        if os.path.exists(moves[-1][1]):
            return
        for tmp, target in moves[:-1]:
            os.replace(tmp, target)
        tmp, target = moves[-1]
        try:
            os.link(tmp, target)  # atomic, also on NFS: fails where the target exists
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: a replace (the same build's content either way)
            os.replace(tmp, target)
    finally:
        for tmp, _ in moves:
            if os.path.exists(tmp):
                os.remove(tmp)


if __name__ == "__main__":
    print(*build_demo_corpus(), sep="\n")
