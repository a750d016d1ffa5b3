# SPDX-License-Identifier: Apache-2.0
"""compressor_plan against a per-token Python construction of the same slots (spec section 3/6)."""

from __future__ import annotations

import pytest
import torch

from vllm_dsv4_hw.attention.compressor_plan import compressor_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_block_table(gen, num_reqs, num_blocks, pool):
    """Distinct pages drawn from a shuffled pool (non-contiguous, interleaved between requests)."""
    perm = torch.randperm(pool, generator=gen)[: num_reqs * num_blocks]
    return perm.view(num_reqs, num_blocks).to(torch.int32)


def _brute_plan(qsl, seq_start, sbt, rpp, ratio, kbt, epp):
    coff = 2 if ratio == 4 else 1
    state_slots, rows, entry, req_of, tok_of, cslots = [], [], [], [], [], []
    for r in range(len(seq_start)):
        for j in range(qsl[r], qsl[r + 1]):
            p = seq_start[r] + (j - qsl[r])
            state_slots.append(sbt[r][p // rpp] * rpp + p % rpp)
            if (p + 1) % ratio == 0:
                i = (p + 1) // ratio - 1
                assert ratio * i + ratio - 1 == p
                members = []
                for m in range(p - coff * ratio + 1, p + 1):
                    members.append(sbt[r][m // rpp] * rpp + m % rpp if m >= 0 else -1)
                rows.append(members)
                entry.append(i)
                req_of.append(r)
                tok_of.append(j)
                if kbt is not None:
                    cslots.append(kbt[r][i // epp] * epp + i % epp)
    return state_slots, rows, entry, req_of, tok_of, cslots


def _check(plan, brute, ratio, with_kv):
    state_slots, rows, entry, req_of, tok_of, cslots = brute
    coff = 2 if ratio == 4 else 1
    assert plan.state_slots.dtype == torch.int64
    assert plan.state_slots.tolist() == state_slots
    assert tuple(plan.group_rows.shape) == (len(rows), coff * ratio)
    assert plan.group_rows.tolist() == rows
    assert plan.group_entry_index.tolist() == entry
    assert plan.group_req.tolist() == req_of
    assert plan.group_token.tolist() == tok_of
    if with_kv:
        assert plan.cache_slots.tolist() == cslots
    else:
        assert plan.cache_slots is None


@pytest.mark.parametrize("ratio,rpp,epp", [(4, 4, 64), (4, 3, 8), (128, 8, 2), (128, 64, 2)])
def test_plan_matches_bruteforce(gen, ratio, rpp, epp):
    for _ in range(6):
        num_reqs = int(torch.randint(1, 6, (1,), generator=gen))
        q_lens = torch.randint(0, 300, (num_reqs,), generator=gen)
        q_lens[torch.randint(0, num_reqs, (1,), generator=gen)] = 1  # always one decode token
        seq_start = torch.randint(0, 700, (num_reqs,), generator=gen)
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(q_lens, 0)
        max_pos = int((seq_start + q_lens).max())
        nb_state = max_pos // rpp + 2
        nb_kv = max_pos // ratio // epp + 2
        sbt = _random_block_table(gen, num_reqs, nb_state, num_reqs * nb_state + 17)
        kbt = _random_block_table(gen, num_reqs, nb_kv, num_reqs * nb_kv + 5)
        for with_kv in (True, False):
            plan = compressor_plan(
                qsl, seq_start, sbt, rpp, ratio, kbt if with_kv else None, entries_per_page=epp
            )
            brute = _brute_plan(
                qsl.tolist(),
                seq_start.tolist(),
                sbt.tolist(),
                rpp,
                ratio,
                kbt.tolist() if with_kv else None,
                epp,
            )
            _check(plan, brute, ratio, with_kv)
            assert plan.positions.tolist() == [
                int(seq_start[r]) + k for r in range(num_reqs) for k in range(int(q_lens[r]))
            ]


def test_plan_boundaries_and_absent_rows():
    """Groups complete exactly at positions 4i+3 / 128i+127; rows before position 0 are -1."""
    # one request, positions 0..9, identity state pages of 4 rows
    sbt = torch.arange(8).view(1, 8)
    plan = compressor_plan(torch.tensor([0, 10]), torch.tensor([0]), sbt, 4, 4)
    assert plan.group_token.tolist() == [3, 7]
    assert plan.group_entry_index.tolist() == [0, 1]
    assert plan.group_rows.tolist() == [[-1, -1, -1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]]
    # decode token at position 131 of a ratio-4 request (entry 32) and 255 of a ratio-128 one
    plan = compressor_plan(
        torch.tensor([0, 1]),
        torch.tensor([131]),
        torch.arange(64).view(1, 64),
        4,
        4,
        torch.tensor([[5, 9, 11]]),
        entries_per_page=16,
    )
    assert plan.group_entry_index.tolist() == [32]
    assert plan.group_rows.tolist() == [list(range(124, 132))]
    assert plan.cache_slots.tolist() == [11 * 16 + 0]
    plan = compressor_plan(
        torch.tensor([0, 1]), torch.tensor([254]), torch.arange(40).view(1, 40), 8, 128
    )
    assert plan.num_groups == 0 and tuple(plan.group_rows.shape) == (0, 128)
    plan = compressor_plan(
        torch.tensor([0, 1]), torch.tensor([255]), torch.arange(40).view(1, 40), 8, 128
    )
    assert plan.group_entry_index.tolist() == [1]
    assert plan.group_rows.tolist() == [list(range(128, 256))]


def test_plan_empty_and_zero_length_requests():
    sbt = torch.arange(12).view(3, 4)
    plan = compressor_plan(torch.tensor([0, 0, 5, 5]), torch.tensor([7, 0, 3]), sbt, 4, 4)
    # only request 1 has tokens: positions 0..4, slots in pages 4, 5
    assert plan.state_slots.tolist() == [16, 17, 18, 19, 20]
    assert plan.group_req.tolist() == [1] and plan.group_token.tolist() == [3]
    plan = compressor_plan(
        torch.tensor([0]),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 4, dtype=torch.long),
        4,
        4,
    )
    assert plan.state_slots.numel() == 0 and tuple(plan.group_rows.shape) == (0, 8)
