"""What the token-level policy tries to run next, in order: the first choice that has a step wins.

The order is the policy's rule between prefill and decode, written once:

  a group in progress finishes first, then turns go on
      (continue the group, continue the turn, start a group, start a turn);
  but after a chunk of a split prefill, or when the turn strategy owes the decoding batches a
  slice (smooth streams), decode goes first, so a stream's gap holds one prefill step
      (continue the turn, start a turn, continue the group, start a group).
"""
from __future__ import annotations

import enum


class Choice(enum.Enum):
    CONTINUE_GROUP = "continue the prefill group in progress"
    CONTINUE_TURN = "continue the current decode turn"
    START_GROUP = "start the next prefill group"
    START_TURN = "start the next decode turn of the round"


GROUP_FIRST = (Choice.CONTINUE_GROUP, Choice.CONTINUE_TURN, Choice.START_GROUP, Choice.START_TURN)
DECODE_FIRST = (Choice.CONTINUE_TURN, Choice.START_TURN, Choice.CONTINUE_GROUP, Choice.START_GROUP)


def choice_order(after_chunk: bool, decode_owed: bool) -> tuple[Choice, ...]:
    """The choices in the order they are tried. after_chunk: the latest output was a chunk of
    a split prefill; decode_owed: the turn strategy owes a decode slice before the next prefill."""
    return DECODE_FIRST if after_chunk or decode_owed else GROUP_FIRST
