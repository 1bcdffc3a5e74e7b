"""``warpsplitk cache``: show, list, prune or clear what the disk cache keeps
(compiled kernels, register records) and list the GPU plans of
``plan="auto"``."""
from __future__ import annotations

from ..planning import plan_cache
from ..runtime import disk_cache


def add_parser(sub):
    p = sub.add_parser("cache", help="show, list, prune or clear the compiled kernels and "
                                     "register records kept on disk")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="one line per file")
    what.add_argument("--clear", action="store_true", help="remove them all")
    what.add_argument("--prune", action="store_true",
                      help="remove those built by other warpsplitk or CuTe DSL versions or "
                           "other kernel sources")
    p.set_defaults(func=run)


def run(args, argv):
    folder = disk_cache.cache_dir()
    if args.clear or args.prune:
        return _remove(folder, args.clear)
    kernels = disk_cache.entries() + [p for p in disk_cache.legacy_entries() if p.suffix == ".o"]
    records = disk_cache.resource_entries()
    stale = {p for p in disk_cache.stale() if not p.name.endswith(".build.json")}
    plans = plan_cache.entries()
    if args.list:
        _list(plans, kernels, records, stale)
    state = "on" if disk_cache.enabled() else "off (WARPSPLITK_DISK_CACHE)"
    print(f"{folder}: {len(kernels)} compiled kernels, {len(records)} resource records "
          f"(registers for `warpsplitk plan`), {disk_cache.size() / 1e6:.1f} MB of "
          f"{disk_cache.max_bytes() / (1 << 30):.1f} GiB (WARPSPLITK_CACHE_MAX_SIZE; the least "
          f"recently used go first) ({len(stale)} stale: other versions, builds or kernel "
          f"sources, 'warpsplitk cache --prune' removes them); {len(plans)} GPU plans "
          f"(plan='auto'; --clear and --prune keep them); disk cache {state}")
    return 0


def _remove(folder, clear) -> int:
    """--clear (everything) or --prune (what is stale); 1 where a file stayed."""
    kernels, records, kept = (disk_cache.clear if clear else disk_cache.prune)(detail=True)
    what = "" if clear else "stale "
    print(f"removed {kernels} {what}compiled kernels and {records} {what}resource records "
          f"from {folder}" + (f"; could not remove {len(kept)} (e.g. {kept[0]})" if kept
                              else ""))
    return 1 if kept else 0


def _list(plans, kernels, records, stale):
    """--list: one line per plan, compiled kernel and register record."""
    for path in plans:
        try:
            shapes = len(plan_cache.read_file(path).entries)
        except (OSError, ValueError):  # not a plan, or not this user's alone
            shapes = "unreadable"
        print(f"plan     {path.name}  {shapes} shapes")
    for path in kernels:
        print(f"kernel   {path.name}  {_size(path) / 1e6:.2f} MB"
              f"{'  stale' if path in stale else ''}")
    for path in records:
        what = disk_cache.describe_resources(path)
        print(f"registers {what}{'  stale' if path in stale else ''}")


def _size(path) -> int:
    """A cached file's size; 0 once gone (another process pruning or clearing)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
