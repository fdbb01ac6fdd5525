"""The demo's chat set: synthetic conversations a tiny model learns in minutes (`make demo-sft`).

    python -m data.chat OUT.jsonl [N]    (or python -m data.chat_demo)
"""

from __future__ import annotations

import json
import os
import random

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
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        for _ in range(n):
            fh.write(json.dumps(demo_conversation(rng)) + "\n")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    import sys

    print(build_demo_chats(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4000))
