#!/usr/bin/env python
"""A model folder with a catalog model's real shapes, random weights and the embedded model's tokenizer.

For ``lora-kit run`` on a machine that cannot download a model (a GPU session without network): the weights are
random, so losses and answers mean nothing, but every tensor has the real model's shape, so memory, kernels and
speed are the real model's. The config is the catalog entry's (``lora_kit.memory.specs.catalog_config``), its
token ids set to the embedded tokenizer's (character-level, the embedded data's phrases as tokens; the model's
larger vocabulary keeps its size). Weights are saved with safetensors, as the kit loads them.

    python scripts/random_model.py qwen2.5-0.5b /tmp/qwen-random                      # float32, on the CPU
    python scripts/random_model.py qwen2.5-0.5b /tmp/qwen-random --dtype bfloat16 --device cuda
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(name: str, out: str | Path, dtype: str = "float32", device: str = "cpu", layers: int | None = None,
          seed: int = 0, config_only: bool = False) -> Path:
    """Write ``out``: config and random weights of catalog model ``name`` (``layers``: cut to that many blocks),
    and the embedded tokenizer; ``config_only``: no weights (what planning reads). Returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lora_kit.loading import EMBEDDED_DIR
    from lora_kit.memory.specs import catalog_config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_DIR / f, out / f)
    ids = json.loads((EMBEDDED_DIR / "generation_config.json").read_text())
    c = {**catalog_config(name), **{k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}}
    if layers:
        c["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(c.pop("model_type"), **c)
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["model_max_length"] = getattr(cfg, "max_position_embeddings", tok["model_max_length"])
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    if config_only:
        cfg.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it is made: seconds on a GPU
        net = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    net.save_pretrained(out, safe_serialization=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", help="catalog model, e.g. qwen2.5-0.5b (lora_kit/catalog/models.json)")
    p.add_argument("out", help="folder to write (created)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="where the weights are initialised: cpu | cuda")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many blocks")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = build(a.name, a.out, a.dtype, a.device, a.layers, a.seed)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{a.name} ({a.dtype}, random weights) in {out}: {size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
