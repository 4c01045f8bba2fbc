"""dflash-generate's in-process backend on the quality benchmark's target, beside plain `generate()`.

Writes N prompts (64-192 bytes, cut at line starts from the training files of the quality
benchmark's corpus: Python sources of installed packages) as `{"id", "prompt"}` records, runs
the `dflash-generate` CLI on them in a child process (timed from its start to its exit), then
runs a plain batched `model.generate` over the same prompt tokens in input order (left
padding, the same batch size, dtype and sampling) in this process, and prints one line:
completions, generated tokens, seconds and generated tokens/s of both, their ratio, and for
greedy decoding how many completions are identical (in bf16 a few may part where other
padding changes a near-tie). dflash-generate's figures: wall seconds of
the whole command (start-up, model load, reading the data, writing the records), and its own
count (its summary line: model load onward); the baseline's: its generate() calls only, after a
warm-up call. --baseline-prompts runs the baseline on the first prompts only (its tokens/s
compare all the same).

The quality target is byte-level and has no tokenizer: a byte tokenizer (id = byte value,
then its pad/bos/eos/mask ids) and a template that renders the prompt's bytes as they are are
written next to links to its weights in WORKDIR/target, so a record is exactly the prompt
bytes and the target's continuation, ended by its EOS or --max-new-tokens.

    python bench/bench_generate.py --target WORK/target --prompts 32768 --max-new-tokens 160 \\
        --batch-size 4096 --dtype bf16 --baseline-prompts 16384 --workdir /dev/shm/dflash-generate  # one H200
    python bench/bench_generate.py --target WORK/target --prompts 64 --batch-size 32 \\
        --device cpu --packages numpy --workdir /tmp/dflash-generate              # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
from corpus import BOS_ID, EOS_ID, MASK_ID, PAD_ID, cut_prompts, load_corpus  # noqa: E402

PROMPT_LENGTHS = [64, 96, 128, 160, 192]
RAW_TEMPLATE = "{%- for message in messages %}{{- message['content'] }}{%- endfor %}"
MODEL_FILES = ("config.json", "generation_config.json")
SUMMARY = re.compile(r"(\d+) records written .* (\d+) generated tokens in ([\d.]+) s")


def target_with_tokenizer(target: Path, workdir: Path) -> Path:
    """`target` itself when it has a tokenizer; else WORKDIR/target: links to its weights and
    config, a byte tokenizer with the corpus's special ids, and the raw template."""
    if (target / "tokenizer.json").is_file() or (target / "tokenizer_config.json").is_file():
        return target
    config = json.loads((target / "config.json").read_text())
    if (config.get("vocab_size"), config.get("eos_token_id")) != (MASK_ID + 1, EOS_ID):
        raise SystemExit(f"{target} has no tokenizer and is not the quality benchmark's byte-level target "
                         f"(vocab_size {config.get('vocab_size')}, eos {config.get('eos_token_id')}); pass a "
                         "model directory with its tokenizer.")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    out = workdir / "target"
    out.mkdir(parents=True, exist_ok=True)
    for name in [*MODEL_FILES, *(p.name for p in target.glob("*.safetensors*"))]:
        link = out / name
        if (target / name).exists() and not link.exists():
            link.symlink_to((target / name).resolve())
    tk = Tokenizer(models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    # Names no source file holds (the text "<mask>" does: it would become the special token).
    specials = {i: f"<|byte-target:{n}|>" for i, n in ((PAD_ID, "pad"), (BOS_ID, "bos"), (EOS_ID, "eos"), (MASK_ID, "mask"))}
    tk.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=specials[PAD_ID], bos_token=specials[BOS_ID],
                                  eos_token=specials[EOS_ID])
    tok.chat_template = RAW_TEMPLATE
    tok.save_pretrained(out)
    assert [tok.convert_tokens_to_ids(specials[i]) for i in sorted(specials)] == sorted(specials)
    return out


def write_prompts(path: Path, count: int, packages: list[str], seed: int) -> list[list[int]]:
    """`count` prompt records (text that is valid UTF-8: a character cut by the end is dropped);
    their byte ids, which the byte tokenizer gives them."""
    train, _ = load_corpus(packages, held_out_percent=10)
    texts = [bytes(p).decode("utf-8", errors="ignore") for p in cut_prompts(train, count, PROMPT_LENGTHS, seed)]
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"p{i:06d}", "prompt": text}) + "\n")
    return [list(t.encode("utf-8")) for t in texts]


def run_dflash_generate(a: argparse.Namespace, target: Path, data: Path, output: Path) -> dict[str, Any]:
    for p in (output, output.with_name(output.name + ".meta.json"), output.with_name(output.name + ".skipped.jsonl")):
        p.unlink(missing_ok=True)  # a fresh run: a resumed one would have nothing left to time
    command = [sys.executable, "-m", "dflash.prepare.generate_cli", "--target-model", str(target),
               "--data", str(data), "--output", str(output), "--max-tokens", str(a.max_new_tokens),
               "--batch-size", str(a.batch_size), "--dtype", a.dtype, "--temperature", str(a.temperature),
               "--seed", str(a.seed), "--no-progress", *(["--device", a.device] if a.device else [])]
    log = a.workdir / "dflash-generate.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    text = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"dflash-generate failed with status {done.returncode} (log {log}):\n{text[-3000:]}")
    m = SUMMARY.search(text)
    if not m:
        raise SystemExit(f"dflash-generate printed no summary (log {log}):\n{text[-3000:]}")
    answers, prompts = {}, {}
    for line in output.read_text().splitlines():
        rec = json.loads(line)
        n = rec["loss_mask"].index(1)  # a record: the prompt (mask 0), then the answer (mask 1)
        prompts[rec["id"]], answers[rec["id"]] = rec["input_ids"][:n], rec["input_ids"][n:]
    return {"prompts": prompts, "completions": len(answers), "tokens": sum(len(v) for v in answers.values()), "wall_s": wall,
            "run_s": float(m.group(3)), "summary_tokens": int(m.group(2)), "answers": answers}


def _answer(row: list[int], eos: set[int]) -> list[int]:
    """The generated tokens through the first EOS (what a record of dflash-generate holds)."""
    for k, t in enumerate(row):
        if t in eos:
            return row[: k + 1]
    return row


def plain_generate(a: argparse.Namespace, target: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """model.generate over `prompts` in input order, batches of --batch-size, left padding."""
    from transformers import AutoModelForCausalLM

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()
    sampling = (dict(do_sample=True, temperature=a.temperature, top_p=1.0) if a.temperature > 0
                else dict(do_sample=False, temperature=None, top_p=None, top_k=None))

    def batch(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for k, p in enumerate(rows):
            ids[k, width - len(p):] = torch.tensor(p)
            attn[k, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=new_tokens,
                                 eos_token_id=EOS_ID, pad_token_id=PAD_ID, **sampling)
        return out[:, width:].tolist()

    batch(prompts[: min(8, len(prompts))], 4)  # kernels loaded, allocator warm: not timed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.manual_seed(a.seed)
    start = time.perf_counter()
    answers = []
    for first in range(0, len(prompts), a.batch_size):
        answers += [_answer(r, {EOS_ID}) for r in batch(prompts[first: first + a.batch_size], a.max_new_tokens)]
    seconds = time.perf_counter() - start  # .tolist() waited for the GPU
    return {"completions": len(answers), "tokens": sum(map(len, answers)), "loop_s": seconds, "answers": answers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="The quality benchmark's target (WORK/target).")
    p.add_argument("--prompts", type=int, default=32768)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (then identical completions are counted).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="[default: cuda if available, else cpu]")
    p.add_argument("--packages", default="torch,transformers,numpy", help="Packages whose sources give the prompts.")
    p.add_argument("--baseline-prompts", type=int, default=-1,
                   help="Prompts (the first ones) the plain generate() baseline runs: -1 all, 0 none.")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--json", action="store_true", help="Also print the figures as one JSON object.")
    a = p.parse_args()
    if importlib.util.find_spec("dflash") is None:
        raise SystemExit("The project is not installed here (no dflash package): run "
                         "`pip install --no-deps --no-build-isolation -e .` at its root first.")
    a.workdir.mkdir(parents=True, exist_ok=True)
    target = target_with_tokenizer(a.target, a.workdir)
    data = a.workdir / "prompts.jsonl"
    prompts = write_prompts(data, a.prompts, [s for s in a.packages.split(",") if s], a.seed)
    gen = run_dflash_generate(a, target, data, a.workdir / "generated.jsonl")
    wrong = [i for i, ids in enumerate(prompts) if gen["prompts"].get(f"p{i:06d}", ids) != ids]
    if wrong:  # the baseline would not generate from the same tokens
        raise SystemExit(f"dflash-generate's records of {len(wrong)} prompts (first p{wrong[0]:06d}) do not start "
                         "with the prompt's bytes: the tokenizer or template of the target is not the byte one.")
    count = len(prompts) if a.baseline_prompts < 0 else min(a.baseline_prompts, len(prompts))
    base = plain_generate(a, target, prompts[:count]) if count else None

    rate = gen["tokens"] / gen["wall_s"]
    run_rate = gen["summary_tokens"] / gen["run_s"]
    figures: dict[str, Any] = {
        "prompts": a.prompts, "batch_size": a.batch_size, "dtype": a.dtype, "temperature": a.temperature,
        "device": a.device or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"),
        "dflash_generate": {k: gen[k] for k in ("completions", "tokens", "wall_s", "run_s")} | {
            "tokens_per_s_wall": rate, "tokens_per_s_run": run_rate}}
    line = (f"bench_generate: {a.prompts} prompts, batch {a.batch_size}, {a.dtype}, T={a.temperature:g}, "
            f"{figures['device']} | dflash-generate: {gen['completions']} completions, {gen['tokens']} generated tokens, "
            f"{gen['wall_s']:.1f} s wall ({gen['run_s']:.1f} s by its own count, model load included), "
            f"{rate:.0f} tok/s wall ({run_rate:.0f} by its own count)")
    if base:
        base_rate = base["tokens"] / base["loop_s"]
        figures["plain_generate"] = {k: base[k] for k in ("completions", "tokens", "loop_s")} | {"tokens_per_s": base_rate}
        line += (f" | model.generate: {base['completions']} completions, {base['tokens']} generated tokens, "
                 f"{base['loop_s']:.1f} s (generate calls only), {base_rate:.0f} tok/s | ratio wall {rate / base_rate:.2f}, "
                 f"own count {run_rate / base_rate:.2f}")
        if a.temperature == 0:
            same = sum(gen["answers"].get(f"p{i:06d}") == ans for i, ans in enumerate(base["answers"]))
            figures["identical_completions"] = same
            line += f" | identical greedy completions {same}/{count}"
    print(line, flush=True)
    if a.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
