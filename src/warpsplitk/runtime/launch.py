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
_PROBE_ADDRESSES = tuple(0x7E0000000000 + 0x1000 * (i + 1) for i in range(8))
_PROBE_M = 0x3A5C0B1D  # wider than 16 bits: a narrower slot would not read back
_PROBE_STREAM = 0x5EED0


def _slot_address(arg) -> int:
    return arg.value if isinstance(arg, ctypes.c_void_p) else int(arg)


def marshals_as_slots(compiled, pointers: int = 4) -> bool:
    """Whether ``compiled`` (our kernels' signature: ``pointers`` addresses,
    then M and the stream; 4 for BF16 weights, 5 with FP8 weights' scales)
    takes its arguments as addresses of plain value slots."""
    from cuda.bindings import driver

    probes = _PROBE_ADDRESSES[:pointers]
    # the slots belong to these objects: keep them alive while reading
    args_in = [gmem_pointer(a) for a in probes]
    stream = driver.CUstream(_PROBE_STREAM)
    try:
        args, adapted = compiled.generate_execution_args(*args_in, _PROBE_M, stream)
    except Exception:
        return False
    if len(args) != pointers + 2:
        return False
    slots = [_slot_address(a) for a in args]
    values = [ctypes.c_uint64.from_address(s).value for s in slots[:pointers]]
    m = ctypes.c_int32.from_address(slots[pointers]).value
    handle = ctypes.c_uint64.from_address(slots[pointers + 1]).value
    del args_in, stream, adapted
    return values == list(probes) and m == _PROBE_M and handle == _PROBE_STREAM


class _Slots(threading.local):
    def __init__(self, pointers):
        self.pointers = (ctypes.c_uint64 * pointers)()
        self.m = ctypes.c_int32()
        self.stream = ctypes.c_uint64()
        base = ctypes.addressof(self.pointers)
        self.args = [base + 8 * i for i in range(pointers)] + [ctypes.addressof(self.m),
                                                                ctypes.addressof(self.stream)]


class Launcher:
    """``launcher(*addresses, m, stream)``: the kernel's ``pointers``
    addresses (weight, x, bias, out; with FP8 weights weight, x, bias,
    scale, out) and the stream handle as ints. Launches compiled code on
    ``device_index``; the caller has validated the arguments (nothing is
    checked here)."""

    def __init__(self, compiled, device_index: int, pointers: int = 4):
        self.compiled = compiled
        self.pointers = pointers
        self.fast = marshals_as_slots(compiled, pointers)
        self._executor = compiled.to(device_index) if self.fast else None
        self._slots = _Slots(pointers)

    def __call__(self, *args):
        if self._executor is None:
            return self._generic(args[:-2], args[-2], args[-1])
        slots = self._slots
        slots.pointers[:] = args[:-2]
        slots.m.value = args[-2]
        slots.stream.value = args[-1]
        self._executor.run_compiled_program(slots.args)

    def _generic(self, addresses, m, stream):
        from cuda.bindings import driver

        self.compiled(*map(gmem_pointer, addresses), m, driver.CUstream(stream))
