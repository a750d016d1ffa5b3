"""Ascend vendor ops through torch_npu (issue 5)."""
