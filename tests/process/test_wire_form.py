"""The per-step messages' own wire form (lowdiff.proc.protocol.encode / decode)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from lowdiff.engine.wire.messages import Record, Stage, Step
from lowdiff.proc.protocol import Close, Flushed, Kind, SlotMessage, decode, encode


@pytest.mark.parametrize("cls", [Record, Step])
@pytest.mark.parametrize(
    "slot, step, meta",
    [
        (0, 0, ""),
        (7, 123456789012, '{"hp":[{"lr":0.001}],"step":3}'),
        (2**40, -1, "δ ✓ \x00 \U0001f600"),  # any int64, any text (UTF-8)
    ],
)
def test_slot_messages_round_trip_in_their_own_form(cls, slot, step, meta):
    msg = cls(slot, step, meta)
    raw = encode(msg)
    assert bytes(raw[:1]) == cls.wire  # not a pickle
    back = decode(raw)
    assert type(back) is cls and back == msg
    assert decode(memoryview(bytes(raw))) == msg


def test_every_other_message_is_a_pickle_and_a_pickled_slot_message_still_decodes():
    buf = torch.zeros(4, dtype=torch.uint8).share_memory_()
    for msg in (Close(), Flushed(12), Stage(buf)):
        raw = encode(msg)
        assert bytes(raw[:1]) == b"\x80"
        back = decode(raw)
        assert type(back) is type(msg)
    assert torch.equal(decode(encode(Stage(buf))).buffer, buf)
    # a process that received a slot message pickled (by an older trainer) still reads it
    assert decode(pickle.dumps(Record(1, 2, "{}"), protocol=5)) == Record(1, 2, "{}")


def test_a_cut_short_slot_message_is_refused():
    raw = bytes(encode(Record(3, 4, "{}")))
    with pytest.raises(ValueError, match="cut short"):
        decode(raw[:9])


def test_a_wire_tag_is_one_byte_of_one_class():
    with pytest.raises(TypeError, match="wire tag"):

        @dataclass(frozen=True)
        class Twin(SlotMessage):  # Record's tag
            kind: ClassVar[Kind] = Kind.RECORD
            wire: ClassVar[bytes] = b"R"

    with pytest.raises(TypeError, match="wire tag"):

        @dataclass(frozen=True)
        class PickleLike(SlotMessage):  # the first byte of every pickle
            kind: ClassVar[Kind] = Kind.RECORD
            wire: ClassVar[bytes] = b"\x80"
