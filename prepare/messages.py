"""What dflash.prepare tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here.

A record's or a rendering's problem (`prepare.record-*`, `prepare.template-*`, `prepare.sample-*`)
is a clause that the finding naming its record (`prepare.bad-record`, `prepare.render-refused`)
holds in its `problem` field and places after the record's file and line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dflash.runtime.findings import Finding, renders

_CHAT_FILES = "*.jsonl, *.jsonl.gz, *.json.gz, *.parquet and .json files of JSON Lines"


def _listed(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


# -- input files ---------------------------------------------------------------------------

@renders("prepare.data-missing", example=dict(file="chat.jsonl"))
def _data_missing(file):
    return f"Input data {file} does not exist. Pass a JSONL/Parquet file or a directory of them with --data."


@renders("prepare.data-files-left-out", example=dict(dir="data", files=["README.txt", "config.json"]))
def _data_files_left_out(dir, files):
    return (f"the scan of {dir} reads {_CHAT_FILES}, and left out {len(files)} other "
            f"file{'s' if len(files) > 1 else ''}: {_listed(files)}. Convert one to JSON Lines (or Parquet) if it is data.")


@renders("prepare.data-no-chat-files", example=dict(dir="data", files=["notes.txt"]))
def _data_no_chat_files(dir, files):
    held = f": it holds {', '.join(files)}" if files else ""
    return f"Input directory {dir} holds no chat files ({_CHAT_FILES}){held}. Check --data."


@renders("prepare.data-unreadable", example=dict(file="chat.jsonl.gz", error="Compressed file ended early"))
def _data_unreadable(file, error):
    return f"{file}: cannot read the file ({error}). Check that it is complete and readable."


@renders("prepare.parquet-needs-pyarrow", example=dict(file="chat.parquet"))
def _parquet_needs_pyarrow(file):
    return (f"{file} is a Parquet file, and reading Parquet needs pyarrow, which is not installed. Install it with "
            "`pip install 'dflash-pipeline[parquet]'` (or `pip install pyarrow`), or convert the file to JSONL.")


# -- a record's problem (a clause: prepare.bad-record places it) --------------------------

@renders("prepare.record-shape", example=dict(keys=["text"]))
def _record_shape(keys):
    return (f"cannot tell the record's shape from its keys {keys}: expected messages, conversations, or "
            "prompt/response (pass --format to force one)")


@renders("prepare.record-field-type", example=dict(field="messages", expected="a list of {role, content} objects"))
def _record_field_type(field, expected, type=None):
    return f"{field} must be {expected}" + (f", not {type}" if type else "")


@renders("prepare.record-role", example=dict(message=1, role="bot", roles=["system", "user", "assistant", "tool"]))
def _record_role(message, role, roles):
    return f"message {message} has role {role!r}; expected one of {', '.join(roles)}"


@renders("prepare.record-turn-role", example=dict(turn=2, role="narrator"))
def _record_turn_role(turn, role):
    if role is None:
        return f"conversation turn {turn} has no 'from'"
    return f"conversation turn {turn} is from {role!r}, which is not a known ShareGPT role"


@renders("prepare.record-tools-json", example={})
def _record_tools_json():
    return "tools is a string but not valid JSON"


@renders("prepare.record-no-prompt", example={})
def _record_no_prompt():
    return "the record has no prompt (or instruction, question)"


@renders("prepare.record-json", example=dict(error="Expecting value: line 1 column 1 (char 0)"))
def _record_json(error):
    return f"the line is not valid JSON ({error})"


@renders("prepare.bad-record", example=dict(where="chat.jsonl, line 3", problem=Finding("prepare.record-no-prompt"),
                                            command="dflash-prepare"))
def _bad_record(where, problem, command):
    if command == "dflash-generate":
        return f"{where}: {problem}. Fix the record (dflash-prepare --skip-bad lists them all)."
    return f"{where}: {problem}. Fix the record or pass --skip-bad to skip it."


@renders("prepare.duplicate-id", example=dict(where="chat.jsonl, line 9", id="a", first="chat.jsonl, line 2"))
def _duplicate_id(where, id, first):
    return f"{where}: id {id!r} was already used at {first}. Ids must be unique."


# -- rendering: a sample's problem (a clause: prepare.render-refused places it) -------------

@renders("prepare.template-failed", example=dict(error="TemplateError: no tools here"))
def _template_failed(error):
    return f"the chat template failed on it ({error})"


@renders("prepare.template-mask-failed", example=dict(error="TemplateError: generation tag"))
def _template_mask_failed(error):
    return f"the chat template's assistant mask failed ({error})"


@renders("prepare.template-mask-tokens", example={})
def _template_mask_tokens():
    return "the template's assistant mask comes with tokens other than the rendering's"


@renders("prepare.template-rewrites-history", example=dict(turn=1, message=1, token=12))
def _template_rewrites_history(turn, message, token):
    return (f"the chat template renders the conversation before assistant turn {turn} (message {message}) "
            f"differently from the same part of the whole conversation (they differ at token {token}), so no "
            "mask can say where that turn starts; use --loss-on last-assistant, or a template that does not "
            "rewrite history")


@renders("prepare.template-rewrites-turn", example=dict(turn=1, message=1))
def _template_rewrites_turn(turn, message):
    return (f"the chat template rewrites assistant turn {turn} (message {message}) once later turns follow, and "
            "no end-of-turn token of the target (EOS ids) closes it in the whole rendering; use --loss-on "
            "last-assistant for this data")


@renders("prepare.history-differs-from-prompt", example=dict(flag="--loss-on"))
def _history_differs_from_prompt(flag):
    return f"the conversation renders its history differently from the last turn's prompt; use {flag} last-assistant"


@renders("prepare.answer-not-round-trip", example=dict(through="the chat template"))
def _answer_not_round_trip(through=None):
    if through:
        return (f"{through} does not render the answer's text as its tokens right after the prompt (the answer "
                "does not round-trip through the template)")
    return "the answer's text does not re-tokenize to itself (decode(encode(text)) differs)"


@renders("prepare.sample-without-assistant", example={})
def _sample_without_assistant():
    return "it has no assistant turn (nothing to learn from)"


@renders("prepare.sample-assistant-opens", example={})
def _sample_assistant_opens():
    return "its only assistant turn opens the conversation (there is no prompt it answers)"


@renders("prepare.sample-nothing-supervised", example=dict(flag="--max-seq-len"))
def _sample_nothing_supervised(flag=None):
    if flag:
        return f"no supervised token within {flag}"
    return "its assistant turns render to no supervised token"


@renders("prepare.sample-too-long", example=dict(tokens=9000, flag="--max-seq-len", limit=8192))
def _sample_too_long(tokens, flag, limit):
    return f"{tokens} tokens > {flag} {limit}"


@renders("prepare.render-refused", example=dict(where="chat.jsonl, line 3", id="a",
                                                problem=Finding("prepare.template-mask-tokens")))
def _render_refused(where, id, problem):
    return f"{where} (id {id}): {problem}. Or pass --skip-bad to skip such samples."


@renders("prepare.no-usable-sample", example=dict(data="chat.jsonl", records=3, skipped={"empty": 3}))
def _no_usable_sample(data, records, skipped):
    return (f"No usable sample in {data} ({records} records; skipped: {skipped}). "
            "Check --data, --format and --max-seq-len.")


# -- settings, tokenizer, template files -----------------------------------------------------

@renders("prepare.flag-choice", example=dict(flag="--loss-on", value="some", choices=["all-assistant", "last-assistant"]))
def _flag_choice(flag, value, choices):
    return f"{flag} must be one of {', '.join(choices)}, not {value!r}."


@renders("prepare.flag-not-positive", example=dict(flag="--max-seq-len", value=0))
def _flag_not_positive(flag, value):
    return f"{flag} must be positive, not {value}."


@renders("prepare.template-kwargs-json", example=dict(error="Expecting value: line 1 column 1 (char 0)"))
def _template_kwargs_json(error):
    what = f"is not valid JSON ({error})" if error else "must be a JSON object"
    return f"--chat-template-kwargs {what}; write e.g. '{{\"enable_thinking\": false}}'."


@renders("prepare.target-model-not-dir", example=dict(dir="models/target"))
def _target_model_not_dir(dir):
    return (f"--target-model {dir} is not a local model directory. "
            "Pass the directory with the target's tokenizer files.")


@renders("prepare.tokenizer-unloadable", example=dict(dir="models/target", error="no tokenizer.json"))
def _tokenizer_unloadable(dir, error):
    return f"Cannot load the tokenizer of {dir} ({error}). Check the model directory."


@renders("prepare.target-config-unloadable", example=dict(dir="models/target", error="no config.json"))
def _target_config_unloadable(dir, error):
    return f"Cannot load the config of --target-model {dir} ({error}). Check the model directory."


@renders("prepare.tokenizer-without-template", example={})
def _tokenizer_without_template():
    return ("The target's tokenizer has no chat template. Pass one with --chat-template FILE "
            "(the Jinja the serving engine uses for this model).")


@renders("prepare.template-unreadable", example=dict(file="template.jinja", error="No such file or directory"))
def _template_unreadable(file, error):
    return f"Cannot read the chat template {file} ({error}). Check --chat-template."


@renders("prepare.template-json", example=dict(file="template.json", error="Expecting value"))
def _template_json(file, error):
    return f"{file} is not valid JSON ({error}); pass a .jinja file or a JSON with a chat_template key."


@renders("prepare.template-json-without-template", example=dict(file="tokenizer_config.json"))
def _template_json_without_template(file):
    return f"{file} has no chat_template string. Pass a Jinja file with --chat-template."


# -- dflash-generate -----------------------------------------------------------------------

@renders("prepare.greedy-samples", example=dict(samples=4, temperature=0.0))
def _greedy_samples(samples, temperature):
    return (f"--samples-per-prompt {samples} with --temperature {temperature:g} would write {samples} identical "
            "greedy answers per conversation, which teach the drafter nothing the first does not. Sample the extra "
            "answers with a temperature (e.g. --temperature 0.7, as the target is served), or keep "
            "--samples-per-prompt 1.")


@renders("prepare.loss-on-dataset-answers", example=dict(flag="--loss-on", value="all-assistant"))
def _loss_on_dataset_answers(flag, value):
    return f"{flag} {value} with --regenerate last also supervises the dataset's earlier answers, not the target's."


@renders("prepare.sample-id-clash", example=dict(id="a", other="a#1", samples=2, sample=1))
def _sample_id_clash(id, other, samples, sample):
    return (f"The dataset has records with the ids {id!r} and {other!r}: with --samples-per-prompt {samples} the "
            f"sample {sample} of {id!r} would get the id {other!r} too. Rename one of the two records (their id "
            "field), then rerun.")


@renders("prepare.output-line-unreadable", example=dict(file="gen.jsonl", line=7))
def _output_line_unreadable(file, line):
    return (f"{file}, line {line}: not a record of dflash-generate (no JSON object with an id, or a sample index "
            "that does not match its id). Point --output to a new file, or remove the line to resume.")


@renders("prepare.output-without-sidecar", example=dict(file="gen.jsonl"))
def _output_without_sidecar(file):
    name = Path(file).name
    return (f"{file} exists but has no sidecar {name}.meta.json: it was not written by dflash-generate (or its "
            "sidecar was lost), so its records cannot be counted as done. Choose a new --output, or move that "
            "file away to start again.")


@renders("prepare.output-other-settings", example=dict(file="gen.jsonl", settings={"chat_template_sha256": "ab12"}))
def _output_other_settings(file, settings):
    return (f"{file} was generated with other settings ({', '.join(settings)} differ: was {settings}). "
            "Rerun with those settings, or write to a new --output.")


def _model(identity: dict[str, Any], provenance: dict[str, Any] | None) -> str:
    provenance = provenance or {}
    if identity.get("backend") == "server":
        name = f"the model {identity['model']!r}" if identity.get("model") else "the default model (no --model)"
        return f"{name} of the server {', '.join(provenance.get('server') or ['?'])}"
    return f"the in-process model {provenance.get('target_path', '?')}"


def _short(value: Any) -> str:
    """A recorded value for a message (a sha256 cut to 12 digits)."""
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return value[:12]
    return repr(value)


@renders("prepare.output-other-model", example=dict(
    file="gen.jsonl", model={"backend": "server", "model": "a"}, provenance={"server": ["http://h:8000"]},
    this_model={"backend": "server", "model": "b"}, this_provenance={"server": ["http://h:8000"]},
    differences=[["model", "a", "b"]]))
def _output_other_model(file, model, provenance, this_model, this_provenance, differences):
    shown = "; ".join(f"{k}: the file's {_short(a)}, this run's {_short(b)}" for k, a, b in differences)
    name = Path(file).name
    return (f"{file} holds the answers of another model than this run's: they were written by "
            f"{_model(model, provenance)}, this run's is {_model(this_model, this_provenance)} ({shown}). "
            "Resuming would mix two models' answers in one file. Write to another --output, rerun with the model "
            f"that wrote it, or delete {file} (with its {name}.skipped.jsonl) to start anew.")


@renders("prepare.output-model-unrecorded", example=dict(file="gen.jsonl", model={"backend": "in-process"},
                                                         provenance={"target_path": "models/target"}))
def _output_model_unrecorded(file, model, provenance):
    return (f"The output {file} records no identity of the model that wrote its answers (written before it was "
            f"recorded): that {_model(model, provenance)} is the model that wrote them is not checked.")


@renders("prepare.served-model-unnamed", example=dict(file="gen.jsonl", flag="--model"))
def _served_model_unnamed(file, flag):
    return (f"No {flag} names the served model, now or when {file} was begun: that the server's model is the one "
            f"that wrote its answers is not checked (pass {flag} to have it checked).")


@renders("prepare.server-prompt-tokens", example=dict(where="chat.jsonl, line 3", id="a"))
def _server_prompt_tokens(where, id):
    return (f"{where} (id {id}): the server tokenized the prompt differently from the local chat template (the "
            "template, its kwargs or the tokenizer differ). Pass the template the server uses with --chat-template "
            "and the same --chat-template-kwargs / --thinking.")


@renders("prepare.request-retries-spent", example=dict(attempts=4, last="http://h:8000: timed out"))
def _request_retries_spent(attempts, last):
    return f"failed after {attempts} attempts; last error {last}"


@renders("prepare.server-http-error", example=dict(url="http://h:8000", status=400, detail="bad request"))
def _server_http_error(url, status, detail):
    return f"{url} answered HTTP {status}: {detail}"


@renders("prepare.server-no-choice", example=dict(url="http://h:8000", payload="{'error': 'x'}"))
def _server_no_choice(url, payload):
    return f"{url} answered without a choice: {payload}"


@renders("prepare.record-failed", example=dict(where="chat.jsonl, line 3", id="a", sample=1,
                                               problem=Finding("prepare.server-no-choice", url="http://h", payload="{}")))
def _record_failed(where, id, sample, problem):
    return f"{where} (id {id}" + (f", sample {sample}" if sample else "") + f"): {problem}"


@renders("prepare.batch-out-of-memory", example=dict(prompts=8, tokens=512, new_tokens=1024, device="cuda:0"))
def _batch_out_of_memory(prompts, tokens, new_tokens, device):
    return (f"A batch of {prompts} prompts of up to {tokens} tokens plus {new_tokens} new ones does not fit in the "
            f"memory of {device}. Lower --batch-size (or --max-tokens); the records written so far are kept and a "
            "rerun goes on from them.")


# -- the commands' contract (prepare/cli.py, generate_cli.py: runtime.cli's stop finding) -------


@renders("prepare.stopped", example=dict(command="dflash-prepare", signal="SIGINT"))
def _stopped(command, signal):
    return f"{command} stopped by {signal}; nothing was written (the output appears only when complete)."


@renders("prepare.generate-stopped", example=dict(command="dflash-generate", signal="SIGTERM"))
def _generate_stopped(command, signal):
    return f"{command} stopped by {signal}; every finished record is kept. Rerun the same command to go on."
