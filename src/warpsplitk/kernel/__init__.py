"""The device code and its proof: address math (``layout``), inline PTX
(``ptx``), the kernel (``warp_splitk``) and a NumPy model of one CTA
(``emulator``). No torch."""
