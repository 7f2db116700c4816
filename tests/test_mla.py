"""DeepSeek's multi-head latent attention (memory.mla): simulate vs a real CPU step, and the planner's note (tiny
DeepSeek-V2 configs: q/k heads 48 wide, v heads 32, so CPU SDPA takes its math path)."""
import torch
from transformers import AutoConfig

from lora_kit.memory.measure import build_real_model, measure_step
from lora_kit.memory.simulate import simulate
from lora_kit.memory.specs import check_model_step
from lora_kit.settings import Step


def tiny(**over):
    c = dict(vocab_size=512, hidden_size=128, intermediate_size=192, moe_intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=512)
    c.update(over)
    cfg = AutoConfig.for_model("deepseek_v2", **c)
    cfg.name_or_path = "tiny-deepseek-v2"
    return cfg


def test_simulate_equals_a_real_cpu_step():
    torch.manual_seed(0)
    cfg = tiny()
    s = Step(method="lora", seq_len=64, batch_size=2, lora_rank=4, gradient_checkpointing=False)
    check_model_step(cfg, s)
    net, opt, batch = build_real_model(cfg, s)
    real = measure_step(net, batch, opt).peak_allocated_bytes
    assert simulate(cfg, s).peak_allocated_bytes == real


def test_a_plan_says_which_attention_kernel_it_counts():
    """The planner's note on an MLA model names the CPU math path and the probabilities it keeps, from the same
    arithmetic as the estimate (one block with checkpointing, every block without)."""
    from lora_kit.plan.planner import check_plan
    on = check_plan("deepseek-v2-lite", "H100-SXM", method="lora", seq_len=2048)["note"]
    off = check_plan("deepseek-v2-lite", "H100-SXM", method="lora", seq_len=2048, gradient_checkpointing=False)["note"]
    assert "math path" in on and "0.25 GiB in the recomputed block" in on  # 16 heads x 2048^2 x 4 B
    assert "6.75 GiB in all blocks" in off  # x 27 blocks
    assert check_plan("llama-3.1-8b", "H100-SXM", method="lora")["note"] == ""


def test_cli_estimate_prints_the_models_note(capsys):
    """`lora-kit estimate` on DeepSeek says what the figure assumes (the planner's note: experts, attention kernel),
    in the table and in --json; a dense model gets none."""
    from lora_kit.ui.cli import main
    assert main(["estimate", "--model", "deepseek-v2-lite", "--seq-len", "4096"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the note is wrapped
    assert "note:" in out and "math path" in out and "1.00 GiB in the recomputed block" in out  # 16 x 4096^2 x 4 B
    assert main(["estimate", "--model", "deepseek-v2-lite", "--json"]) == 0
    assert "multi-head latent attention" in __import__("json").loads(capsys.readouterr().out)["note"]
    assert main(["estimate", "--model", "llama-3.1-8b"]) == 0
    assert "note:" not in capsys.readouterr().out
