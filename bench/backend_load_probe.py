"""Where a warm plan's load time goes below the frontend (issue 3 diagnosis, second probe).

``deserialize_probe.py`` timed the frontend's ``pygraph.deserialize`` whole: 0.5-2.7 ms a plan
even the second time, and 60-140 ms for the first plan of some engine families. That call is
C++ that holds the GIL throughout and does four things: it parses the blob (UBJSON), finalizes a
cuDNN backend plan from the JSON inside it, and "warms up" the plan (cudaMalloc of 1 MiB, a
throwaway CUDA graph capture of one execute with fake pointers, cudaFree). This probe does the
backend's part alone through ctypes (which releases the GIL) and times each piece:

  decode     the blob's UBJSON, in Python
  finalize   cudnnBackendFinalize of an EXECUTION_PLAN from the JSON (and a second one)
  execute    cudnnBackendExecute with a variant pack (scratch pointers), first and second

in fresh processes: pieces in order; every plan finalized on N threads (one handle each), then
executed on the main thread; the frontend's deserialize after such a threaded finalize; and the
pieces in order under CUDA_MODULE_LOADING=EAGER (is a family's first cost the driver's lazy
loading?).

    python3 bench/backend_load_probe.py --out bench/results
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXECUTION_PLAN, VARIANT_PACK = 5, 16  # cudnnBackendDescriptorType_t
TYPE_HANDLE, TYPE_INT64, TYPE_VOID_PTR, TYPE_CHAR = 0, 3, 6, 24  # cudnnBackendAttributeType_t
PLAN_HANDLE, PLAN_WORKSPACE_SIZE, PLAN_JSON = 400, 402, 405
VP_UIDS, VP_PTRS, VP_WORKSPACE = 1000, 1001, 1003


# ------------------------------------------------------------------ UBJSON (nlohmann's to_ubjson)


def ubjson_loads(data: bytes):
    pos = 0

    def read(n):
        nonlocal pos
        out = data[pos:pos + n]
        if len(out) != n:
            raise ValueError("truncated UBJSON")
        pos += n
        return out

    ints = {b"i": ">b", b"U": ">B", b"I": ">h", b"l": ">i", b"L": ">q", b"d": ">f", b"D": ">d"}

    def length():
        m = read(1)
        return struct.unpack(ints[m], read(struct.calcsize(ints[m])))[0]

    def value(m):
        if m in ints:
            return struct.unpack(ints[m], read(struct.calcsize(ints[m])))[0]
        if m == b"Z":
            return None
        if m == b"T":
            return True
        if m == b"F":
            return False
        if m == b"C":
            return read(1).decode()
        if m in (b"S", b"H"):
            s = read(length()).decode()
            return float(s) if m == b"H" else s
        if m in (b"[", b"{"):
            obj = m == b"{"
            typ = count = None
            nxt = read(1)
            if nxt == b"$":
                typ = read(1)
                nxt = read(1)
            if nxt == b"#":
                count = length()
            else:
                nonlocal pos
                pos -= 1
            out = {} if obj else []
            i = 0
            while True:
                if count is not None and i == count:
                    break
                if count is None:
                    peek = data[pos:pos + 1]
                    if peek == (b"}" if obj else b"]"):
                        pos += 1
                        break
                    if peek == b"N":
                        pos += 1
                        continue
                if obj:
                    key = read(length()).decode()
                    out[key] = value(typ if typ is not None else read(1))
                else:
                    out.append(value(typ if typ is not None else read(1)))
                i += 1
            return out
        raise ValueError(f"UBJSON marker {m!r} at {pos - 1}")

    return value(read(1))


# ------------------------------------------------------------------ the backend through ctypes


def _libcudnn():
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libcudnn.so" in path:
            return ctypes.CDLL(path)
    return ctypes.CDLL("libcudnn.so.9")


class Backend:
    def __init__(self):
        lib = self.lib = _libcudnn()
        for name in ("cudnnCreate", "cudnnBackendCreateDescriptor", "cudnnBackendFinalize", "cudnnBackendSetAttribute",
                     "cudnnBackendGetAttribute", "cudnnBackendExecute", "cudnnBackendDestroyDescriptor"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cudnnBackendSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                                 ctypes.c_void_p]
        lib.cudnnBackendGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                                 ctypes.c_void_p, ctypes.c_void_p]
        lib.cudnnBackendCreateDescriptor.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.cudnnBackendFinalize.argtypes = [ctypes.c_void_p]
        lib.cudnnBackendExecute.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: cuDNN status {rc}")

    def handle(self) -> int:
        h = ctypes.c_void_p()
        self.check(self.lib.cudnnCreate(ctypes.byref(h)), "cudnnCreate")
        return h.value

    def plan(self, handle: int, text: str):
        desc = ctypes.c_void_p()
        self.check(self.lib.cudnnBackendCreateDescriptor(EXECUTION_PLAN, ctypes.byref(desc)), "create plan")
        buf = ctypes.create_string_buffer(text.encode(), len(text))
        self.check(self.lib.cudnnBackendSetAttribute(desc, PLAN_JSON, TYPE_CHAR, len(text), buf), "set json")
        h = ctypes.c_void_p(handle)
        self.check(self.lib.cudnnBackendSetAttribute(desc, PLAN_HANDLE, TYPE_HANDLE, 1, ctypes.byref(h)), "set handle")
        self.check(self.lib.cudnnBackendFinalize(desc), "finalize plan")
        return desc

    def workspace(self, plan) -> int:
        ws, n = ctypes.c_int64(), ctypes.c_int64()
        self.check(self.lib.cudnnBackendGetAttribute(plan, PLAN_WORKSPACE_SIZE, TYPE_INT64, 1, ctypes.byref(n),
                                                     ctypes.byref(ws)), "workspace size")
        return ws.value

    def execute(self, handle: int, plan, uids, ptrs, ws: int) -> None:
        vp = ctypes.c_void_p()
        self.check(self.lib.cudnnBackendCreateDescriptor(VARIANT_PACK, ctypes.byref(vp)), "create variant pack")
        u = (ctypes.c_int64 * len(uids))(*uids)
        p = (ctypes.c_void_p * len(ptrs))(*ptrs)
        w = ctypes.c_void_p(ws)
        self.check(self.lib.cudnnBackendSetAttribute(vp, VP_UIDS, TYPE_INT64, len(uids), u), "uids")
        self.check(self.lib.cudnnBackendSetAttribute(vp, VP_PTRS, TYPE_VOID_PTR, len(ptrs), p), "pointers")
        self.check(self.lib.cudnnBackendSetAttribute(vp, VP_WORKSPACE, TYPE_VOID_PTR, 1, ctypes.byref(w)), "workspace")
        self.check(self.lib.cudnnBackendFinalize(vp), "finalize variant pack")
        self.check(self.lib.cudnnBackendExecute(ctypes.c_void_p(handle), plan, vp), "execute")
        self.lib.cudnnBackendDestroyDescriptor(vp)


# ------------------------------------------------------------------ children


def _blobs(specs_path: str):
    from cudnn_fuse.cache import open_default_cache
    from cudnn_fuse.spec import spec_from_dict

    pc = open_default_cache()
    out = {}
    for name, d in json.load(open(specs_path)).items():
        t = time.perf_counter()
        entry = pc.get(spec_from_dict(d).digest())
        out[name] = (entry, time.perf_counter() - t)
    return out


class Scratch:
    def __init__(self, torch):
        self.buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.ws = {}
        self.torch = torch
        self.scalar = ctypes.c_double(1.0)

    def args(self, doc: dict, ws_size: int):
        byval = {int(k) for k in (doc.get("pass_by_values") or {})}
        uids = sorted(int(u) for u in doc["variant_pack_uids"])
        ptrs = [ctypes.addressof(self.scalar) if u in byval else self.buf.data_ptr() for u in uids]
        if ws_size not in self.ws:
            self.ws[ws_size] = self.torch.empty(max(ws_size, 1), dtype=self.torch.uint8, device="cuda")
        return uids, ptrs, self.ws[ws_size].data_ptr()


def _extras(doc: dict) -> dict:
    return {k: len(doc.get(k) or {}) for k in ("pass_by_values", "workspace_modifications", "variant_pack_replacements")}


def child_pieces(specs_path: str) -> dict:
    import torch

    from cudnn_fuse import plans

    plans.handle_for(0)  # loads cuDNN as the library does
    be = Backend()
    h = be.handle()
    scratch = Scratch(torch)
    torch.cuda.synchronize()
    rows = {}
    for name, (entry, get_s) in _blobs(specs_path).items():
        r = {"cache_get": get_s}
        t = time.perf_counter()
        doc = ubjson_loads(entry.blob)
        r["decode"] = time.perf_counter() - t
        text = doc["cudnn_backend_data"]
        t = time.perf_counter()
        plan = be.plan(h, text)
        r["finalize_1"] = time.perf_counter() - t
        t = time.perf_counter()
        plan2 = be.plan(h, text)
        r["finalize_2"] = time.perf_counter() - t
        be.lib.cudnnBackendDestroyDescriptor(plan2)
        ws = be.workspace(plan)
        uids, ptrs, wsp = scratch.args(doc, ws)
        for k in ("execute_1", "execute_2"):
            t = time.perf_counter()
            be.execute(h, plan, uids, ptrs, wsp)
            torch.cuda.synchronize()
            r[k] = time.perf_counter() - t
        row = {k: round(1e3 * v, 3) for k, v in r.items()}
        row.update(engine=entry.meta.get("engine_name"), json_bytes=len(text), **_extras(doc))
        rows[name] = row
    return rows


def child_threads(specs_path: str, threads: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import cudnn
    import torch

    from cudnn_fuse import plans

    fh = plans.handle_for(0)
    be = Backend()
    scratch = Scratch(torch)
    blobs = _blobs(specs_path)
    docs = {name: ubjson_loads(e.blob) for name, (e, _) in blobs.items()}
    handles = [be.handle() for _ in range(threads)]
    torch.cuda.synchronize()
    import threading

    local = threading.local()
    pool_handles = iter(handles)
    lock = threading.Lock()

    def one(item):
        name, doc = item
        if not hasattr(local, "h"):
            with lock:
                local.h = next(pool_handles)
        t = time.perf_counter()
        p = be.plan(local.h, doc["cudnn_backend_data"])
        return name, (p, local.h, time.perf_counter() - t)

    t = time.perf_counter()
    if threads == 1:
        done = dict(one(i) for i in docs.items())
    else:
        with ThreadPoolExecutor(threads) as ex:
            done = dict(ex.map(one, docs.items()))
    wall = time.perf_counter() - t
    rows = {}
    for name, (plan, h, fin_s) in done.items():
        uids, ptrs, wsp = scratch.args(docs[name], be.workspace(plan))
        t = time.perf_counter()
        be.execute(h, plan, uids, ptrs, wsp)
        torch.cuda.synchronize()
        ex1 = time.perf_counter() - t
        t = time.perf_counter()
        g = cudnn.pygraph(handle=fh.handle)
        g.deserialize(fh.handle, blobs[name][0].blob)
        fe = time.perf_counter() - t
        rows[name] = {"finalize_in_thread": round(1e3 * fin_s, 3), "execute_1": round(1e3 * ex1, 3),
                      "frontend_deserialize_after": round(1e3 * fe, 3)}
    return {"threads": threads, "finalize_wall_ms": round(1e3 * wall, 2), "per_graph": rows}


def _child(mode: str, specs_path: str, cache_dir: str, extra: dict | None = None) -> dict:
    env = dict(os.environ, CUDNN_FUSE_CACHE_DIR=cache_dir, CUDNN_FUSE_AUTOTUNE="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {}))
    t = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--specs", specs_path],
                       env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"error": f"{mode} child failed ({p.returncode}): {p.stderr[-2000:]}"}
    lines = p.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    out["process_wall_s"] = round(wall, 2)
    return out


def _means(rows: dict) -> dict:
    keys = [k for k, v in next(iter(rows.values())).items() if isinstance(v, float)]
    return {k: round(sum(r[k] for r in rows.values()) / len(rows), 3) for k in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--specs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if args.child == "fill":
        from bench.deserialize_probe import _fill

        _fill(args.specs)
        print("{}")
        return 0
    if args.child == "pieces":
        print(json.dumps({"per_graph": child_pieces(args.specs)}))
        return 0
    if args.child and args.child.startswith("threads"):
        print(json.dumps(child_threads(args.specs, int(args.child[7:]))))
        return 0
    from bench.common import device_name, write_json

    result = {"device": device_name()}
    with tempfile.TemporaryDirectory() as cache_dir:
        specs = os.path.join(cache_dir, "specs.json")
        result["fill"] = _child("fill", specs, cache_dir)
        for key, mode, extra in [("pieces", "pieces", None), ("threads_1", "threads1", None),
                                 (f"threads_{args.threads}", f"threads{args.threads}", None),
                                 ("pieces_eager_loading", "pieces", {"CUDA_MODULE_LOADING": "EAGER"})]:
            r = result[key] = _child(mode, specs, cache_dir, extra)
            if "per_graph" in r:
                r["mean_ms"] = _means(r["per_graph"])
                r["sum_ms"] = {k: round(v * len(r["per_graph"]), 2) for k, v in r["mean_ms"].items()}
            print(key, json.dumps({k: v for k, v in r.items() if k != "per_graph"}), flush=True)
    write_json(os.path.join(args.out, "backend_load_probe.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
