"""What a long kernel's captured cuDNN launch holds, where it is not one kernel node (GPU).

Long kernels' plans keep a capture only as a KernelReplay (launch_graphs.KERNEL_MAX_US); a capture of
more nodes is declined and the plan launches raw. This probe runs bench/memory.py's conv-bias-ReLU
training step (8 layers, 32x128x56x56 fp16 NHWC) through cf.optimize and records, for every declined
capture, each node: its kind, a kernel's function name (cuFuncGetName), a memset's size and value, a
memcpy's direction and size, and the graph's edges; and for every plan, its op, engine, estimate and
launch set; with ``--model mlp``, memory.py's Linear+GELU stack instead (bf16, 8192 rows). Written to
capture_nodes_probe[_mlp][_autotuned].json. Kernel nodes also carry what the library reads of them, and
the graph its edges through both edge queries (with their data: programmatic dependencies).

    python3 bench/capture_nodes_probe.py --out bench/results/launch_graphs [--autotune] [--model mlp]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.common import device_name, write_json  # noqa: E402
from bench.memory import convs, mlp, train_step  # noqa: E402
from cudnn_fuse import launch_graphs, plans  # noqa: E402


class _Memcpy3D(ctypes.Structure):  # CUDA_MEMCPY3D
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
                ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
                ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


MEMTYPE = {1: "host", 2: "device", 3: "array", 4: "unified"}
RECORDS: list = []


def _describe(graph: int) -> dict:
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * max(1, n.value))()
    lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n))
    index = {nodes[i]: i for i in range(n.value)}
    out = []
    for i in range(n.value):
        kind = ctypes.c_int(-1)
        lib.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(kind))
        rec = {"kind": launch_graphs.NODE_TYPE_NAMES[kind.value] if 0 <= kind.value < 14 else kind.value}
        if kind.value == 0:
            p = launch_graphs._KernelNodeParams()
            lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(nodes[i]), ctypes.byref(p))
            func = p.func
            if not func and p.kern:
                f = ctypes.c_void_p()
                lib.cuKernelGetFunction(ctypes.byref(f), ctypes.c_void_p(p.kern))
                func = f.value
            name = ctypes.c_char_p()
            if func and hasattr(lib, "cuFuncGetName") and lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)) == 0:
                rec["function"] = (name.value or b"").decode(errors="replace")[:160]
            rec["grid"] = [p.gx, p.gy, p.gz]
            rec["block"] = [p.bx, p.by, p.bz]
            rec["smem"] = p.smem
        elif kind.value == 2:
            m = launch_graphs._MemsetNodeParams()
            lib.cuGraphMemsetNodeGetParams(ctypes.c_void_p(nodes[i]), ctypes.byref(m))
            rec.update(bytes=m.width * m.elementSize * max(1, m.height), value=m.value, element_size=m.elementSize)
        elif kind.value == 1:
            m = _Memcpy3D()
            lib.cuGraphMemcpyNodeGetParams(ctypes.c_void_p(nodes[i]), ctypes.byref(m))
            rec.update(src=MEMTYPE.get(m.srcMemoryType, m.srcMemoryType), dst=MEMTYPE.get(m.dstMemoryType, m.dstMemoryType),
                       bytes=m.WidthInBytes * max(1, m.Height) * max(1, m.Depth))
        if kind.value == 0:  # what the library reads of it: a launch it can replay, or why not
            drv = launch_graphs.driver()
            p2 = launch_graphs._KernelNodeParams()
            rec["params_rc"] = lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(nodes[i]), ctypes.byref(p2))
            rec["kernel_params_null"], rec["extra"] = not p2.kernelParams, bool(p2.extra)
            rec["attr_rc"] = {}
            for aid in launch_graphs.NODE_ATTRS + (launch_graphs.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION,):
                v = launch_graphs._AttrValue()
                rc = lib.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(nodes[i]), aid, ctypes.byref(v))
                rec["attr_rc"][aid] = rc if rc else [int(w) for w in v.words[:2]]
            rec["library_reads_it"] = drv._kernel_node(nodes[i], graph, 0) is not None
        deps = ctypes.c_size_t(0)
        lib.cuGraphNodeGetDependencies(ctypes.c_void_p(nodes[i]), None, ctypes.byref(deps))
        dl = (ctypes.c_void_p * max(1, deps.value))()
        lib.cuGraphNodeGetDependencies(ctypes.c_void_p(nodes[i]), dl, ctypes.byref(deps))
        rec["after"] = [index.get(dl[j], "?") for j in range(deps.value)]
        out.append(rec)
    m = ctypes.c_size_t(0)
    edges = {"v1_rc": lib.cuGraphGetEdges(ctypes.c_void_p(graph), None, None, ctypes.byref(m)), "v1_count": m.value}
    k = max(1, m.value)  # the plain query again, filling the arrays: the library's second call
    edges["v1_fill_rc"] = lib.cuGraphGetEdges(ctypes.c_void_p(graph), (ctypes.c_void_p * k)(), (ctypes.c_void_p * k)(),
                                              ctypes.byref(m))
    if hasattr(lib, "cuGraphGetEdges_v2"):
        m = ctypes.c_size_t(0)
        lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(m))
        k = max(1, m.value)
        frm, to, data = (ctypes.c_void_p * k)(), (ctypes.c_void_p * k)(), (launch_graphs._EdgeData * k)()
        edges["v2_rc"] = lib.cuGraphGetEdges_v2(ctypes.c_void_p(graph), frm, to, data, ctypes.byref(m))
        edges["v2"] = [{"from": index.get(frm[j], "?"), "to": index.get(to[j], "?"), "from_port": data[j].from_port,
                        "to_port": data[j].to_port, "type": data[j].type} for j in range(m.value)]
    return {"nodes": out, "edges": edges}


def _kind(ex) -> str:
    if isinstance(ex, launch_graphs.SequenceReplay):
        return "SequenceReplay(" + ", ".join(ex.kinds) + ")"
    return "graph" if isinstance(ex, int) else type(ex).__name__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/launch_graphs")
    ap.add_argument("--autotune", action="store_true", help="autotune every graph first ($CUDNN_FUSE_TUNE_BUDGET_S)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", choices=("conv", "mlp"), default="conv",
                    help="memory.py's conv-bias-ReLU stack (default) or its Linear+GELU stack")
    args = ap.parse_args(argv)
    if args.autotune:
        cf.set_autotune(True)
    drv = launch_graphs.driver()
    orig = type(drv).node_kinds

    def node_kinds(self, graph):
        RECORDS.append(_describe(graph))
        return orig(self, graph)

    type(drv).node_kinds = node_kinds
    torch.manual_seed(0)
    if args.model == "mlp":  # memory.py's Linear+GELU stack, pre-activation kept
        model = cf.optimize(copy.deepcopy(mlp().cuda().to(torch.bfloat16)))
        x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    else:
        model = cf.optimize(copy.deepcopy(convs().cuda().half().to(memory_format=torch.channels_last)))
        x = torch.randn(32, 128, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    x.requires_grad_()
    for _ in range(args.steps):
        train_step(model, x)
    torch.cuda.synchronize()
    plan_rows = []
    for p in plans.plans_in_memory():
        p = getattr(p, "gemm", p)
        gs = getattr(p, "_graphs", None)
        spec = getattr(p, "spec", None)
        plan_rows.append({"op": getattr(spec, "op", None), "spec": type(spec).__name__, "engine": getattr(p, "engine", None),
                          "estimated_us": launch_graphs.estimated_us(spec) if spec is not None else None,
                          "launch_set": None if gs is None else {"kernel_only": gs.kernel_only, "off": gs.off,
                                                                 "execs": len(gs.execs), "reuses": gs.reuses,
                                                                 "kinds": sorted({_kind(e) for e in gs.execs.values()})}})
    name = "capture_nodes_probe" + ("_mlp" if args.model == "mlp" else "") + ("_autotuned" if args.autotune else "") + ".json"
    write_json(os.path.join(args.out, name), {"device": device_name(), "autotune": args.autotune,
                                              "graph_stats": {k: v for k, v in cf.plan_stats().items() if k.startswith("graph_")},
                                              "plans": plan_rows, "declined": RECORDS})
    for r in plan_rows:
        print(r)
    for r in RECORDS:
        print([(n["kind"], n.get("function", n.get("bytes")), n["after"]) for n in r["nodes"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
