"""What generation must stop on after chat SFT: the control token the template writes after a last reply, which the
loss trained the model to write (<|im_end|>, <|eot_id|>, <|end_of_turn|>, gpt-oss's <|return|>).

A base model's generation_config.json stops on its pretraining EOS (Qwen2.5-7B: <|endoftext|>; Llama-3-8B:
<|end_of_text|>), not on the chat template's end-of-turn: its SFT export ran on past every reply in `generate()` and
vLLM. The export adds this token to the stops (as Instruct releases list theirs); nothing where the template writes
no token after a last reply (Qwen1.5's: counted `no_stop_rows` at preparation) or the tokenizer has no template
(the ChatML default ends a reply with <|im_end|> where the vocabulary has it, else its EOS); GLM's, the next
message's <|user|> the history ends a reply with, is appended after the last one and trained (data/chat_ends.last_stop):
that one, and <|observation|> after a call. An end-of-turn the template writes only in the history (gpt-oss's <|end|>)
is not one: the last reply's is read. One that is no stop, followed by one (Command R7B's
<|END_RESPONSE|><|END_OF_TURN_TOKEN|>): that stop, which the loss trains last. A turn that is only a tool call may end
on another (gpt-oss's <|call|>, Gemma 4's <|tool_response>): that one too.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def _encoder(tokenizer_path: str | None, chat_template: str):
    """The run's chat encoder as the preparation built it; None for a sentencepiece file, a refusal, or none. Built
    once for the stops and the template both (a tokenizer load and the template's probes)."""
    import os

    if not tokenizer_path or not os.path.isdir(tokenizer_path):
        return None
    from data.chat import ChatEncoder
    from data.tokenizer import Tokenizer

    try:
        enc = ChatEncoder(Tokenizer(tokenizer_path), template=chat_template)
    except ValueError:
        return None
    return None if enc.refusal else enc


def reply_stops(tokenizer_path: str | None, chat_template: str = "auto") -> list[int]:
    """The ids that end a last reply in `tokenizer_path`'s template (`chat_template` as the preparation took it);
    [] for a sentencepiece file (its EOS: the export writes it) or where none is known."""
    from data.chat import _PROBE
    from data.chat_ends import REPLIES

    enc = _encoder(tokenizer_path, chat_template)
    if enc is None:
        return []
    if enc.kind == "chatml":
        return [int(enc.default_eot)]
    _ = enc.eot  # the probe: enc._ends, the id after each probe reply
    last = enc._ends.get(REPLIES[-1])
    if last is None:  # the stop appended after a last reply (GLM's <|user|>), as the run encodes it
        try:
            ids, _, stats = enc.encode({"messages": _PROBE})
        except ValueError:  # RowError: the template refuses the probe
            return []
        if not stats.get("appended_stops"):
            return []
        last = ids[-1]
    if enc._carry and last not in enc._carry:  # trained on to a stop after it (R7B's <|END_OF_TURN_TOKEN|>)
        from data.chat_locate import through_stop

        ids = enc.tok.encode(enc._text(_PROBE))
        at = max((i for i, t in enumerate(ids) if t == last), default=None)
        last = ids[through_stop(enc, ids, at + 1) - 1] if at is not None else last
    return [int(last)] + [c for c in _call_stop(enc) if c != last]


def _call_stop(enc) -> list[int]:
    """The control token a turn that is only a tool call ends on, where the template renders one (data/chat_sweep's
    "tool call" case, encoded as the run encodes it: its last trained id): gpt-oss's <|call|>, Gemma 4's
    <|tool_response>, which the loss trains there and a server must stop on to run the tool (a base's generation
    config lacked it: generation ran on, writing the tool's answer itself); [] where no call renders."""
    from data.chat_sweep import CASES

    try:
        ids, mask, _ = enc.encode({"messages": CASES["tool call"][:2]})
    except ValueError:  # RowError: the template refuses such a turn
        return []
    trained = [i for i, m in zip(ids, mask) if m]
    return [int(trained[-1])] if trained and trained[-1] in enc.special else []


def trained_template(tokenizer_path: str | None, chat_template: str = "auto") -> str | None:
    """The chat template an export must carry (the one the rows were rendered with) where the tokenizer's own default
    is another (the ChatML default, `--chat_template chatml`, a named template): None where it is the same."""
    enc = _encoder(tokenizer_path, chat_template)
    return enc.serves if enc is not None else None
