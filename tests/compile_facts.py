"""What the compile tests read from a CompileReport (shared with their subprocess).

Not a test module: ``test_compile.py`` uses it in-process and runs it as a
script in a fresh interpreter (test_two_archs_in_one_process, and the sm_100a
spread, which also proves a fresh process compiles on its own).
"""

import json
import re
import sys


def facts(report):
    """JSON-able facts of one compiled kernel."""
    ptx = report.ptx
    target = re.search(r"^\s*\.target\s+(\S+)", ptx, re.M)
    reqntid = re.search(r"\.reqntid\s+(\d+)", ptx)
    return {
        "audit": report.audit(),
        "target": target.group(1) if target else None,
        "registers": report.registers,
        "spill_bytes": report.spill_bytes,
        "local_bytes": report.local_bytes,
        "local_memory": bool(re.search(r"\bld\.local|\bst\.local", ptx)),
        "reqntid": int(reqntid.group(1)) if reqntid else None,
        "mma": len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16", ptx)),
        "ldmatrix": len(re.findall(r"\bldmatrix\.sync\.aligned", ptx)),
        "entries": len(re.findall(r"\.entry\s", ptx)),
        "cubin_elf": bool(report.cubin) and report.cubin[:4] == b"\x7fELF",
        "threads": report.threads,
        "smem_bytes": report.smem_bytes,
    }


def main():
    """stdin: JSON list of [arch, n, k, tactic_short, has_bias(, swiglu)]; stdout:
    a line ``FACTS <JSON list of facts>`` (other output of the DSL may surround it)."""
    if "--import-cutlass" in sys.argv:
        import cutlass  # noqa: F401  (as an application that uses the DSL already would)
    from warpsplitk.runtime.compile import compile_for_arch
    from warpsplitk.tactics import WarpSplitKTactic
    results = []
    for arch, n, k, short, has_bias, *swiglu in json.load(sys.stdin):
        report = compile_for_arch(n, k, WarpSplitKTactic.parse(short), arch, has_bias=has_bias,
                                  swiglu=bool(swiglu and swiglu[0]))
        results.append(facts(report))
    print("FACTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
