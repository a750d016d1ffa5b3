# SPDX-License-Identifier: Apache-2.0
"""Test aids kept out of the runtime package ``vllm_dsv4_hw``.

* ``c_op_trap``: records every ``torch.ops._C*`` call of a served process; a served process gets it
  through the test-only distribution under ``installed/c_op_trap`` (a ``vllm.general_plugins``
  entry point, put on the server's ``PYTHONPATH`` by ``tests.serve.process.VllmServer``).
* ``topk``: records the indexer's top-k selections of chosen attention layers.
"""
