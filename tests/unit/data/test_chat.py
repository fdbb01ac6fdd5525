"""Chat rows -> ids + loss mask (data/chat.py): golden masks per template family, the cases peers got wrong (a
reply repeated in the user turn, the end-of-turn token, an empty think block, a template that rewrites history),
the ChatML default and the refusal, and the three row formats. No network: tests/unit/data/chat_fixtures.py."""

from __future__ import annotations

import numpy as np
import pytest

from data.chat import ChatEncoder, RowError, normalize
from data.tokenizer import Tokenizer
from tests.unit.data.chat_fixtures import QWEN15_SHAPE, build_tokenizer


@pytest.fixture(scope="module")
def tok_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chat_tokenizers"))


def encoder(root, family, **kw):
    return ChatEncoder(Tokenizer(build_tokenizer(root, family)), **kw)


def spans(enc, ids, mask) -> list[str]:
    """The supervised runs of `mask`, decoded (special tokens kept)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.tok.hf.decode(ids[a:b]) if enc.tok.hf is not None else enc.tok.decode(ids[a:b])
            for a, b in zip(edges[::2], edges[1::2])]


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [{"role": "user", "content": "Repeat these words: apple river"},
         {"role": "assistant", "content": "apple river"},
         {"role": "user", "content": "Count them."},
         {"role": "assistant", "content": "2 words"}]

# family -> (with a system turn?, the supervised spans: each reply and its end-of-turn token, nothing else)
GOLDEN = {
    "llama3": (True, ["apple river<|eot_id|>", "2 words<|eot_id|>"]),
    "qwen25": (True, ["apple river<|im_end|>", "2 words<|im_end|>"]),
    "smollm2": (True, ["apple river<|im_end|>", "2 words<|im_end|>"]),
    "gemma": (False, ["apple river<end_of_turn>", "2 words<end_of_turn>"]),
    "mistral": (False, [" apple river</s>", " 2 words</s>"]),  # the template writes the space before the reply
    "markers": (True, ["apple river<|im_end|>", "2 words<|im_end|>"]),  # {% generation %}: HF's own mask
}


@pytest.mark.parametrize("family", sorted(GOLDEN))
def test_golden_mask_multi_turn(tok_root, family):
    with_system, want = GOLDEN[family]
    enc = encoder(tok_root, family)
    ids, mask, stats = enc.encode({"messages": ([SYSTEM] if with_system else []) + TURNS})
    assert spans(enc, ids, mask) == want
    assert stats["untrained_turns"] == 0
    assert enc.kind == ("markers" if family == "markers" else "prefix")
    # the ids are exactly the template's own rendering of the conversation
    full = enc.tok.hf.apply_chat_template(([SYSTEM] if with_system else []) + TURNS, tokenize=False)
    assert ids == enc.tok.encode(full)


@pytest.mark.parametrize("family", ["llama3", "qwen25", "gemma", "mistral", "smollm2"])
def test_reply_repeated_in_user_turn(tok_root, family):
    """The reply's text appears first in the user turn: a text search would mask the user's copy."""
    enc = encoder(tok_root, family)
    conv = [{"role": "user", "content": "Say exactly: apple river"}, {"role": "assistant", "content": "apple river"}]
    ids, mask, _ = enc.encode({"messages": conv})
    got = spans(enc, ids, mask)
    assert len(got) == 1 and got[0].strip().startswith("apple river")
    first = int(np.flatnonzero(mask)[0])
    head = enc.tok.encode(enc.tok.hf.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True))
    assert first >= len(head) - 1  # after the assistant header, never inside the user turn


def test_empty_think_block_and_rewritten_history(tok_root):
    """Qwen3-style: the last reply carries an empty think block (the model generates it: trained), an earlier
    reply renders without one once a later user turn follows (history rewritten): still located, token-wise."""
    enc = encoder(tok_root, "qwen3")
    ids, mask, stats = enc.encode({"messages": TURNS})
    assert spans(enc, ids, mask) == ["apple river<|im_end|>", "<think>\n\n</think>\n\n2 words<|im_end|>"]
    assert stats["untrained_turns"] == 0


def test_mistral_system_prompt_is_refused_not_guessed(tok_root):
    """Mistral v0.3 writes the system prompt into the user turn only when that turn is the last message: in a
    conversation ending with a reply it is dropped, so every turn's header renders differently alone than in the
    whole conversation. No turn is located: the row is refused (a bad row, counted), never masked by guesswork."""
    enc = encoder(tok_root, "mistral")
    with pytest.raises(RowError, match="none of the 2 assistant turn"):
        enc.encode({"messages": [SYSTEM] + TURNS})


def test_mistral_system_prompt_it_drops_refuses_loss_on_all(tok_root):
    """The same row under `--loss_on all` trained every token of a rendering without the system prompt (no span to
    locate, nothing refused): refused as under `assistant`, in one line naming the message and the fix. Where a user
    turn is last the template writes it, and the row trains whole; one without a system message is untouched."""
    enc = encoder(tok_root, "mistral", loss_on="all")
    with pytest.raises(RowError, match=r"message 0 \(system\): .* does not render it .* put it in the first user turn"):
        enc.encode({"messages": [SYSTEM] + TURNS})
    for conv in ([SYSTEM] + TURNS[:3], TURNS):  # (a conversation ending with a user turn: its system prompt shown)
        ids, mask, _ = enc.encode({"messages": conv})
        assert mask.all() and (SYSTEM["content"] in enc.tok.decode(ids)) == (conv[0] is SYSTEM)


def test_a_mistral_folder_with_tekken_json_renders_its_own_template(tok_root, tmp_path, monkeypatch):
    """Mistral's repos (Nemo, Small 3.x, Devstral, Magistral) ship tekken.json beside tokenizer.json and the template.
    With mistral-common installed (vLLM brings it), transformers 5 loads such a folder as MistralCommonBackend: no
    jinja template, another API (a traceback in ChatEncoder, text preparation included). Stand-in for mistral-common
    being installed: transformers' own probe answering that it is. The folder loads as the Hugging Face tokenizer
    with its template, and the replies train as for any Mistral folder."""
    import shutil

    import transformers.integrations.mistral.tokenizer as mt
    import transformers.models.auto.tokenization_auto as ta

    folder = tmp_path / "mistral_small"
    shutil.copytree(build_tokenizer(tok_root, "mistral"), folder)
    (folder / "tekken.json").write_text("{}")  # never read: the Hugging Face files are loaded
    (folder / "config.json").write_text('{"model_type": "mistral"}')
    monkeypatch.setattr(mt, "is_mistral_common_available", lambda: True)
    monkeypatch.setitem(ta.TOKENIZER_MAPPING_NAMES, "mistral", "MistralCommonBackend")  # set at import when installed
    assert mt.resolve_mistral_format(str(folder))[0]  # what transformers decides without mistral_format=False
    enc = ChatEncoder(Tokenizer(str(folder)))
    assert enc.kind == "prefix" and "[INST]" in enc.template
    ids, mask, _ = enc.encode({"messages": TURNS})
    assert spans(enc, ids, mask) == [" apple river</s>", " 2 words</s>"]


def test_template_refusal_is_a_bad_row(tok_root):
    enc = encoder(tok_root, "gemma")
    with pytest.raises(RowError, match="refuses"):
        enc.encode({"messages": [SYSTEM] + TURNS})  # gemma-2: "System role not supported"


def test_default_chatml_and_refusal(tok_root):
    enc = encoder(tok_root, "none")  # an HF tokenizer without a template
    assert enc.default and enc.serves and "{% generation %}" not in enc.serves
    ids, mask, _ = enc.encode({"messages": TURNS})
    # its vocabulary has <|im_end|> (the default's end-of-turn when present; else EOS: test_sentencepiece_default)
    assert spans(enc, ids, mask) == ["apple river<|im_end|>", "2 words<|im_end|>"]
    assert "<|im_start|>assistant\n" in enc.tok.hf.decode(ids)
    forced = encoder(tok_root, "qwen25", template="chatml")  # <|im_end|> is in this vocabulary: it ends the turns
    ids, mask, _ = forced.encode({"messages": TURNS})
    assert spans(forced, ids, mask) == ["apple river<|im_end|>", "2 words<|im_end|>"]
    refuse = encoder(tok_root, "none", template="none")
    with pytest.raises(RowError, match="has no chat template"):
        refuse.encode({"messages": TURNS})
    # --loss_on all: the default's "\n" after its end-of-turn was taken for a reply that ends with none (a false
    # "no end-of-turn token" warning on every row)
    _, _, st = encoder(tok_root, "none", loss_on="all").encode({"messages": TURNS})
    assert st["no_stop_rows"] == 0


def _metaspace_tokenizer(folder) -> str:
    """A sentencepiece-style Hugging Face tokenizer without a chat template (Llama 2 / Mistral v0.1 bases): every
    encode call opens with the dummy prefix `▁`."""
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Rust(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    t.train_from_iterator([m["content"] for m in TURNS] * 20 + ["<|im_start|>user\n"] * 5,
                          trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    return str(folder)


def test_the_chatml_default_trains_what_a_server_tokenizes(tmp_path):
    """The ChatML default on a sentencepiece-style tokenizer without a template: the rows are the text a server
    renders with the template the export writes (`serves`), tokenized as one. Built token by token, every header and
    reply opened with the dummy prefix: each reply was trained to start with a space (`▁ap` where the served prompt
    has `ap`), after headers the served prompt never shows."""
    enc = ChatEncoder(Tokenizer(_metaspace_tokenizer(tmp_path / "sp_hf")))
    ids, mask, _ = enc.encode({"messages": TURNS})
    hf = enc.tok.hf
    served = hf.apply_chat_template(TURNS, chat_template=enc.serves, tokenize=False)
    assert ids == hf(served, add_special_tokens=False)["input_ids"]
    assert spans(enc, ids, mask) == ["apple river</s>", "2 words</s>"]
    starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
    assert [hf.convert_ids_to_tokens(ids[a])[0] for a in starts] == ["a", "2"]  # no dummy prefix before a reply


def test_sentencepiece_default():
    """The demo's sentencepiece tokenizer: ChatML layout, its EOS ends each assistant turn and is trained."""
    enc = ChatEncoder(Tokenizer(".cache/demo/stdlib_sp.model"))
    ids, mask, _ = enc.encode({"messages": TURNS})
    sup = [t for t, m in zip(ids, mask) if m]
    assert sup.count(enc.tok.eos_id) == 2 and enc.tok.decode(sup).split() == ["apple", "river", "2", "words"]


def test_formats_and_loss_on(tok_root):
    enc = encoder(tok_root, "qwen25")
    share = {"conversations": [{"from": "human", "value": TURNS[0]["content"]}, {"from": "gpt", "value": "apple river"}]}
    ids, mask, _ = enc.encode(share)
    assert spans(enc, ids, mask) == ["apple river<|im_end|>"]
    # conversational prompt/completion: only the completion's assistant turns
    pair = {"prompt": TURNS[:3], "completion": TURNS[3:]}
    ids, mask, _ = enc.encode(pair)
    assert spans(enc, ids, mask) == ["2 words<|im_end|>"]
    # text prompt/completion: the completion and the EOS appended
    ids, mask, _ = enc.encode({"prompt": "Count: apple river.", "completion": " 2 words"})
    assert spans(enc, ids, mask) == [" 2 words<|im_end|>"]
    # tokenized as one text, split where the prompt's ids end (TRL's way): a sentencepiece tokenizer given the
    # completion alone starts a new text with its space ('▁The' after 'Response:\n'; two before ' 42')
    from data.tokenizer import Tokenizer

    sp = ChatEncoder(Tokenizer("recipes/base/tiny_passkey256/tokenizer.model"))
    for p, c in (("Question: the key?\nAnswer:", " 42"), ("### Response:\n", "The key is 42")):
        ids, mask, _ = sp.encode({"prompt": p, "completion": c})
        assert ids[:-1] == sp.tok.encode(p + c) and sp.tok.decode(ids[:-1]) == p + c
        assert sp.tok.decode(ids[: int(mask.argmax())]) == p and mask[int(mask.argmax()):].all()  # the prompt's ids
    everything = encoder(tok_root, "qwen25", loss_on="all")
    ids, mask, _ = everything.encode({"messages": TURNS})
    assert mask.all()
    assistant = encoder(tok_root, "qwen25", loss_on="assistant")  # every assistant turn, prompt's too
    ids, mask, _ = assistant.encode(pair)
    assert spans(assistant, ids, mask) == ["apple river<|im_end|>", "2 words<|im_end|>"]


@pytest.mark.parametrize("row,match", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "must be a string"),
    ({"conversations": [{"from": "alien", "value": "hi"}]}, "from 'alien'"),
    ({"prompt": "a", "completion": ["b"]}, "two strings or two lists"),
])
def test_bad_rows(row, match):
    with pytest.raises(RowError, match=match):
        normalize(row)


def test_tool_role(tok_root):
    """A tool turn (Qwen2.5 renders it as a user-side <tool_response>) gets no loss; the reply after it does."""
    enc = encoder(tok_root, "qwen25")
    conv = TURNS[:1] + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "count", "arguments": {"n": 2}}}]},
        {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2 words"}]
    ids, mask, _ = enc.encode({"messages": conv})
    got = spans(enc, ids, mask)
    assert got[-1] == "2 words<|im_end|>" and "tool_response" not in "".join(got)
    assert got[0].startswith("<tool_call>") and got[0].endswith("</tool_call><|im_end|>")


def test_final_eos_does_not_pull_the_mask_through_later_turns(tok_root):
    """Phi-3 ends the conversation with an EOS when no generation prompt is asked: the first turn rendered alone ends
    `<|end|>\\n<|endoftext|>`, the same turn inside the conversation `<|end|>\\n<|user|>`. Each reply is its text and
    its <|end|>: never the next user turn, never the trailing newline and EOS (issue 47 item 1)."""
    enc = encoder(tok_root, "phi3")
    ids, mask, stats = enc.encode({"messages": [SYSTEM] + TURNS})
    assert spans(enc, ids, mask) == ["apple river<|end|>", "2 words<|end|>"]
    assert stats["untrained_turns"] == 0


def test_named_templates_default_or_the_one_named():
    """A dict-valued chat_template (Command-R, Hermes-2-Pro): `default` unless one is named; one line otherwise."""
    from data.chat_template import pick_template

    named = {"default": "D", "tool_use": "T"}
    assert pick_template(named, "auto", "tok") == "D" and pick_template(named, "tool_use", "tok") == "T"
    assert pick_template(named, "chatml", "tok") is None and pick_template("S", "auto", "tok") == "S"
    with pytest.raises(ValueError, match=r"named chat templates \['rag', 'tool_use'\] and none is named `default`"):
        pick_template({"tool_use": "T", "rag": "R"}, "auto", "tok")
    with pytest.raises(ValueError, match="none is named 'rag'"):
        pick_template(named, "rag", "tok")
    with pytest.raises(ValueError, match="has no named templates"):
        pick_template("S", "tool_use", "tok")


def test_the_chatml_default_refuses_tool_calls(tok_root):
    """The default renders no tool calls: a tool-call turn would train an empty reply; the row is refused."""
    enc = encoder(tok_root, "none")
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "count", "arguments": {}}}]}
    with pytest.raises(RowError, match="the ChatML default does not render its tool call"):
        enc.encode({"messages": TURNS[:1] + [call]})


def test_the_sentencepiece_default_refuses_a_prompts_tool_call():
    """The token-built default (a sentencepiece model, no template) renders no tool call. A prompt / completion whose
    prompt holds one trained the completion on a tool result the model never asked for (the call vanished: only the
    trained turns were checked); refused now, under every loss, as the same conversation's messages row is."""
    tok = Tokenizer("recipes/base/tiny_passkey256/tokenizer.model")
    call = {"id": "call00001", "type": "function",
            "function": {"name": "count_words", "arguments": {"text": "apple river"}}}
    prompt = [TURNS[0], {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call00001", "content": "2"}]
    for loss_on in ("auto", "completion", "all"):
        with pytest.raises(RowError, match=r"message 1 \(assistant\): tool calls, and the ChatML default"):
            ChatEncoder(tok, loss_on).encode({"prompt": prompt, "completion": TURNS[3:]})
        with pytest.raises(RowError, match=r"message 1 \(assistant\): tool calls, and the ChatML default"):
            ChatEncoder(tok, loss_on).encode({"messages": prompt + TURNS[3:]})


def test_a_longer_generation_prompt_is_followed_only_up_to_the_reply(tok_root):
    """DeepSeek-R1's case (a generation prompt longer than the header in the conversation) is taken only where the
    reply's text starts right where the conversation leaves the prompt: a header that goes on differently inside
    the conversation (here ` (bot)` after `assistant`) is not trained as if it were the reply."""
    tok = Tokenizer(build_tokenizer(tok_root, "qwen25"))
    tok.hf.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + "
                            "(' (bot)' if m['role'] == 'assistant' else '') + '\n' + m['content'] + '<|im_end|>\n' }}"
                            "{% endfor %}"
                            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(RowError, match="none of the 2 assistant turn"):
        ChatEncoder(tok).encode({"messages": TURNS})


def test_end_of_turn_text_in_a_rewritten_reply_is_counted_never_cut(tok_root):
    """Qwen3 rewrites an earlier reply (its think block dropped) and the reply quotes `<|im_end|>`: tokenized as the
    control token (as TRL does), the reply is not trained (it would teach a stop inside it) and is counted; before,
    its span silently ended at the quoted token (issue 47 item 6)."""
    enc = encoder(tok_root, "qwen3")
    conv = [TURNS[0], {"role": "assistant", "content": "apple <|im_end|> river"}] + TURNS[2:]
    ids, mask, stats = enc.encode({"messages": conv})
    assert spans(enc, ids, mask) == ["<think>\n\n</think>\n\n2 words<|im_end|>"]
    assert stats["untrained_turns"] == 1 and "end-of-turn token's text" in stats["why"][0]


@pytest.mark.parametrize("linear", [True, False])
def test_an_end_of_turn_written_only_when_a_message_follows_is_trained(tok_root, linear):
    """Qwen1.5 writes `<|im_end|>\\n` after a message only when another follows: an earlier reply rendered alone ends
    in its text, inside the conversation in its `<|im_end|>`. That token is the reply's end (the model must learn to
    stop there), and nothing after it is; the last reply has no end-of-turn token to train. Before, the earlier reply
    was trained without its `<|im_end|>` (the search stopped at the end of the turn rendered alone)."""
    tok = Tokenizer(build_tokenizer(tok_root, "qwen25"))
    tok.hf.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                            "{% if not loop.last or add_generation_prompt %}{{ '<|im_end|>\n' }}{% endif %}"
                            "{% endfor %}"
                            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    enc = ChatEncoder(tok)
    enc.linear = linear
    for conv, want in (([SYSTEM] + TURNS, ["apple river<|im_end|>", "2 words"]),
                       (TURNS + [{"role": "user", "content": "Thanks."}], ["apple river<|im_end|>",
                                                                          "2 words<|im_end|>"])):
        ids, mask, stats = enc.encode({"messages": conv})
        assert spans(enc, ids, mask) == want
        assert stats["untrained_turns"] == 0
        assert ids == tok.encode(tok.hf.apply_chat_template(conv, tokenize=False))


def test_phi4_mini_renders_the_system_messages_tool_list(tok_root):
    """Phi-4-mini's own template writes the system message's `tools` between `<|tool|>` and `<|/tool|>`: the row's
    list reaches the rendering (data/chat_rows.py passes it on), the replies alone are trained."""
    tok = Tokenizer(build_tokenizer(tok_root, "phi3"))
    tok.hf.chat_template = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
                            "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
                            "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
                            "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
    enc = ChatEncoder(tok)
    tools = '[{"name": "count_words"}]'
    ids, mask, stats = enc.encode({"messages": [{**SYSTEM, "tools": tools}] + TURNS})
    assert "<|tool|>" + tools + "<|/tool|>" in tok.hf.decode(ids)
    assert spans(enc, ids, mask) == ["apple river<|end|>", "2 words<|end|>"] and stats["untrained_turns"] == 0


def test_olmo3_renders_its_functions_and_function_calls(tmp_path):
    """OLMo 3's real template (data/chat_templates/olmo3.jinja, as the sweep ships it): the system message's
    `functions` is in the ids, a reply's `function_calls` text is trained with the reply (data/chat_rows.py passes
    both on; before, the system turn said it had no functions and the call was never rendered)."""
    import json
    import os

    from data import chat_sweep

    fam = json.load(open(os.path.join(os.path.dirname(chat_sweep.__file__), "chat_templates", "families.json")))["olmo3"]
    tok = Tokenizer(chat_sweep.build_tokenizer(str(tmp_path), "olmo3", fam))
    enc = ChatEncoder(tok)
    funcs, calls = '[{"name": "count_words"}]', '[{"name": "count_words"}]'
    ids, mask, stats = enc.encode({"messages": [{**SYSTEM, "functions": funcs}, TURNS[0],
                                                {"role": "assistant", "content": "", "function_calls": calls},
                                                TURNS[2], TURNS[3]]})
    assert "<functions>" + funcs + "</functions>" in tok.hf.decode(ids)
    assert spans(enc, ids, mask) == ["<function_calls>" + calls + "</function_calls><|im_end|>",
                                     "2 words<|endoftext|>"] and stats["untrained_turns"] == 0




@pytest.mark.parametrize("loss_on", ["auto", "all"])
def test_a_last_reply_with_no_end_of_turn_is_counted(tok_root, loss_on):
    """A template that writes no end-of-turn after the last message (Qwen1.5) trains a conversation's final reply with
    no stop token: the row is counted (`no_stop_rows`, warned about by the preparation), not silent. A row ending
    with a user turn, or a template that ends every reply (Qwen2.5), is not."""
    tok = Tokenizer(build_tokenizer(tok_root, "qwen25"))
    own = ChatEncoder(tok, loss_on=loss_on)
    tok15 = Tokenizer(build_tokenizer(tok_root, "qwen25"))
    tok15.hf.chat_template = QWEN15_SHAPE
    enc = ChatEncoder(tok15, loss_on=loss_on)
    thanks = TURNS + [{"role": "user", "content": "Thanks."}]
    assert [e.encode({"messages": c})[2]["no_stop_rows"] for e in (enc, own) for c in (TURNS[:2], thanks)] == [1, 0,
                                                                                                               0, 0]


def test_a_reply_flagged_not_to_train_is_context_only(tok_root):
    """OpenAI's fine-tuning `weight: 0` (Axolotl's `training: false`): the reply stays in the ids, gets no loss, and
    is counted; the refusals where the flag cannot be honoured are one line. Before: trained, without a word."""
    enc = encoder(tok_root, "qwen25")
    conv = [TURNS[0], {**TURNS[1], "weight": 0}, *TURNS[2:]]
    ids, mask, stats = enc.encode({"messages": conv})
    assert ids == enc.encode({"messages": TURNS})[0]
    assert spans(enc, ids, mask) == ["2 words<|im_end|>"] and stats["flagged_turns"] == 1
    assert stats["untrained_turns"] == 0
    for row, match, kw in [
        ({"messages": conv}, "--loss_on all trains every token", {"loss_on": "all"}),
        ({"messages": [*conv[:3], {**TURNS[3], "training": False}]}, "every assistant turn .2. is flagged", {}),
        ({"prompt": [TURNS[0], {**TURNS[1], "weight": 1}, TURNS[2]], "completion": TURNS[3:]}, "in the prompt", {}),
    ]:
        with pytest.raises(RowError, match=match) as e:
            encoder(tok_root, "qwen25", **kw).encode(row)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("form", ["string", "named"])
def test_a_template_shipped_in_chat_template_json_is_the_tokenizers(tmp_path, form):
    """Mistral Small 3.1 ships its only template in the processor's chat_template.json, which AutoTokenizer does not
    read: before, such a model's chat rows were rendered with the ChatML default, unsaid."""
    import json
    import shutil

    from tests.unit.data.chat_fixtures import FAMILIES

    path = str(tmp_path / "gemma")
    shutil.copytree(build_tokenizer(str(tmp_path / "src"), "none"), path)
    template = FAMILIES["gemma"][0]
    value = template if form == "string" else [{"name": "default", "template": template}]
    (tmp_path / "gemma" / "chat_template.json").write_text(json.dumps({"chat_template": value}))
    enc = ChatEncoder(Tokenizer(path))
    assert enc.kind == "prefix"
    ids, mask, _ = enc.encode({"messages": TURNS})
    assert spans(enc, ids, mask) == ["apple river<end_of_turn>", "2 words<end_of_turn>"]
    (tmp_path / "gemma" / "chat_template.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match=r"chat_template.json: chat_template is int, not a template") as e:
        Tokenizer(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("loss_on", ["auto", "all"])
def test_a_template_that_renders_no_string_content_refuses_chat_rows(tmp_path, loss_on):
    """LLaVA's processor template (a chat_template.json) writes only content parts' text: a string's vanishes, and
    `--loss_on all` trained 'USER: ASSISTANT: ' for every row, without a word. Refused in one line."""
    import json
    import shutil

    path = str(tmp_path / "llava")
    shutil.copytree(build_tokenizer(str(tmp_path / "src"), "none"), path)
    llava = ("{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
             "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}{{ item['text'] }}{% endfor %}"
             "{% if message['role'] == 'user' %} {% else %}{{ eos_token }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    (tmp_path / "llava" / "chat_template.json").write_text(json.dumps({"chat_template": llava}))
    with pytest.raises(RowError, match="renders no message text given as a string") as e:
        ChatEncoder(Tokenizer(path), loss_on).encode({"messages": TURNS})
    assert "\n" not in str(e.value)


def test_an_empty_reply_is_not_trained_and_is_counted(tok_root):
    """A reply with no text, call or reasoning (raw ShareGPT dumps hold such turns): trained, it taught the model to
    stop at once, without a word. Now it is left untrained and counted; a row with nothing else is a bad row."""
    enc = encoder(tok_root, "qwen25")
    conv = [TURNS[0], {**TURNS[1], "content": " "}, *TURNS[2:]]
    ids, mask, stats = enc.encode({"messages": conv})
    assert spans(enc, ids, mask) == ["2 words<|im_end|>"] and stats["untrained_turns"] == 1
    assert "an empty reply" in stats["why"][0]
    with pytest.raises(RowError, match="an empty reply") as e:
        enc.encode({"messages": conv[:2]})
    assert "\n" not in str(e.value)
