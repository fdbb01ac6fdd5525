"""Reply texts that quote what a template cuts or stops at (data/chat.py, chat_locate.py, chat_reasoning.py), on the
sweep's tokenizers (data/chat_sweep.py): a quoted `</think>`, the EOS written as text, a reply ending in a control
token's string, two assistant messages in a row. Each was trained wrong without a word. ~4 s, no network."""

from __future__ import annotations

import numpy as np
import pytest

from data.chat import ChatEncoder, RowError
from data.chat_sweep import build_tokenizer, check, families
from data.tokenizer import Tokenizer

ASK = {"role": "user", "content": "How are think tags written?"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quoted_tokenizers"))


def encoder(root: str, key: str) -> ChatEncoder:
    fam = families()[key]
    return ChatEncoder(Tokenizer(build_tokenizer(root, key, fam)), "assistant", fam.get("template", "auto"))


def spans(enc: ChatEncoder, conv: list[dict]) -> tuple[list[str], dict]:
    ids, mask, stats = enc.encode({"messages": conv})
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])], stats


_EMPTY, _TWO = "Empty blocks look like <think></think> in the logs.", "<think>\nr\n</think>\n\nA tag `</think>` closes; B."
_BARE2 = "Use s.split('</think>')[-1], not s.split('</think>')[0]."  # read as reasoning</think>answer: the rest is cut


@pytest.mark.parametrize("key,reply", [(k, r) for k in ("qwen3", "glm46", "minimax_m2") for r in (_EMPTY, _TWO)]
                         + [("deepseek_v31", _EMPTY), ("qwen3", _BARE2), ("glm46", _BARE2)])
def test_a_quoted_think_tag_a_template_cuts_at_is_never_trained_rewritten(root, key, reply):
    """Qwen3, GLM, MiniMax-M2, DeepSeek-V3.1 cut a reply's content at its first / last `</think>`: a reply quoting the
    tag trained `<think>\\n\\n</think>\\n\\n in the logs.` (text lost, a made-up think block), uncounted, since the
    span check compared only the part past the last `</think>`. Now the turn is counted, its reason named; alone in
    a row, the row is refused in one line."""
    enc = encoder(root, key)
    got, stats = spans(enc, [ASK, {"role": "assistant", "content": reply},
                             {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Fine."}])
    assert stats["untrained_turns"] == 1 and "holds `</think>` that is not a leading think block" in stats["why"][0]
    assert got and all("Fine." in g for g in got), got
    with pytest.raises(RowError, match="holds `</think>` that is not a leading think block") as e:
        enc.encode({"messages": [ASK, {"role": "assistant", "content": reply}]})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["qwen25", "qwen3_coder"])
def test_a_quoted_think_tag_trains_whole_where_the_template_prints_the_content(root, key):
    """Templates that print the content verbatim with no place of their own for reasoning train such a reply whole
    (nothing refused that trained right)."""
    reply = "Use s.split('</think>')[-1] to drop it."
    got, stats = spans(encoder(root, key), [ASK, {"role": "assistant", "content": reply}])
    assert len(got) == 1 and reply in got[0] and stats["untrained_turns"] == 0, (got, stats)


@pytest.mark.parametrize("key", ["gpt_oss", "seed_oss", "apriel16"])
@pytest.mark.parametrize("reply", ["hmm apple\n</think>\n\napple river", "Use s.split('</think>')[-1] to drop it."])
def test_a_bare_close_is_refused_where_the_template_has_a_place_for_reasoning(root, key, reply):
    """A raw R1 completion (`reasoning</think>answer`: R1's generation prompt opens the block) on gpt-oss, Seed-OSS,
    Apriel-1.6 trained as answer text (`<|channel|>final<|message|>hmm apple\n</think>...`) where it was refused as a
    think block; it cannot be told from a quoted tag: refused, naming both fixes. The same text with the reasoning
    in its field, or a leading think block, reads as before."""
    enc = encoder(root, key)
    with pytest.raises(RowError, match=r"no `<think>` before it, .*write it otherwise .*thinking \(or "
                                       r"reasoning_content\) field$") as e:
        enc.encode({"messages": [ASK, {"role": "assistant", "content": reply}]})
    assert "\n" not in str(e.value)
    if key != "apriel16":  # (Apriel-1.6's last reply with reasoning is located with none: its prompt differs)
        got, _ = spans(enc, [ASK, {"role": "assistant", "content": reply, "reasoning_content": "Quote it."}])
        assert reply in got[0], got
    with pytest.raises(RowError, match="in a place of its own, and the content's think block as answer text"):
        enc.encode({"messages": [ASK, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nriver"}]})


def test_reasoning_before_a_bare_close_still_trains_where_the_prompt_opens_the_block(root):
    """Nemotron Nano v2's generation prompt opens the block: `reasoning</think>answer` is its form, trained whole."""
    got, stats = spans(encoder(root, "nemotron_nano2"),
                       [ASK, {"role": "assistant", "content": "Two words.\n</think>\n\napple river"}])
    assert got == ["Two words.\n</think>\n\napple river\n<SPECIAL_12>"] and not stats["untrained_turns"], got


@pytest.mark.parametrize("key,eos", [("gemma3", "<eos>"), ("phi3", "<|endoftext|>"), ("qwen25", "<|endoftext|>"),
                                     ("llama31", "<|end_of_text|>")])
def test_the_eos_written_in_a_reply_is_not_trained_without_a_generation_config(root, key, eos):
    """A tokenizer folder without generation_config.json (tokenizer.save_pretrained writes none): only the
    end-of-turn's text was checked, so `<eos>` / `<|endoftext|>` quoted in a reply trained as a mid-reply stop."""
    enc = encoder(root, key)
    conv = [{"role": "user", "content": "How does GPT-2 end a text?"}, {"role": "assistant", "content": f"With `{eos}`."},
            {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Fine."}]
    got, stats = spans(enc, conv)
    assert stats["untrained_turns"] == 1 and eos in stats["why"][0] and not any(eos in g for g in got), (got, stats)


@pytest.mark.parametrize("key,tag,end", [("qwen15", "<|im_start|>", "<|im_end|>"), ("apriel16", "<|begin_user|>",
                                                                                    "\n<|end|>")])
def test_a_reply_ending_in_a_control_tokens_text_trains_with_its_stop(root, key, tag, end):
    """Qwen1.5 / Apriel-1.6 write a reply's end-of-turn only when a message follows; a reply whose text ends with a
    control token's string took the path that ends a reply after its last control token: trained with no stop."""
    conv = [{"role": "user", "content": "Which token opens a turn?"}, {"role": "assistant", "content": f"It is {tag}"},
            {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "fine"}]
    got, _ = spans(encoder(root, key), conv)
    assert got[0] == f"It is {tag}{end}", got


_PHI3V = ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n'}}{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
          "{{ message['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}{{- '<|assistant|>\\n' -}}{% endif %}")


@pytest.mark.parametrize("key", ["qwen15", "apriel16", "phi3v"])
def test_two_replies_in_a_row_train_without_the_second_ones_header(root, key):
    """Qwen1.5, Apriel-1.6 and Phi-3-vision write no generation prompt after an assistant message: the second of two
    replies in a row was found at the first one's end and trained with its header (`<|im_start|>assistant\\n`) as
    text, uncounted. Checked against Hugging Face's assistant mask of the marked template (the sweep's oracle)."""
    from data.chat_sweep import marked

    fam = families()["phi3" if key == "phi3v" else key]
    tok = Tokenizer(build_tokenizer(root, "phi3" if key == "phi3v" else key, fam))
    oracle = _PHI3V if key == "phi3v" else marked(fam)
    if key == "phi3v":  # microsoft/Phi-3-vision-128k-instruct's template (the markers taken out)
        tok.hf.chat_template = _PHI3V.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    conv = [{"role": "user", "content": "Say exactly: apple river"}, {"role": "assistant", "content": "apple"},
            {"role": "assistant", "content": "river"}, {"role": "user", "content": "Count them."},
            {"role": "assistant", "content": "2 words"}]
    assert check(ChatEncoder(tok, "assistant"), oracle, conv) == "trains"


@pytest.mark.parametrize("key,second", [("qwen15", {"content": "<think>\nhmm\n</think>\n\nriver"}),
                                        ("apriel16", {"content": "river", "reasoning_content": "hmm"})])
def test_two_replies_in_a_row_the_second_with_reasoning_train_it(root, key, second):
    """The second of two replies in a row carrying reasoning the template prints before its answer (Qwen1.5's content
    think block verbatim, Apriel-1.6's reasoning_content): the header's end was looked for right before the answer,
    so the turn went untrained (counted). Now it starts at the reasoning, without the header."""
    conv = [{"role": "user", "content": "Say exactly: apple river"}, {"role": "assistant", "content": "apple"},
            {"role": "assistant", **second}]
    got, stats = spans(encoder(root, key), conv)
    assert not stats["untrained_turns"] and "hmm" in got[-1] and "river" in got[-1], (got, stats)
    assert "assistant" not in got[-1], got
