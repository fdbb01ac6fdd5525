"""The demo's chat set: synthetic conversations a tiny model learns in minutes (`make demo-sft`).

    python -m data.chat_demo OUT.jsonl [N]    # N conversations (default 4000) as JSONL at OUT.jsonl

OUT is kept when it exists and is a chat set already (so `make demo-sft` and scripts/setup.sh may run it again);
a folder, or an existing file that is not a chat set, is refused in one line (exit 2), as is an N that is not a
positive integer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from base.atomic import atomic_write

_WORDS = ("apple", "river", "candle", "forest", "mirror", "silver", "garden", "planet", "window", "tiger", "bottle",
          "castle", "dragon", "engine", "feather", "guitar", "harbor", "island", "jacket", "lemon", "marble", "needle",
          "orange", "pencil", "rocket", "saddle", "tunnel", "violin", "wallet", "yellow")


def demo_conversation(rng: random.Random) -> dict:
    """One synthetic conversation a tiny model learns in minutes: repeat, reverse or count a list of words, over
    1-3 turns, in one of the three row formats (so the demo exercises all three readers)."""
    msgs = [{"role": "system", "content": "You are a careful assistant."}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        words = rng.sample(_WORDS, rng.randint(2, 5))
        op = rng.choice(("Repeat", "Reverse", "Count"))
        reply = (" ".join(words) if op == "Repeat" else " ".join(reversed(words)) if op == "Reverse"
                 else f"{len(words)} words")
        msgs += [{"role": "user", "content": f"{op} these words: {' '.join(words)}"},
                 {"role": "assistant", "content": reply}]
    form = rng.random()
    if form < 0.6:
        return {"messages": msgs}
    if form < 0.85:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}
    return {"prompt": msgs[:-1], "completion": msgs[-1:]}


def build_demo_chats(path: str, n: int = 4000, seed: int = 0) -> str:
    """Write `n` demo conversations as JSONL at `path` (atomic; kept when it exists)."""
    if os.path.exists(path):
        return path
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # its own tmp (base/atomic.tmp_name): two jobs' rank 0s with one pid in their containers build it at once
    text = "".join(json.dumps(demo_conversation(rng)) + "\n" for _ in range(n))
    atomic_write(path, text.encode())
    return path


ROW_KEYS = ("messages", "conversations", "prompt")  # the three row formats data/chat_rows.py reads


def is_chat_set(path: str) -> bool:
    """Whether `path`'s first line is a chat row (a JSON object with one of ROW_KEYS): an earlier run's output."""
    try:
        with open(path) as fh:
            row = json.loads(fh.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(row, dict) and any(k in row for k in ROW_KEYS)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message} (python -m data.chat_demo --help)\n")


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use a positive integer (the conversations to write)")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m data.chat_demo", description=__doc__.splitlines()[0])
    p.add_argument("out", metavar="OUT", help="the JSONL file to write (kept when it is a chat set already)")
    p.add_argument("n", metavar="N", nargs="?", type=_count, default=4000, help="conversations (default 4000)")
    a = p.parse_args(argv)
    why = None
    if os.path.isdir(a.out):
        why = "a folder: name a .jsonl file (e.g. .cache/demo/chat_demo.jsonl)"
    elif os.path.exists(a.out) and not is_chat_set(a.out):
        why = "exists and is not a chat set (its first line is no messages/conversations/prompt row): remove it or " \
              "name another file"
    if why is None:
        try:
            print(build_demo_chats(a.out, a.n))
            return 0
        except OSError as e:  # a file where its folder should be, a folder this user cannot write
            why = f"cannot write it ({e.strerror}: {e.filename}): name a file in a folder this user can write"
    print(f"error: OUT {a.out}: {why}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
