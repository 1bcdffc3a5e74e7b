"""What the kernel takes, stated once: the token rows, the operand
alignment, the target archs and the GPUs the package's data was measured on.

Everything that validates an operand, picks an arch or names a GPU reads
these constants instead of restating them. No torch, no CuTe DSL.
"""

from __future__ import annotations

#: Token rows (M) a call takes at most: the largest token tile, so one
#: weight tile is streamed once per call.
MAX_M = 32

#: Bytes every operand's address must be a multiple of: the compiled code
#: is told its pointers are this aligned (``runtime.compile.gmem_pointer``)
#: and vectorises its loads and stores on that promise.
ALIGN_BYTES = 32

#: The archs the kernel is built for (Hopper and Blackwell).
SUPPORTED_ARCHS = ("sm_90a", "sm_100a")

#: The GPU (name, SM count) an arch stands for where none is present
#: (``warpsplitk plan --arch`` without ``--sm-count``).
ARCH_GPUS = {"sm_90a": ("NVIDIA H200", 132), "sm_100a": ("NVIDIA B200", 148)}

#: The built-in plans and the GPU (name, SM count) each was measured on.
BUILTIN_PLAN_GPUS = {"h200": ("NVIDIA H200", 132)}

__all__ = ["MAX_M", "ALIGN_BYTES", "SUPPORTED_ARCHS", "ARCH_GPUS", "BUILTIN_PLAN_GPUS"]
