"""dflash-prepare's loss masks against references built from hand-written pieces of each template's output."""

from __future__ import annotations

import json

import pytest
from chat_utils import (
    GENERATION_TEMPLATE,
    LLAMA3_TEMPLATE,
    QWEN3_TEMPLATE,
    make_tokenizer,
    pieces_reference,
)
from click.testing import CliRunner
from conftest import read_jsonl, write_jsonl
from dflash.prepare.cli import main as prepare_main

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
    {"role": "user", "content": "Use calc."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": json.dumps({"x": 1})}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "It is 4."},
]
PLAIN_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "One?"},
    {"role": "assistant", "content": "Two."},
    {"role": "user", "content": "Three?"},
    {"role": "assistant", "content": "Four."},
]


def run_prepare(tmp_path, template, records, *args, eos="<|im_end|>", expect_ok=True):
    tok_dir = tmp_path / "tok"
    tok = make_tokenizer(tok_dir, template, eos=eos)
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "prepared.jsonl"
    result = CliRunner().invoke(prepare_main, ["--target-model", str(tok_dir), "--data", str(data),
                                               "--output", str(out), "--no-progress", *args])
    if expect_ok:
        assert result.exit_code == 0, result.output
        return tok, read_jsonl(out), result
    return tok, None, result


def qwen3_system_with_tools() -> str:
    tools = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in TOOLS)
    return ("<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist "
            "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>{tools}\n</tools>\n\nFor each function call, return a json object with function "
            "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
            "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")


def test_qwen3_tool_conversation_masks_every_assistant_turn_as_rendered(tmp_path):
    tok, recs, _ = run_prepare(tmp_path, QWEN3_TEMPLATE, [{"id": "a", "messages": TOOL_CONVERSATION, "tools": TOOLS}])
    ids, mask = pieces_reference(tok, [
        (qwen3_system_with_tools(), 0),
        ("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello.<|im_end|>", 1),  # earlier reasoning is stripped by the template: the turn as rendered
        ("\n<|im_start|>user\nUse calc.<|im_end|>\n<|im_start|>assistant\n", 0),
        ('<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call><|im_end|>', 1),
        ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\n", 0),  # the template's empty reasoning block: not supervised
        ("It is 4.<|im_end|>", 1),
    ])
    assert recs == [{"id": "a", "input_ids": ids, "loss_mask": mask}]


def test_qwen3_empty_reasoning_block_is_supervised_when_asked(tmp_path):
    conv = PLAIN_CONVERSATION[1:3]
    tok, recs, _ = run_prepare(tmp_path, QWEN3_TEMPLATE, [{"messages": conv}], "--supervise-empty-reasoning")
    ids, mask = pieces_reference(tok, [
        ("<|im_start|>user\nOne?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\n\n</think>\n\nTwo.<|im_end|>", 1),
    ])
    assert recs[0]["input_ids"] == ids and recs[0]["loss_mask"] == mask
    assert recs[0]["id"] == "chat.jsonl:1"


@pytest.mark.parametrize("loss_on", ["all-assistant", "last-assistant"])
def test_qwen3_thinking_off_puts_the_empty_block_in_the_prompt(tmp_path, loss_on):
    # The generation prompt of every turn ends with the empty think block, which the template
    # drops from past turns: the first answer starts right after its header in the history.
    tok, recs, _ = run_prepare(tmp_path, QWEN3_TEMPLATE, [{"messages": PLAIN_CONVERSATION}],
                               "--thinking", "off", "--loss-on", loss_on)
    ids, mask = pieces_reference(tok, [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOne?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("Two.<|im_end|>", int(loss_on == "all-assistant")),
        ("\n<|im_start|>user\nThree?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),
        ("Four.<|im_end|>", 1),
    ])
    assert recs[0]["input_ids"] == ids and recs[0]["loss_mask"] == mask
    meta = json.loads((tmp_path / "prepared.jsonl.meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"enable_thinking": False}
    assert meta["loss_on"] == loss_on
    import hashlib

    assert meta["chat_template_sha256"] == hashlib.sha256(QWEN3_TEMPLATE.encode()).hexdigest()


def test_qwen3_explicit_reasoning_of_the_last_turn_is_supervised(tmp_path):
    conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "think hard"}]
    tok, recs, _ = run_prepare(tmp_path, QWEN3_TEMPLATE, [{"messages": conv}])
    ids, mask = pieces_reference(tok, [
        ("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\nthink hard\n</think>\n\nA<|im_end|>", 1),
    ])
    assert recs[0]["input_ids"] == ids and recs[0]["loss_mask"] == mask


@pytest.mark.parametrize("loss_on", ["all-assistant", "last-assistant"])
def test_llama3_multi_turn_with_system_prompt(tmp_path, loss_on):
    tok, recs, _ = run_prepare(tmp_path, LLAMA3_TEMPLATE, [{"messages": PLAIN_CONVERSATION}],
                               "--loss-on", loss_on, eos="<|eot_id|>")
    first = 1 if loss_on == "all-assistant" else 0
    ids, mask = pieces_reference(tok, [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nOne?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("Two.<|eot_id|>", first),
        ("<|start_header_id|>user<|end_header_id|>\n\nThree?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("Four.<|eot_id|>", 1),
    ])
    assert recs[0]["input_ids"] == ids and recs[0]["loss_mask"] == mask


@pytest.mark.parametrize("loss_on", ["all-assistant", "last-assistant"])
def test_generation_markers_give_the_templates_own_mask(tmp_path, loss_on):
    tok, recs, _ = run_prepare(tmp_path, GENERATION_TEMPLATE, [{"messages": PLAIN_CONVERSATION}], "--loss-on", loss_on)
    first = 1 if loss_on == "all-assistant" else 0
    ids, mask = pieces_reference(tok, [
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOne?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Two.<|im_end|>", first),
        ("\n<|im_start|>user\nThree?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Four.<|im_end|>", 1),
    ])
    assert recs[0]["input_ids"] == ids and recs[0]["loss_mask"] == mask
    meta = json.loads((tmp_path / "prepared.jsonl.meta.json").read_text())
    assert meta["template_generation_mask"] is True


# A template that rewrites what came before once more turns follow (here: a running count in
# user questions in the system header), so no prefix rendering matches the whole conversation.
COUNTING_TEMPLATE = (
    "{{- '<|im_start|>system\\nquestions: ' + (messages|selectattr('role', 'equalto', 'user')|list|length)|string + '<|im_end|>\\n' }}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_history_rewriting_template_is_refused_naming_the_sample(tmp_path):
    good = {"id": "ok", "messages": PLAIN_CONVERSATION[1:3]}
    bad = {"id": "multi", "messages": PLAIN_CONVERSATION[1:]}
    _, _, result = run_prepare(tmp_path, COUNTING_TEMPLATE, [good, bad], expect_ok=False)
    assert result.exit_code == 2
    assert "chat.jsonl, line 2 (id multi)" in result.output and "assistant turn 1" in result.output
    assert not (tmp_path / "prepared.jsonl").exists()  # nothing half-written


def test_refused_and_bad_records_are_counted_with_skip_bad(tmp_path):
    tok_dir = tmp_path / "tok"
    make_tokenizer(tok_dir, QWEN3_TEMPLATE)
    records = [
        {"id": "r0", "messages": PLAIN_CONVERSATION},
        {"id": "r1", "messages": [{"role": "user", "content": "no answer"}]},  # empty: nothing to supervise
        {"id": "r2", "messages": [{"role": "wizard", "content": "x"}]},  # bad role
        {"id": "r3", "messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]},
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    with open(data, "a") as f:
        f.write("{not json\n")
    out = tmp_path / "p.jsonl"
    args = ["--target-model", str(tok_dir), "--data", str(data), "--output", str(out), "--no-progress",
            "--max-seq-len", "200"]
    stopped = CliRunner().invoke(prepare_main, args)
    assert stopped.exit_code == 2 and "chat.jsonl, line 3" in stopped.output and "wizard" in stopped.output
    result = CliRunner().invoke(prepare_main, args + ["--skip-bad"])
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in read_jsonl(out)] == ["r0"]
    stats = json.loads((tmp_path / "p.jsonl.meta.json").read_text())["stats"]
    assert stats["records"] == 5 and stats["written"] == 1
    assert stats["skipped"] == {"empty": 1, "bad_record": 2, "long": 1}
    assert "line 5" in result.output and "skipped" in result.output


def test_an_opening_assistant_greeting_is_context_not_supervised(tmp_path):
    conv = [{"role": "assistant", "content": "Hello!"}, *PLAIN_CONVERSATION[1:3]]
    tok, recs, _ = run_prepare(tmp_path, LLAMA3_TEMPLATE, [{"messages": conv}], eos="<|eot_id|>")
    ids, mask = pieces_reference(tok, [
        ("<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nOne?<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n", 0),
        ("Two.<|eot_id|>", 1),
    ])
    assert recs[0]["input_ids"] == ids and recs[0]["loss_mask"] == mask
