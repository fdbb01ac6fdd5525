"""What rendering a retrieval trial through a chat template costs, whole vs spliced (data/chat.py `encode_long`).

    DS_ACCELERATOR=cpu .venv/bin/python -m tests.unit.data.chat_render_bench [--lengths 16k,128k,1m] [--families llama3,qwen25,mistral]

For each template family of the golden tests (the fixture tokenizers: a byte-level BPE with each family's control
tokens; a real 128k-vocabulary tokenizer takes longer per character, the ratio is what carries over) and each length,
one passkey trial's user turn (the haystack and the question, decoded from the plain trial as data/tasks.py
`chat_sample` does) is rendered with its reply: `whole` is `encode` (the conversation rendered three times, tokenized
once: the two prefix renders that locate the reply are views on its tokens, data/chat_views.py; before, three
tokenizations), `spliced` is `encode_long` (the template around a placeholder, the haystack tokenized once), both on
one core; `decode` is the plain trial's decode both pay first.
The ids and masks are checked equal. Prints a Markdown table; nothing is written.

`--many 100:1m,1000:64k,1000:1m` (issue 47 item 12): a conversation of that many messages (user and assistant in
turn, filler words) of about that many tokens, encoded by the linear path (data/chat_views.py: tokenized once) and,
where turns x tokens <= `--exact_budget`, by the exact path (`ChatEncoder.linear = False`: every prefix render
tokenized whole, the code before the change); the ids and masks are checked equal. It lives beside the fixtures it
builds its tokenizers with (bench/ may not import tests/); no test runs it (pytest collects test_*.py only).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)


def best_of(repeat: int, fn, *args) -> tuple[float, object]:
    out, best = None, float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16k,128k,1m")
    p.add_argument("--families", default="llama3,qwen25,mistral")
    p.add_argument("--repeat", type=int, default=2, help="best of N runs per cell")
    p.add_argument("--many", default="", help="messages:tokens cells of long multi-turn conversations")
    p.add_argument("--exact_budget", type=float, default=2e8, help="time the exact path where turns x tokens <= this")
    a = p.parse_args(argv)
    if a.many:
        return many_turns(a)

    import numpy as np

    from data.chat import ChatEncoder
    from data.tasks import make_sample
    from data.tokenizer import Tokenizer
    from planner.memory_model import parse_seq_len
    from tests.unit.data.chat_fixtures import build_tokenizer

    root = os.path.join(tempfile.gettempdir(), "bench_chat_render")
    print("| family | length | decode (s) | whole render (s) | spliced (s) | speedup | same ids and mask |")
    print("|---|---|---|---|---|---|---|")
    for family in a.families.split(","):
        tok = Tokenizer(build_tokenizer(root, family))
        enc = ChatEncoder(tok, "assistant", "none")
        for n in map(parse_seq_len, a.lengths.split(",")):
            s = make_sample("passkey", tok, n, 0.5, random.Random(0))
            first = int(np.flatnonzero(s["shift_labels"] != -100)[0]) + 1
            t_dec, user = best_of(a.repeat, tok.decode, s["input_ids"][:first])
            user = user.strip()
            msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": s["answer"]}]
            t_whole, (ids, mask, _) = best_of(a.repeat, enc.encode, {"messages": msgs})
            t_splice, (ids2, mask2) = best_of(a.repeat, enc.encode_long, msgs, 0)
            same = ids == ids2 and bool(np.array_equal(mask, mask2))
            print(f"| {family} | {n} | {t_dec:.3f} | {t_whole:.3f} | {t_splice:.3f} | {t_whole / t_splice:.1f}x | "
                  f"{'yes' if same else 'NO'} |", flush=True)
    return 0


def conversation(tok, messages: int, tokens: int, rng) -> list[dict]:
    """`messages` messages, user and assistant in turn, of filler words: about `tokens` tokens in all."""
    words = "apple river two words count them say exactly question answer the of step tool result".split()
    probe = " ".join(rng.choice(words) for _ in range(2000))
    per = max(1, int(tokens / messages * len(probe) / len(tok.encode(probe)) / 6))  # words per message
    return [{"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choice(words) for _ in range(per))}
            for i in range(messages)]


def many_turns(a) -> int:
    import numpy as np

    from data.chat import ChatEncoder
    from data.tokenizer import Tokenizer
    from planner.memory_model import parse_seq_len
    from tests.unit.data.chat_fixtures import build_tokenizer

    root = os.path.join(tempfile.gettempdir(), "bench_chat_render")
    print("| family | messages | tokens | linear (s) | exact (s) | speedup | same ids and mask |")
    print("|---|---|---|---|---|---|---|")
    for family in a.families.split(","):
        enc = ChatEncoder(Tokenizer(build_tokenizer(root, family)), "assistant", "none")
        for cell in a.many.split(","):
            messages, tokens = int(cell.split(":")[0]), parse_seq_len(cell.split(":")[1])
            conv = conversation(enc.tok, messages, tokens, random.Random(cell))
            enc.linear = True
            t_lin, (ids, mask, _) = best_of(a.repeat, enc.encode, {"messages": conv})
            if messages * tokens > a.exact_budget:
                print(f"| {family} | {messages} | {len(ids)} | {t_lin:.2f} | not run (turns x tokens > "
                      f"{a.exact_budget:.0e}) | | |", flush=True)
                continue
            enc.linear = False
            t_ex, (ids2, mask2, _) = best_of(1, enc.encode, {"messages": conv})
            same = ids == ids2 and bool(np.array_equal(mask, mask2))
            print(f"| {family} | {messages} | {len(ids)} | {t_lin:.2f} | {t_ex:.1f} | {t_ex / t_lin:.0f}x | "
                  f"{'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
