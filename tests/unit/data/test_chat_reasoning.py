"""A reply's reasoning (data/chat_reasoning.py): a template that never renders it refuses the row in one line; one
that renders only the replies' after the last user turn (Qwen3, gpt-oss) trains the rest, counted in the manifest
and warned. Before, every such reply trained with its reasoning gone, without a word (the sweep's `reasoning`
column: WRONG on 24 families on the old encoder). Fixture tokenizers of the sweep's families, no network: ~2 s."""

from __future__ import annotations

import json
import os

import pytest

from data.chat import ChatEncoder, RowError
from data.chat_sweep import CASES, build_tokenizer, families
from data.prepare_data import prepare
from data.tokenizer import Tokenizer
from tests.unit.data.test_chat_tools import encoder
from tests.unit.data.test_chat_tools import trained_text as trained

WHY = "Two words: apple, river."


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reasoning_tokenizers"))


@pytest.mark.parametrize("key,case,match", [
    ("llama31", "reasoning", "never renders its reasoning field"),  # no reasoning branch: the field is dropped
    ("qwen25", "reasoning", "never renders its reasoning field"),
    ("deepseek_r1", "reasoning in the content", "never renders the think block of its content"),  # cut at </think>
])
@pytest.mark.parametrize("loss_on", ["auto", "all"])
def test_reasoning_a_template_never_renders_refuses_the_row_in_one_line(root, key, case, match, loss_on):
    with pytest.raises(RowError, match=match) as e:
        encoder(root, key, loss_on).encode({"messages": CASES[case]})
    assert "\n" not in str(e.value) and "message 1 (assistant)" in str(e.value)


def test_the_r1_refusal_names_a_template_that_trains_the_content_whole(root):
    """DeepSeek-R1's template cuts the content at </think>: the refusal names TRL's deepseek_r1_distill_training.jinja
    (it said only "Qwen3, gpt-oss, ..."), and that template, set as the tokenizer's, trains the row's reasoning and
    answers, its generation prompt's `<think>\n` not (data/chat_locate.prompt_cut)."""
    from tests.unit.data.test_chat_trl_templates import R1_DISTILL_TRAINING, _pair

    with pytest.raises(RowError) as e:
        encoder(root, "deepseek_r1").encode({"messages": CASES["reasoning in the content"]})
    assert "TRL's deepseek_r1_distill_training.jinja as the tokenizer's chat_template" in str(e.value)
    assert "\n" not in str(e.value)
    trl = _pair(root, "deepseek_r1", R1_DISTILL_TRAINING)[1]
    ids, mask, stats = trl.encode({"messages": CASES["reasoning in the content"]})
    text = trained(trl, ids, mask)
    assert text.count(WHY) == 2 and "2 words" in text and "<think>" not in text and stats["untrained_turns"] == 0


@pytest.mark.parametrize("key", ["llama31", "qwen25", "deepseek_v3"])
def test_reasoning_in_the_content_of_a_template_that_prints_it_trains_whole(root, key):
    enc = encoder(root, key)
    ids, mask, stats = enc.encode({"messages": CASES["reasoning in the content"]})
    assert trained(enc, ids, mask).count(WHY) == 2 and stats["dropped_reasoning"] == 0


@pytest.mark.parametrize("key,case", [("qwen3", "reasoning"), ("qwen3", "reasoning in the content"),
                                      ("gpt_oss", "reasoning")])
def test_the_historys_reasoning_a_template_drops_is_counted(root, key, case):
    """Qwen3 and gpt-oss render the reasoning of the replies after the last user turn only (as at inference): the
    last reply trains with it, the first without it, counted."""
    enc = encoder(root, key)
    ids, mask, stats = enc.encode({"messages": CASES[case]})
    assert trained(enc, ids, mask).count(WHY) == 1 and stats["dropped_reasoning"] == 1
    one = enc.encode({"messages": CASES[case][:2]})  # one row per reply keeps each reasoning
    assert trained(enc, one[0], one[1]).count(WHY) == 1 and one[2]["dropped_reasoning"] == 0


def test_the_preparation_counts_and_warns(tmp_path):
    path = build_tokenizer(str(tmp_path), "qwen3", families()["qwen3"])
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": CASES[c]}) + "\n" for c in ("reasoning", "multi-turn")))
    lines = []
    m = prepare([str(src)], str(tmp_path / "out"), path, workers=0, log=lines.append)
    assert (m["chat_docs"], m["dropped_reasoning"]) == (2, 1)
    warn = [x for x in lines if x.startswith("warning:") and "reasoning" in x]
    assert len(warn) == 1 and "1 trained repl(ies)" in warn[0] and "one row per reply" in warn[0]


def test_gpt_oss_agent_rows_train_the_call_and_the_answer(root):
    """gpt-oss writes a tool call's analysis until a final answer follows: the prefixes showed it, the conversation
    did not, and the row was refused ("none of the 2 assistant turn(s) could be located"). The history is now read as
    the conversation renders it."""
    enc = encoder(root, "gpt_oss")
    ids, mask, stats = enc.encode({"messages": CASES["tool call with reasoning"]})
    text = trained(enc, ids, mask)
    assert "count_words" in text and "2 words" in text and WHY not in text, text
    assert (stats["untrained_turns"], stats["dropped_reasoning"]) == (0, 1)
    assert ids == enc.tok.encode(enc._text(CASES["tool call with reasoning"]))


def test_only_the_trained_replies_are_checked_and_counted(root):
    """A reply not trained (in a prompt, or weighted 0) is never refused for what the template drops of it, nor
    counted: a call with text in a prompt through Llama 3.1 (which writes the call alone) left the completion
    trainable before the text check came, and must again; a weight-0 reply with reasoning on the marker path was
    counted as a trained reply without its reasoning."""
    call = CASES["tool call with text"]
    enc = encoder(root, "llama31")
    ids, mask, stats = enc.encode({"prompt": call[:3], "completion": call[3:]})
    assert trained(enc, ids, mask).strip().startswith("2 words") and stats["untrained_turns"] == 0
    markers = encoder(root, "chatml_generation")
    conv = [CASES["reasoning"][0], {**CASES["reasoning"][1], "weight": 0}, *CASES["multi-turn"][2:]]
    conv[1] = {k: v for k, v in conv[1].items() if k != "thinking"}
    ids, mask, stats = markers.encode({"messages": conv})
    assert (stats["flagged_turns"], stats["dropped_reasoning"]) == (1, 0) and trained(markers, ids, mask).count("2 words")


def test_an_end_of_turn_only_the_history_writes_is_not_trained_where_generation_does_not_stop_on_it(root, tmp_path):
    """gpt-oss ends an answer followed by more with <|end|>, the last with <|return|>; generation stops on <|return|>,
    <|call|>, <|endoftext|> (its generation_config.json). Every earlier answer's <|end|> was trained, teaching a stop
    generation does not stop on (the tuned model ran on into another turn): now not trained, counted. OLMo 3's
    <|im_end|> (its EOS last) is one of its stops: trained. Without a generation config: trained, as written."""
    import shutil

    conv = CASES["multi-turn"]
    enc = encoder(root, "gpt_oss")
    ids, mask, stats = enc.encode({"messages": conv})
    end, ret = enc.tok.hf.convert_tokens_to_ids(["<|end|>", "<|return|>"])
    trained_ids = [i for i, m in zip(ids, mask) if m]
    assert end not in trained_ids and trained_ids[-1] == ret and stats["history_ends"] == 1
    assert "apple river" in trained(enc, ids, mask) and "2 words" in trained(enc, ids, mask)
    bare = tmp_path / "gpt_oss_no_generation_config"
    shutil.copytree(enc.tok.path, bare)
    os.remove(bare / "generation_config.json")
    ids2, mask2, stats2 = ChatEncoder(Tokenizer(str(bare))).encode({"messages": conv})
    assert ids2 == ids and end in [i for i, m in zip(ids2, mask2) if m] and stats2["history_ends"] == 0
    assert stats2["history_ends_unknown"] == 1 and stats["history_ends_unknown"] == 0  # said in the summary:
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": conv}) + "\n")
    for folder, counted in ((enc.tok.path, "1 end-of-turn token(s) after earlier answers not trained"),
                            (str(bare), "1 earlier answer(s) end with a token the template writes only in the history")):
        lines = []
        prepare([str(src)], str(tmp_path / f"out{len(counted)}"), folder, workers=0, log=lines.append)
        assert sum(counted in x for x in lines) == 1, lines
    olmo = encoder(root, "olmo3")
    ids, mask, stats = olmo.encode({"messages": conv})
    assert olmo.tok.hf.convert_tokens_to_ids("<|im_end|>") in [i for i, m in zip(ids, mask) if m]
    assert stats["history_ends"] == 0


def test_a_reply_in_another_unicode_form_than_the_tokenizer_normalizes_to_trains(root, tmp_path):
    """Qwen2's tokenizer normalizes to NFC: a reply in decomposed form (macOS text) or with the OHM SIGN decodes in
    its normal form, and the reply, compared as given, was not found: the turn untrained ('no end-of-turn token'),
    a one-turn row refused. Its reasoning likewise was counted as dropped."""
    import shutil

    nfc = tmp_path / "qwen3_nfc"
    shutil.copytree(encoder(root, "qwen3").tok.path, nfc)
    spec = json.loads((nfc / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (nfc / "tokenizer.json").write_text(json.dumps(spec))
    enc = ChatEncoder(Tokenizer(str(nfc)))
    reply, why = "Cafe\u0301 au lait, 10 k\u2126", "Cafe\u0301: two words"
    ids, mask, stats = enc.encode({"messages": [CASES["multi-turn"][0], {"role": "assistant", "content": reply,
                                                                         "reasoning_content": why}]})
    assert stats["untrained_turns"] == 0 and stats["dropped_reasoning"] == 0, stats
    assert "Café au lait, 10 kΩ" in trained(enc, ids, mask)


def test_glm_with_its_think_tokens_special_trains_too(tmp_path):
    """GLM-4.7's <think> / </think> are plain added tokens (the sweep's family); with them special (a converted or
    older vocabulary) a last reply with reasoning ended at its `</think>` (the last control token of the turn) and
    the row was refused ('no end-of-turn token')."""
    fam = {**families()["glm47"], "special": families()["glm47"]["special"] + ["<think>", "</think>"]}
    fam["added"] = [t for t in fam["added"] if t not in ("<think>", "</think>")]
    enc = ChatEncoder(Tokenizer(build_tokenizer(str(tmp_path), "glm47_special_think", fam)))
    for case in ("multi-turn", "reasoning", "reasoning in the content"):
        ids, mask, stats = enc.encode({"messages": CASES[case]})
        text = trained(enc, ids, mask)
        assert stats["untrained_turns"] == 0 and "apple river" in text and "2 words" in text, (case, text)
        # each reply's stop (the last one's appended: data/chat_ends.last_stop), no user text
        assert text.count("<|user|>") == 2 and text.endswith("<|user|>") and "Count them" not in text


def test_the_fix_a_refusal_names_is_the_templates_own_reasoning_form(tmp_path):
    """Magistral / Ministral Reasoning render a reply's reasoning as [THINK]...[/THINK] (from `thinking` content
    parts) and never read reasoning_content: the refusal told the user to write <think>...</think>, which such a
    template prints as plain text, training the wrong tags without a word. It names the template's own tags now; a
    thinking part is refused with the same advice."""
    template = ("{%- for m in messages -%}{%- if m.role == 'user' -%}[INST]{{ m.content }}[/INST]{%- else -%}"
                "{%- if m.content is not string -%}{%- for p in m.content -%}{%- if p.type == 'thinking' -%}[THINK]"
                "{{ p.thinking }}[/THINK]{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- else -%}{{ m.content }}"
                "{%- endif -%}</s>{%- endif -%}{%- endfor -%}")
    fam = {"eos": "</s>", "special": ["[INST]", "[/INST]", "[THINK]", "[/THINK]", "</s>"], "bos": None}
    import data.chat_sweep as sweep

    orig = sweep.marked
    sweep.marked = lambda fam, name=None: template
    try:
        enc = ChatEncoder(Tokenizer(build_tokenizer(str(tmp_path), "magistral_like", {**fam, "file": "x"})))
    finally:
        sweep.marked = orig
    row = [_ASK_ROW, {"role": "assistant", "content": "apple river", "reasoning_content": WHY}]
    with pytest.raises(RowError, match=r"as \[THINK\]\.\.\.\[/THINK\] where the template prints the content"):
        enc.encode({"messages": row})
    part = [_ASK_ROW, {"role": "assistant", "content": [{"type": "thinking", "thinking": WHY},
                                                        {"type": "text", "text": "apple river"}]}]
    ids, mask, _ = enc.encode({"messages": [_ASK_ROW, {"role": "assistant",
                                                       "content": f"[THINK]{WHY}[/THINK]apple river"}]})
    assert "[THINK]" + WHY + "[/THINK]apple river" in trained(enc, ids, mask)
    assert enc.encode({"messages": part})[0] == ids  # a thinking part this template renders trains as it renders it


_ASK_ROW = {"role": "user", "content": "Say exactly: apple river"}


def test_a_reply_cut_between_a_letter_and_its_mark_is_still_found(root):
    """A GLM-4.7 turn's start is checked on the reply's first 16 characters: cut before its normal form, the cut fell
    between a letter and its combining mark (decomposed Vietnamese), which no normalized text holds: the turn was
    not located (a one-turn row refused)."""
    enc = encoder(root, "glm47")
    reply = "a" * 15 + "e\u0302\u0301 river"  # the 16th character is an e followed by two combining marks
    conv = [CASES["multi-turn"][0], {"role": "assistant", "content": "apple river"},
            {"role": "user", "content": "Count them."}, {"role": "assistant", "content": reply}]
    ids, mask, stats = enc.encode({"messages": conv})
    assert stats["untrained_turns"] == 0, stats


# a template that writes its own <think> before a reply's content: Nemotron-Nano-v2's opens the block in its
# generation prompt and writes the content after it; Kimi-K2-Thinking's writes an empty block before every content
_NESTS = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{OWN}{% endif %}"
          "{{ m.content }}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{GEN}{%- endif %}")


@pytest.mark.parametrize("own,gen,trains", [("<think>\n", "<think>\n", "Two words.\n</think>\n\napple river"),
                                            ("<think></think>", "", None)])
def test_reasoning_a_template_would_nest_in_its_own_think_block_is_refused(root, own, gen, trains):
    """<think>reasoning</think>answer (OpenThoughts, Llama-Nemotron rows) through a template that writes its own
    <think> first was trained as a block nested in a second opening (`<think>\\n<think>...`), without a word. Refused
    in one line; where the generation prompt opens the block, reasoning</think>answer is the fix and trains whole."""
    tok = Tokenizer(build_tokenizer(root, "qwen25", families()["qwen25"]))
    tok.hf.chat_template = _NESTS.replace("{OWN}", own).replace("{GEN}", gen)
    enc = ChatEncoder(tok)
    ask = {"role": "user", "content": "Say apple river"}
    with pytest.raises(RowError, match=r"^message 1 \(assistant\): .* writes its own <think> before a reply") as e:
        enc.encode({"messages": [ask, {"role": "assistant", "content": "<think>\nTwo words.\n</think>\n\napple river"}]})
    assert ("reasoning</think>answer" in str(e.value)) == (trains is not None)
    row = {"messages": [ask, {"role": "assistant", "content": "Two words.\n</think>\n\napple river"}]}
    if trains is None:
        with pytest.raises(RowError, match="writes its own <think>"):
            enc.encode(row)
    else:
        ids, mask, _ = enc.encode(row)
        assert trained(enc, ids, mask).lstrip("\n") == trains + "<|im_end|>"  # "\n" + text: one token here
    enc.encode({"messages": [ask, {"role": "assistant", "content": "apple river"}]})  # no reasoning: trains
    # a reasoning field it never renders: the fix named is the one that trains (the think block was, then refused)
    field = {"messages": [ask, {"role": "assistant", "content": "apple river", "reasoning_content": "Two words."}]}
    with pytest.raises(RowError, match="never renders its reasoning field") as e:
        enc.encode(field)
    assert ("reasoning</think>answer" in str(e.value)) == (trains is not None)


@pytest.mark.parametrize("key", ["deepseek_r1", "glm47"])
def test_a_decomposed_reply_is_found_where_the_reply_start_is_searched(root, key):
    """A reply in decomposed form (NFD Hangul: three jamo a syllable, macOS text) on the templates whose reply start
    is searched token by token (DeepSeek-R1, GLM-4.7): the window was sized by the normal form's tokens, too short
    to reach the text, and the one-turn row was refused ("does not go on from the messages before it")."""
    import unicodedata

    reply = unicodedata.normalize("NFD", "안녕하세요, 반갑습니다")
    enc = encoder(root, key)
    ids, mask, stats = enc.encode({"messages": [CASES["multi-turn"][0], {"role": "assistant", "content": reply}]})
    assert stats["untrained_turns"] == 0
    assert unicodedata.normalize("NFC", reply) in unicodedata.normalize("NFC", trained(enc, ids, mask))


def test_the_stop_a_chat_sft_trains_is_the_last_replys_end(root):
    """A base model's generation config stops on its pretraining EOS (Qwen2.5-7B's <|endoftext|>), not on the
    template's end-of-turn the SFT trained: its export ran on past every reply. data/chat_stops.reply_stops gives the
    token that ends a last reply: Qwen's <|im_end|>, Llama 3's <|eot_id|>, gpt-oss's <|return|> (not <|end|>, which
    only the history writes), GLM-4.7's <|user|> (the next message's token, appended after a last reply: its template
    writes none there) and <|observation|> after a call."""
    from data.chat_stops import reply_stops

    def ids(key, names):
        hf = encoder(root, key).tok.hf
        return [hf.convert_tokens_to_ids(n) for n in names]

    for key, want in (("qwen25", ["<|im_end|>"]), ("llama31", ["<|eot_id|>"]), ("gpt_oss", ["<|return|>", "<|call|>"]),
                      ("glm47", ["<|user|>", "<|observation|>"])):
        assert reply_stops(encoder(root, key).tok.path) == ids(key, want), key
    assert reply_stops(None) == [] and reply_stops("recipes/base/tiny_passkey256/tokenizer.model") == []


@pytest.mark.parametrize("key", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("name", ["reasoning", "reasoning_content", "thinking"])
def test_a_reasoning_field_under_any_name_reaches_the_template(root, key, name):
    """A reply's reasoning under any of its names (OpenRouter's and newer vLLM's `reasoning`; Qwen3's template reads
    `reasoning_content`, gpt-oss's `thinking`) trains with it. Before, `reasoning` was dropped without a word: Qwen3
    trained an empty think block before the answer (a model taught to skip thinking), gpt-oss refused the others."""
    enc = encoder(root, key)
    row = {"messages": [{"role": "user", "content": "Say exactly: apple river"},
                        {"role": "assistant", "content": "apple river", name: WHY}]}
    ids, mask, stats = enc.encode(row)
    assert trained(enc, ids, mask).count(WHY) == 1 and stats["dropped_reasoning"] == 0


def test_two_reasoning_fields_with_two_texts_are_refused_in_one_line(root):
    row = {"messages": [{"role": "user", "content": "Q?"},
                        {"role": "assistant", "content": "A.", "reasoning": WHY, "thinking": "Another thought."}]}
    with pytest.raises(RowError, match="thinking and reasoning hold different texts") as e:
        encoder(root, "qwen3").encode(row)
    assert "\n" not in str(e.value)


def test_gemma4_renders_reasoning_only_on_a_reply_with_tool_calls(root):
    """Gemma 4's own template (data/chat_templates/gemma4.jinja, byte for byte) writes a reply's reasoning as its
    thought channel only for a reply with tool calls after the last user turn. The probe gives the reply a call and a
    tool list where a plain reply drops it: a reply with calls trains with its reasoning; a plain one is refused in one
    line naming no content fix (a think block in the content is answer text there). Before, both were refused as
    'never renders its reasoning field', with a '<think>' fix that cannot work on Gemma 4."""
    from data.chat_sweep import TOOLS

    enc = encoder(root, "gemma4")
    call = {"id": "call00001", "type": "function", "function": {"name": "count_words", "arguments": {"text": "a b"}}}
    row = {"messages": [{"role": "user", "content": "How many words in a b?"},
                        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning": WHY},
                        {"role": "tool", "tool_call_id": "call00001", "content": "2"},
                        {"role": "assistant", "content": "2 words"}], "tools": TOOLS["tool list"]}
    ids, mask, stats = enc.encode(row)
    assert WHY in trained(enc, ids, mask) and "<|tool_call>call:count_words" in trained(enc, ids, mask)
    assert stats["dropped_reasoning"] == 0
    plain = {"messages": [{"role": "user", "content": "Say exactly: apple river"},
                          {"role": "assistant", "content": "apple river", "reasoning": WHY}]}
    with pytest.raises(RowError, match="renders a reply's reasoning only on a reply with tool calls") as e:
        enc.encode(plain)
    assert "\n" not in str(e.value) and "<think>" not in str(e.value)
