# SPDX-License-Identifier: Apache-2.0
"""The launch checks (``engine/serve_checks.py``) on stand-in vLLM configs: every refusal is one
line naming the field or flag and the fix; honoured flags map to our cache formats; a damaged shard
(truncated, missing, longer than its header, a garbled header) is named with the fix. (Through a
real ``vllm serve`` and timed: ``tests/serve/test_dropin.py``.)"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from vllm_dsv4_hw.engine.serve_checks import (
    UnsupportedSettingError,
    check_kv_capacity,
    check_serve_settings,
    check_shards,
    raw_hf_config,
)
from vllm_dsv4_hw.tools import checkpoint as ck


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_checks") / "tiny-flash-fp8"
    ck.make_checkpoint(path, "tiny-flash", "fp8", 0, progress=lambda _m: None)
    return path


def _config(
    path, *, tp=1, pp=1, dp=1, ep=False, spec=None, quant="ours", cache_dtype="auto", indexer="auto"
):
    from vllm_dsv4_hw.quant.config import DSV4HwQuantConfig
    from vllm_dsv4_hw.quant.scheme import WeightScheme

    cfg = json.loads((path / "config.json").read_text())
    qc = {
        "ours": DSV4HwQuantConfig(WeightScheme.from_hf_config(cfg)),
        "none": None,
        "other": SimpleNamespace(get_name=lambda: "awq"),
    }[quant]
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(path), hf_config=None),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            enable_expert_parallel=ep,
        ),
        speculative_config=spec,
        quant_config=qc,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        attention_config=SimpleNamespace(indexer_kv_dtype=indexer),
    )


def test_honoured_flags_map_to_our_formats(ckpt):
    for tp, ep in ((2, False), (2, True), (1, True)):
        check_serve_settings(_config(ckpt, tp=tp, ep=ep))  # splits the checkpoint allows
    s = check_serve_settings(_config(ckpt))
    assert s.cfg.weights.fp8_linears and (s.main_format, s.indexer_format) == ("fp8", "mxfp4")
    s = check_serve_settings(_config(ckpt, cache_dtype="bfloat16", indexer="bf16"))
    assert (s.main_format, s.indexer_format) == ("bf16", "bf16")
    s = check_serve_settings(_config(ckpt, cache_dtype="fp8", indexer="fp8"))
    assert (s.main_format, s.indexer_format) == ("fp8", "fp8")


@pytest.mark.parametrize(
    "kw,needle",
    [
        (
            {"tp": 4},
            "--tensor-parallel-size 4: o_groups 2 is not divisible by 4 (each rank takes "
            "whole output groups); sizes that split this checkpoint: 1, 2",
        ),
        (
            {"tp": 3, "ep": True},
            "--tensor-parallel-size 3 with --enable-expert-parallel: "
            "num_attention_heads 4 is not divisible by 3",
        ),
        ({"pp": 2}, "--pipeline-parallel-size 2"),
        ({"dp": 4}, "--data-parallel-size 4"),
        ({"spec": object()}, "--speculative-config"),
        ({"quant": "other"}, "--quantization awq"),
        ({"cache_dtype": "fp8_e5m2"}, "--kv-cache-dtype fp8_e5m2"),
        (
            {"indexer": "nvfp4"},
            "indexer_kv_dtype=nvfp4 is not supported by vllm-dsv4-hw; use mxfp4",
        ),
    ],
)
def test_refusals_are_one_line_with_the_fix(ckpt, kw, needle):
    with pytest.raises(UnsupportedSettingError) as exc:
        check_serve_settings(_config(ckpt, **kw))
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg
    assert not isinstance(exc.value, ValueError)  # pydantic would wrap it into several lines


def test_checkpoint_problems_are_named(ckpt, tmp_path):
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["compress_ratios"][3] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedSettingError, match=r"compress_ratios\[3\] = 64 \(layer 3\)"):
        check_serve_settings(_config(bad))
    cfg["compress_ratios"][3] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    for name in ("layers.1.attn.wq_a.scale", "layers.2.ffn.experts.3.w2.weight"):
        del index["weight_map"][name]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedSettingError) as exc:
        check_serve_settings(_config(bad))
    msg = str(exc.value)
    assert "2 tensor(s) missing" in msg and "layers.1.attn.wq_a.scale" in msg
    assert "layers.2.ffn.experts.3.w2.weight" in msg


SHARD = "model-00002-of-00003.safetensors"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return f"is {len(data) // 2} bytes but its header describes {len(data)}: truncated"


def _delete(path):
    path.unlink()
    return "is missing (model.safetensors.index.json puts "


def _append(path):
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(b"\0" * 100)
    return f"is {size + 100} bytes but its header describes {size}: 100 trailing bytes"


def _header_length(path):
    data = bytearray(path.read_bytes())
    data[0:8] = (int.from_bytes(data[0:8], "little") + 3).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return "-byte header that is not valid JSON ("


def _huge_header_length(path):
    data = bytearray(path.read_bytes())
    data[0:8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return f"header length of {1 << 40} bytes, over safetensors' limit"


def _header_cut(path):
    path.write_bytes(path.read_bytes()[:100])
    return "is 100 bytes but its header alone needs "


def _not_safetensors(path):
    header = b'{"x": 1}'
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return "has a header that is not a safetensors header ("


def _stub(path):
    path.write_bytes(b"\x07")
    return "is 1 bytes, shorter than a safetensors header: truncated"


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _delete,
        _append,
        _header_length,
        _huge_header_length,
        _header_cut,
        _not_safetensors,
        _stub,
    ],
)
def test_a_damaged_shard_is_named_with_the_fix(ckpt, tmp_path, damage):
    """Only the headers are read: the first process names the file, what is wrong and how to get
    a good copy (this checkpoint was made by make-checkpoint: that command, with its settings)."""
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    check_shards(bad)  # the intact copy passes
    needle = damage(bad / SHARD)
    with pytest.raises(UnsupportedSettingError) as exc:
        check_serve_settings(_config(bad))
    msg = str(exc.value)
    assert msg.startswith(f"{bad / SHARD} ") and needle in msg and "\n" not in msg, msg
    fix = f"make it again: vllm-dsv4-hw make-checkpoint {bad} --preset tiny-flash --dtype fp8"
    assert fix in msg and "--seed 0 --force" in msg, msg


def test_shards_without_an_index_and_of_a_downloaded_checkpoint(ckpt, tmp_path):
    """A single-file checkpoint (no index) is checked too; a checkpoint not made here is
    downloaded again; several missing shards are listed in one line."""
    one = tmp_path / "single"
    one.mkdir()
    shutil.copy(ckpt / SHARD, one / "model.safetensors")
    check_shards(one)
    with (one / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    with pytest.raises(UnsupportedSettingError) as exc:
        check_shards(one)
    msg = str(exc.value)
    assert msg.startswith(f"{one / 'model.safetensors'} is 1000 bytes but its header"), msg
    assert msg.endswith(
        "download the file again (or the checkpoint, e.g. with huggingface-cli download)"
    ), msg
    two = shutil.copytree(ckpt, tmp_path / "two-missing")
    (two / "checkpoint_info.json").unlink()
    (two / "model-00001-of-00003.safetensors").unlink()
    (two / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(UnsupportedSettingError) as exc:
        check_shards(two)
    msg = str(exc.value)
    assert msg.startswith(
        f"{two}: 2 shard files that model.safetensors.index.json names are "
        "missing: model-00001-of-00003.safetensors, "
        "model-00003-of-00003.safetensors; download the file again"
    ), msg


@pytest.mark.parametrize(
    "max_len,kv_bytes,fits",
    [
        (792, 64 << 20, True),
        (793, 64 << 20, False),  # vLLM's engine: 792 is its estimate here
        (1 << 20, 1 << 30, True),
        (1 << 20, 64 << 20, False),
        (1 << 20, None, True),
    ],
)
def test_kv_capacity_for_one_request(ckpt, monkeypatch, max_len, kv_bytes, fits):
    """The boundary is vLLM's own: 792 tokens start with 64 MiB and 2048-token chunks (``vllm
    serve`` logged "CPU KV cache size: 794 tokens, ... 1.00x"), 793 are refused in one line; an
    unknown size (GPU profiling) is not checked here."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    vc = _config(ckpt)
    vc.cache_config.kv_cache_memory_bytes = kv_bytes
    vc.model_config.max_model_len = max_len
    vc.scheduler_config = SimpleNamespace(max_num_batched_tokens=2048)
    settings = check_serve_settings(vc)
    if fits:
        check_kv_capacity(vc, settings)
        return
    with pytest.raises(UnsupportedSettingError) as exc:
        check_kv_capacity(vc, settings)
    msg = str(exc.value)
    assert msg.startswith(f"--max-model-len {max_len} needs ") and "\n" not in msg, msg
    assert "(--kv-cache-memory-bytes)" in msg and "at most 792" in msg, msg


def test_a_gpu_without_bf16_is_refused(ckpt, monkeypatch):
    """A V100 (sm_70) as the device: one line naming the device and what is supported."""
    from vllm_dsv4_hw.platform.device import adaptor_for

    monkeypatch.setenv("VLLM_DSV4_HW_DEVICE", "cuda")
    monkeypatch.setenv("VLLM_DSV4_HW_CUDA_CAPABILITY", "7.0")
    adaptor_for.cache_clear()
    try:
        with pytest.raises(UnsupportedSettingError) as exc:
            check_serve_settings(_config(ckpt))
    finally:
        monkeypatch.undo()
        adaptor_for.cache_clear()
    msg = str(exc.value)
    assert "needs bf16 compute" in msg and "declared sm_70" in msg and "\n" not in msg, msg


def test_hf_overrides_apply_to_the_config_we_read(ckpt):
    """``--hf-overrides '{"index_topk": 32}'`` reaches our model's config (vLLM applies it to its
    own config object; we read config.json, so we apply it there too); a callable override is
    vLLM's to apply to its config, not ours."""
    mc = SimpleNamespace(model=str(ckpt), hf_config=None, hf_overrides={"index_topk": 32})
    assert raw_hf_config(mc)["index_topk"] == 32
    cfg = _config(ckpt)
    cfg.model_config.hf_overrides = {"index_topk": 32}
    assert check_serve_settings(cfg).cfg.index_topk == 32
    plain = SimpleNamespace(model=str(ckpt), hf_config=None, hf_overrides=lambda c: c)
    assert (
        raw_hf_config(plain)["index_topk"]
        == json.loads((ckpt / "config.json").read_text())["index_topk"]
        != 32
    )
