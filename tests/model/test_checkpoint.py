# SPDX-License-Identifier: Apache-2.0
"""``make-checkpoint``: config.json, official tensor names / dtypes / shapes, FP8 and FP4 encodings,
the tokenizer and chat template, and the CLI. transformers reading the directories:
``test_checkpoint_transformers.py``; the official layout the names are checked against:
``official_layout.py``.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from tests.model.checkpoints import PROMPT, SEED, _load_all, _stored_tensors
from tests.model.official_layout import OFFICIAL_FIELDS, official_layout
from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.tools import checkpoint as ck
from vllm_dsv4_hw.tools import tokenizer_gen

pytestmark = pytest.mark.usefixtures("one_thread")


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
    assert cfg["rope_scaling"] == {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    }
    assert 0 < cfg["num_hash_layers"] < n
    if dtype == "fp8":
        assert cfg["quantization_config"] == {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        }
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
    assert c.compress_ratios == tuple(raw["compress_ratios"][: raw["num_hidden_layers"]])
    assert (c.head_dim, c.rope_dim, c.nope_dim) == (512, 64, 448)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window) == (64, 128, 16, 128)
    assert (c.hidden_size, c.num_heads, c.o_groups, c.o_lora_rank, c.q_lora_rank) == (
        raw["hidden_size"],
        raw["num_attention_heads"],
        raw["o_groups"],
        raw["o_lora_rank"],
        raw["q_lora_rank"],
    )
    assert (c.n_routed_experts, c.num_experts_per_tok, c.num_hash_layers, c.vocab_size) == (
        raw["n_routed_experts"],
        raw["num_experts_per_tok"],
        raw["num_hash_layers"],
        raw["vocab_size"],
    )
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
        math.prod(s) * sizes[dt] for dt, s in got.values()
    )
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(f"-of-{len(shards):05d}" in s.name for s in shards)
    # The generator's own layout table agrees with the official one.
    assert set(ck.stored_layout(cfg, dtype)) == set(want)


def _dequant_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = torch.exp2(scale.view(torch.uint8).double() - 127)
    s = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    return (q.double() * s).float()


_E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float64,
)


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
            assert ((ratio > 224) & (ratio <= 448)).all(), (
                f"{name}: scale is not 2^ceil(log2(amax/448))"
            )
            # e4m3: 3 mantissa bits (relative error <= 2^-4); subnormal step 2^-9 * s.
            tol = torch.maximum(2.0**-4 * master.abs(), 2.0**-10 * s) + 1e-12
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
        return {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(p.iterdir())
            if f.name != "checkpoint_info.json"
        }

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
    for text in [
        "Hello, world!",
        PROMPT,
        "  two  spaces\tand a tab\n",
        "café ünïcödé 你好 🙂 ∞",
        "def f(x):\n    return x * 2\n",
        "",
    ]:
        enc = tok.encode(text)
        assert enc.ids[0] == 0, "BOS is prepended"
        assert tok.decode(enc.ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert len(tok.encode(PROMPT).ids) >= 40

    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == tokenizer_gen.BOS and tcfg["eos_token"] == tokenizer_gen.EOS
    assert tcfg["chat_template"]
    import jinja2

    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Count to 3."},
    ]
    text = (
        jinja2.Environment()
        .from_string(tcfg["chat_template"])
        .render(
            messages=msgs,
            add_generation_prompt=True,
            bos_token=tcfg["bos_token"],
            eos_token=tcfg["eos_token"],
        )
    )
    assert text == (
        f"{tokenizer_gen.BOS}Be brief.{tokenizer_gen.USER}Hello!{tokenizer_gen.ASSISTANT}"
        f"Hi.{tokenizer_gen.EOS}{tokenizer_gen.USER}Count to 3.{tokenizer_gen.ASSISTANT}"
    )
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == tok.token_to_id(tokenizer_gen.ASSISTANT)
    assert ids.count(tok.token_to_id(tokenizer_gen.USER)) == 2
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


# -- CLI ----------------------------------------------------------------------------------------------
def test_cli_make_checkpoint(ckpts, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(
        [
            "make-checkpoint",
            str(out),
            "--preset",
            "tiny-flash",
            "--dtype",
            "bf16",
            "--seed",
            str(SEED),
        ]
    )
    o, e = capsys.readouterr()
    assert rc == 0, e
    assert str(out) in o and "tiny-flash" in o
    assert "make-checkpoint: generating layers.0 [" in e and "shard file(s)" in e  # progress
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


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--preset", "tiny-huge"], "invalid choice"),
        (["--preset", "tiny-flash", "--dtype", "fp16"], "invalid choice"),
        (["--preset", "tiny-flash", "--seed", "-3"], "seed must be in"),
        (["--preset", "tiny-flash", "--seed", "x"], "not an integer seed"),
        ([], "required"),
    ],
)
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
