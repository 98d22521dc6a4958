"""The token-level policy's rule between prefill and decode is one ordered list of choices
(scheduler/turn_choice.py); test_overload's split-prompt test shows its effect on a schedule."""
from __future__ import annotations

import pytest

from scheduler.turn_choice import Choice, choice_order


@pytest.mark.parametrize("after_chunk,decode_owed", [(False, False), (True, False), (False, True), (True, True)])
def test_every_order_tries_each_choice_once(after_chunk, decode_owed):
    order = choice_order(after_chunk, decode_owed)
    assert sorted(order, key=lambda c: c.name) == sorted(Choice, key=lambda c: c.name)


def test_a_group_in_progress_finishes_before_a_turn_and_a_turn_goes_on_before_a_new_group():
    order = choice_order(after_chunk=False, decode_owed=False)
    assert order[0] is Choice.CONTINUE_GROUP
    assert order.index(Choice.CONTINUE_TURN) < order.index(Choice.START_GROUP) < order.index(Choice.START_TURN)


@pytest.mark.parametrize("after_chunk,decode_owed", [(True, False), (False, True)])
def test_after_a_chunk_or_with_a_slice_owed_every_decode_choice_comes_before_any_prefill(after_chunk, decode_owed):
    order = choice_order(after_chunk, decode_owed)
    decode = [order.index(Choice.CONTINUE_TURN), order.index(Choice.START_TURN)]
    prefill = [order.index(Choice.CONTINUE_GROUP), order.index(Choice.START_GROUP)]
    assert max(decode) < min(prefill)
    assert order[0] is Choice.CONTINUE_TURN
