"""``make-checkpoint``: config.json, official tensor names / dtypes / shapes, FP8 and FP4 encodings,
tokenizer and chat template, and transformers' DeepseekV4ForCausalLM loading the bf16 directory.

What transformers accepts (checked in ``test_transformers_*``, run in a subprocess by hf_check.py):
the bf16 directory loads into ``DeepseekV4ForCausalLM`` through its official-name conversion mapping
with no missing, unexpected or mismatched keys (the ``mtp.*`` tensors are ignored by its
``_keys_to_ignore_on_load_unexpected``); its config reads the legacy ``compress_ratios`` /
``num_hash_layers`` / ``rope_scaling`` fields. The fp8 directory does not load there: transformers'
FP8 quantizer requires the ``accelerate`` package, which this environment lacks (and its FP8 path
has no MXFP4-expert support for this model anyway); ``test_transformers_fp8_directory`` asserts that
exact failure, so a change in it shows up. The fp8 directory's weights are instead checked to
dequantize bit for bit to the bf16 directory's.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.tools import checkpoint as ck
from vllm_dsv4_hw.tools import tokenizer_gen

SEED = 1234
PROMPT = ("The quick brown fox jumps over the lazy dog. A long context model reads a whole book "
          "before it answers a single question about chapter three, and then it writes a summary "
          "for the committee, which meets on Tuesday at 10:30 to discuss 42 new proposals.")
NEW_TOKENS = 32

OFFICIAL_FIELDS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "compress_ratios",
    "compress_rope_theta", "rope_theta", "rope_scaling", "num_hash_layers", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
    "scoring_func", "topk_method", "norm_topk_prob", "swiglu_limit", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "hidden_act", "rms_norm_eps", "vocab_size",
    "max_position_embeddings", "num_nextn_predict_layers", "bos_token_id", "eos_token_id",
    "tie_word_embeddings", "torch_dtype",
)


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small tensors: one thread is fastest and does not stall when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for preset in ck.PRESETS:
        for dtype in ck.DTYPES:
            path = root / f"{preset}-{dtype}"
            summary = ck.make_checkpoint(path, preset, dtype, SEED, progress=lambda _m: None)
            out[preset, dtype] = summary
    return out


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _stored_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (safetensors dtype string, shape, shard file) over all shards, from the headers."""
    out = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        for name, meta in _read_header(shard).items():
            assert name not in out, f"{name} is stored twice"
            out[name] = (meta["dtype"], tuple(meta["shape"]), shard.name)
    return out


def _load_all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        out.update(load_file(shard))
    return out


# The official layout, written out here independently of the generator (DeepSeek-V4-Flash/-Pro
# safetensors: FP8 linears with [N/128, K/128] F8_E8M0 scales; routed experts I8 [N, K/2] with
# [N, K/32] F8_E8M0 scales; unquantized projections, norms and the router weight in BF16; sinks,
# ape, mHC parameters and the router bias in F32; tid2eid I64 on the hash-routed layers).
def official_layout(cfg: dict, quantized: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    d, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    h, ql = cfg["num_attention_heads"], cfg["q_lora_rank"]
    g, ol = cfg["o_groups"], cfg["o_lora_rank"]
    e, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    ih, ihd, hc = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hc_mult"]
    n = cfg["num_hidden_layers"]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def lin(name, rows, cols):
        if quantized:
            out[name + ".weight"] = ("F8_E4M3", (rows, cols))
            out[name + ".scale"] = ("F8_E8M0", (math.ceil(rows / 128), math.ceil(cols / 128)))
        else:
            out[name + ".weight"] = ("BF16", (rows, cols))

    def expert(name, rows, cols):
        if quantized:
            out[name + ".weight"] = ("I8", (rows, cols // 2))
            out[name + ".scale"] = ("F8_E8M0", (rows, cols // 32))
        else:
            out[name + ".weight"] = ("BF16", (rows, cols))

    def hyper(prefix):
        out[prefix + "_fn"] = ("F32", ((2 + hc) * hc, hc * d))
        out[prefix + "_base"] = ("F32", ((2 + hc) * hc,))
        out[prefix + "_scale"] = ("F32", (3,))

    def head_mix(prefix):
        out[prefix + "hc_head_fn"] = ("F32", (hc, hc * d))
        out[prefix + "hc_head_base"] = ("F32", (hc,))
        out[prefix + "hc_head_scale"] = ("F32", (1,))

    def compressor(prefix, ratio, dim):
        coff = 2 if ratio == 4 else 1
        out[prefix + ".wkv.weight"] = ("BF16", (coff * dim, d))
        out[prefix + ".wgate.weight"] = ("BF16", (coff * dim, d))
        out[prefix + ".ape"] = ("F32", (ratio, coff * dim))
        out[prefix + ".norm.weight"] = ("BF16", (dim,))

    def block(p, ratio, hashed):
        a = p + ".attn"
        lin(a + ".wq_a", ql, d)
        lin(a + ".wq_b", h * hd, ql)
        lin(a + ".wkv", hd, d)
        lin(a + ".wo_a", g * ol, h * hd // g)
        lin(a + ".wo_b", d, g * ol)
        out[a + ".q_norm.weight"] = ("BF16", (ql,))
        out[a + ".kv_norm.weight"] = ("BF16", (hd,))
        out[a + ".attn_sink"] = ("F32", (h,))
        if ratio:
            compressor(a + ".compressor", ratio, hd)
        if ratio == 4:
            lin(a + ".indexer.wq_b", ih * ihd, ql)
            out[a + ".indexer.weights_proj.weight"] = ("BF16", (ih, d))
            compressor(a + ".indexer.compressor", 4, ihd)
        out[p + ".attn_norm.weight"] = ("BF16", (d,))
        out[p + ".ffn_norm.weight"] = ("BF16", (d,))
        hyper(p + ".hc_attn")
        hyper(p + ".hc_ffn")
        f = p + ".ffn"
        out[f + ".gate.weight"] = ("BF16", (e, d))
        if hashed:
            out[f + ".gate.tid2eid"] = ("I64", (v, k))
        else:
            out[f + ".gate.bias"] = ("F32", (e,))
        for i in range(e):
            expert(f"{f}.experts.{i}.w1", inter, d)
            expert(f"{f}.experts.{i}.w2", d, inter)
            expert(f"{f}.experts.{i}.w3", inter, d)
        lin(f + ".shared_experts.w1", inter, d)
        lin(f + ".shared_experts.w2", d, inter)
        lin(f + ".shared_experts.w3", inter, d)

    out["embed.weight"] = ("BF16", (v, d))
    out["head.weight"] = ("BF16", (v, d))
    out["norm.weight"] = ("BF16", (d,))
    head_mix("")
    for i in range(n):
        block(f"layers.{i}", cfg["compress_ratios"][i], i < cfg["num_hash_layers"])
    block("mtp.0", cfg["compress_ratios"][n], False)
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = ("BF16", (d,))
    lin("mtp.0.e_proj", d, d)
    lin("mtp.0.h_proj", d, d)
    head_mix("mtp.0.")
    return out


# -- config.json --------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(ck.PRESETS))
@pytest.mark.parametrize("dtype", list(ck.DTYPES))
def test_config_json_has_the_official_fields(ckpts, preset, dtype):
    cfg = json.loads((ckpts[preset, dtype].path / "config.json").read_text())
    missing = [f for f in OFFICIAL_FIELDS if f not in cfg]
    assert not missing, missing
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    n = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    assert len(ratios) == n + 1 and ratios[-1] == 0, "one ratio per layer, then the MTP layer's 0"
    # tiny-flash has every layer kind (0, 4, 128); tiny-pro follows V4-Pro, which has no
    # window-only main layer (its hash-routed layers are c128a instead).
    assert set(ratios[:n]) == ({0, 4, 128} if preset == "tiny-flash" else {4, 128})
    assert (cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["sliding_window"]) == (512, 64, 128)
    assert (cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]) == (64, 128, 16)
    assert cfg["hc_mult"] == 4 and cfg["num_attention_heads"] % cfg["o_groups"] == 0
    assert cfg["rope_scaling"] == {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                   "original_max_position_embeddings": 65536, "type": "yarn"}
    assert 0 < cfg["num_hash_layers"] < n
    if dtype == "fp8":
        assert cfg["quantization_config"] == {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        assert cfg["expert_dtype"] == "fp4"
    else:
        assert "quantization_config" not in cfg and "expert_dtype" not in cfg


def test_presets_follow_the_model_patterns(ckpts):
    flash = json.loads((ckpts["tiny-flash", "fp8"].path / "config.json").read_text())
    pro = json.loads((ckpts["tiny-pro", "fp8"].path / "config.json").read_text())
    # Flash: 0, 0, then 4 on even / 128 on odd layers; Pro: 128, 128, then the same alternation.
    assert flash["compress_ratios"] == [0, 0, 4, 128, 4, 0]
    assert pro["compress_ratios"] == [128, 128, 4, 128, 0]
    assert pro["routed_scaling_factor"] == 2.5 and flash["routed_scaling_factor"] == 1.5
    assert pro["hidden_size"] > flash["hidden_size"]
    assert pro["num_attention_heads"] > flash["num_attention_heads"]


@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_config_loads_with_dsv4config(ckpts, preset):
    path = ckpts[preset, "fp8"].path
    raw = json.loads((path / "config.json").read_text())
    c = DSV4Config.from_json(path)
    assert c.compress_ratios == tuple(raw["compress_ratios"][:raw["num_hidden_layers"]])
    assert (c.head_dim, c.rope_dim, c.nope_dim) == (512, 64, 448)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window) == (64, 128, 16, 128)
    assert (c.hidden_size, c.num_heads, c.o_groups, c.o_lora_rank, c.q_lora_rank) == (
        raw["hidden_size"], raw["num_attention_heads"], raw["o_groups"], raw["o_lora_rank"],
        raw["q_lora_rank"])
    assert (c.n_routed_experts, c.num_experts_per_tok, c.num_hash_layers, c.vocab_size) == (
        raw["n_routed_experts"], raw["num_experts_per_tok"], raw["num_hash_layers"],
        raw["vocab_size"])
    assert c.yarn.factor == 16 and c.yarn.original_max_position_embeddings == 65536
    assert c.compress_rope_theta == 160000 and c.rope_theta == 10000
    assert c.num_mtp_layers == 1
    # The same config as the generator's own helper.
    assert raw == ck.hf_config(preset, "fp8")


# -- tensors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(ck.PRESETS))
@pytest.mark.parametrize("dtype", list(ck.DTYPES))
def test_tensor_names_dtypes_shapes_are_official(ckpts, preset, dtype):
    path = ckpts[preset, dtype].path
    cfg = json.loads((path / "config.json").read_text())
    want = official_layout(cfg, quantized=dtype == "fp8")
    stored = _stored_tensors(path)
    got = {name: (dt, shape) for name, (dt, shape, _) in stored.items()}
    assert sorted(set(want) - set(got)) == [], "missing tensors"
    assert sorted(set(got) - set(want)) == [], "unexpected tensors"
    wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
    assert not wrong, wrong
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: shard for n, (_, _, shard) in stored.items()}
    sizes = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}
    assert index["metadata"]["total_size"] == sum(
        math.prod(s) * sizes[dt] for dt, s in got.values())
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(f"-of-{len(shards):05d}" in s.name for s in shards)
    # The generator's own layout table agrees with the official one.
    assert set(ck.stored_layout(cfg, dtype)) == set(want)


def _dequant_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = torch.exp2(scale.view(torch.uint8).double() - 127)
    s = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    return (q.double() * s).float()


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                      -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def _dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    vals = torch.stack([_E2M1[b & 0xF], _E2M1[b >> 4]], dim=-1).flatten(-2)  # low nibble first
    s = torch.exp2(scale.view(torch.uint8).double() - 127).repeat_interleave(32, dim=1)
    return (vals * s).float()


@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_fp8_and_fp4_dequantize_to_the_bf16_checkpoint(ckpts, preset):
    """Same seed: every FP8 linear (e4m3 * 2^(scale-127) per 128x128 block) and FP4 expert
    (e2m1 * 2^(scale-127) per 32 along K) dequantizes exactly to the bf16 checkpoint's weight, and
    within FP8 / FP4 rounding of the generator's fp32 master weights; scales are the ue8m0 amax
    scales. Tensors stored unquantized are identical in both."""
    q = _load_all(ckpts[preset, "fp8"].path)
    b = _load_all(ckpts[preset, "bf16"].path)
    cfg = ck.hf_config(preset, "fp8")
    masters = {spec.name: m for spec, m in ck.master_weights(cfg, SEED)}
    n8 = n4 = 0
    for name, t in q.items():
        if name.endswith(".scale"):
            continue
        base = name.removesuffix(".weight")
        if base + ".scale" not in q:
            assert torch.equal(t, b[name]), f"{name} differs between the fp8 and bf16 checkpoints"
            continue
        scale = q[base + ".scale"]
        assert scale.dtype == torch.float8_e8m0fnu
        master = masters[base]
        if ".experts." in name:
            n4 += 1
            assert t.dtype == torch.int8
            deq = _dequant_fp4(t, scale)
            s = torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, dim=1)
            amax = master.abs().reshape(master.shape[0], -1, 32).amax(-1)
            ratio = amax / s[:, ::32]
            assert ((ratio > 3) & (ratio <= 6)).all(), f"{name}: scale is not 2^ceil(log2(amax/6))"
            # e2m1: relative spacing 1/2 at most; below 0.25*s values round to 0.
            tol = torch.maximum(0.25 * master.abs(), 0.25 * s) + 1e-12
        else:
            n8 += 1
            assert t.dtype == torch.float8_e4m3fn
            deq = _dequant_fp8(t, scale)
            s = _dequant_fp8(torch.ones_like(t, dtype=torch.float32).to(torch.float8_e4m3fn), scale)
            rows, cols = master.shape
            blocks = master.reshape(rows // 128, 128, cols // 128, 128)
            block_scale = torch.exp2(scale.view(torch.uint8).float() - 127)
            ratio = blocks.abs().amax(dim=(1, 3)) / block_scale
            assert ((ratio > 224) & (ratio <= 448)).all(), \
                f"{name}: scale is not 2^ceil(log2(amax/448))"
            # e4m3: 3 mantissa bits (relative error <= 2^-4); subnormal step 2^-9 * s.
            tol = torch.maximum(2.0 ** -4 * master.abs(), 2.0 ** -10 * s) + 1e-12
        assert torch.equal(deq, b[name].float()), f"{name}: dequantized fp8 != bf16 checkpoint"
        assert ((deq - master).abs() <= tol).all(), f"{name}: beyond quantization error of master"
    assert n8 > 0 and n4 == 3 * cfg["n_routed_experts"] * (cfg["num_hidden_layers"] + 1)


def test_weights_are_deterministic_in_the_seed(ckpts, tmp_path):
    a = ckpts["tiny-flash", "fp8"].path
    def quiet(_msg):
        pass

    again = ck.make_checkpoint(tmp_path / "again", "tiny-flash", "fp8", SEED, progress=quiet)
    other = ck.make_checkpoint(tmp_path / "other", "tiny-flash", "fp8", SEED + 1, progress=quiet)

    def digest(p):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(p.iterdir()) if f.name != "checkpoint_info.json"}

    assert digest(again.path) == digest(a)
    assert digest(other.path) != digest(a)
    # Different seed, same tokenizer and config.
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (other.path / f).read_bytes() == (a / f).read_bytes()


def test_weight_statistics(ckpts):
    """O(1) scales: unit-variance embedding, fan-in-scaled linears, norms near 1, head logits std ~3."""
    w = _load_all(ckpts["tiny-flash", "bf16"].path)
    d = 256
    assert abs(w["embed.weight"].float().std().item() - 1.0) < 0.05
    assert abs(w["head.weight"].float().std().item() * math.sqrt(d) - 3.0) < 0.3
    assert abs(w["layers.2.attn.wq_a.weight"].float().std().item() * math.sqrt(d) - 1.0) < 0.1
    norm = w["layers.0.attn_norm.weight"].float()
    assert 0.5 <= norm.min() and norm.max() <= 1.5 and abs(norm.mean().item() - 1) < 0.05
    assert w["layers.0.attn.attn_sink"].dtype == torch.float32
    t2e = w["layers.0.ffn.gate.tid2eid"]
    assert t2e.min() >= 0 and t2e.max() < 8
    assert all(len(set(row.tolist())) == row.numel() for row in t2e[:100]), "distinct experts"


# -- tokenizer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_tokenizer_round_trips_and_has_a_chat_template(ckpts, preset):
    from tokenizers import Tokenizer

    path = ckpts[preset, "bf16"].path
    cfg = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert tok.token_to_id(tokenizer_gen.BOS) == cfg["bos_token_id"] == 0
    assert tok.token_to_id(tokenizer_gen.EOS) == cfg["eos_token_id"] == 1
    for text in ["Hello, world!", PROMPT, "  two  spaces\tand a tab\n", "café ünïcödé 你好 🙂 ∞",
                 "def f(x):\n    return x * 2\n", ""]:
        enc = tok.encode(text)
        assert enc.ids[0] == 0, "BOS is prepended"
        assert tok.decode(enc.ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert len(tok.encode(PROMPT).ids) >= 40

    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == tokenizer_gen.BOS and tcfg["eos_token"] == tokenizer_gen.EOS
    assert tcfg["chat_template"]
    import jinja2

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Count to 3."}]
    text = jinja2.Environment().from_string(tcfg["chat_template"]).render(
        messages=msgs, add_generation_prompt=True, bos_token=tcfg["bos_token"],
        eos_token=tcfg["eos_token"])
    assert text == (f"{tokenizer_gen.BOS}Be brief.{tokenizer_gen.USER}Hello!{tokenizer_gen.ASSISTANT}"
                    f"Hi.{tokenizer_gen.EOS}{tokenizer_gen.USER}Count to 3.{tokenizer_gen.ASSISTANT}")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == tok.token_to_id(tokenizer_gen.ASSISTANT)
    assert ids.count(tok.token_to_id(tokenizer_gen.USER)) == 2
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


# -- transformers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_report(ckpts):
    bf16 = [str(ckpts[p, "bf16"].path) for p in ck.PRESETS]
    req = {"bf16": bf16, "fp8": [str(ckpts["tiny-flash", "fp8"].path)], "prompt": PROMPT,
           "new_tokens": NEW_TOKENS, "nocache_check": [str(ckpts["tiny-flash", "bf16"].path)]}
    script = Path(__file__).with_name("hf_check.py")
    proc = subprocess.run([sys.executable, str(script), json.dumps(req)], capture_output=True,
                          text=True, timeout=300, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HF_CHECK_JSON ")), None)
    assert proc.returncode == 0 and line, (
        f"hf_check.py failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("HF_CHECK_JSON "):])


@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_transformers_reads_the_config(ckpts, hf_report, preset):
    rep = hf_report["bf16"][str(ckpts[preset, "bf16"].path)]
    cfg = ck.hf_config(preset, "bf16")
    n = cfg["num_hidden_layers"]
    names = {0: "sliding_attention", 4: "compressed_sparse_attention",
             128: "heavily_compressed_attention"}
    assert rep["config_class"] == "DeepseekV4Config"
    assert rep["layer_types"] == [names[r] for r in cfg["compress_ratios"][:n]]
    assert rep["mlp_layer_types"] == (["hash_moe"] * cfg["num_hash_layers"]
                                      + ["moe"] * (n - cfg["num_hash_layers"]))
    comp = rep["rope_parameters"]["compress"]
    assert comp["rope_type"] == "yarn" and comp["factor"] == 16 and comp["rope_theta"] == 160000
    assert comp["attention_factor"] == 1.0
    assert rep["rope_parameters"]["main"]["rope_theta"] == 10000
    assert rep["qk_rope_head_dim"] == 64


@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_transformers_loads_every_tensor(ckpts, hf_report, preset):
    """No missing / unexpected / mismatched keys through transformers' official-name mapping, and
    the values land on the right parameters (spot checks incl. expert merging, tid2eid, bias)."""
    rep = hf_report["bf16"][str(ckpts[preset, "bf16"].path)]
    assert rep["loading_info"] == {"missing_keys": [], "unexpected_keys": [],
                                   "mismatched_keys": [], "error_msgs": []}
    assert rep["values"]["mismatched"] == []
    summary = ckpts[preset, "bf16"]
    cfg = ck.hf_config(preset, "bf16")
    # transformers' parameters = ours without the MTP layer and without its buffers
    # (tid2eid on hash layers, e_score_correction_bias on the others).
    n, nh = cfg["num_hidden_layers"], cfg["num_hash_layers"]
    buffers = (nh * cfg["vocab_size"] * cfg["num_experts_per_tok"]
               + (n - nh) * cfg["n_routed_experts"])
    assert rep["num_parameters"] == summary.num_params_main - buffers


@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_transformers_forward_gives_varied_greedy_tokens(ckpts, hf_report, preset):
    rep = hf_report["bf16"][str(ckpts[preset, "bf16"].path)]
    assert rep["prompt_len"] >= 40
    assert rep["logits_finite"]
    assert 2.0 < rep["logits_std"] < 5.0
    assert 0.05 < rep["top1_prob_mean"] < 0.9, "neither flat nor collapsed"
    greedy = rep["greedy"]
    assert len(greedy) == NEW_TOKENS
    assert greedy[0] == rep["argmax_per_position"][-1]
    # "Varied outputs": not one repeated token -- in fact many distinct ones, none of them special.
    assert len(set(greedy)) >= NEW_TOKENS // 2, greedy
    assert len(set(rep["argmax_per_position"])) >= 20
    special = set(tokenizer_gen.special_token_ids(ck.PRESETS[preset]["vocab_size"]))
    assert not special & set(greedy)
    # The chat template through AutoTokenizer.
    assert rep["chat_text"].startswith(tokenizer_gen.BOS)
    assert rep["chat_text"].endswith(tokenizer_gen.ASSISTANT)
    assert rep["chat_ids"][0] == 0 and rep["chat_ids"].count(0) == 1


def test_transformers_cached_generation_matches_recompute(ckpts, hf_report):
    rep = hf_report["bf16"][str(ckpts["tiny-flash", "bf16"].path)]
    assert rep["greedy_nocache"] == rep["greedy"]


def test_transformers_fp8_directory(ckpts, hf_report):
    """transformers cannot load the FP8/FP4 directory here: its FP8 quantizer needs `accelerate`
    (not installed). If that changes, this test says so (and the report must be updated)."""
    import importlib.util

    rep = hf_report["fp8"][str(ckpts["tiny-flash", "fp8"].path)]
    if importlib.util.find_spec("accelerate") is None:
        assert rep["loaded"] is False
        assert rep["error_type"] == "ImportError" and "accelerate" in rep["error"], rep
    else:
        pytest.fail(f"accelerate is installed now; transformers on the fp8 directory gave {rep}")


# -- CLI ----------------------------------------------------------------------------------------------
def test_cli_make_checkpoint(ckpts, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["make-checkpoint", str(out), "--preset", "tiny-flash", "--dtype", "bf16",
               "--seed", str(SEED)])
    o, e = capsys.readouterr()
    assert rc == 0, e
    assert str(out) in o and "tiny-flash" in o
    assert "make-checkpoint: generating layers.0" in e and "writing shard" in e  # progress
    ref = ckpts["tiny-flash", "bf16"].path
    for f in ref.iterdir():
        if f.name != "checkpoint_info.json":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    info = ck.read_checkpoint_info(out)
    assert (info["preset"], info["dtype"], info["seed"]) == ("tiny-flash", "bf16", SEED)

    # Not empty: refused; --force replaces it.
    rc = main(["make-checkpoint", str(out), "--preset", "tiny-flash", "-q"])
    o, e = capsys.readouterr()
    assert rc == 2 and e.count("\n") == 1 and "not empty" in e and "--force" in e
    rc = main(["make-checkpoint", str(out), "--preset", "tiny-flash", "--force", "-q", "--json"])
    o, e = capsys.readouterr()
    assert rc == 0 and e == ""
    summary = json.loads(o)
    assert summary["dtype"] == "fp8" and summary["seed"] == 0
    assert not list(tmp_path.glob(".cli.partial-*")), "no leftover temporary directory"


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "tiny-huge"], "invalid choice"),
    (["--preset", "tiny-flash", "--dtype", "fp16"], "invalid choice"),
    (["--preset", "tiny-flash", "--seed", "-3"], "seed must be in"),
    (["--preset", "tiny-flash", "--seed", "x"], "not an integer seed"),
    ([], "required"),
])
def test_cli_make_checkpoint_bad_arguments(tmp_path, capsys, argv, needle):
    rc = main(["make-checkpoint", str(tmp_path / "x"), *argv])
    _, e = capsys.readouterr()
    assert rc == 2
    assert e.count("\n") == 1 and e.startswith("vllm-dsv4-hw: error:") and needle in e, e
    assert not (tmp_path / "x").exists()


def test_cli_make_checkpoint_unwritable(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["make-checkpoint", str(blocker / "sub"), "--preset", "tiny-flash", "-q"])
    _, e = capsys.readouterr()
    assert rc == 2 and e.count("\n") == 1 and "cannot create" in e, e
    rc = main(["make-checkpoint", str(blocker), "--preset", "tiny-flash", "-q"])
    _, e = capsys.readouterr()
    assert rc == 2 and "not a directory" in e, e
