"""The launcher's argument slots, with stand-ins for compiled code (no GPU)."""

import ctypes
import importlib.util

import pytest

if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the CuTe DSL (nvidia-cutlass-dsl)", allow_module_level=True)

from warpsplitk.runtime import launch  # noqa: E402


class Marshalling:
    """Compiled code whose converter stores each value in its own slot, as the
    DSL does; ``width`` of M's slot and ``order`` of the slots are variable."""

    def __init__(self, m_type=ctypes.c_int32, order=range(6), extra=0):
        self.m_type, self.order, self.extra = m_type, list(order), extra
        self.calls, self.devices = [], []

    def generate_execution_args(self, *args):
        *pointers, m, stream = args
        values = [ctypes.c_uint64(p._pointer) for p in pointers]
        values += [self.m_type(m), ctypes.c_uint64(int(stream))]
        values += [ctypes.c_uint64(0)] * self.extra
        self._keep = values
        slots = [ctypes.addressof(v) for v in values]
        return [slots[i] for i in self.order] + slots[len(self.order):], []

    def to(self, device):
        self.devices.append(device)
        return Executor(self)

    def __call__(self, *args):
        self.calls.append(args)


class Executor:
    def __init__(self, compiled):
        self.compiled = compiled

    def run_compiled_program(self, args):
        read = [ctypes.c_uint64.from_address(a).value for a in args[:4]]
        read.append(ctypes.c_int32.from_address(args[4]).value)
        read.append(ctypes.c_uint64.from_address(args[5]).value)
        self.compiled.calls.append(tuple(read))


def test_slots_of_the_dsls_layout_are_recognised():
    assert launch.marshals_as_slots(Marshalling())


@pytest.mark.parametrize("compiled", [
    Marshalling(order=[1, 0, 2, 3, 4, 5]),      # pointers swapped
    Marshalling(order=[0, 1, 2, 3, 5, 4]),      # M and stream swapped
    Marshalling(extra=1),                       # a seventh argument
    Marshalling(m_type=ctypes.c_int8),          # M not a 32-bit slot
], ids=["pointer order", "m and stream", "extra argument", "m width"])
def test_any_other_layout_is_refused(compiled):
    assert not launch.marshals_as_slots(compiled)


def test_a_converter_that_raises_is_refused():
    class Raising(Marshalling):
        def generate_execution_args(self, *args):
            raise TypeError("different signature")
    assert not launch.marshals_as_slots(Raising())


def test_fast_path_writes_each_call_s_values():
    compiled = Marshalling()
    launcher = launch.Launcher(compiled, 3)
    assert launcher.fast and compiled.devices == [3]
    launcher(0x1000, 0x2000, 0x3000, 0x4000, 7, 0xABC)
    launcher(0x1000, 0x2020, 0x3000, 0x4040, 32, 0xDEF)
    assert compiled.calls == [(0x1000, 0x2000, 0x3000, 0x4000, 7, 0xABC),
                              (0x1000, 0x2020, 0x3000, 0x4040, 32, 0xDEF)]


def test_slots_are_per_thread():
    import threading
    compiled = Marshalling()
    launcher = launch.Launcher(compiled, 0)
    launcher(1 << 12, 2 << 12, 3 << 12, 4 << 12, 1, 5)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(launcher._slots.args))
    thread.start()
    thread.join()
    assert seen[0] != launcher._slots.args


def test_generic_path_when_the_layout_differs():
    compiled = Marshalling(order=[0, 1, 2, 3, 5, 4])
    launcher = launch.Launcher(compiled, 0)
    assert not launcher.fast and compiled.devices == []
    launcher(0x1000, 0x2000, 0x3000, 0x4000, 9, 0xABC)
    (call,) = compiled.calls
    assert [p._pointer for p in call[:4]] == [0x1000, 0x2000, 0x3000, 0x4000]
    assert call[4] == 9 and int(call[5]) == 0xABC


class Marshalling5(Marshalling):
    """The FP8 kernel's signature: five pointers (the scales fourth), M, stream."""

    def __init__(self):
        super().__init__(order=range(7))

    def to(self, device):
        self.devices.append(device)
        return Executor5(self)


class Executor5(Executor):
    def run_compiled_program(self, args):
        read = [ctypes.c_uint64.from_address(a).value for a in args[:5]]
        read.append(ctypes.c_int32.from_address(args[5]).value)
        read.append(ctypes.c_uint64.from_address(args[6]).value)
        self.compiled.calls.append(tuple(read))


def test_five_pointer_signature_takes_the_fast_path():
    compiled = Marshalling5()
    assert launch.marshals_as_slots(compiled, pointers=5)
    assert not launch.marshals_as_slots(compiled)  # counted as four: a seventh argument
    launcher = launch.Launcher(compiled, 0, pointers=5)
    assert launcher.fast
    launcher(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 3, 0xABC)
    assert compiled.calls == [(0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 3, 0xABC)]
