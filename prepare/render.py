"""Rendering a conversation through the target's chat template, with assistant-only loss masks.

A mask is derived from renderings of prefixes of the conversation, never from searching the
text for role markers:
- the prompt of assistant turn i is the rendering of messages[:i] with the generation prompt;
  it must be a token prefix of the whole rendering (the tokens the model saw before it spoke),
  or differ from it only inside the generation prompt (a template that drops its empty think
  block from past turns; the turn then starts where the two part); otherwise the sample is
  refused with the turn named;
- the turn ends where the rendering of messages[:i+1] ends, when that rendering is a token
  prefix of the whole; a template that rewrites a turn once later turns follow (Qwen3 drops the
  reasoning of earlier turns) makes it not one, and the turn then ends at its first end-of-turn
  token (the target's EOS ids) in the whole rendering, or the sample is refused;
- inside a turn, the supervised tokens end at the end-of-turn token: what the template appends
  after it (a newline) is glue the model never generates;
- a template with `{% generation %}` markers supplies its own assistant mask, which is used
  (restricted to the last turn under --loss-on last-assistant);
- an empty reasoning block the template inserts into a turn without reasoning
  (`<think>\\n\\n</think>\\n\\n`) is not supervised unless asked.
The rendering is cut after the last supervised token, so a record is exactly the sequence the
target produces at serving: prompt + its answer + its end-of-turn token.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding

from .formats import Conversation

LOSS_ON = ("all-assistant", "last-assistant")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
THINK_PAIRS = (("<think>", "</think>"), ("<thinking>", "</thinking>"))


class RenderError(InputError):
    """A conversation cannot be rendered with a correct mask; its finding is the reason."""


class EmptySampleError(RenderError):
    """The conversation has nothing to supervise (no assistant turn, or it renders to none)."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    prompt_len: int  # tokens before the last supervised turn


def load_chat_template(path: str | Path) -> str:
    """A template file: Jinja text, or a tokenizer_config/chat_template JSON holding one."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(Finding("prepare.template-unreadable", file=str(p), error=str(e))) from e
    if p.suffix == ".json":
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(Finding("prepare.template-json", file=str(p), error=str(e))) from e
        text = data.get("chat_template") if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise InputError(Finding("prepare.template-json-without-template", file=str(p)))
    return text


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def end_of_turn_ids(tokenizer: Any, model_dir: str | Path | None = None) -> set[int]:
    """The target's EOS ids: the tokenizer's, and those of generation_config.json."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        except (OSError, ValueError):
            pass
    return ids


class ChatRenderer:
    """Renders conversations with one tokenizer, template and kwargs; see the module docstring."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None,
                 loss_on: str = "all-assistant", supervise_empty_reasoning: bool = False,
                 eos_ids: set[int] | None = None):
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, not {loss_on!r}")
        template = chat_template or tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise InputError(Finding("prepare.tokenizer-without-template"))
        self.tokenizer = tokenizer
        self.template = template
        self.kwargs = dict(chat_template_kwargs or {})
        self.loss_on = loss_on
        self.supervise_empty_reasoning = supervise_empty_reasoning
        self.eos_ids = set(eos_ids) if eos_ids else end_of_turn_ids(tokenizer)
        self.has_generation_mask = bool(GENERATION_TAG.search(template))
        vocab = tokenizer.get_vocab()
        self.think_ids = next(((vocab[a], vocab[b]) for a, b in THINK_PAIRS if a in vocab and b in vocab), None)

    def with_loss_on(self, loss_on: str) -> ChatRenderer:
        """The same renderer supervising other turns."""
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, not {loss_on!r}")
        clone = copy.copy(self)
        clone.loss_on = loss_on
        return clone

    @property
    def sha256(self) -> str:
        return template_sha256(self.template)

    def meta(self) -> dict[str, Any]:
        """What a prepared file records about its rendering (the extractor copies it)."""
        return {"chat_template_sha256": self.sha256, "chat_template_kwargs": self.kwargs,
                "loss_on": self.loss_on, "supervise_empty_reasoning": self.supervise_empty_reasoning,
                "template_generation_mask": self.has_generation_mask}

    # -- rendering -------------------------------------------------------------------------
    def render_text(self, messages: list[dict], tools: list | None, *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.kwargs,
            )
        except Exception as e:  # jinja2 errors (raise_exception in templates), bad message shapes
            raise RenderError(Finding("prepare.template-failed", error=f"{type(e).__name__}: {e}")) from None

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The tokens the target sees before answering after `messages` (generation prompt on)."""
        return self.tokenize(self.render_text(messages, tools, add_generation_prompt=True))

    def render(self, conv: Conversation) -> Rendered:
        """input_ids and loss_mask of a conversation; raises RenderError with the reason."""
        turns = conv.assistant_turns()
        if not turns:
            raise EmptySampleError(Finding("prepare.sample-without-assistant"))
        # An opening assistant message (a greeting) answers no prompt: it is context, never supervised.
        supervised = [i for i in (turns if self.loss_on == "all-assistant" else turns[-1:]) if i > 0]
        if not supervised:
            raise EmptySampleError(Finding("prepare.sample-assistant-opens"))
        msgs = conv.messages[: supervised[-1] + 1]
        full = self.tokenize(self.render_text(msgs, conv.tools, add_generation_prompt=False))
        mask = np.zeros(len(full), np.uint8)
        if self.has_generation_mask:
            mask[:] = self._template_mask(msgs, conv.tools, full)
        starts = []
        for t, i in enumerate(supervised):
            start = self._prompt_len(msgs, conv.tools, i, full, t)
            starts.append(start)
            if self.has_generation_mask:
                continue
            end = self._turn_end(msgs, conv.tools, i, full, start, t)
            mask[start:end] = 1
        if self.has_generation_mask and self.loss_on == "last-assistant":
            mask[: starts[-1]] = 0
        for i, start in zip(supervised, starts):
            if not self.supervise_empty_reasoning and not _has_reasoning(msgs[i]):
                self._unmask_empty_reasoning(full, mask, start)
        if not mask.any():
            raise EmptySampleError(Finding("prepare.sample-nothing-supervised"))
        last = int(np.flatnonzero(mask)[-1]) + 1
        return Rendered(input_ids=full[:last], loss_mask=mask[:last].tolist(), prompt_len=starts[-1])

    def _prompt_len(self, msgs, tools, i: int, full: list[int], t: int) -> int:
        """Where assistant turn i starts in the whole rendering (see the module docstring)."""
        prompt = self.prompt_ids(msgs[:i], tools)
        if full[: len(prompt)] == prompt:
            return len(prompt)
        # Once the turn is history, some templates drop part of their generation prompt (Qwen3's
        # empty think block under enable_thinking=False): the turn then starts where the two
        # renderings part, provided the history before the generation prompt is unchanged.
        at = _first_difference(prompt, full)
        history = self.tokenize(self.render_text(msgs[:i], tools, add_generation_prompt=False))
        if full[: len(history)] == history and at >= len(history):
            return at
        raise RenderError(Finding("prepare.template-rewrites-history", turn=t + 1, message=i, token=at))

    def _turn_end(self, msgs, tools, i: int, full: list[int], start: int, t: int) -> int:
        through = self.tokenize(self.render_text(msgs[: i + 1], tools, add_generation_prompt=False))
        if full[: len(through)] == through:
            end = len(through)
        else:  # the template rewrites this turn once later turns follow: find its end-of-turn token
            end = len(full)
        for k in range(start, end):
            if full[k] in self.eos_ids:
                return k + 1
        if end == len(through):
            return end
        raise RenderError(Finding("prepare.template-rewrites-turn", turn=t + 1, message=i))

    def _template_mask(self, msgs, tools, full: list[int]) -> np.ndarray:
        try:
            out = self.tokenizer.apply_chat_template(
                msgs, tools=tools, chat_template=self.template, tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True, add_generation_prompt=False, **self.kwargs,
            )
        except Exception as e:
            raise RenderError(Finding("prepare.template-mask-failed", error=f"{type(e).__name__}: {e}")) from None
        ids, amask = list(out["input_ids"]), out["assistant_masks"]
        if ids != full:
            raise RenderError(Finding("prepare.template-mask-tokens"))
        return np.asarray(amask, np.uint8)

    def _unmask_empty_reasoning(self, full: list[int], mask: np.ndarray, start: int) -> None:
        """Unmask `<think>` whitespace `</think>` whitespace at the start of a turn (template-inserted)."""
        if self.think_ids is None:
            return
        open_id, close_id = self.think_ids
        k = start
        while k < len(full) and not mask[k]:  # the block may follow unsupervised prompt glue
            k += 1
        if k >= len(full) or full[k] != open_id:
            return
        try:
            close = full.index(close_id, k + 1)
        except ValueError:
            return
        if self.tokenizer.decode(full[k + 1: close]).strip():
            return  # real reasoning inside: not the template's empty block
        end = close + 1
        while end < len(full) and mask[end] and full[end] not in self.eos_ids \
                and not self.tokenizer.decode([full[end]]).strip():
            end += 1
        mask[k:end] = 0


def _has_reasoning(message: dict) -> bool:
    if any(message.get(k) for k in REASONING_KEYS):
        return True
    content = message.get("content")
    return isinstance(content, str) and any(a in content for a, _ in THINK_PAIRS)


def _first_difference(a: list[int], b: list[int]) -> int:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))
