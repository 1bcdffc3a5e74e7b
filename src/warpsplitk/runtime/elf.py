"""Just enough ELF64 reading to get a cubin's kernel resources without CUDA tools.

The cubin's ``.nv.info`` section is a list of attributes; for each kernel it
holds ``EIATTR_REGCOUNT`` (registers per thread) and ``EIATTR_FRAME_SIZE``
(bytes of the per-thread local-memory frame, where spilled registers and
run-time-indexed arrays go). Entries are ``format u8, attribute u8`` then,
for the sized format 0x04, ``size u16`` and ``size`` bytes.
"""

from __future__ import annotations

import struct

EIFMT_SVAL = 0x04
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F


def _sections(blob: bytes):
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise ValueError("not a 64-bit ELF (cubin) image")
    (shoff,) = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]

    def name(offset):
        end = blob.index(b"\0", names_offset + offset)
        return blob[names_offset + offset:end].decode()

    for h in headers:
        yield name(h[0]), h


def nv_info_attributes(blob: bytes):
    """``(attribute, payload)`` of every sized entry of the global ``.nv.info``."""
    blob = bytes(blob)
    for name, header in _sections(blob):
        if name != ".nv.info":
            continue
        offset, size = header[4], header[5]
        p = offset
        while p + 4 <= offset + size:
            fmt, attr = blob[p], blob[p + 1]
            if fmt == EIFMT_SVAL:
                (length,) = struct.unpack_from("<H", blob, p + 2)
                yield attr, blob[p + 4:p + 4 + length]
                p += 4 + length
            else:
                p += 4


def read_resources(cubin: bytes):
    """(registers per thread, local frame bytes, max stack bytes): maxima over kernels."""
    registers = frame = stack = 0
    for attr, payload in nv_info_attributes(cubin):
        if len(payload) < 8:
            continue
        _, value = struct.unpack_from("<II", payload)
        if attr == EIATTR_REGCOUNT:
            registers = max(registers, value)
        elif attr == EIATTR_FRAME_SIZE:
            frame = max(frame, value)
        elif attr == EIATTR_MAX_STACK_SIZE:
            stack = max(stack, value)
    return registers, frame, stack
