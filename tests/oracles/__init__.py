# SPDX-License-Identifier: Apache-2.0
"""Float64 dense oracles, written independently of ``vllm_dsv4_hw.ops.reference``.

They favour obviousness over speed: explicit loops, masks and complex numbers. Tests compare the
implementations against these on fresh random inputs.
"""

from tests.oracles.dense import (  # noqa: F401
    dense_attention_with_sink,
    rms_norm_oracle,
    rope_angles_oracle,
    rope_oracle,
    yarn_inv_freq_oracle,
)
