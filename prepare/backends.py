"""The two ways dflash-generate asks the target for an answer, behind one interface.

`ServerBackend.complete(request)` sends one chat completion to an OpenAI-compatible server
(vLLM, SGLang, `transformers serve`), spreading requests over several URLs, retrying
connection errors, timeouts, 429 and 5xx with exponential backoff (on the next server).
`HFBackend.complete_batch(requests)` runs batched greedy or sampled `generate()` in-process
(left padding, KV cache), on prompts `HFBackend.render` tokenized beforehand (one batched
tokenizer call; the driver sorts by their lengths). Both return `Completion`s: the answer's
text, its token ids where known, why it ended.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dflash.runtime.errors import EnvironmentFault, MismatchError
from dflash.runtime.findings import Finding
from dflash.runtime.positions import target_positions
from dflash.runtime.safetensors_files import refuse_incomplete_weights


class RequestFailed(Exception):
    """A request failed for good (after its retries, or with an error a retry cannot fix);
    `finding` says how."""

    def __init__(self, finding: Finding):
        super().__init__(finding)
        self.finding = finding


class ServerMismatchError(MismatchError):
    """The server renders prompts with other tokens than the local chat template."""


@dataclass
class Request:
    messages: list[dict[str, Any]]
    tools: list | None = None
    prompt_ids: list[int] | None = None  # the local rendering, once the in-process backend made it
    sample: int = 0  # which of the conversation's --samples-per-prompt answers (its seed)


@dataclass
class Completion:
    text: str
    finish_reason: str  # stop | length | tool_calls | ...
    token_ids: list[int] | None = None  # the answer's ids, when the backend knows them
    prompt_token_ids: list[int] | None = None  # the prompt as the server tokenized it
    tool_calls: list | None = None
    reasoning_content: str | None = None
    local_prompt: bool = False  # prompt_token_ids is the local rendering itself (in-process backend)


@dataclass(kw_only=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 2048
    stop: list[str] | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The sampling seed of sample `sample`: --seed itself for sample 0, a 31-bit value derived
    from (seed, sample) for the others (one seed for every sample would make a seeded server
    draw the same answer N times); None stays None."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.sha256(f"dflash-generate sample seed {seed} {sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class ServerStats:
    requests: int = 0
    retries: int = 0
    errors: Counter = field(default_factory=Counter)  # "URL: reason" -> count
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, url: str, reason: str) -> None:
        with self.lock:
            self.errors[f"{url}: {reason}"] += 1


class ServerBackend:
    """Chat completions over HTTP; thread-safe (one call per worker thread)."""

    def __init__(self, urls: list[str], sampling: Sampling, *, model: str | None = None,
                 request_timeout: float = 600.0, max_retries: int = 5, backoff: float = 0.5,
                 token_ids: str = "auto"):
        self.urls = [u.rstrip("/") for u in urls]
        self.sampling = sampling
        self.model = model
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.token_ids = token_ids  # auto: ask for ids, fall back to text where refused; text; server
        self.text_only: set[str] = set() if token_ids != "text" else set(self.urls)
        self.stats = ServerStats()
        self._next = itertools.count()

    def body(self, request: Request, url: str) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {"messages": _wire_messages(request.messages), "max_tokens": s.max_tokens,
                                "temperature": s.temperature, "top_p": s.top_p, "stream": False}
        if self.model:
            body["model"] = self.model
        if request.tools:
            body["tools"] = request.tools
        if s.stop:
            body["stop"] = s.stop
        seed = sample_seed(s.seed, request.sample)
        if seed is not None:
            body["seed"] = seed
        if s.chat_template_kwargs:
            body["chat_template_kwargs"] = s.chat_template_kwargs
        if url not in self.text_only:
            body["return_token_ids"] = True  # vLLM: prompt_token_ids and choices[].token_ids
        return body

    def complete(self, request: Request) -> Completion:
        last = ""
        start = next(self._next)
        for attempt in range(self.max_retries + 1):
            url = self.urls[(start + attempt) % len(self.urls)]
            if attempt:
                with self.stats.lock:
                    self.stats.retries += 1
                time.sleep(min(30.0, self.backoff * 2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                return self._post(url, request)
            except _Retryable as e:
                last = f"{url}: {e}"
                self.stats.error(url, str(e))
        raise RequestFailed(Finding("prepare.request-retries-spent", attempts=self.max_retries + 1, last=last))

    def _post(self, url: str, request: Request) -> Completion:
        with self.stats.lock:
            self.stats.requests += 1
        body = self.body(request, url)
        data = json.dumps(body).encode()
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            if e.code in (400, 422) and self.token_ids == "auto" and "return_token_ids" in body:
                # A server that refuses the return_token_ids field (transformers serve) gets the
                # request again without it; its answers are then re-tokenized and checked.
                self.text_only.add(url)
                return self._post(url, request)
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"HTTP {e.code}") from None
            raise RequestFailed(Finding("prepare.server-http-error", url=url, status=e.code, detail=detail)) from None
        except TimeoutError:
            raise _Retryable("timed out") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError | socket.timeout):
                raise _Retryable("timed out") from None
            raise _Retryable(f"connection failed ({getattr(reason, 'strerror', None) or reason})") from None
        except (ConnectionError, json.JSONDecodeError, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        return _parse_choice(payload, url)


class _Retryable(Exception):
    pass


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the OpenAI API spells them: tool-call arguments as a JSON string (the local
    form keeps them as a mapping, which chat templates expect)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
                and not isinstance(c["function"].get("arguments"), str) else c
                for c in calls]}
        out.append(m)
    return out


def _parse_choice(payload: dict, url: str) -> Completion:
    try:
        choice = payload["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestFailed(Finding("prepare.server-no-choice", url=url, payload=str(payload)[:300])) from None
    ids = choice.get("token_ids")
    return Completion(
        text=message.get("content") or "", finish_reason=choice.get("finish_reason") or "stop",
        token_ids=list(ids) if ids is not None else None,
        prompt_token_ids=payload.get("prompt_token_ids") or choice.get("prompt_token_ids"),
        tool_calls=message.get("tool_calls"), reasoning_content=message.get("reasoning_content"),
    )


class BatchTooLargeError(EnvironmentFault):
    """A batch of the in-process backend does not fit in the device's memory."""


class HFBackend:
    """Batched `generate()` of a local HF model (left padding; greedy when temperature is 0).

    A seed is set once, here: successive batches draw on one random stream (the same seed,
    data and batch size give the same records). Sample k > 0 of --samples-per-prompt has a
    stream of its own, seeded from `sample_seed(seed, k)` and kept between its batches, so
    sample 0 draws exactly what a single-sample run draws. A batch holds one sample index."""

    def __init__(self, model_dir: str, renderer: Any, sampling: Sampling, *, device: str | None = None,
                 dtype: str = "bf16", stop_flag: Any = None):
        import torch
        from transformers import AutoModelForCausalLM, StoppingCriteria

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        model, loading = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, output_loading_info=True)
        refuse_incomplete_weights(model_dir, loading)
        self.model = model.to(self.device).eval()
        self.positions = target_positions(model.config)  # prompt + answer stay within them
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.sampling = sampling
        self.eos_ids = sorted(renderer.eos_ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        self._streams: dict[int, tuple[Any, Any]] = {}  # sample > 0 -> its saved (CPU, CUDA) RNG state

        class _Stop(StoppingCriteria):  # Ctrl-C ends a batch within one decoding step
            def __call__(self, input_ids, scores, **kwargs):
                stop = bool(stop_flag and stop_flag.requested)
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

        self.stopping = _Stop()

    def render(self, requests: list[Request]) -> None:
        """Set the prompt ids of the requests that have none: each rendered by the template, all
        tokenized in one call (the same ids as `renderer.prompt_ids`, one at a time)."""
        todo = [r for r in requests if r.prompt_ids is None]
        if not todo:
            return
        texts = [self.renderer.render_text(r.messages, r.tools, add_generation_prompt=True) for r in todo]
        for r, ids in zip(todo, self.tokenizer(texts, add_special_tokens=False)["input_ids"]):
            r.prompt_ids = list(ids)

    def past_positions(self, request: Request) -> str | None:
        """Why a rendered prompt leaves no position for an answer (a drop reason), or None."""
        if self.positions is None or len(request.prompt_ids) < self.positions.limit:
            return None
        return f"prompt of {len(request.prompt_ids):,} tokens leaves no room within {self.positions.describe()}"

    @contextlib.contextmanager
    def _stream(self, sample: int):
        """Draw on sample `sample`'s own random stream inside the block (sample 0, or no seed:
        the process's stream, as a single-sample run)."""
        seed = sample_seed(self.sampling.seed, sample)
        if sample == 0 or seed is None or self.sampling.temperature <= 0:
            yield
            return
        torch = self.torch
        dev = torch.device(self.device)
        cuda = dev.type == "cuda"
        index = (dev.index if dev.index is not None else torch.cuda.current_device()) if cuda else None
        with torch.random.fork_rng(devices=[index] if cuda else []):  # the process's stream is put back after
            state = self._streams.get(sample)
            if state is None:
                torch.manual_seed(seed)
            else:
                torch.set_rng_state(state[0])
                if cuda:
                    torch.cuda.set_rng_state(state[1], index)
            yield
            self._streams[sample] = (torch.get_rng_state(), torch.cuda.get_rng_state(index) if cuda else None)

    def complete_batch(self, requests: list[Request]) -> list[Completion]:
        torch = self.torch
        samples = {r.sample for r in requests}
        if len(samples) != 1:
            raise ValueError(f"a batch holds the requests of one sample index, not {sorted(samples)}")
        self.render(requests)
        prompts = [r.prompt_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for k, p in enumerate(prompts):
            ids[k, width - len(p):] = torch.tensor(p)
            attn[k, width - len(p):] = 1
        s = self.sampling
        # Past the target's positions its answers are out of range: a batch ends at the last one
        # its longest prompt leaves (batches are sorted by prompt length), and an answer cut there
        # reads finish_reason "length".
        cap = s.max_tokens if self.positions is None else max(1, min(s.max_tokens, self.positions.limit - width))
        kwargs: dict[str, Any] = {"max_new_tokens": cap, "eos_token_id": self.eos_ids,
                                  "pad_token_id": self.pad_id, "stopping_criteria": [self.stopping]}
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if s.stop:
            kwargs.update(stop_strings=s.stop, tokenizer=self.tokenizer)
        try:
            with torch.inference_mode(), self._stream(samples.pop()):
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        except torch.OutOfMemoryError:
            raise BatchTooLargeError(Finding("prepare.batch-out-of-memory", prompts=len(prompts), tokens=width,
                                             new_tokens=s.max_tokens, device=str(self.device))) from None
        answers = []
        for row in out[:, width:].tolist():
            gen = []
            for t in row[:cap]:
                gen.append(t)
                if t in self.renderer.eos_ids:
                    break
            answers.append(gen)
        texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True)
        results = []
        for gen, text, prompt in zip(answers, texts, prompts):
            stopped = bool(gen) and gen[-1] in self.renderer.eos_ids
            results.append(Completion(
                text=text, finish_reason="stop" if stopped or len(gen) < cap else "length",
                token_ids=gen, prompt_token_ids=prompt, local_prompt=True))
        return results
