"""FP8 weights as in the DeepSeek V4 checkpoints: e4m3 values with one ue8m0 (power-of-two) scale per
128x128 block, and the GEMM paths that use them.

GEMM paths (``Fp8Gemm.mode``; ``auto`` picks per device after a probe against ``dequant``):

* ``triton``    (decode, M <= ``small_m``): ``benchmarks.stack.w8a16`` — the e4m3 bytes are read once
  and converted in registers (W8A16: bf16 activations, fp32 accumulation). Larger M (prefill chunks)
  uses ``dequant``;
* ``scaled_mm`` ``torch._scaled_mm`` with DeepSeek's blockwise recipe (activations quantized to e4m3
  per 1x128 group with power-of-two scales, weights per 128x128 block): the FP8 x FP8 tensor-core
  GEMM of the real model, where this torch/GPU accepts it (the probe tries the scale layouts);
* ``dequant``   the weight is dequantized blockwise to the activation dtype on every call, then a
  plain GEMM (works everywhere; moves ~5x the weight bytes).

Compressor projections (``compressor.wkv/wgate``) and ``indexer.weights_proj`` are not FP8 in the
checkpoints (vLLM builds them with ``quant_config=None``): they stay bf16 here, the compressor's
GEMM producing fp32 (``mm_f32``).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("decode_stack")

BLOCK = 128
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite fp32 x (from the mantissa / exponent split)."""
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return torch.where(m == 0.5, e - 1, e)


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (float) -> (e4m3 [..., N, K], scale fp32 [..., ceil(N/128), ceil(K/128)]),
    scale = 2^ceil(log2(amax / 448)) per 128x128 block (a ue8m0 value); dequant = e4m3 * scale."""
    *lead, n, k = w.shape
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    wf = w.float()
    if n % BLOCK or k % BLOCK:
        wf = F.pad(wf, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = wf.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-4)          # [..., nb, kb]
    scale = torch.exp2(_ceil_log2(amax / E4M3_MAX).float())
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].to(FP8_DTYPE).contiguous()
    return q, scale.contiguous()


def dequantize_blockwise(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise` in ``dtype`` (exact for bf16 / fp32: power-of-two scales)."""
    *lead, n, k = w8.shape
    if n % BLOCK == 0 and k % BLOCK == 0:
        nb, kb = n // BLOCK, k // BLOCK
        v = w8.to(dtype).view(*lead, nb, BLOCK, kb, BLOCK) * scale.to(dtype)[..., :, None, :, None]
        return v.view(*lead, n, k)
    s = scale.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    return (w8.float() * s).to(dtype)


# -- activation quantization for the scaled_mm path (1 x 128 groups, power-of-two scales) ----------
def act_quant_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (e4m3 [M, K], scale fp32 [M, K/128])."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1).clamp_min(1e-10)
    s = torch.exp2(_ceil_log2(amax / E4M3_MAX).float())
    q = (xb / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).view(m, k)
    return q, s


_SCALED_MM_LAYOUTS = (
    # (scale_a outer-dim-major, scale_b contiguous (K/128, N/128))
    (True, False), (True, True), (False, True), (False, False),
)


def _scaled_mm(x8, sa, w8, sw, layout, out_dtype):
    a_outer, b_contig = layout
    sa_l = sa.t().contiguous().t() if a_outer else sa.contiguous()
    sb = sw.t()                                  # (K/128, N/128)
    sb = sb.contiguous() if b_contig else sb
    return torch._scaled_mm(x8, w8.t(), scale_a=sa_l, scale_b=sb, out_dtype=out_dtype)


def mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T with fp32 output (bf16 operands on GPUs, as vLLM's compressor GEMM)."""
    if x.device.type == "cuda" and _MM_OUT_DTYPE.get("ok", None) is not False:
        try:
            y = torch.mm(x.to(w.dtype), w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE["ok"] = True
            return y
        except (TypeError, RuntimeError) as exc:
            _MM_OUT_DTYPE["ok"] = False
            logger.warning("torch.mm(out_dtype=float32) unavailable (%s): compressor GEMM outputs "
                           "bf16, then fp32", exc)
    if x.device.type == "cuda":
        return F.linear(x.to(w.dtype), w).float()
    return F.linear(x.float(), w.float())


_MM_OUT_DTYPE: dict = {}


class Fp8Gemm:
    """The GEMM path for FP8 weights, chosen once per process (``resolve``)."""

    MODES = ("auto", "triton", "scaled_mm", "dequant")

    def __init__(self, mode: str = "auto", small_m: int = 64) -> None:
        if mode not in self.MODES:
            raise ValueError(f"fp8 gemm mode {mode!r}; use one of {self.MODES}")
        self.requested = mode
        self.mode = None if mode == "auto" else mode
        self.small_m = small_m
        self.scaled_mm_layout = None
        self.probes: dict = {}

    def resolve(self, device: torch.device) -> str:
        if self.mode is not None and self.mode != "scaled_mm":
            if self.mode == "triton" and "triton" not in self.probes:
                self.probes["triton"] = _probe_triton(device)
                if not self.probes["triton"].get("ok"):
                    raise RuntimeError(f"--fp8-gemm triton does not run here: "
                                       f"{self.probes['triton']}")
            return self.mode
        if self.mode == "scaled_mm":
            if self.scaled_mm_layout is None:
                res = _probe_scaled_mm(device)
                self.probes["scaled_mm"] = res
                if not res.get("ok"):
                    raise RuntimeError(f"--fp8-gemm scaled_mm does not run here: {res}")
                self.scaled_mm_layout = tuple(res["layout"])
            return self.mode
        # auto
        if device.type != "cuda":
            self.mode = "dequant"
            return self.mode
        res = _probe_triton(device)
        self.probes["triton"] = res
        if res.get("ok"):
            self.mode = "triton"
            return self.mode
        res = _probe_scaled_mm(device)
        self.probes["scaled_mm"] = res
        if res.get("ok"):
            self.mode = "scaled_mm"
            self.scaled_mm_layout = tuple(res["layout"])
            return self.mode
        self.mode = "dequant"
        return self.mode

    def path_for(self, m: int) -> str:
        mode = self.mode or "dequant"
        if mode == "triton" and m > self.small_m:
            return "dequant"
        return mode

    def describe(self) -> dict:
        return {"requested": self.requested, "mode": self.mode, "small_m": self.small_m,
                "large_m_path": "dequant" if self.mode == "triton" else self.mode,
                "scaled_mm_layout": self.scaled_mm_layout, "probes": self.probes}

    # -- the GEMMs --------------------------------------------------------------------------------
    def linear(self, x2: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] in x2's dtype."""
        path = self.path_for(x2.shape[0])
        if path == "triton":
            from benchmarks.stack.w8a16 import w8a16_matmul

            return w8a16_matmul(x2, w8, scale)
        if path == "scaled_mm":
            x8, sa = act_quant_1x128(x2)
            return _scaled_mm(x8, sa, w8, scale, self.scaled_mm_layout, x2.dtype)
        return F.linear(x2, dequantize_blockwise(w8, scale, x2.dtype))

    def grouped(self, x3: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x3 [M, G, K] with w8 [G, N, K] -> [M, G, N]."""
        path = self.path_for(x3.shape[0])
        if path == "triton":
            from benchmarks.stack.w8a16 import w8a16_matmul

            return w8a16_matmul(x3, w8, scale)
        if path == "scaled_mm":
            outs = [self.linear_scaled(x3[:, i], w8[i], scale[i]) for i in range(w8.shape[0])]
            return torch.stack(outs, dim=1)
        w = dequantize_blockwise(w8, scale, x3.dtype)           # [G, N, K]
        return torch.einsum("mgk,gnk->mgn", x3, w)

    def linear_scaled(self, x2, w8, scale):
        x8, sa = act_quant_1x128(x2.contiguous())
        return _scaled_mm(x8, sa, w8, scale, self.scaled_mm_layout, x2.dtype)


GEMM = Fp8Gemm("auto")


def set_gemm(mode: str, small_m: int = 64) -> Fp8Gemm:
    global GEMM
    GEMM = Fp8Gemm(mode, small_m)
    return GEMM


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _probe_problem(device, m, n, k, g=None, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (g, n, k) if g else (n, k)
    w = torch.randn(shape, generator=gen, device=device) / math.sqrt(k)
    w8, s = quantize_blockwise(w)
    xs = (m, g, k) if g else (m, k)
    x = torch.randn(xs, generator=gen, device=device).to(torch.bfloat16)
    return x, w8, s


def _probe_triton(device: torch.device) -> dict:
    """The Triton W8A16 kernel against the fp32 dequantized product (plain and grouped, several
    M); on GPUs the first e4m3 conversion mode (hardware -> bf16, via fp32, integer decode) that
    compiles and matches is kept."""
    try:
        from benchmarks.stack import w8a16
    except Exception as exc:  # no triton
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    problems = [_probe_problem(device, m, n, k, g) + ((m, n, k, g),)
                for m, n, k, g in ((1, 384, 1024, None), (4, 1024, 512, None),
                                   (32, 512, 1024, None), (33, 256, 768, None),
                                   (2, 256, 512, 3))]
    tried = []
    for cvt in ((2, 1, 0) if device.type == "cuda" else (0,)):
        errs = {}
        try:
            for x, w8, s, (m, n, k, g) in problems:
                wf = dequantize_blockwise(w8, s, torch.float32)
                ref = (torch.einsum("mgk,gnk->mgn", x.float(), wf) if g else x.float() @ wf.t())
                got = w8a16.w8a16_matmul(x, w8, s, cvt=cvt)
                errs[f"m{m}n{n}k{k}g{g or 1}"] = _rel(got, ref)
            if all(e < 1e-2 for e in errs.values()):
                w8a16.CVT_MODE["cvt"] = cvt
                return {"ok": True, "cvt": cvt, "rel_err": errs, "tried": tried}
            tried.append({"cvt": cvt, "rel_err": errs})
        except Exception as exc:
            tried.append({"cvt": cvt, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return {"ok": False, "tried": tried}


def _probe_scaled_mm(device: torch.device) -> dict:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return {"ok": False, "error": "needs CUDA and torch._scaled_mm"}
    tried = []
    for layout in _SCALED_MM_LAYOUTS:
        try:
            errs = {}
            for m in (1, 4, 32):
                x, w8, s = _probe_problem(device, m, 512, 1024)
                ref = x.float() @ dequantize_blockwise(w8, s, torch.float32).t()
                x8, sa = act_quant_1x128(x)
                got = _scaled_mm(x8, sa, w8, s, layout, torch.bfloat16)
                errs[m] = _rel(got, ref)
            if all(e < 5e-2 for e in errs.values()):
                return {"ok": True, "layout": list(layout), "rel_err": errs, "tried": tried}
            tried.append({"layout": list(layout), "rel_err": errs})
        except Exception as exc:
            tried.append({"layout": list(layout), "error": f"{type(exc).__name__}: {exc}"[:300]})
    return {"ok": False, "tried": tried}


# -- modules ---------------------------------------------------------------------------------------
class FP8Linear(nn.Module):
    """``<name>.weight`` e4m3 [N, K] + ``<name>.scale`` (fp32 values of the ue8m0 block scales)."""

    def __init__(self, w8: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = w8.shape
        self.register_buffer("weight", w8)
        self.register_buffer("scale", scale)

    @classmethod
    def random(cls, out_features: int, in_features: int, device, generator, std_scale=1.0):
        w = torch.randn(out_features, in_features, device=device, generator=generator)
        w.mul_(std_scale / math.sqrt(in_features))
        w8, s = quantize_blockwise(w)
        return cls(w8, s)

    def checkpoint_bytes(self) -> int:
        """e4m3 bytes + one ue8m0 byte per 128x128 block (what a step must read)."""
        return self.weight.numel() + self.scale.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = GEMM.linear(x.reshape(-1, x.shape[-1]), self.weight, self.scale)
        return y.view(*lead, self.out_features)


class FP8GroupedLinear(nn.Module):
    """``wo_a`` as G independent [r, (H/G)*D] FP8 matrices (the checkpoint's [G*r, (H/G)*D] viewed
    per group; 128x128 blocks never straddle groups since r = 1024)."""

    def __init__(self, w8: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.groups, self.out_features, self.in_features = w8.shape
        self.register_buffer("weight", w8)
        self.register_buffer("scale", scale)

    @classmethod
    def random(cls, groups, out_features, in_features, device, generator, std_scale=1.0):
        w = torch.randn(groups, out_features, in_features, device=device, generator=generator)
        w.mul_(std_scale / math.sqrt(in_features))
        w8, s = quantize_blockwise(w)
        return cls(w8, s)

    def checkpoint_bytes(self) -> int:
        return self.weight.numel() + self.scale.numel()

    def forward(self, x3: torch.Tensor) -> torch.Tensor:
        return GEMM.grouped(x3, self.weight, self.scale)
