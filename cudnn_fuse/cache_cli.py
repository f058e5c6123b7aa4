"""``cudnn-fuse cache {ls,stats,verify,prune,clear,export,import}``: the plan cache from a shell.

cli.py wires it in::

    add_cache_commands(subparsers)   # adds "cache" with run=run_cache_command
    ...
    return args.run(args)

Exit status: 0 on success; 1 when the cache cannot be opened or read (the error says why: a
directory refused as unsafe, one this user cannot read, a path below a file), when --namespace
names no namespace of the cache directory (the error lists those there; only ``import`` may make
one), when an action fails, when ``verify`` found a fault (each is listed, removed or not), when
``export`` meets a damaged fingerprint.json, or when ``import`` rejects or fails entries; 2 for a
usage error.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import logging
import os
import re
import sys

from .cache import ORPHAN_GRACE_S, CacheError, PlanCache, list_namespaces
from .progress import Bar, format_table, human_bytes

_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_READ_ONLY_ACTIONS = ("ls", "stats", "export")
# Fewer entries than this take well under a second to verify, export or import: a bar would only
# add lines to a log.
BAR_MIN_ITEMS = 100

_DESCRIPTIONS = {
    "ls": "List the plans cached in one environment namespace: key, op, engine, workspace, size, "
          "whether pinned (pre-warmed) and when tuned.",
    "stats": "Entries, bytes against the size limit and the lifetime hit rate of one namespace, "
             "and the other namespaces of the cache directory.",
    "verify": "Re-check every entry's checksum, the namespace's fingerprint.json and its value files, "
              "and list each fault found: the entry's key and op, the fault (truncated, checksum, "
              "unsafe-row, missing-file, orphan, fingerprint, barred-engine, ...), whether it was pinned "
              "and what was done. Bad entries are removed, pinned ones too (a corrupt plan is of no use; "
              "pre-warm again to pin its rebuilt plan); orphan value files older than "
              f"{ORPHAN_GRACE_S:.0f} s are removed (younger ones may be a running writer's); a damaged "
              "fingerprint.json is rewritten (this machine's namespace) or removed; entries that name an "
              "engine barred for their graph are removed, except pinned ones, which a process rebuilds in "
              "place. Exit status 1 when a fault was found, 0 when the cache was sound.",
    "prune": "Remove the entries unused for --older-than, then the least recently used ones until "
             "--max-bytes remain (default: the size limit). Pinned (pre-warmed) entries stay unless "
             "--include-pinned.",
    "clear": "Remove every entry of the namespace, pinned ones too.",
    "export": "Write every entry that passes verification to one portable file (JSON lines; a pipe "
              "such as /dev/stdout works), under a header naming the namespace and its fingerprint. A "
              "namespace whose fingerprint.json is damaged is refused (exit 1), since the header would "
              "name no environment or a wrong one: `cudnn-fuse cache verify` repairs it first.",
    "import": "Add the entries of a file written by `cache export`, verifying each; entries already "
              "cached are skipped. The file must come from this namespace unless --force. Unlike the "
              "other actions, --namespace may name a namespace that is not there yet: import makes it.",
}


def add_cache_commands(subparsers) -> argparse.ArgumentParser:
    """Add the ``cache`` command and its actions to an argparse subparsers object."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", help="cache root (default: $CUDNN_FUSE_CACHE_DIR or the user "
                                      "cache dir)")
    common.add_argument("--namespace", help="environment namespace (default: this machine's, "
                                            "see `cudnn-fuse doctor`); one the cache root holds")
    cache = subparsers.add_parser(
        "cache", help="inspect and maintain the on-disk plan cache",
        description="Inspect and maintain the on-disk plan cache: one directory per environment "
                    "namespace (GPU, driver and library versions) under the cache root. Each action "
                    "takes --dir and --namespace; `cudnn-fuse cache ACTION --help` says more.")
    actions = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        return actions.add_parser(name, parents=[common], help=help, description=_DESCRIPTIONS[name])

    action("ls", "list the cached plans")
    action("stats", "entries, bytes, hit rate")
    action("verify", "re-check every entry; remove bad ones and orphan files, listing each fault")
    prune = action("prune", "remove old or least recently used entries")
    prune.add_argument("--max-bytes", type=parse_size, metavar="SIZE",
                       help="keep at most SIZE bytes (e.g. 512M; default: the size limit)")
    prune.add_argument("--older-than", type=parse_duration, metavar="AGE",
                       help="remove entries unused for AGE (e.g. 30d, 12h, 3600)")
    prune.add_argument("--include-pinned", action="store_true",
                       help="pre-warmed (pinned) entries may go too")
    action("clear", "remove every entry, pinned ones too")
    export = action("export", "write every valid entry to one portable file")
    export.add_argument("file", help="output file (JSON lines)")
    imp = action("import", "add the entries of an exported file, verifying each")
    imp.add_argument("file", help="a file written by `cache export`")
    imp.add_argument("--force", action="store_true",
                     help="import even if the file comes from another environment namespace")
    cache.set_defaults(run=run_cache_command)
    return cache


def run_cache_command(args: argparse.Namespace) -> int:
    """Run one ``cache`` action; returns the exit status."""
    handler = _show_warnings()
    cache = None
    try:
        if args.dir is not None and not args.dir.strip():
            print("error: --dir is empty (give a directory, or leave --dir out for the default)", file=sys.stderr)
            return 2
        # A read-only open first: it creates nothing, so a cache that cannot be used is reported before
        # anything is made, and a --namespace typo makes no namespace (verify, prune and clear open for
        # writing; before, `clear --namespace <typo>` made one that stats then listed).
        cache = PlanCache(args.dir, namespace=args.namespace, read_only=True)
        problem = _unusable(cache, handler)
        if problem is None and args.namespace is not None and args.cache_command != "import":
            problem = _unknown_namespace(cache)
        if problem is None and args.cache_command not in _READ_ONLY_ACTIONS:
            cache.close()
            cache = PlanCache(args.dir, namespace=args.namespace)
            problem = _unusable(cache, handler)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 1
        return _ACTIONS[args.cache_command](cache, args)
    except (CacheError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if cache is not None:
            cache.close()
        if handler is not None:
            logging.getLogger("cudnn_fuse").removeHandler(handler)


def _unusable(cache: PlanCache, handler) -> "str | None":
    """Why the opened cache cannot be used (its ``disabled`` reason, said once), or None."""
    if cache.disabled is None:
        return None
    said = handler is not None and any(cache.disabled in m for m in handler.said)
    return "the plan cache is disabled" + (" (the warning above says why)" if said else f": {cache.disabled}")


def _unknown_namespace(cache: PlanCache) -> "str | None":
    """The error for a --namespace the cache root does not hold, listing those it does; or None."""
    there = list_namespaces(cache.path)
    if cache.namespace in there:
        return None
    if not os.path.lexists(cache.path):
        return f"no namespace {cache.namespace!r} under {cache.path}: the directory does not exist"
    return (f"no namespace {cache.namespace!r} under {cache.path} "
            f"(namespaces there: {', '.join(there) or 'none'})")


class _SayingHandler(logging.StreamHandler):
    """A stderr handler that remembers what it printed (an error need not repeat a warning's reason)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.said.append(record.getMessage())


def _show_warnings() -> "_SayingHandler | None":
    """Print the cache's warnings to stderr unless the application configured logging."""
    logger = logging.getLogger("cudnn_fuse")
    configured = logging.getLogger().handlers or [
        h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if configured:
        return None
    handler = _SayingHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger.addHandler(handler)
    return handler


def _progress(label: str):
    """A progress callback that draws a ``progress.Bar`` on stderr once the work has at least
    BAR_MIN_ITEMS items."""
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if total < BAR_MIN_ITEMS:
            return
        if bar is None:
            bar = Bar(label)
        bar(done, total)

    return update


def _ls(cache: PlanCache, args) -> int:
    infos = list(cache.entry_info())
    if not infos:
        print(f"no plans cached in {cache.dir}")
        return 0
    rows = [(info.key[:12], _op(info.meta), _engine(info.meta),
             _maybe_bytes(_first(info.meta, "workspace_bytes", "workspace")),
             human_bytes(info.size), "yes" if info.pinned else "", _when(info.meta, info))
            for info in infos]
    print(format_table(("key", "op", "engine", "workspace", "size", "pinned", "tuned_at"), rows))
    total = sum(info.size for info in infos)
    print(f"\n{_count(len(infos), 'plan')}, {human_bytes(total)} in {cache.dir}")
    return 0


def _stats(cache: PlanCache, args) -> int:
    s = cache.stats()
    rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    rows = [
        ("directory", s["dir"]),
        ("namespace", s["namespace"]),
        ("entries", f"{s['entries']} ({s['pinned']} pinned)"),
        ("bytes", f"{human_bytes(s['bytes'])} of {human_bytes(s['size_limit'])}"),
        ("hits", s["hits"]),
        ("misses", s["misses"]),
        ("hit rate", rate),
    ]
    others = [ns for ns in list_namespaces(cache.path) if ns != cache.namespace]
    if others:
        rows.append(("other namespaces", ", ".join(others)))
    if s.get("error"):
        rows.append(("error", s["error"]))
    print(format_table(("item", "value"), rows))
    return 1 if s.get("error") else 0  # cache.db could not be read: the counts above are not its own


def _verify(cache: PlanCache, args) -> int:
    c = cache.verify(progress=_progress(f"verifying {cache.namespace}"))
    faults = c["faults"]
    print(f"checked {_count(c['checked'], 'entry')}: {c['ok']} ok, {c['bad']} bad, "
          f"{c['removed']} removed")
    print(f"orphan value files: {c['orphans']}, {c['orphans_removed']} removed"
          + (f", {c['young_orphans']} younger than {ORPHAN_GRACE_S:.0f} s left (a running writer may own them)"
             if c["young_orphans"] else ""))
    barred = _barred_keys(cache)
    for fault in barred:
        if not fault["pinned"] and not cache.read_only:
            fault["removed"] = bool(cache.delete(fault["key"]))
    if barred:
        n, kept = len(barred), sum(f["pinned"] for f in barred)
        print(f"{_count(n, 'entry')} {'names' if n == 1 else 'name'} an engine that computes "
              f"{'its' if n == 1 else 'their'} graph wrongly "
              f"(engines.barred_engines): {sum(f['removed'] for f in barred)} removed, "
              f"{kept} pinned left for a process to rebuild in place")
    faults += barred
    if not faults:
        print(f"no faults: {cache.dir} is sound")
        return 0
    lost = [f for f in faults if f["pinned"] and f["removed"]]
    if lost:
        one = len(lost) == 1
        print(f"warning: removed {_count(len(lost), 'pinned entry')} (pre-warmed): "
              f"{'its plan is' if one else 'their plans are'} rebuilt at first use, unpinned; "
              f"pre-warm again to pin {'it' if one else 'them'}", file=sys.stderr)
    left = [f for f in faults if not f["removed"] and not (f["kind"] == "barred-engine" and f["pinned"])]
    if cache.read_only and left:
        print(f"the cache is read-only: {_count(len(left), 'fault')} left in place", file=sys.stderr)
    print(f"\n{_count(len(faults), 'fault')} found in {cache.dir}:\n")
    print(format_table(("key", "op", "fault", "pinned", "action", "detail"),
                       [_fault_row(f, cache) for f in faults]))
    return 1


def _fault_row(fault: dict, cache: PlanCache) -> tuple:
    """key, op, fault, pinned, action, detail; a file (an orphan, fingerprint.json) has no key or op."""
    entry = fault["key"] is not None
    detail = fault["detail"].removeprefix(f"{fault['kind']}: ")  # CorruptEntry's text starts with its kind
    return (fault["key"][:12] if entry else "-", fault["op"] or ("?" if entry else "-"), fault["kind"],
            ("yes" if fault["pinned"] else "no") if entry else "-", _action(fault, cache), detail)


def _action(fault: dict, cache: PlanCache) -> str:
    if fault.get("repair"):
        return fault["repair"]
    if fault["removed"]:
        return "removed"
    if fault["kind"] == "barred-engine" and fault["pinned"]:
        return "left: pinned, a process rebuilds it in place"
    return "left (read-only cache)" if cache.read_only else "left"


def _barred_keys(cache: PlanCache) -> list:
    """A verify fault (as ``PlanCache.verify`` lists them) for each entry whose recorded engine is
    barred for its spec, and for its engine record (which holds no spec of its own, and goes or
    stays with its entry). A pinned (pre-warmed) entry is not removed: the loader refuses it and
    rebuilds it in place, still pinned."""
    from .loader import engine_record_key
    from .engines import barred_engines
    from .spec import spec_from_dict

    out = []
    infos = list(cache.entry_info())
    keys = {info.key for info in infos}
    for info in infos:
        eid, spec = info.meta.get("engine_id"), info.meta.get("spec")
        if eid is None or not isinstance(spec, dict):
            continue
        try:
            if int(eid) not in barred_engines(spec_from_dict(dict(spec))):
                continue
        except (TypeError, ValueError, KeyError, OverflowError):  # OverflowError: an engine id of Infinity
            continue  # a spec or engine id this version cannot read: not ours to judge
        fault = dict(key=info.key, op=_op(info.meta), kind="barred-engine", pinned=info.pinned, removed=False,
                     detail=f"engine {eid} computes this graph wrongly (engines.barred_engines)")
        out.append(fault)
        if engine_record_key(info.key) in keys:
            out.append(dict(fault, key=engine_record_key(info.key),
                            detail=f"the engine record of {info.key[:12]}, whose engine {eid} is barred"))
    return out


def _prune(cache: PlanCache, args) -> int:
    removed = cache.prune(max_bytes=args.max_bytes, older_than_s=args.older_than,
                          include_pinned=args.include_pinned)
    print(f"removed {_count(removed, 'entry')}; {human_bytes(cache.stats()['bytes'])} left")
    return 0


def _clear(cache: PlanCache, args) -> int:
    print(f"removed {_count(cache.clear(), 'entry')} from {cache.dir}")
    return 0


def _export(cache: PlanCache, args) -> int:
    n = cache.export(args.file, progress=_progress(f"exporting {cache.namespace}"))
    # into a pipe (/dev/stdout | ssh host cudnn-fuse cache import /dev/stdin) the export goes alone
    out = sys.stdout if os.path.isfile(args.file) else sys.stderr
    print(f"exported {_count(n, 'entry')} of namespace {cache.namespace} to {args.file}", file=out)
    return 0


def _import(cache: PlanCache, args) -> int:
    c = cache.import_(args.file, force=args.force, progress=_progress(f"importing {os.path.basename(args.file)}"))
    print(f"into {cache.dir}:\n")
    print(format_table(("imported", "skipped (already cached)", "rejected (failed verification)",
                        "failed (not written)"), [(c["imported"], c["skipped"], c["rejected"], c["failed"])]))
    return 1 if c["rejected"] or c["failed"] else 0


_ACTIONS = {"ls": _ls, "stats": _stats, "verify": _verify, "prune": _prune, "clear": _clear,
            "export": _export, "import": _import}


# ---------------------------------------------------------------- formatting


def parse_size(text: str) -> int:
    """ "512M" -> 536870912; plain numbers are bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512M, 2G)")
    return int(decimal.Decimal(m.group(1)) * _SIZE_UNITS[m.group(2)])  # a float would overflow past 1e308


def parse_duration(text: str) -> float:
    """ "30d" -> 2592000.0; plain numbers are seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 12h, 30d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def _count(n: int, noun: str) -> str:
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


def _first(meta: dict, *names):
    for name in names:
        if meta.get(name) is not None:
            return meta[name]
    return None


def _op(meta: dict) -> str:
    spec = meta.get("spec")
    op = _first(meta, "op") or (spec.get("op") if isinstance(spec, dict) else None)
    return str(op) if op is not None else "?"


def _engine(meta: dict) -> str:
    """The engine an entry names; a tuned entry that runs torch's implementation or a 1x1 conv's
    GEMM instead says so, with the cuDNN plan it keeps as its blob in brackets."""
    if meta.get("kind") == "family-record":  # a shape family's tuned engines (loader._note_family)
        anchors = meta.get("anchors")
        return f"family ({len(anchors) if isinstance(anchors, list) else '?'} tuned sizes)"
    engine = _first(meta, "engine", "engine_id", "engine_name")
    if isinstance(engine, dict):
        engine = _first(engine, "name", "id", "engine_id")
    name = str(engine) if engine is not None else "?"
    if meta.get("use_gemm"):
        return f"gemm (conv {name})"
    if meta.get("use_torch"):
        return f"torch (cuDNN {name})"
    return name


def _maybe_bytes(value) -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 2**63  # NaN fails too
    return human_bytes(value) if ok else "?"


def _when(meta: dict, info) -> str:
    tuned = meta.get("tuned_at")
    stamp = tuned if isinstance(tuned, (int, float)) else (None if tuned else info.stored_at)
    if stamp is None:
        return str(tuned)
    try:
        return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):  # NaN, or past the platform's dates: one row says so
        return str(stamp)
