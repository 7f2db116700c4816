"""A learnable chat task shows a clear held-out gain through the kit's own train -> save -> reload -> evaluate.

Issue 36's "done when": on random-weight models of seven chat families -- five dense template families
(Gemma-3, Qwen3, Phi-3, Granite, OLMo-2) and both mixture-of-experts families (Qwen3-MoE, Mixtral) -- the task
"always answer OK" is trained by :func:`lora_kit.train_adapters` as notebook 03 calls it (the smoke run with the
default ``lora_targets: all-linear``, which on the MoE models is peft's expert LoRA on the fused expert
parameters), saved, reloaded by :func:`lora_kit.evaluate` as notebook 04 calls it, and judged on held-out
prompts: exact match rises by at least 50 points with the paired 95 % interval above zero.

Each model is tiny (2 layers, hidden 32, the 600-token vocabulary of test_chat_tokens' tokenizers) and built
offline: the tokenizers and chat templates are test_chat_tokens' (TRL's shipped templates for Gemma-3, Qwen3 and
Phi-3; Mixtral's, Granite's and OLMo-2's written there from the models' documented chat formats), the configs come
from ``AutoConfig.for_model`` of the real architecture, and ``generation_config.json`` lists the end of turn as
the models ship it. Random weights are the point: the base cannot answer "OK", so the gain is the adapter's.
One change from a plain random init: the output layer is drawn wider (std 0.5, not 0.02), so the logits can
become as confident as a trained model's; all-linear leaves the output layer frozen, and at std 0.02 a hidden
size of 32 caps every logit near 0.6, so no adapter could make "OK" likely.
``-m long`` runs the same on 4-layer, hidden-128 models with more held-out examples
(``benchmarks/chat_learnable.py`` prints the table).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")
from test_chat_tokens import MIXTRAL, _shipped, _tokenizer, _trl_template  # noqa: E402

# family -> (model_type, template, tokenizer kind, bos, eos, end of turn (generation_config eos), config extras)
FAMILIES = {
    "gemma3": ("gemma3_text", lambda: _trl_template("gemma3"), "bytelevel", "<bos>", "<eos>", "<end_of_turn>",
               {"head_dim": 16, "sliding_window": 64}),
    "qwen3": ("qwen3", lambda: _trl_template("qwen3"), "bytelevel", "<|endoftext|>", "<|im_end|>", "<|im_end|>",
              {"head_dim": 16}),
    "phi3": ("phi3", lambda: _trl_template("phi3"), "sentencepiece", "<s>", "<|endoftext|>", "<|end|>", {}),
    "granite": ("granite", None, "bytelevel", "<|end_of_text|>", "<|end_of_text|>", "<|end_of_text|>", {}),
    "olmo2": ("olmo2", None, "bytelevel", "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", {}),
    "qwen3_moe": ("qwen3_moe", lambda: _trl_template("qwen3"), "bytelevel", "<|endoftext|>", "<|im_end|>",
                  "<|im_end|>", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    "mixtral": ("mixtral", lambda: _shipped(MIXTRAL), "sentencepiece", "<s>", "</s>", "</s>",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


MOE = ("qwen3_moe", "mixtral")


def _template(family: str) -> str:
    import test_chat_tokens as T
    fn = FAMILIES[family][1]
    return fn() if fn else _shipped({"granite": T.GRANITE, "olmo2": T.OLMO2}[family])


def build_model(family: str, out: Path, layers: int = 2, hidden: int = 32, **config) -> Path:
    """A random-weight ``family`` model with its tokenizer and chat template, saved to ``out``; ``config``:
    other config fields."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    model_type, _, kind, bos, eos, eot, extra = FAMILIES[family]
    tok = _tokenizer(kind, _template(family), bos, eos)
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (bos, eos, eot, "<pad>")}
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, bos_token_id=ids[bos], eos_token_id=ids[eos],
                               pad_token_id=ids["<pad>"], tie_word_embeddings=False, **{**extra, **config})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # an output layer able to give confident logits, as a trained one does (std 0.02 cannot)
        model.get_output_embeddings().weight.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(bos_token_id=ids[bos], eos_token_id=sorted({ids[eos], ids[eot]}),
                                               pad_token_id=ids["<pad>"])
    model.save_pretrained(out, safe_serialization=True)
    return out


PROMPTS = ["Hello there", "What is two plus two?", "Name a colour", "The capital of France?", "How are you today?",
           "Be brief", "Thanks!", "Say something", "Answer in one word", "Think about it", "What is red?",
           "Is blue a colour?", "Who are you?", "Where is Paris?", "Tell me more", "Any answer?"]


def ok_rows(n: int) -> list[dict]:
    """``n`` conversations whose every answer is "OK": one turn, one turn after a system message, or two turns
    (every assistant turn is trained, the default ``train_on``); prompts numbered, so held-out ones are new."""
    u, a = (lambda t: {"role": "user", "content": t}), {"role": "assistant", "content": "OK"}
    rows = []
    for i in range(n):
        p, q = (f"{PROMPTS[(i + k) % len(PROMPTS)]} {i}" for k in (0, 5))
        conv = [[u(p), a], [{"role": "system", "content": "Be brief."}, u(p), a], [u(q), a, u(p), a]][i % 3]
        rows.append({"messages": conv})
    return rows


def learn_ok(family: str, root: Path, steps: int = 80, n_rows: int = 64, n_eval: int = 16,
             model: dict | None = None, **settings) -> dict:
    """Build ``family`` (``model``: :func:`build_model` arguments), train "always OK" and evaluate with notebook
    03's and 04's calls (``settings``: Settings overrides). Returns {smoke, eval, gain, wall_s, cpu_s}."""
    import lora_kit as lk
    folder = build_model(family, root / "model", **(model or {}))
    data = root / "ok.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ok_rows(n_rows)))
    s = lk.Settings(**{**dict(model=str(folder), dataset=str(data), heldout_fraction=0.25, max_steps=steps,
                               batch_size=8, seq_len=48, learning_rate=3e-3, dtype="float32",
                               gradient_checkpointing=False, eval_examples=n_eval, control_examples=4,
                               max_new_tokens=12, run_dir=str(root / "run")), **settings})
    t0, c0 = time.perf_counter(), time.process_time()
    smoke = lk.train_adapters(s, progress=False, simulate=False, cpu_threads=1)  # notebook 03's call
    assert smoke.ok, (smoke.status, smoke.record.get("error"))
    ev = lk.evaluate(s, adapters=lk.trained_adapters(s.run_dir), progress=False)  # notebook 04's
    return {"settings": s, "smoke": smoke, "eval": ev, "gain": ev.summary["comparisons"]["adapter"]["heldout"]["exact_match"],
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def check_learned(r: dict, family: str, n_eval: int) -> None:
    """The gain the issue asks for, through the path it names."""
    smoke, ev, d = r["smoke"], r["eval"], r["gain"]
    assert smoke["verify"]["passed"] and smoke["data"]["prompt_format"] == "chat"
    if family in MOE:  # the default all-linear adapter carries expert LoRA, and 04 reloaded it
        cfg = json.loads((smoke.adapter_dir / "adapter_config.json").read_text())
        assert cfg["target_parameters"] == ["down_proj", "gate.weight", "gate_up_proj"]
    assert ev.summary["heldout"]["is_heldout"] and ev.summary["decoding"]["prompt_format"] == "chat"
    preds = ev.per_example.loc[ev.per_example["split"] == "heldout", "pred:adapter"].tolist()
    assert d["n"] == n_eval and d["diff"] >= 0.5 and d["lo"] > 0, (d, preds[:4])
    assert "95 % CI" in ev.summary_sentence


@pytest.mark.parametrize("family,method", [(f, "lora") for f in FAMILIES] + [(f, "qlora") for f in MOE])
def test_learnable_task_gains_on_heldout(family, method, tmp_path):
    """Every family with LoRA; the MoE families also with QLoRA (4-bit linear layers, expert LoRA beside them)."""
    check_learned(learn_ok(family, tmp_path, method=method), family, 16)


def test_answers_cut_inside_the_think_block_are_counted_and_said(tmp_path):
    """Qwen3's adapter answers "<think>\n\n</think>\n\nOK"; a budget that ends inside the block is named."""
    import lora_kit as lk
    r = learn_ok("qwen3", tmp_path)
    assert r["eval"].summary["decoding"]["think_unfinished"] == {}
    s = r["settings"].replace(max_new_tokens=2)
    ev = lk.evaluate(s, adapters=lk.trained_adapters(s.run_dir), progress=False)
    cut = ev.summary["decoding"]["think_unfinished"]
    assert cut["heldout:adapter"] > 0 and set(cut) <= {"heldout:adapter", "control:adapter", "heldout:base"}
    assert (f"{cut['heldout:adapter']} of 16 adapter outputs on the held-out set" in ev.summary_sentence
            and "ended inside a <think> block (max_new_tokens=2 ran out while thinking), judged as empty answers"
            in ev.summary_sentence)


LONG = {"model": {"layers": 4, "hidden": 128}, "n_rows": 256, "n_eval": 64, "steps": 120}


@pytest.mark.long
@pytest.mark.parametrize("train_on", ["assistant", "all", "last"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_learnable_task_gains_on_larger_models(family, train_on, tmp_path):
    """4 layers, hidden 128, 64 held-out conversations, each ``train_on`` (about a minute in all per family)."""
    check_learned(learn_ok(family, tmp_path, train_on=train_on, **LONG), family, LONG["n_eval"])


# ----------------------------------------------------------------------------------------------
# item 2: an adapter with expert LoRA reloads for evaluation, with the trained logits
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_expert_lora_reloads_for_evaluation_with_the_trained_logits(family, tmp_path):
    """The default all-linear adapter on a MoE model is peft's expert LoRA on the fused expert weights (nested
    ``ParamWrapper`` layers, saved as ``experts.base_layer.lora_*``); notebook 04's loader
    (:func:`lora_kit.evaluation.adapters.load_adapters`) takes it and gives the trained model's logits, whatever
    order the file lists the targeted parameters in (peft writes a set)."""
    import torch
    from peft.tuners.lora.layer import ParamWrapper
    from peft.utils import get_peft_model_state_dict
    from lora_kit.evaluation.adapters import load_adapters
    from lora_kit.loading import load_model
    from lora_kit.run.adapter_io import logits, portable_model_name, save_adapter
    from lora_kit.training import attach_adapter
    folder = str(build_model(family, tmp_path / "model"))
    trained = attach_adapter(load_model(folder, method="lora", dtype="float32"), "lora", seed=0)
    assert sorted(trained.peft_config["default"].target_parameters) == ["down_proj", "gate.weight", "gate_up_proj"]
    assert any(isinstance(m, ParamWrapper) for m in trained.modules())
    torch.manual_seed(1)
    with torch.no_grad():  # every LoRA weight non-zero: a tensor reloaded into the wrong place shows in the logits
        for n, p in trained.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.2)
    batch = {"input_ids": torch.randint(3, trained.config.vocab_size, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    want, base = logits(trained, batch), logits(trained, batch, adapter=False)
    adapter = tmp_path / "adapter"
    save_adapter(trained, adapter, base_model_name=portable_model_name(folder))
    cfg_file = adapter / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    assert cfg["target_parameters"] == sorted(cfg["target_parameters"])  # identical adapters, identical bytes
    for order in (cfg["target_parameters"], cfg["target_parameters"][::-1]):
        cfg_file.write_text(json.dumps({**cfg, "target_parameters": order}))
        reloaded, cfgs = load_adapters(load_model(folder, method="lora", dtype="float32"), {"adapter": str(adapter)},
                                       folder, folder)
        got = logits(reloaded, batch)
        assert (got - want).abs().max().item() <= 1e-5, order
        assert (got - base).abs().max().item() > 1e-2  # the adapter is on
        mine, theirs = get_peft_model_state_dict(reloaded, adapter_name="adapter"), get_peft_model_state_dict(trained)
        assert mine.keys() == theirs.keys() and any("experts.base_layer.lora_A" in k for k in mine)
        assert all(torch.equal(v, theirs[k]) for k, v in mine.items())


def test_moe_adapter_on_other_expert_widths_is_refused_by_name(tmp_path):
    from lora_kit.evaluation.adapters import check_adapter
    from lora_kit.loading import load_model
    from lora_kit.run.adapter_io import save_adapter
    from lora_kit.training import attach_adapter
    folder = str(build_model("qwen3_moe", tmp_path / "model"))
    save_adapter(attach_adapter(load_model(folder, dtype="float32"), "lora", seed=0), tmp_path / "adapter")
    other = str(build_model("qwen3_moe", tmp_path / "wide", moe_intermediate_size=48))
    with pytest.raises(ValueError, match=r"does not fit base .*: the base has 32/96 outputs in "
                                         r"'model.layers.0.mlp.experts' \(adapter tensor .*experts.base_layer.lora_B"):
        check_adapter(str(tmp_path / "adapter"), load_model(other, dtype="float32"), other, other,
                      check_base_name=False)
