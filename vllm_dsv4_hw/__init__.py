# SPDX-License-Identifier: Apache-2.0
"""vllm-dsv4-hw: DeepSeek V4 long-context attention for vLLM on any accelerator."""

__version__ = "0.1.0"
