"""TRL's training templates (`tokenizer.chat_template = get_training_chat_template(tokenizer)`, trl/chat_templates/
*_training.jinja, TRL 1.16.0) mark with `{% generation %}` some of what the generation prompt writes: DeepSeek-R1-Distill's
`<｜Assistant｜>`, Qwen2.5's header `\\n`, Nemotron 3 Nano's `<think>`, SmolLM3's whole header. The marker path trained it
(the markers decided); the shipped templates, found by prefix renders, train the reply and its end alone. Now a marked
run starts no earlier than where the conversation leaves the generation prompt (data/chat_locate.prompt_cut): the same
ids get the same mask with and without markers. And gpt-oss's history `<|end|>` (an end generation never writes) is
left untrained on the marker path too (it was trained, uncounted). Fixture tokenizers of the sweep's families, no
network: ~2 s."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data.chat import ChatEncoder
from data.chat_sweep import MARKER, build_tokenizer, families, marked
from data.tokenizer import Tokenizer

# trl/chat_templates/deepseek_r1_distill_training.jinja (TRL 1.16.0, Apache-2.0) past its comment, verbatim: its
# generation prompt `<｜Assistant｜><think>\n`, each reply marked from its `<｜Assistant｜>`
R1_DISTILL_TRAINING = (
    r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"""
    r"""{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"""
    r"""{%- for message in messages %}{%- if message['role'] == 'system' %}"""
    r"""{% set ns.system_prompt = message['content'] %}{%- endif %}"""
    r"""{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"""
    r"""{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}"""
    r"""{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}"""
    r"""{%- set ns.is_tool = false -%}{%- generation %}{%- for tool in message['tool_calls']%}"""
    r"""{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"""
    r"""{%- set ns.is_first = true -%}"""
    r"""{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"""
    r"""{%- endif %}{%- endfor %}{%- endgeneration %}{%- endif %}"""
    r"""{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"""
    r"""{%- generation %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"""
    r"""{%- set ns.is_tool = false -%}{%- endgeneration %}{%- else %}"""
    r"""{%- generation %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endgeneration %}"""
    r"""{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"""
    r"""{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"""
    r"""{%- set ns.is_output_first = false %}"""
    r"""{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}"""
    r"""{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"""
    r"""{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}"""
)
U, A = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant", "content": t})
MULTI = [U("Say exactly: apple river"), A("apple river"), U("How many words?"), A("2 words")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trl_templates"))


def _pair(root: str, key: str, template: str) -> tuple[ChatEncoder, ChatEncoder]:
    """(the family's template as shipped, `template` over the same tokenizer) encoders."""
    path = build_tokenizer(root, key, families()[key])
    other = path + f"_{abs(hash(template))}"
    if not os.path.isdir(other):
        shutil.copytree(path, other)
    tok = Tokenizer(other)
    tok.hf.chat_template = template
    return ChatEncoder(Tokenizer(path)), ChatEncoder(tok)


def _runs(enc: ChatEncoder, ids: list[int], mask: np.ndarray) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [enc.tok.hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("row", [{"messages": MULTI}, {"prompt": MULTI[:1], "completion": MULTI[1:2]},
                                 {"prompt": MULTI[:3], "completion": MULTI[3:]}])
def test_a_marked_generation_prompt_is_not_trained(root, row):
    """TRL's deepseek_r1_distill_training.jinja marks `<｜Assistant｜>` + reply + EOS; its generation prompt is
    `<｜Assistant｜><think>\\n`, so marked_header (the whole prompt's text) never matched and `<｜Assistant｜>` was
    trained before every reply: now the same mask as the shipped template's, on a messages row and a prompt /
    completion one."""
    shipped, trl = _pair(root, "deepseek_r1", R1_DISTILL_TRAINING)
    assert (shipped.kind, trl.kind) == ("prefix", "markers")
    ids, mask, _ = shipped.encode(json.loads(json.dumps(row)))
    ids2, mask2, stats = trl.encode(json.loads(json.dumps(row)))
    assert ids2 == ids and stats["untrained_turns"] == 0
    assert not any(r.startswith("<｜Assistant｜>") for r in _runs(trl, ids2, mask2)), _runs(trl, ids2, mask2)
    assert mask2.tolist() == mask.tolist()


def test_reasoning_in_the_content_trains_past_the_prompts_think(root):
    """The shipped R1 template cuts a content's think block (refused: data/chat_reasoning.py); TRL's training one
    prints it whole, its `<think>\\n` the generation prompt's: the reasoning and the answer are trained, that not."""
    _, trl = _pair(root, "deepseek_r1", R1_DISTILL_TRAINING)
    ids, mask, _ = trl.encode({"messages": [U("Say"), A("<think>\nTwo words.\n</think>\n\napple river")]})
    assert _runs(trl, ids, mask) == ["Two words.\n</think>\n\napple river<｜end▁of▁sentence｜>"]


# A thinking ChatML template (Nemotron 3 Nano's shape): the generation prompt opens a think block
# (`<|im_start|>assistant\n<think>\n`; with enable_thinking false `<think></think>`), the history writes a reply
# without reasoning `<think></think>reply`. `@0`..`@3`: where a training template's `{% generation %}` may open.
THINKING = ("{% for m in messages %}{% if m.role == 'assistant' %}@0<|im_start|>assistant@1{{ '\n' }}@2<think></think>@3"
            "{{ m.content }}<|im_end|>@E{{ '\n' }}{% else %}<|im_start|>{{ m.role + '\n' + m.content }}<|im_end|>"
            "{{ '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{{ '\n' }}"
            "{% endif %}{% endif %}")


def _thinking(at: str | None) -> str:
    text = THINKING if at is None else THINKING.replace(at, "{% generation %}").replace("@E", "{% endgeneration %}")
    for m in ("@0", "@1", "@2", "@3", "@E"):
        text = text.replace(m, "")
    return text


@pytest.mark.parametrize("at", ["@0", "@1", "@2", "@3"])  # SmolLM3's whole header, Qwen2.5's `\n`, Nemotron 3 Nano's
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])  # `<think></think>`, the reply alone
def test_wherever_the_markers_open_the_reply_and_its_end_are_trained(root, at, kwargs):
    shipped, trl = _pair(root, "qwen3", _thinking(at))
    shipped.tok.hf.chat_template = _thinking(None)
    shipped = ChatEncoder(shipped.tok)
    assert (shipped.kind, trl.kind) == ("prefix", "markers")
    row = {"messages": MULTI + [U("And again?"), A("2 words")], **({"chat_template_kwargs": kwargs} if kwargs else {})}
    ids, mask, _ = shipped.encode(json.loads(json.dumps(row)))
    ids2, mask2, stats = trl.encode(json.loads(json.dumps(row)))
    assert ids2 == ids and stats["untrained_turns"] == 0
    assert _runs(trl, ids2, mask2) == ["apple river<|im_end|>", "2 words<|im_end|>", "2 words<|im_end|>"]
    assert mask2.tolist() == mask.tolist()


def test_an_end_only_the_history_writes_is_not_trained_on_the_marker_path(root):
    """gpt-oss as TRL marks it (gptoss_training.jinja: `{% generation %}` from `<|start|>assistant` through the end of
    each reply): the history's `<|end|>` after an earlier answer was trained and not counted (history_ends ran on the
    prefix path only; the header marked sent the row there, under the marker kind). Now the marker path takes the
    header off and the end too: the shipped template's mask, history_ends 1 both."""
    text = MARKER.sub("", marked(families()["gpt_oss"]))
    head = "{{- '<|start|>assistant' -}}\n        {%- set tail"
    tail = "{%- if tail.end -%}{{- '<|end|>' -}}{%- endif -%}"
    assert text.count(head) == 1 and text.count(tail) == 1
    trl_like = text.replace(head, "{% generation %}" + head).replace(tail, tail + "{% endgeneration %}")
    shipped, trl = _pair(root, "gpt_oss", trl_like)
    assert (shipped.kind, trl.kind) == ("prefix", "markers")
    ids, mask, stats = shipped.encode({"messages": MULTI})
    ids2, mask2, stats2 = trl.encode({"messages": MULTI})
    end = trl.tok.hf.convert_tokens_to_ids("<|end|>")
    assert ids2 == ids and end not in [i for i, m in zip(ids2, mask2) if m]
    assert mask2.tolist() == mask.tolist() and stats["history_ends"] == stats2["history_ends"] == 1


@pytest.mark.parametrize("key", ["glm46", "glm47"])
def test_glms_last_reply_trains_the_stop_its_history_writes(root, key, tmp_path):
    """GLM-4.5 / 4.6 / 4.7 end a reply with the next message's token (`<|user|>`, `<|observation|>` before a tool
    result), both stops of their generation config, and the last reply with nothing: a single-turn row trained no
    stop (every row of a one-turn dataset counted, the warning's fix, appending the token, refused as a control token
    in the content). TRL's glm4moe_training.jinja writes `<|user|>` after the last reply: now it is appended and
    trained, counted (appended_stops); the same ids under --loss_on all. Without a generation config saying
    `<|user|>` is a stop (nor is it the EOS): nothing appended, counted as before."""
    from data.chat_sweep import CASES

    path = build_tokenizer(root, key, families()[key])
    enc, user, obs = ChatEncoder(Tokenizer(path)), *Tokenizer(path).hf.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    rendered = enc.tok.encode(enc.tok.hf.apply_chat_template(MULTI[:2], tokenize=False))
    for conv, stop in ((MULTI[:2], user), (MULTI, user), (CASES["reasoning"][:2], user), (CASES["tool call"][:2], obs)):
        ids, mask, stats = enc.encode({"messages": conv})
        assert ids[-1] == stop and mask[-1] == 1 and mask[-2] == 1, _runs(enc, ids, mask)
        assert (stats["appended_stops"], stats["no_stop_rows"]) == (1, 0)
        assert ChatEncoder(enc.tok, loss_on="all").encode({"messages": conv})[0] == ids
    assert ids[:-1] == enc.tok.encode(enc.tok.hf.apply_chat_template(CASES["tool call"][:2], tokenize=False))
    assert enc.encode({"messages": MULTI[:2]})[0] == rendered + [user]
    from data.chat_stops import reply_stops

    assert reply_stops(path) == [user, obs]  # an export stops where the run trained it to (a base's config lacks them)
    bare = tmp_path / "no_generation_config"
    shutil.copytree(path, bare)
    os.remove(bare / "generation_config.json")
    ids, mask, stats = ChatEncoder(Tokenizer(str(bare))).encode({"messages": MULTI[:2]})
    assert ids == rendered and (stats["appended_stops"], stats["no_stop_rows"]) == (0, 1)


def test_the_preparation_counts_the_stops_it_appended(root, tmp_path):
    """prepare_data sums appended_stops in the manifest and says it in a note; no "never shown where to stop"."""
    from data.prepare_data import prepare

    src = tmp_path / "glm.jsonl"
    src.write_text(json.dumps({"messages": MULTI[:2]}) + "\n")
    lines = []
    manifest = prepare([str(src)], str(tmp_path / "out"), build_tokenizer(root, "glm46", families()["glm46"]),
                       workers=0, log=lines.append)
    assert (manifest["appended_stops"], manifest["no_stop_rows"]) == (1, 0)
    assert sum("appended after the last reply and trained" in x for x in lines) == 1, lines
    assert not any("never shown where to stop" in x for x in lines)
