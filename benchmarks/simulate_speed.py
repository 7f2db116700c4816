"""How long ``lora_kit.memory.simulate`` takes: Llama-3.1-8B LoRA at seq_len 2048 (target <= 15 s on a
2-core CPU), plus a few more catalog configurations. Prints wall and process CPU seconds (CPU
contention from other processes inflates wall time; CPU time shows the work itself).

    .venv/bin/python benchmarks/simulate_speed.py            # the 8B target case
    .venv/bin/python benchmarks/simulate_speed.py --more     # + QLoRA / checkpointing / full cases
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def llama_31_8b():
    """Llama-3.1-8B from the catalog; its published config facts if the catalog is unavailable."""
    try:
        from lora_kit.memory.simulate import load_config
        return load_config("llama-3.1-8b")
    except Exception:  # noqa: BLE001 - fall back to the published facts
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                           intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                           max_position_embeddings=131072, rope_theta=500000.0)


def run(label, cfg, **kw):
    from lora_kit.memory.simulate import simulate
    c0, t0 = time.process_time(), time.perf_counter()
    r = simulate(cfg, **kw)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{label:<44} wall {wall:6.2f} s  cpu {cpu:6.2f} s  peak {r.peak_allocated_bytes / 2**30:7.3f} GiB "
          f"({r.phase})", flush=True)
    return wall, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--more", action="store_true", help="also time QLoRA, checkpointing and full fine-tuning")
    args = ap.parse_args(argv)
    import torch
    t0 = time.perf_counter()
    import lora_kit.memory.simulate  # noqa: F401  (imports counted separately)
    import peft  # noqa: F401
    import transformers  # noqa: F401
    print(f"imports: {time.perf_counter() - t0:.2f} s; torch threads {torch.get_num_threads()}, "
          f"os cpus {os.cpu_count()}, load avg {os.getloadavg()[0]:.2f}")
    cfg = llama_31_8b()
    run("warm-up (tiny seq, not the target)", cfg, method="lora", seq_len=16)
    wall, cpu = run("llama-3.1-8b lora r16 all-linear seq 2048", cfg, method="lora", seq_len=2048)
    # simulate is single-threaded Python: on an idle machine wall ~= process CPU time; other
    # processes on the same cores stretch wall time, so both are judged and printed
    print(f"target <= 15 s: wall {wall:.2f} s ({'met' if wall <= 15 else 'MISSED'}), process CPU {cpu:.2f} s "
          f"({'met' if cpu <= 15 else 'MISSED'}); load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.more:
        run("llama-3.1-8b qlora seq 2048", cfg, method="qlora", seq_len=2048)
        run("llama-3.1-8b lora seq 2048 checkpointing", cfg, method="lora", seq_len=2048, gradient_checkpointing=True)
        run("llama-3.1-8b full bf16 seq 2048", cfg, method="full", seq_len=2048)


if __name__ == "__main__":
    main()
