# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_dsv4_hw``: the ``vllm-dsv4-hw`` command line."""

from vllm_dsv4_hw.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
