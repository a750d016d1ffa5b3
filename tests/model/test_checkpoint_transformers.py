# SPDX-License-Identifier: Apache-2.0
"""``make-checkpoint`` directories read by transformers' DeepseekV4ForCausalLM (in a subprocess,
``hf_check.py``).

What transformers accepts: the bf16 directory loads into ``DeepseekV4ForCausalLM`` through its
official-name conversion mapping with no missing, unexpected or mismatched keys (the ``mtp.*``
tensors are ignored by its ``_keys_to_ignore_on_load_unexpected``); its config reads the legacy
``compress_ratios`` / ``num_hash_layers`` / ``rope_scaling`` fields. The fp8 directory loads there too
(transformers' FP8 quantizer, with ``accelerate``, a test dependency, dequantizes it on CPU, the
FP4 experts included): ``test_transformers_fp8_directory`` asserts that every tensor then equals the
bf16 directory's (also checked without transformers in ``test_checkpoint.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model.checkpoints import NEW_TOKENS, PROMPT
from vllm_dsv4_hw.tools import checkpoint as ck
from vllm_dsv4_hw.tools import tokenizer_gen

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_report(ckpts):
    bf16 = [str(ckpts[p, "bf16"].path) for p in ck.PRESETS]
    req = {
        "bf16": bf16,
        "fp8": [str(ckpts["tiny-flash", "fp8"].path)],
        "prompt": PROMPT,
        "new_tokens": NEW_TOKENS,
        "nocache_check": [str(ckpts["tiny-flash", "bf16"].path)],
    }
    script = Path(__file__).with_name("hf_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(req)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HF_CHECK_JSON ")), None)
    assert proc.returncode == 0 and line, (
        f"hf_check.py failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return json.loads(line[len("HF_CHECK_JSON ") :])


@pytest.mark.parametrize("preset", list(ck.PRESETS))
def test_transformers_reads_the_config(ckpts, hf_report, preset):
    rep = hf_report["bf16"][str(ckpts[preset, "bf16"].path)]
    cfg = ck.hf_config(preset, "bf16")
    n = cfg["num_hidden_layers"]
    names = {
        0: "sliding_attention",
        4: "compressed_sparse_attention",
        128: "heavily_compressed_attention",
    }
    assert rep["config_class"] == "DeepseekV4Config"
    assert rep["layer_types"] == [names[r] for r in cfg["compress_ratios"][:n]]
    assert rep["mlp_layer_types"] == (
        ["hash_moe"] * cfg["num_hash_layers"] + ["moe"] * (n - cfg["num_hash_layers"])
    )
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
    assert rep["loading_info"] == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    assert rep["values"]["mismatched"] == []
    summary = ckpts[preset, "bf16"]
    cfg = ck.hf_config(preset, "bf16")
    # transformers' parameters = ours without the MTP layer and without its buffers
    # (tid2eid on hash layers, e_score_correction_bias on the others).
    n, nh = cfg["num_hidden_layers"], cfg["num_hash_layers"]
    buffers = (
        nh * cfg["vocab_size"] * cfg["num_experts_per_tok"] + (n - nh) * cfg["n_routed_experts"]
    )
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
    """transformers loads the FP8/FP4 directory (dequantizing it) into the bf16 twin's values."""
    rep = hf_report["fp8"][str(ckpts["tiny-flash", "fp8"].path)]
    assert rep["loaded"], rep
    assert rep["compared"] > 100 and rep["differs"] == [], rep
