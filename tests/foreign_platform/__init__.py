# SPDX-License-Identifier: Apache-2.0
"""A test-only out-of-tree vLLM platform: the vendor's case without a vendor.

``vendor_platform.ForeignPlatform`` is what a hardware vendor's fork of vLLM ships: a ``Platform``
with ``PlatformEnum.OOT`` that knows nothing about DeepSeek V4 or this plugin (it is not our
``DSV4HwCpuPlatform`` and not vLLM's ``CpuPlatform``), with its own worker (``worker.py``) because
vLLM's generic worker code assumes one of the built-in enums. Its device is the host CPU, so the
whole path runs on a CPU-only machine. ``entry_point.py`` and ``installed/`` make it loadable the
way a vendor's package is, through a ``vllm.platform_plugins`` entry point of a ``*.dist-info`` on
``PYTHONPATH`` (no pip install); ``installed/stock_cpu`` hands out vLLM's stock ``CpuPlatform`` the
same way. ``tests/serve/test_any_platform.py`` serves the tiny checkpoint under both.
"""
