"""Chat-template families as their models ship them, over a small local tokenizer (no network).

The templates are the `chat_template` strings of the models' tokenizer_config.json (checked against copies of
those files in public repositories): Meta-Llama-3-8B-Instruct, Qwen2.5-*-Instruct, Mistral-7B-Instruct-v0.3
(its tool-call branches left out: they render only for `tools` / `tool_calls`, which these tests do not send),
gemma-2-*-it, SmolLM2-*-Instruct, Phi-3-mini-instruct (an EOS after the last message), and a Qwen3-style template
whose last reply always carries a (possibly empty) think block and whose earlier replies drop theirs. Every family
users fine-tune, through templates written here: data/chat_templates/ and data/chat_sweep.py. The tokenizer is a
byte-level BPE trained in a second on a few sentences, with each family's control tokens as single special tokens,
as in the real vocabularies: merges across a header's end and a reply's start happen as they do in the real ones.
"""

from __future__ import annotations

import os

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 "
          "== 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- for message in loop_messages | rejectattr("role", "equalto", "tool") | rejectattr("role", "equalto", "tool_results") | selectattr("tool_calls", "undefined") %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
           " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt"
           " %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Qwen3's rule for reasoning, reduced to it: replies after the last user turn carry a think block (empty when the
# message has no reasoning_content), earlier replies do not (the template rewrites history).
QWEN3_THINK = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = message.reasoning_content or '' %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + message.content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# TRL-style: the same ChatML layout with generation markers around the reply and its end-of-turn
CHATML_MARKERS = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
                  "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
                  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Phi-3 / 3.5-mini-instruct's layout: an EOS after the last message when no generation prompt is asked, so a turn
# rendered alone ends differently from the same turn inside the conversation
PHI3 = ("{% for message in messages %}{% if message['role'] in ('system', 'user', 'assistant') and message['content'] %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

# Qwen1.5-Chat's shape: no <|im_end|> after the last message (without a generation prompt)
QWEN15_SHAPE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                "{% if not loop.last or add_generation_prompt %}{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
FAMILIES = {  # name: (template, bos, eos, end-of-turn token)
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "qwen25": (QWEN25, None, "<|im_end|>", "<|im_end|>"),
    "mistral": (MISTRAL, "<s>", "</s>", "</s>"),
    "gemma": (GEMMA, "<bos>", "<eos>", "<end_of_turn>"),
    "smollm2": (SMOLLM2, None, "<|im_end|>", "<|im_end|>"),
    "qwen3": (QWEN3_THINK, None, "<|im_end|>", "<|im_end|>"),
    "markers": (CHATML_MARKERS, None, "<|im_end|>", "<|im_end|>"),
    "phi3": (PHI3, "<s>", "<|endoftext|>", "<|end|>"),
    "none": (None, None, "</s>", "</s>"),
}
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
           "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>",
           "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|endoftext|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. Hello there, how are you today?",
          "Repeat these words: apple river candle forest mirror. Reverse the list. Count them.",
          "You are a helpful assistant. system user assistant model tool think answer question.",
          "<think> </think> The capital of France is Paris. 12345 67890 yes no maybe."] * 20


def build_tokenizer(root: str, family: str) -> str:
    """A Hugging Face tokenizer folder under `root` with `family`'s template and control tokens; its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, bos, eos, _ = FAMILIES[family]
    out = os.path.join(root, family)
    if os.path.isdir(out):
        return out
    os.makedirs(root, exist_ok=True)
    base = os.path.join(root, "_bpe.json")
    if not os.path.exists(base):
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        t.save(base)
    tok = PreTrainedTokenizerFast(tokenizer_file=base, bos_token=bos, eos_token=eos, pad_token="<pad>")
    if template:
        tok.chat_template = template
    tok.save_pretrained(out)
    return out
