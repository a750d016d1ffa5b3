# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek V4 network around attention (``vllm_dsv4_hw.model``) against transformers.

* **Parity** (the central test): tiny-flash / tiny-pro bf16 checkpoints (``make_checkpoint``, seed
  from the session seed) loaded by transformers' ``DeepseekV4ForCausalLM`` in float32 and by
  ``DSV4Network`` in float32 with our ``DSV4Attention`` over a single-sequence paged cache in the
  exact ``fp32`` entry format (run outside vLLM through ``attention.layer.running_step``) (``loader.load_weights`` from the safetensors files). Log-softmax of
  the logits at every position of prompts of 1, 127, 128, 129 and 257 tokens (one shot each), then
  chunked prefill (100 + 29 + 128) and decode steps (single tokens at 0..8, 120..131 and
  250..256, chunks between) against our one-shot run and against transformers.
  ``PARITY_TOL`` bounds max |logprob difference|; observed 1.7-2.8e-5 over seeds (fp32 rounding
  through 4-5 layers; transformers' fp32 RoPE angles differ from our float64-built tables by up to
  6e-6 rad at position 256).
* The **bf16** network (bf16 weights, bf16 main + indexer caches, as served) against the same
  transformers fp32 reference: discrete decisions (MoE top-k, indexer top-k) flip on a few tokens
  under bf16 rounding and those positions then differ by O(1) nats, so this checks the bulk
  statistics (median per-position max difference, top-1 agreement) and reports the maximum.
* Unit tests in float64 with fresh random inputs: ``moe`` against ``DeepseekV4SparseMoeBlock``
  (top-k and hash-routed, SwiGLU clamp active; same experts, outputs to 1e-10); ``mhc`` (hc_pre /
  hc_head) against ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and one whole decoder
  layer (mHC around a stub attention and the real MoE) against ``DeepseekV4DecoderLayer``. Those
  agree to fp32 rounding only (2e-6 of the largest value): transformers casts the streams to fp32
  (``.float()``) for the mixes and its RMSNorms take the rsqrt in fp32, whatever the input dtype.
* The **FP8 / FP4 checkpoint** with its weights resident as shipped (FP8 block linears, FP4
  experts, ``ops.fp8_block_linear`` / ``ops.moe_experts``) against transformers loading the same
  checkpoint (it dequantizes at load: exactly the bf16 twin's values), with the fp32 tolerance.
  The loader itself: ``test_loader.py``.

Top-k margins: the prompt is redrawn until every routing and indexer top-k decision in
transformers' own forward has a gap >= ``MIN_MARGIN`` (relative to the row's scale), so fp32
rounding differences cannot flip a selection (observed errors are ~1e-6 relative).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import SESSION_SEED
from tests.weights import assign
from vllm_dsv4_hw.attention.caches import allocate_layer_caches, page_geometry, static_block_tables
from vllm_dsv4_hw.attention.layer import DSV4Attention, running_step
from vllm_dsv4_hw.attention.metadata import build_step_metadata
from vllm_dsv4_hw.config import DSV4Config, validate_hf_config
from vllm_dsv4_hw.model import mhc
from vllm_dsv4_hw.model.loader import load_weights, safetensors_weights
from vllm_dsv4_hw.model.moe import DSV4MoE
from vllm_dsv4_hw.model.network import DSV4DecoderLayer, DSV4Network
from vllm_dsv4_hw.ops.reference import mhc as ref_mhc
from vllm_dsv4_hw.ops.registry import REGISTRY
from vllm_dsv4_hw.parallel import ParallelLayout
from vllm_dsv4_hw.tools import checkpoint as ck

PRESETS = ("tiny-flash", "tiny-pro")
LENGTHS = (1, 127, 128, 129, 257)
MAX_LEN = 257
CHUNKS = (100, 29, 128)
# Single tokens at 0..8 (first c4a entries), 120..131 (window 127/128, first c128a entry),
# 250..256 (logical block 255/256); prefill chunks in between.
DECODE = (1,) * 9 + (111,) + (1,) * 12 + (118,) + (1,) * 7
PARITY_TOL = 1e-4        # max |logprob diff|, fp32 network vs transformers fp32 (obs. 1.7-2.8e-5)
SELF_TOL = 1e-4          # chunked / decode vs our one-shot, same network (observed 1.5-2.5e-5)
MIN_MARGIN = 2e-5        # ~1 prompt in 4 is redrawn
BF16_MEDIAN_TOL = 0.3    # bf16 network: median over positions of max |logprob diff| (obs. ~0.11)
BF16_TOP1_MIN = 0.9      # bf16 network: argmax agreement with transformers (observed 0.96-0.98)
CKPT_SEED = SESSION_SEED % 100_000
assert sum(CHUNKS) == MAX_LEN and sum(DECODE) == MAX_LEN

pytestmark = pytest.mark.usefixtures("vllm_single_rank", "one_thread")


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    """Reference ops (plain torch): no Triton interpreter for these shapes."""
    monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", "reference")
    REGISTRY.clear_cache()
    yield
    REGISTRY.clear_cache()


def _hf_modeling():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


# -- checkpoints and models (built once per module, dropped at its end) ----------------------------
_STATE: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _module_state(tmp_path_factory):
    _STATE["root"] = tmp_path_factory.mktemp("dsv4_network")
    yield
    for cached in (_ckpt, _hf_model, _runner, _prompt, _hf_logprobs, _ours_oneshot):
        cached.cache_clear()
    _STATE.clear()


@functools.cache
def _ckpt(preset: str, dtype: str) -> Path:
    path = _STATE["root"] / f"{preset}-{dtype}"
    ck.make_checkpoint(path, preset, dtype, CKPT_SEED, progress=lambda _m: None)
    return path


def _hf_config_dict(preset: str) -> dict:
    return json.loads((_ckpt(preset, "bf16") / "config.json").read_text())


@functools.cache
def _hf_model(preset: str, ckpt_dtype: str = "bf16"):
    from transformers import DeepseekV4ForCausalLM

    # the FP8 / FP4 checkpoint: transformers dequantizes it at load (needs accelerate), to bf16
    # on CPU whatever dtype is asked for; the values are exact in bf16, so .float() is lossless
    model = DeepseekV4ForCausalLM.from_pretrained(_ckpt(preset, ckpt_dtype), dtype=torch.float32)
    return model.float().eval()


def _network(cfg_dict: dict, dtype: torch.dtype, max_positions: int = MAX_LEN,
             layout: ParallelLayout = ParallelLayout()) -> DSV4Network:
    acfg = DSV4Config.from_hf_dict(cfg_dict)

    def make_attention(layer_id: int, ratio: int):
        return DSV4Attention(acfg, layer_id, ratio=ratio, dtype=dtype,
                             max_positions=max_positions, layout=layout)

    return DSV4Network(cfg_dict, make_attention, dtype=dtype, layout=layout)


class SingleSequenceRunner:
    """One request over paged caches (every position has its page), driven step by step."""

    def __init__(self, path: Path, dtype: torch.dtype, main_format: str, indexer_format: str,
                 layout: ParallelLayout = ParallelLayout(), max_len: int = MAX_LEN):
        self.max_len = max_len
        self.net = _network(json.loads((path / "config.json").read_text()), dtype,
                            max_positions=max_len, layout=layout)
        self.cfg = self.net.cfg
        load_weights(self.net, safetensors_weights(path), self.cfg)
        self.formats = (main_format, indexer_format)

    def _reset(self) -> None:
        cfg = self.cfg
        self.tables, self.counts, self.geoms = {}, {}, {}
        for r in sorted(set(cfg.compress_ratios)):
            geom, _ = page_geometry(cfg, r, *self.formats)
            self.tables[r], self.counts[r] = static_block_tables(geom, r, [self.max_len])
        self.caches = {
            i: allocate_layer_caches(cfg, r, self.counts[r], *self.formats,
                                     block_tables=self.tables[r])
            for i, r in enumerate(cfg.compress_ratios)}
        self.geoms = {r: self.caches[cfg.compress_ratios.index(r)].geometry
                      for r in self.tables}
        self.pos = 0

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        metas = {r: build_step_metadata([self.pos], [n], r, self.tables[r], self.geoms[r],
                                        self.cfg.sliding_window)
                 for r in self.tables}
        with running_step(metas, self.caches):
            logits = self.net.compute_logits(self.net(ids))
        self.pos += n
        return logits

    def logprobs(self, ids: torch.Tensor, chunks=None) -> torch.Tensor:
        """Log-softmax at every position of ``ids`` run as ``chunks`` (default: one step)."""
        self._reset()
        chunks = chunks or (ids.numel(),)
        assert sum(chunks) == ids.numel()
        out, start = [], 0
        for c in chunks:
            out.append(self._step(ids[start:start + c]))
            start += c
        return torch.cat(out).log_softmax(-1)


@functools.cache
def _runner(preset: str, dtype: torch.dtype, fmt: str, ckpt_dtype: str = "bf16"
            ) -> SingleSequenceRunner:
    return SingleSequenceRunner(_ckpt(preset, ckpt_dtype), dtype, fmt, fmt)


# -- prompts with safe top-k margins ---------------------------------------------------------------
def _hf_margins(model, ids: torch.Tensor) -> float:
    """Smallest relative top-k gap of every router and indexer decision in one forward."""
    m = _hf_modeling()
    gaps: list[float] = []
    hooks = []

    def router_hook(mod, args, _out):
        flat = args[0].reshape(-1, mod.hidden_dim)
        scores = mod.score_fn(torch.nn.functional.linear(flat, mod.weight))
        sel = (scores + mod.e_score_correction_bias).sort(dim=-1, descending=True).values
        k = mod.top_k
        gaps.append(float(((sel[:, k - 1] - sel[:, k]) / sel[:, 0].abs()).min()))

    def scorer_hook(mod, _args, out):
        s = out[0]                                          # [S, T] (batch 1)
        pos = torch.arange(s.shape[0])
        visible = torch.arange(s.shape[1])[None, :] < ((pos + 1) // 4)[:, None]
        k = model.config.index_topk
        rows = visible.sum(-1) > k
        if rows.any():
            v = s.masked_fill(~visible, float("-inf"))[rows].sort(-1, descending=True).values
            scale = v[:, 0].abs().clamp_min(1e-30)
            gaps.append(float(((v[:, k - 1] - v[:, k]) / scale).min()))

    for mod in model.modules():
        if isinstance(mod, m.DeepseekV4TopKRouter):
            hooks.append(mod.register_forward_hook(router_hook))
        elif isinstance(mod, m.DeepseekV4IndexerScorer):
            hooks.append(mod.register_forward_hook(scorer_hook))
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return min(gaps) if gaps else float("inf")


@functools.cache
def _prompt(preset: str) -> torch.Tensor:
    model = _hf_model(preset)
    gen = torch.Generator().manual_seed(SESSION_SEED * 31 + PRESETS.index(preset))
    for _ in range(10):
        ids = torch.randint(0, model.config.vocab_size, (MAX_LEN,), generator=gen)
        if _hf_margins(model, ids) >= MIN_MARGIN:
            return ids
    pytest.fail(f"10 prompts all had a top-k near-tie < {MIN_MARGIN} (seed {SESSION_SEED})")


@functools.cache
def _hf_logprobs(preset: str, length: int, ckpt_dtype: str = "bf16") -> torch.Tensor:
    with torch.no_grad():
        model = _hf_model(preset, ckpt_dtype)
        return model(_prompt(preset)[None, :length]).logits[0].log_softmax(-1)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# -- parity ---------------------------------------------------------------------------------------
@functools.cache
def _ours_oneshot(preset: str, length: int) -> torch.Tensor:
    return _runner(preset, torch.float32, "fp32").logprobs(_prompt(preset)[:length])


@pytest.mark.parametrize("preset", PRESETS)
def test_oneshot_parity_with_transformers(preset):
    runner = _runner(preset, torch.float32, "fp32")
    worst = {}
    for n in LENGTHS:
        ours = _ours_oneshot(preset, n)
        ref = _hf_logprobs(preset, n)
        assert ours.shape == ref.shape == (n, runner.cfg.vocab_size)
        worst[n] = _maxdiff(ours, ref)
    print(f"\n{preset} fp32 one-shot max |dlogprob| vs transformers by length: {worst}")
    assert max(worst.values()) <= PARITY_TOL, worst


@pytest.mark.parametrize("preset", PRESETS)
def test_fp8_checkpoint_parity_with_transformers(preset):
    """Weights resident as shipped (FP8 block linears, FP4 experts) against transformers loading
    the same FP8 checkpoint, same tolerance as the bf16 checkpoint."""
    runner = _runner(preset, torch.float32, "fp32", "fp8")
    assert runner.net.layers[0].attn.wq_a_wkv.weight.dtype == torch.float8_e4m3fn
    assert runner.net.layers[0].ffn.experts.w13.dtype == torch.uint8
    worst = {}
    for n in (LENGTHS[-2], LENGTHS[-1]):
        ours = runner.logprobs(_prompt(preset)[:n])
        worst[n] = _maxdiff(ours, _hf_logprobs(preset, n, "fp8"))
    print(f"\n{preset} fp8/fp4 checkpoint, fp32 math: max |dlogprob| vs transformers {worst}")
    assert max(worst.values()) <= PARITY_TOL, worst


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_and_decode_match_oneshot(preset):
    runner = _runner(preset, torch.float32, "fp32")
    ids = _prompt(preset)
    oneshot = _ours_oneshot(preset, MAX_LEN)
    ref = _hf_logprobs(preset, MAX_LEN)
    res = {}
    for name, chunks in (("chunked", CHUNKS), ("decode", DECODE)):
        out = runner.logprobs(ids, chunks)
        res[name] = (_maxdiff(out, oneshot), _maxdiff(out, ref))
    print(f"\n{preset} fp32 max |dlogprob| (vs our one-shot, vs transformers): {res}")
    for name, (self_d, ref_d) in res.items():
        assert self_d <= SELF_TOL, (name, self_d)
        assert ref_d <= PARITY_TOL, (name, ref_d)


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_network_with_bf16_caches(preset):
    runner = _runner(preset, torch.bfloat16, "bf16")
    ids = _prompt(preset)
    ours = runner.logprobs(ids)
    ref = _hf_logprobs(preset, MAX_LEN)
    assert torch.isfinite(ours).all()
    per_pos = (ours - ref).abs().amax(-1)
    median = float(per_pos.median())
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"\n{preset} bf16 network + bf16 caches vs transformers fp32: max {float(per_pos.max()):.3g}"
          f", median {median:.3g}, top-1 agreement {top1:.3f}")
    assert median <= BF16_MEDIAN_TOL and top1 >= BF16_TOP1_MIN, (median, top1)


# -- unit tests against transformers' modules (float64, fresh inputs) ------------------------------
def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-6) -> None:
    """|a - b| <= rel * max|b| everywhere."""
    a, b = a.detach(), b.detach()
    err = float((a - b).abs().max())
    assert err <= rel * float(b.abs().max()), (err, float(b.abs().max()))


def _hf_cfg(preset: str = "tiny-flash"):
    from transformers import DeepseekV4Config

    # "eager": the per-expert loop (the standalone default would warn that none was chosen).
    return DeepseekV4Config(**ck.hf_config(preset, "bf16"), experts_implementation="eager")


def _ours_cfg(preset: str = "tiny-flash") -> DSV4Config:
    return validate_hf_config(ck.hf_config(preset, "bf16"))


def _randomize_(module: torch.nn.Module, gen: torch.Generator, vocab: int, n_experts: int) -> None:
    """Fill every parameter / buffer with values of a useful scale (no init from transformers)."""
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.dtype == torch.int64:
                t.copy_(torch.randint(0, n_experts, t.shape, generator=gen))
            elif name.endswith("fn"):   # mHC mixes: the checkpoint generator's scale
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.5
                        / t.shape[-1] ** 0.5)
            elif name.endswith("scale"):
                t.copy_(0.5 + torch.rand(t.shape, generator=gen, dtype=t.dtype))
            elif name.endswith(("base", "bias")) or t.dim() == 1:
                t.copy_((1.0 if t.dim() == 1 and "norm" in name else 0.0)
                        + 0.5 * torch.randn(t.shape, generator=gen, dtype=t.dtype))
            else:
                # matrices: std 5/sqrt(fan_in) so |w1 x| exceeds swiglu_limit=10 now and then
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 5 / t.shape[-1] ** 0.5)


def test_hc_pre_and_head_match_transformers(gen):
    m = _hf_modeling()
    cfg = _hf_cfg()
    ours = _ours_cfg()
    hc = m.DeepseekV4HyperConnection(cfg).double()
    head = m.DeepseekV4HyperHead(cfg).double()
    _randomize_(hc, gen, cfg.vocab_size, cfg.n_routed_experts)
    _randomize_(head, gen, cfg.vocab_size, cfg.n_routed_experts)
    h = torch.randn(1, 37, cfg.hc_mult, cfg.hidden_size, generator=gen, dtype=torch.float64) * 3
    post_r, comb_r, x_r = hc(h)
    x, post, comb = ref_mhc.mixes(h[0], hc.fn, hc.scale, hc.base, ours.hc_sinkhorn_iters,
                                  ours.hc_eps, ours.rms_norm_eps)
    # transformers casts the streams and fn to fp32 (``.float()``) for the mixes, whatever the
    # input dtype: agreement is to fp32 rounding (~1e-7 relative), ours stays fp64.
    _close(x, x_r[0])
    _close(post, post_r[0])
    _close(comb, comb_r[0])
    # Sinkhorn really ran: columns sum to 1, rows nearly so.
    assert (comb.sum(-2) - 1).abs().max() < 1e-5 and (comb.sum(-1) - 1).abs().max() < 1e-3
    y = mhc.hc_head(h[0], head.hc_fn, head.hc_scale, head.hc_base, hc_eps=ours.hc_eps,
                    norm_eps=ours.rms_norm_eps)
    _close(y, head(h)[0])


def _moe_pair(layer_id: int, gen: torch.Generator):
    m = _hf_modeling()
    cfg = _hf_cfg()
    theirs = m.DeepseekV4SparseMoeBlock(cfg, layer_id).double()
    _randomize_(theirs, gen, cfg.vocab_size, cfg.n_routed_experts)
    ours = DSV4MoE(_ours_cfg(), layer_id, torch.float64)
    sd = {
        "gate.weight": theirs.gate.weight,
        "experts.w13": theirs.experts.gate_up_proj,
        "experts.w2": theirs.experts.down_proj,
        "shared_experts.w1.weight": theirs.shared_experts.gate_proj.weight,
        "shared_experts.w3.weight": theirs.shared_experts.up_proj.weight,
        "shared_experts.w2.weight": theirs.shared_experts.down_proj.weight,
    }
    if ours.hash_routed:
        sd["gate.tid2eid"] = theirs.gate.tid2eid
    else:
        sd["gate.bias"] = theirs.gate.e_score_correction_bias
    assign(ours, sd)
    return theirs, ours, cfg


@pytest.mark.parametrize("layer_id", [0, 3], ids=["hash", "topk"])
def test_moe_matches_transformers(layer_id, gen):
    theirs, ours, cfg = _moe_pair(layer_id, gen)
    assert ours.hash_routed == (layer_id < _ours_cfg().num_hash_layers) == theirs.is_hash
    t = 61
    x = torch.randn(1, t, cfg.hidden_size, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=gen)
    with torch.no_grad():
        ref = theirs(x, input_ids=ids)
        _, w_ref, idx_ref = (theirs.gate(x, ids) if theirs.is_hash else theirs.gate(x))
    w, idx = ours.route(x[0], ids[0])
    out = ours(x[0], ids[0])
    # Same experts (as sets) with the same weights.
    o_ref, o = idx_ref.sort(-1), idx.sort(-1)
    assert torch.equal(o.values, o_ref.values)
    torch.testing.assert_close(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref[0], rtol=1e-10, atol=1e-10)
    # The clamp mattered: some gate / up pre-activations exceed swiglu_limit.
    e0 = int(idx[0, 0])
    pre = torch.nn.functional.linear(x[0], ours.experts.w13[e0])
    assert (pre.abs() > cfg.swiglu_limit).any()


def test_decoder_layer_matches_transformers(gen):
    """mHC pre/post around the sub-blocks, norm placement and the MoE: one transformers decoder
    layer with its attention replaced by a stub, against ours with the same stub."""
    m = _hf_modeling()
    cfg = _hf_cfg()
    layer_id = 2
    theirs = m.DeepseekV4DecoderLayer(cfg, layer_id).double()
    _randomize_(theirs, gen, cfg.vocab_size, cfg.n_routed_experts)
    w_stub = torch.randn(cfg.hidden_size, cfg.hidden_size, generator=gen,
                         dtype=torch.float64) / cfg.hidden_size ** 0.5

    class StubAttention(torch.nn.Module):
        def __init__(self, hf: bool) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, x, **_kw):
            y = torch.tanh(x @ w_stub)
            return (y, None) if self.hf else y

    theirs.self_attn = StubAttention(hf=True)
    ours = DSV4DecoderLayer(_ours_cfg(), layer_id, StubAttention(hf=False), torch.float64)
    assign(ours, {
        "attn_norm.weight": theirs.input_layernorm.weight,
        "ffn_norm.weight": theirs.post_attention_layernorm.weight,
        "hc_attn_fn": theirs.attn_hc.fn, "hc_attn_base": theirs.attn_hc.base,
        "hc_attn_scale": theirs.attn_hc.scale,
        "hc_ffn_fn": theirs.ffn_hc.fn, "hc_ffn_base": theirs.ffn_hc.base,
        "hc_ffn_scale": theirs.ffn_hc.scale,
        "ffn.gate.weight": theirs.mlp.gate.weight,
        "ffn.gate.bias": theirs.mlp.gate.e_score_correction_bias,
        "ffn.experts.w13": theirs.mlp.experts.gate_up_proj,
        "ffn.experts.w2": theirs.mlp.experts.down_proj,
        "ffn.shared_experts.w1.weight": theirs.mlp.shared_experts.gate_proj.weight,
        "ffn.shared_experts.w3.weight": theirs.mlp.shared_experts.up_proj.weight,
        "ffn.shared_experts.w2.weight": theirs.mlp.shared_experts.down_proj.weight,
    })
    h = torch.randn(1, 29, cfg.hc_mult, cfg.hidden_size, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=gen)
    with torch.no_grad():
        ref = theirs(h, input_ids=ids)
    out = ours(h[0], ids[0])
    # fp32-level agreement: transformers' mHC mixes and RMSNorms compute in fp32 (see above).
    _close(out, ref[0])
