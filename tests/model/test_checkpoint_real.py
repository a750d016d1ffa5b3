# SPDX-License-Identifier: Apache-2.0
"""``make-checkpoint --preset v4-flash|v4-pro --layers N``: real-dimension checkpoints, checked
without writing their gigabytes.

* The config.json of N layers is the real model's (every ``load_config`` fact, ratios
  ``compress_ratios[:N]`` + the MTP layer's 0, hash-routed first layers) and validates.
* The planned tensors (names, dtypes, shapes; what ``--dry-run`` reports) are the official layout
  (``official_layout.py``), and they load through the product's loader into the network built on
  the meta device from that config.json (every parameter exactly once, shapes and formats checked;
  the tensors are zero-storage expanded scalars).
* What the real sizes change in the writer, exercised at tiny sizes: tensors drawn and written in
  blocks of rows land at their offsets (a tiny checkpoint with a small ``CHUNK_ELEMENTS`` loads
  and equals its masters' encoding), a tiny preset cut to N layers loads into the network, the fast
  FP4 encoder is ``quantize_fp4_experts`` bit for bit, the real-vocabulary tokenizer.
* The CLI: ``--layers`` refused in one line (exit 2) when missing, out of range or not a count.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.official_layout import official_layout
from vllm_dsv4_hw.cli.main import main
from vllm_dsv4_hw.config import DSV4Config, load_config, validate_hf_config
from vllm_dsv4_hw.tools import checkpoint as ck
from vllm_dsv4_hw.tools import checkpoint_weights, tokenizer_gen
from vllm_dsv4_hw.tools.checkpoint_writer import SAFETENSORS_DTYPES

pytestmark = pytest.mark.usefixtures("one_thread")

REAL = ("v4-flash", "v4-pro")
_SAME = [
    f for f in DSV4Config.__dataclass_fields__ if f not in ("name", "compress_ratios", "weights")
]


# -- config.json ----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", REAL)
@pytest.mark.parametrize("layers", [1, 2, 4])
def test_config_is_the_real_model_cut_to_n_layers(preset, layers):
    real = load_config(preset)
    cfg = ck.hf_config(preset, "fp8", layers)
    got = validate_hf_config(cfg)
    assert {f: getattr(got, f) for f in _SAME} == {f: getattr(real, f) for f in _SAME}
    assert got.compress_ratios == real.compress_ratios[:layers]
    assert cfg["compress_ratios"] == [*real.compress_ratios[:layers], 0], "then the MTP layer's 0"
    assert cfg["num_hidden_layers"] == layers and cfg["num_nextn_predict_layers"] == 1
    assert cfg["num_hash_layers"] == real.num_hash_layers == 3
    assert got.weights.fp8_linears and cfg["expert_dtype"] == "fp4"
    assert cfg["vocab_size"] == 129280 and cfg["hidden_size"] == real.hidden_size
    assert "quantization_config" not in ck.hf_config(preset, "bf16", layers)
    full = ck.hf_config(preset, "fp8", real.num_layers)
    assert full["compress_ratios"][:-1] == list(real.compress_ratios)


# -- the tensors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", REAL)
@pytest.mark.parametrize("dtype", ck.DTYPES)
def test_planned_tensors_are_the_official_layout(preset, dtype):
    plan = ck.checkpoint_plan(preset, dtype, 4)
    want = official_layout(plan.cfg, quantized=dtype == "fp8")
    got = {n: (SAFETENSORS_DTYPES[dt], shape) for n, (dt, shape) in plan.layout().items()}
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    assert {n: got[n] for n in want if got[n] != want[n]} == {}
    hashed = sorted(n for n in got if n.endswith("gate.tid2eid"))
    assert hashed == [f"layers.{i}.ffn.gate.tid2eid" for i in range(3)], "layers 0-2 hash-routed"
    e = plan.cfg["n_routed_experts"]
    assert sum(n.endswith(".w1.weight") and ".experts." in n for n in got) == 5 * e
    # The files: each tensor inside its shard, none overlapping, the file exactly covered.
    spans: dict[int, list] = {}
    for t in plan.tensors.values():
        spans.setdefault(t.shard, []).append((t.offset, t.offset + t.nbytes, t.dtype.itemsize))
    for shard, s in spans.items():
        s.sort()
        assert s[0][0] == len(plan.headers[shard]) and s[-1][1] == plan.file_sizes[shard]
        assert all(a[1] == b[0] for a, b in zip(s, s[1:], strict=False)), "contiguous"
        assert all(start % size == 0 for start, _, size in s), "aligned"
    assert plan.tensor_bytes == sum(f - len(h) for f, h in zip(plan.file_sizes, plan.headers))


@pytest.mark.usefixtures("vllm_single_rank")
@pytest.mark.parametrize(
    "preset, dtype, layers", [("v4-flash", "fp8", 4), ("v4-pro", "fp8", 4), ("v4-flash", "bf16", 2)]
)
def test_real_dimensions_load_through_the_loader_on_meta(preset, dtype, layers, caplog):
    from vllm_dsv4_hw.attention.layer import DSV4Attention
    from vllm_dsv4_hw.model.loader import load_weights
    from vllm_dsv4_hw.model.network import DSV4Network

    plan = ck.checkpoint_plan(preset, dtype, layers)
    acfg = DSV4Config.from_hf_dict(plan.cfg)
    with torch.device("meta"):
        net = DSV4Network(
            plan.cfg,
            lambda i, r: DSV4Attention(
                acfg, i, ratio=r, dtype=torch.bfloat16, max_positions=16, prefix=f"layers.{i}.attn"
            ),
            dtype=torch.bfloat16,
        )
    # What the loader reads: each tensor's dtype and shape, as zero-storage expanded zeros.
    tensors = [(n, torch.zeros((), dtype=dt).expand(s)) for n, (dt, s) in plan.layout().items()]
    loaded = load_weights(net, tensors, net.cfg)
    assert loaded == set(net.state_dict()), "every parameter loaded"
    quantized = {p.dtype for p in net.parameters()} & {torch.float8_e4m3fn, torch.uint8}
    assert bool(quantized) == (dtype == "fp8")
    assert (
        len(net.layers) == layers
        and net.cfg.n_routed_experts == load_config(preset).n_routed_experts
    )
    experts = net.layers[0].ffn.experts
    assert {tuple(p.shape) for p in experts.parameters()} >= (
        {(net.cfg.n_routed_experts, 2 * net.cfg.moe_intermediate_size, net.cfg.hidden_size // 2)}
        if dtype == "fp8"
        else set()
    )


# -- the writer at tiny sizes ---------------------------------------------------------------------
def test_blocks_of_rows_land_at_their_offsets(tmp_path, monkeypatch):
    """With a small CHUNK_ELEMENTS the tiny embedding, head, tid2eid and FP8 linears are drawn in
    blocks of rows (as the real ones are): the files hold each tensor's assembled master values,
    encoded (FP8 blocks of whole 128-row blocks: the same as encoding the whole tensor)."""
    from safetensors import safe_open

    monkeypatch.setattr(checkpoint_weights, "CHUNK_ELEMENTS", 1 << 15)
    path = tmp_path / "chunked"
    ck.make_checkpoint(path, "tiny-pro", "fp8", 7, layers=1, progress=lambda _m: None, workers=3)
    cfg = json.loads((path / "config.json").read_text())
    special = tokenizer_gen.special_token_ids(cfg["vocab_size"])
    chunked = 0
    stored = {}
    for f in sorted(path.glob("model-*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            stored.update({n: h.get_tensor(n) for n in h.keys()})  # noqa: SIM118
    for spec in ck.tensor_specs(cfg):
        blocks = ck.row_chunks(spec)
        chunked += len(blocks) > 1
        if spec.kind == "fp8":
            assert all(r0 % 128 == 0 and r1 % 128 in (0, spec.shape[0] % 128) for r0, r1 in blocks)
        master = ck.master_tensor(spec, 7, special)
        for name, want in ck.encode_tensor(spec, master, "fp8").items():
            assert torch.equal(stored[name].view(torch.uint8), want.view(torch.uint8)), name
    assert chunked >= 10
    head = ck.master_tensor(
        next(s for s in ck.tensor_specs(cfg) if s.name == "head.weight"), 7, special
    )
    ratio = head[special].std() / head[[i for i in range(64) if i not in special]].std()
    assert ratio < 0.5, "special rows scaled down in every block"


def test_a_tiny_preset_cut_to_n_layers_loads(tmp_path):
    from vllm_dsv4_hw.engine.serve_checks import _refetch

    path = tmp_path / "cut"
    s = ck.make_checkpoint(path, "tiny-flash", "bf16", 3, layers=3, progress=lambda _m: None)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == s.layers == 3 and cfg["compress_ratios"] == [0, 0, 4, 0]
    assert "--preset tiny-flash --layers 3 --dtype bf16 --seed 3 --force" in _refetch(path)
    full = ck.checkpoint_plan("tiny-flash", "bf16")
    assert set(ck.checkpoint_plan("tiny-flash", "bf16", 3).layout()) < set(full.layout())


@pytest.mark.usefixtures("vllm_single_rank")
def test_the_cut_checkpoint_loads_into_the_network(tmp_path):
    from vllm_dsv4_hw.attention.layer import DSV4Attention
    from vllm_dsv4_hw.model.loader import safetensors_weights
    from vllm_dsv4_hw.model.network import DSV4Network

    path = tmp_path / "cut8"
    ck.make_checkpoint(path, "tiny-pro", "fp8", 5, layers=3, progress=lambda _m: None)
    cfg = json.loads((path / "config.json").read_text())
    acfg = DSV4Config.from_hf_dict(cfg)
    net = DSV4Network(
        cfg,
        lambda i, r: DSV4Attention(
            acfg, i, ratio=r, dtype=torch.bfloat16, max_positions=16, prefix=f"layers.{i}.attn"
        ),
        dtype=torch.bfloat16,
    )
    assert net.load_weights(safetensors_weights(path)) == set(net.state_dict())
    h = net.layers[2].ffn(torch.randn(5, cfg["hidden_size"]).bfloat16(), torch.arange(5))
    assert torch.isfinite(h.float()).all()


def test_fast_fp4_encoder_is_the_reference_bit_for_bit(gen):
    from vllm_dsv4_hw.quant.formats import quantize_fp4_experts

    grid = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 1e-30])
    ties = torch.cat([grid, torch.nextafter(grid, torch.tensor(9.0))])  # 32: one block
    cases = [
        torch.randn(64, 256, generator=gen) * 0.02,
        torch.cat([ties, -ties, ties * 2.0**-7, -ties * 2.0**40]).reshape(4, 32),
        torch.zeros(2, 64),
    ]
    for w in cases:
        q0, s0 = quantize_fp4_experts(w)
        q1, s1 = checkpoint_weights._quantize_fp4(w)
        assert torch.equal(q0, q1) and torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))


def test_the_real_vocabulary_tokenizer():
    tok = tokenizer_gen.build_tokenizer(129280)
    assert tok.get_vocab_size() == 129280
    text = "Hello, world! café 你好 <unused_5>"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and max(ids) < tokenizer_gen.MAX_BPE_TOKENS, "fillers unreached"
    special = tokenizer_gen.special_token_ids(129280)
    assert special[-1] == 129279 and len(special) == 129280 - tokenizer_gen.MAX_BPE_TOKENS + 5
    assert tok.token_to_id(tokenizer_gen.filler_token(0)) == tokenizer_gen.MAX_BPE_TOKENS
    # the tiny vocabularies are unchanged: only the placeholders after the BPE tokens
    assert tokenizer_gen.special_token_ids(1024)[5:] == list(range(1016, 1024))


# -- CLI ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--preset", "v4-flash"], "v4-flash needs --layers N (1-43"),
        (
            ["--preset", "v4-pro", "--layers", "62"],
            "--layers 62: v4-pro has 61 layers (choose 1-61)",
        ),
        (["--preset", "v4-flash", "--layers", "44"], "v4-flash has 43 layers"),
        (["--preset", "v4-flash", "--layers", "0"], "must be at least 1"),
        (["--preset", "v4-flash", "--layers", "two"], "not a layer count"),
        (["--preset", "tiny-flash", "--layers", "6"], "tiny-flash has 5 layers"),
        (["--preset", "v4-flash", "--layers", "1", "--device", "tpu"], "--device tpu"),
        (["--preset", "v4-flash", "--layers", "1", "--workers", "0"], "positive integer"),
    ],
)
def test_cli_layers_refused_in_one_line(tmp_path, capsys, argv, needle):
    rc = main(["make-checkpoint", str(tmp_path / "x"), *argv])
    _, e = capsys.readouterr()
    assert rc == 2
    assert e.count("\n") == 1 and e.startswith("vllm-dsv4-hw: error:") and needle in e, e
    assert not (tmp_path / "x").exists()


def test_cli_dry_run(tmp_path, capsys):
    out = tmp_path / "x"
    rc = main(["make-checkpoint", str(out), "--preset", "v4-pro", "--layers", "2", "--dry-run"])
    o, e = capsys.readouterr()
    assert rc == 0 and "v4-pro" in o and "2 layers + 1 MTP" in o and "nothing written" in o
    assert not out.exists()
    rc = main(
        [
            "make-checkpoint",
            str(out),
            "--preset",
            "v4-flash",
            "--layers",
            "3",
            "--dry-run",
            "--json",
        ]
    )
    o, _ = capsys.readouterr()
    got = json.loads(o)
    assert got["layers"] == 3 and got["compress_ratios"] == [0, 0, 4, 0]
    plan = ck.checkpoint_plan("v4-flash", "fp8", 3)
    assert got["tensor_bytes"] == plan.tensor_bytes and got["num_tensors"] == len(plan.tensors)
    # FP4 experts: 3 x 256 x 2048 x 4096 x (1/2 + 1/32) bytes in each of 3 layers + MTP
    experts = 4 * 3 * 256 * 2048 * 4096 * 17 // 32
    assert experts < plan.tensor_bytes < experts + 3 * 2**30
    assert not out.exists()
