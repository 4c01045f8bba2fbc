"""Tokenizers, chat templates and tiny targets built in the tests (nothing from a hub).

The tokenizer is byte-level with no merges: every byte is one token and the template markers
are atomic added tokens, so the reference masks of the tests can be computed by tokenizing
hand-written pieces separately (their concatenation tokenizes the same), and any generated
ASCII text round-trips through decode/encode exactly.
"""

from __future__ import annotations

from pathlib import Path

from conftest import make_tiny_target

# Qwen3's published chat template (tool calls, reasoning_content, enable_thinking; it strips the
# reasoning of turns before the last user query: a template that rewrites history).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Meta-Llama-3-8B-Instruct's published chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# ChatML with {% generation %} markers (the form transformers documents for assistant masks).
GENERATION_TEMPLATE = r"""{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- generation %}
{{- message.content + '<|im_end|>' }}
{%- endgeneration %}
{{- '\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(PLAIN_ADDED)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def make_tokenizer(path: Path, template: str, eos: str = "<|im_end|>"):
    """A byte-level tokenizer (token id = byte value, then the added tokens) saved to `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, bos_token="<|begin_of_text|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = template
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(path)
    return tok


def pieces_reference(tok, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Tokens and mask of hand-written (text, supervised) pieces, each tokenized on its own."""
    ids, mask = [], []
    for text, flag in pieces:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [flag] * len(t)
    return ids, mask


def make_chat_target(path: Path, template: str, *, eos: str = "<|im_end|>", seed: int = 0,
                     layers: int = 2) -> Path:
    """A random-init tiny Llama target with the byte tokenizer, saved to `path`.

    Its generation_config suppresses every token but printable ASCII, newline and the EOS, so
    greedy generations decode to text that re-tokenizes to the same ids (the server's text
    path must round-trip) and stop at the EOS or the length cap.
    """
    from transformers import GenerationConfig

    tok = make_tokenizer(path, template, eos=eos)
    eos_id = tok.eos_token_id
    allowed = set(range(32, 127)) | {10, eos_id}
    generation = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        suppress_tokens=[i for i in range(VOCAB_SIZE) if i not in allowed], do_sample=False,
    )
    return make_tiny_target(path, family="llama", hidden=32, layers=layers, vocab=VOCAB_SIZE, heads=4, kv_heads=2,
                            head_dim=8, max_positions=1024, seed=seed, generation_config=generation,
                            eos_token_id=eos_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
