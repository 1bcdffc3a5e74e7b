"""Reading kernel resources out of a cubin without CUDA tools."""

import importlib.util
import struct

import pytest

from warpsplitk.runtime import elf
from warpsplitk.tactics import WarpSplitKTactic


def make_elf(sections):
    """A minimal ELF64 image: ``sections`` is ``[(name, payload bytes)]``; a null
    section and ``.shstrtab`` are added."""
    names = b"\0"
    offsets = {}
    for name, _ in sections + [(".shstrtab", b"")]:
        offsets[name] = len(names)
        names += name.encode() + b"\0"
    body = b""
    headers = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    data_start = 64
    for name, payload in sections + [(".shstrtab", names)]:
        headers.append(struct.pack("<IIQQQQIIQQ", offsets[name], 1, 0, 0,
                                   data_start + len(body), len(payload), 0, 0, 1, 0))
        body += payload
    shoff = data_start + len(body)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0,
                                 64, len(headers), len(headers) - 1)
    assert len(header) == 64
    return header + body + b"".join(headers)


def sval(attr, *words):
    payload = struct.pack(f"<{len(words)}I", *words)
    return struct.pack("<BBH", elf.EIFMT_SVAL, attr, len(payload)) + payload


def test_read_resources_synthetic():
    info = (sval(elf.EIATTR_REGCOUNT, 7, 40)
            + struct.pack("<BBH", 0x03, 0x1B, 0xFF)  # an unsized entry: skipped
            + sval(elf.EIATTR_FRAME_SIZE, 7, 16)
            + sval(elf.EIATTR_MAX_STACK_SIZE, 7, 24)
            + sval(elf.EIATTR_REGCOUNT, 9, 96)  # more kernels: the maximum wins,
            + sval(elf.EIATTR_REGCOUNT, 11, 64)  # neither the first nor the last
            + sval(0x37, 7))  # short payload of another attribute: ignored
    blob = make_elf([(".text.kernel", b"\0" * 16), (".nv.info", info)])
    assert elf.read_resources(blob) == (96, 16, 24)
    attrs = [a for a, _ in elf.nv_info_attributes(blob)]
    assert attrs == [elf.EIATTR_REGCOUNT, elf.EIATTR_FRAME_SIZE, elf.EIATTR_MAX_STACK_SIZE,
                     elf.EIATTR_REGCOUNT, elf.EIATTR_REGCOUNT, 0x37]


def test_only_the_global_nv_info_is_read():
    blob = make_elf([(".nv.info.kernel", sval(elf.EIATTR_REGCOUNT, 1, 200)),
                     (".nv.info", sval(elf.EIATTR_REGCOUNT, 1, 32))])
    assert elf.read_resources(blob) == (32, 0, 0)


def test_no_nv_info_reads_zero():
    assert elf.read_resources(make_elf([(".text", b"\0" * 8)])) == (0, 0, 0)


@pytest.mark.parametrize("blob", [b"", b"not an elf at all", b"\x7fELF\x01" + bytes(60)])
def test_rejects_non_elf64(blob):
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        elf.read_resources(blob)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs the CuTe DSL")
def test_read_resources_of_a_compiled_cubin():
    from warpsplitk.runtime.compile import compile_for_arch
    report = compile_for_arch(256, 512, WarpSplitKTactic(32, 16, 128, 2, 2), "sm_90a")
    assert report.cubin[:4] == b"\x7fELF"
    registers, frame, stack = elf.read_resources(report.cubin)
    assert 0 < registers <= 255
    assert (registers, frame, stack) == (report.registers, report.spill_bytes, report.local_bytes)
    assert frame == 0
    assert any(a == elf.EIATTR_REGCOUNT for a, _ in elf.nv_info_attributes(report.cubin))
