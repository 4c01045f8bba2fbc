"""ModelOpt's DFlash on the quality benchmark: `python bench/peers/modelopt_train.py RECIPE.json`.

ModelOpt trains DFlash online: `modelopt.torch.speculative.convert(model, [("dflash", cfg)])`
turns the in-process HF target into a model whose training forward runs the frozen target,
concatenates its `target_layer_ids` hidden states and trains the draft module on random anchors;
HF's Trainer drives it, and `modelopt.torch.export.export_speculative_decoding` writes the
z-lab-layout directory (`config.json` + `model.safetensors`, no `dflash_module.` prefix).

The data is our cache's token ids and loss masks (the same samples the other runs train on; the
hidden states come from the target itself here). ModelOpt's forward needs the sequence length
to be a multiple of its block size: the collator pads each batch up to one, with the attention
mask and loss mask zero on the padding. RECIPE.json (bench/peers/run.py writes it) holds
`target`, `cache`, `output_dir`, `dflash` (the DFlashConfig dict) and `training` (HF
TrainingArguments). Writes OUTPUT_DIR/export/ and OUTPUT_DIR/train_result.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


class CacheTokens(torch.utils.data.Dataset):
    """The cache's samples as {input_ids, loss_mask} (the hidden states are not read)."""

    def __init__(self, cache_dir: str):
        from dflash.cache_tools.reader import CacheReader

        reader = CacheReader(cache_dir)
        self.samples = []
        for part in range(len(reader.parts)):
            offsets = [0]
            for n in reader.parts[part].lengths:
                offsets.append(offsets[-1] + n)
            rows = reader.read_tokens(part, 0, offsets[-1])  # ids and masks of the whole part
            for a, b in zip(offsets, offsets[1:]):
                self.samples.append((torch.from_numpy(rows["input_ids"][a:b].copy()),  # (the reader gives numpy)
                                     torch.from_numpy(rows["loss_mask"][a:b].astype("float32"))))
        reader.close()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples[i]
        return {"input_ids": ids, "loss_mask": mask}


def collate(block_size: int, pad_id: int):
    def fn(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(b["input_ids"]) for b in batch)
        length = -(-longest // block_size) * block_size
        ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
        attention = torch.zeros(len(batch), length, dtype=torch.long)
        loss = torch.zeros(len(batch), length)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n], attention[i, :n], loss[i, :n] = b["input_ids"], 1, b["loss_mask"]
        return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}

    return fn


def rotary_without_device(module: torch.nn.Module) -> None:
    """ModelOpt 0.47 builds the draft's RoPE lazily as `Qwen3RotaryEmbedding(config=..., device=...)`;
    transformers releases after the ones it supports (< 5.15) dropped `device`. Built here from the
    same config, the lazy build is skipped (the Trainer moves it to the device with the model)."""
    import inspect

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    if "device" not in inspect.signature(Qwen3RotaryEmbedding.__init__).parameters and not hasattr(module, "rotary_emb"):
        module.rotary_emb = Qwen3RotaryEmbedding(config=module._rotary_config)
        print("modelopt: RoPE built without `device` (this transformers has no such argument)")


def main(recipe_path: str) -> int:
    import modelopt.torch.speculative as mtsp
    import transformers
    from modelopt.torch.export import export_speculative_decoding

    recipe = json.loads(Path(recipe_path).read_text())
    out = Path(recipe["output_dir"])
    training = dict(recipe["training"])
    cpu = bool(training.get("use_cpu"))
    dtype = torch.float32 if cpu else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(recipe["target"], dtype=dtype, local_files_only=True)
    start = time.perf_counter()
    mtsp.convert(model, [("dflash", recipe["dflash"])])
    rotary_without_device(model.dflash_module)
    data = CacheTokens(recipe["cache"])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    args = transformers.TrainingArguments(output_dir=str(out / "hf"), **training)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collate(recipe["dflash"]["dflash_block_size"], pad))
    result = trainer.train()
    if not cpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.eval()
    export_speculative_decoding(model, dtype=torch.bfloat16, export_dir=str(out / "export"))
    (out / "train_result.json").write_text(json.dumps({"train_seconds": seconds, "samples": len(data),
                                                       "steps": result.global_step,
                                                       "train_loss": result.training_loss}, indent=2) + "\n")
    print(f"modelopt: {len(data)} samples, {result.global_step} steps, {seconds:.0f} s; export in {out / 'export'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
