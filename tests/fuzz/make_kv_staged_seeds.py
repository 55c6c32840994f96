#!/usr/bin/env python3
"""Writes the seeds of kv_staged_parse_fuzzer (tests/fuzz/corpus/kv_staged_parse_fuzzer/):
AppendAttendRequest wire bytes encoded by hand (kv.proto's field numbers), so
the seeds hold the forms the staged parse must treat as protobuf does: a tensor
given twice, data beside a shared-memory span, empty data, unknown fields,
a non-canonical tag, a group, a cut message. Each seed is a control byte, its
cut points (two bytes each), then the message; see the fuzzer's header.
Usage: tests/fuzz/make_kv_staged_seeds.py [OUT_DIR]"""
import os
import struct
import sys


def varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def field(number, wire_type, payload):
    tag = varint(number << 3 | wire_type)
    if wire_type == 2:
        return tag + varint(len(payload)) + payload
    return tag + payload


def tensor(shape, data=None, dtype=3, shm=None, extra=b""):
    out = field(1, 0, varint(dtype))  # dtype
    out += field(2, 2, b"".join(varint(d) for d in shape))  # shape, packed
    if data is not None:
        out += field(3, 2, data)
    if shm is not None:
        out += field(4, 2, field(1, 2, shm.encode()))  # SharedTensor.region
    return out + extra


def floats(n, start=0.25):
    return b"".join(struct.pack("<f", start + i / 64) for i in range(n))


def step(sequence_id=1, length=0, new=1, queries=1):
    return field(4, 2, field(1, 0, varint(sequence_id)) + field(2, 0, varint(length)) +
                 field(3, 0, varint(new)) + field(4, 0, varint(queries)))


def request(q, k, v, extra=b""):
    return (field(1, 2, b"req-1") + field(2, 2, b"cache-1") + field(3, 0, varint(0)) + step() +
            field(5, 2, q) + field(6, 2, k) + field(7, 2, v) + extra)


def seed(message, control=0, cuts=()):
    assert len(cuts) <= 7
    control |= len(cuts)
    return bytes([control]) + b"".join(struct.pack("<H", c) for c in cuts) + message


decode = request(tensor([1, 1, 8], floats(8)), tensor([1, 1, 8], floats(8, 1.0)),
                 tensor([1, 1, 8], floats(8, 2.0)))
prefill = request(tensor([4, 2, 8], floats(64)), tensor([4, 1, 8], floats(32, 1.0)),
                  tensor([4, 1, 8], floats(32, 2.0)))
seeds = {
    "decode": seed(decode),
    "decode_sliced": seed(decode, cuts=(1, 40, 77, 78, 200)),
    "prefill_sliced_everywhere": seed(prefill, cuts=tuple(range(3, 700, 100))),
    # q twice: the second occurrence's data wins, dtype and shape merge.
    "q_twice": seed(request(tensor([1, 1, 8], floats(8)), tensor([1, 1, 8], floats(8)),
                            tensor([1, 1, 8], floats(8))) +
                    field(5, 2, field(3, 2, floats(8, 5.0)))),
    # The last data of k is empty: protobuf keeps it empty.
    "k_data_emptied": seed(request(tensor([1, 1, 8], floats(8)), tensor([1, 1, 8], floats(8)),
                                   tensor([1, 1, 8], floats(8))) + field(6, 2, field(3, 2, b""))),
    "v_data_and_shm": seed(request(tensor([1, 1, 8], floats(8)), tensor([1, 1, 8], floats(8)),
                                   tensor([1, 1, 8], floats(8), shm="region-a"))),
    "unknown_fields": seed(request(tensor([1, 1, 8], floats(8), extra=field(9, 0, varint(7))),
                                   tensor([1, 1, 8], floats(8), extra=field(12, 5, b"\1\2\3\4")),
                                   tensor([1, 1, 8], floats(8)),
                                   extra=field(15, 1, b"\0" * 8) + field(99, 2, b"unknown"))),
    # q's tag as a two-byte varint (0xaa 0x00 for field 5, wire type 2).
    "q_tag_not_canonical": seed(b"\xaa\x00" + varint(len(tensor([1, 1, 8], floats(8)))) +
                                tensor([1, 1, 8], floats(8)) + decode),
    # A group (wire type 3) inside k: left to protobuf.
    "group_in_k": seed(request(tensor([1, 1, 8], floats(8)),
                               tensor([1, 1, 8], floats(8), extra=b"\x2b\x08\x01\x2c"),
                               tensor([1, 1, 8], floats(8)))),
    "cut_short": seed(decode[:-5]),
    "first_allocation_refused": seed(decode, control=1 << 3),
    "third_allocation_refused": seed(prefill, control=3 << 3, cuts=(50,)),
}
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "corpus", "kv_staged_parse_fuzzer")
os.makedirs(out, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(out, name + ".bin"), "wb") as f:
        f.write(data)
print(f"wrote {len(seeds)} seeds to {out}")
