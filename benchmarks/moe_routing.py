"""Does the token-to-expert routing move the peak of a MoE training step? Real CPU steps, printed.

Usage (CPU, offline, ~2 min)::

    HF_HUB_OFFLINE=1 python benchmarks/moe_routing.py

A reduced Mixtral (hidden 256, 8 experts, top-2, 2 layers, 512 tokens, bf16, random weights) takes one
measured real step (the second of two, :func:`lora_kit.memory.measure.measure_step`) with its router as
initialised ("random": tokens spread over all experts) and with the router's weight zeroed ("two": equal
logits, so every token goes to the same two experts), for transformers' default ``grouped_mm`` experts and
for ``eager`` experts (a Python loop over the experts hit), LoRA all-linear and full fine-tuning,
checkpointing off and on. ``simulate`` (fake tensors: its router output has no values) is printed beside.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from lora_kit.memory.measure import build_real_model, measure_step  # noqa: E402
from lora_kit.memory.simulate import simulate  # noqa: E402
from lora_kit.memory.specs import check_model_step  # noqa: E402
from lora_kit.settings import Step  # noqa: E402


def config():
    cfg = AutoConfig.for_model("mixtral", vocab_size=1000, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                               num_local_experts=8, num_experts_per_tok=2)
    cfg.name_or_path = "mixtral-reduced"
    return cfg


def tokens_per_expert(net, batch) -> list:
    counts = []
    hooks = [m.register_forward_hook(lambda mod, i, o: counts.append(
        torch.bincount(o[2].flatten(), minlength=mod.weight.shape[0]).tolist()))
        for m in net.modules() if type(m).__name__ == "MixtralTopKRouter"]
    with torch.no_grad():
        net(**batch)
    for h in hooks:
        h.remove()
    return counts[0]


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = config()
    print(f"{'experts':10s} {'method':6s} {'ckpt':4s} {'routing':7s} {'tokens per expert (block 0)':36s} "
          f"{'real peak B':>12s} {'simulate B':>12s}")
    for method in ("lora", "full"):
        for gc in (False, True):
            kw = dict(method=method, seq_len=512, batch_size=1, gradient_checkpointing=gc,
                      **({} if method == "full" else dict(lora_rank=8)))
            s = Step(**kw)
            check_model_step(cfg, s)
            sim = simulate(cfg, **kw).peak_allocated_bytes
            for impl in ("grouped_mm", "eager"):
                for routing in ("random", "two"):
                    torch.manual_seed(0)
                    net, opt, batch = build_real_model(config(), s)  # its own config: set_experts_... changes it
                    if impl == "eager":
                        net.set_experts_implementation("eager")
                    if routing == "two":
                        for m in net.modules():
                            if type(m).__name__ == "MixtralTopKRouter":
                                torch.nn.init.zeros_(m.weight)
                    counts = tokens_per_expert(net, batch)
                    peak = measure_step(net, batch, opt).peak_allocated_bytes
                    print(f"{impl:10s} {method:6s} {'on' if gc else 'off':4s} {routing:7s} {str(counts):36s} "
                          f"{peak:12d} {sim if impl == 'grouped_mm' else '':>12}", flush=True)


if __name__ == "__main__":
    main()
