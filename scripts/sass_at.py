"""SASS of one compiled kernel at given offsets (to read a sanitizer report).

    python3 scripts/sass_at.py N K TACTIC OFFSET [OFFSET ...]
    e.g. python3 scripts/sass_at.py 32 128 16,8,128,1,1 0xa20 0x1860

Compiles with compile_for_arch (sm_90a; WARPSPLITK_THREAD_ARRIVE=1 for the
diagnostic build), disassembles the CUBIN with nvdisasm (CUDA toolkit) and
prints each requested instruction with two neighbours either side.
"""

import glob
import re
import shutil
import subprocess
import sys
import tempfile

from warpsplitk.compile import compile_for_arch
from warpsplitk.tactics import WarpSplitKTactic


def main():
    n, k = int(sys.argv[1]), int(sys.argv[2])
    tactic = WarpSplitKTactic(*(int(v) for v in sys.argv[3].split(",")))
    offsets = [int(v, 16) for v in sys.argv[4:]]
    report = compile_for_arch(n, k, tactic, "sm_90a")
    tool = shutil.which("nvdisasm") or (glob.glob("/usr/local/cuda*/bin/nvdisasm") or [None])[0]
    if tool is None:
        sys.exit("nvdisasm not found")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(report.cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    lines = [line for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    index = {int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16): i
             for i, line in enumerate(lines)}
    for offset in offsets:
        i = index.get(offset)
        print(f"--- {offset:#x}" + ("" if i is not None else " (not found)"))
        if i is not None:
            for line in lines[max(0, i - 2):i + 3]:
                print(("> " if line is lines[i] else "  ") + " ".join(line.split()))


if __name__ == "__main__":
    main()
