"""Launching compiled code with little host time.

A compiled CuTe DSL function called the generic way converts every argument
on each call: a CuTe pointer object per address (~2 µs each) and a pass over
the signature (~5 µs), on top of the launch itself. In eager decode that is
paid per projection, and it is more than the kernel time of a small weight.

The compiled host function itself takes an array of addresses, one per
argument, each pointing at the argument's value (a 64-bit device address, a
32-bit M, a 64-bit stream handle). :class:`Launcher` keeps those value slots
(one set per thread) and only writes the new values before each launch.

That layout is the DSL's, not ours, so it is checked, not assumed: at
construction the generic converter is run on probe values and each slot it
produces must read back as the probe; if anything differs (a newer DSL that
marshals differently) the launcher uses the generic call instead.
"""

from __future__ import annotations

import ctypes
import threading

from .dsl import gmem_pointer

# probe values: distinct, 32 B aligned, never dereferenced
_PROBE_ADDRESSES = (0x7E0000001000, 0x7E0000002000, 0x7E0000003000, 0x7E0000004000)
_PROBE_M = 0x3A5C0B1D  # wider than 16 bits: a narrower slot would not read back
_PROBE_STREAM = 0x5EED0


def _slot_address(arg) -> int:
    return arg.value if isinstance(arg, ctypes.c_void_p) else int(arg)


def marshals_as_slots(compiled) -> bool:
    """Whether ``compiled`` (our kernel's signature: four pointers, M, stream)
    takes its arguments as addresses of plain value slots."""
    from cuda.bindings import driver

    # the slots belong to these objects: keep them alive while reading
    pointers = [gmem_pointer(a) for a in _PROBE_ADDRESSES]
    stream = driver.CUstream(_PROBE_STREAM)
    try:
        args, adapted = compiled.generate_execution_args(*pointers, _PROBE_M, stream)
    except Exception:
        return False
    if len(args) != 6:
        return False
    slots = [_slot_address(a) for a in args]
    values = [ctypes.c_uint64.from_address(s).value for s in slots[:4]]
    m = ctypes.c_int32.from_address(slots[4]).value
    handle = ctypes.c_uint64.from_address(slots[5]).value
    del pointers, stream, adapted
    return values == list(_PROBE_ADDRESSES) and m == _PROBE_M and handle == _PROBE_STREAM


class _Slots(threading.local):
    def __init__(self):
        self.pointers = (ctypes.c_uint64 * 4)()
        self.m = ctypes.c_int32()
        self.stream = ctypes.c_uint64()
        base = ctypes.addressof(self.pointers)
        self.args = [base + 8 * i for i in range(4)] + [ctypes.addressof(self.m),
                                                         ctypes.addressof(self.stream)]


class Launcher:
    """``launcher(weight, x, bias, out, m, stream)``: addresses and the stream
    handle as ints. Launches compiled code on ``device_index``; the caller
    has validated the arguments (nothing is checked here)."""

    def __init__(self, compiled, device_index: int):
        self.compiled = compiled
        self.fast = marshals_as_slots(compiled)
        self._executor = compiled.to(device_index) if self.fast else None
        self._slots = _Slots()

    def __call__(self, weight: int, x: int, bias: int, out: int, m: int, stream: int):
        if self._executor is None:
            return self._generic(weight, x, bias, out, m, stream)
        slots = self._slots
        p = slots.pointers
        p[0], p[1], p[2], p[3] = weight, x, bias, out
        slots.m.value = m
        slots.stream.value = stream
        self._executor.run_compiled_program(slots.args)

    def _generic(self, weight, x, bias, out, m, stream):
        from cuda.bindings import driver

        self.compiled(gmem_pointer(weight), gmem_pointer(x), gmem_pointer(bias),
                      gmem_pointer(out), m, driver.CUstream(stream))
