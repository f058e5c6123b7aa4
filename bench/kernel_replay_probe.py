"""Could a captured cuDNN launch be replayed as its kernel (cuLaunchKernelEx) instead of a graph?

graph_queue_probe.json found that launch-graph replays block the host once 9-31 are queued behind
busy GPU work, where kernel launches queue ~1000, and eager_host_probe.json that cuGraphLaunch
costs ~5 us of the ~10 us eager call. This probe captures one plan's launch into a graph (as
launch_graphs.py does), reads its nodes, and where the graph is one kernel node launches that
kernel directly with the node's function, dimensions, parameters and attributes. For each case
it reports the graph's node types and the kernel node's attributes, whether the direct launch
gives bit-identical outputs to a raw cuDNN launch (on fresh inputs), and host microseconds per
call of cuGraphLaunch, cuLaunchKernelEx and the raw launch, back to back and queued behind a sleep.

    python3 bench/kernel_replay_probe.py --out bench/results/launch_graphs
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from bench.common import write_json  # noqa: E402
from cudnn_fuse import plans  # noqa: E402

vp, u32 = ctypes.c_void_p, ctypes.c_uint


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", vp), ("gx", u32), ("gy", u32), ("gz", u32), ("bx", u32), ("by", u32), ("bz", u32),
                ("smem", u32), ("kernelParams", vp), ("extra", vp), ("kern", vp), ("ctx", vp)]


class AttrValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes
    _fields_ = [("pad", ctypes.c_ubyte * 64), ("u64", ctypes.c_uint64 * 8)]


class LaunchAttr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_ubyte * 4), ("value", AttrValue)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", u32), ("gy", u32), ("gz", u32), ("bx", u32), ("by", u32), ("bz", u32), ("smem", u32),
                ("hStream", vp), ("attrs", ctypes.POINTER(LaunchAttr)), ("numAttrs", u32)]


ATTR_NAMES = {1: "access_policy_window", 2: "cooperative", 4: "cluster_dimension",
              5: "cluster_scheduling_policy", 8: "priority", 9: "mem_sync_domain_map", 10: "mem_sync_domain",
              11: "preferred_cluster_dimension", 14: "preferred_shared_memory_carveout"}
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}

lib = ctypes.CDLL("libcuda.so.1")


def fn(name, *args):
    f = getattr(lib, name)
    f.argtypes, f.restype = list(args), ctypes.c_int
    return f


P = ctypes.POINTER
cuStreamBeginCapture = fn("cuStreamBeginCapture_v2", vp, ctypes.c_int)
cuStreamEndCapture = fn("cuStreamEndCapture", vp, P(vp))
cuGraphInstantiate = fn("cuGraphInstantiateWithFlags", P(vp), vp, ctypes.c_ulonglong)
cuGraphLaunch = fn("cuGraphLaunch", vp, vp)
cuGraphGetNodes = fn("cuGraphGetNodes", vp, vp, P(ctypes.c_size_t))
cuGraphNodeGetType = fn("cuGraphNodeGetType", vp, P(ctypes.c_int))
try:
    cuKernelNodeGetParams = fn("cuGraphKernelNodeGetParams_v2", vp, P(KernelNodeParams))
except AttributeError:
    cuKernelNodeGetParams = fn("cuGraphKernelNodeGetParams", vp, P(KernelNodeParams))
cuKernelNodeGetAttribute = fn("cuGraphKernelNodeGetAttribute", vp, ctypes.c_int, P(AttrValue))
cuLaunchKernelEx = fn("cuLaunchKernelEx", P(LaunchConfig), vp, vp, vp)
cuKernelGetFunction = fn("cuKernelGetFunction", P(vp), vp)
cuLaunchKernel = fn("cuLaunchKernel", vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp)
cuFuncGetAttribute = fn("cuFuncGetAttribute", P(ctypes.c_int), ctypes.c_int, vp)
try:
    cuFuncGetParamInfo = fn("cuFuncGetParamInfo", vp, ctypes.c_size_t, P(ctypes.c_size_t), P(ctypes.c_size_t))
except AttributeError:
    cuFuncGetParamInfo = None
FUNC_ATTRS = {10: "cluster_size_must_be_set", 11: "required_cluster_width", 12: "required_cluster_height",
              13: "required_cluster_depth", 15: "cluster_scheduling_policy_preference"}


def check(rc, what):
    if rc:
        raise RuntimeError(f"{what}: CUresult {rc}")


class Replay:
    """One captured launch: the graph exec, and (one kernel node) its direct launch."""

    def __init__(self, plan, ptrs):
        fnr, slots, array, address, n, index, raw_handle = plan._raw
        import cudnn

        self.plan, self.ptrs = plan, list(ptrs)
        side = torch.cuda.Stream()
        dev = plan.device
        stream = torch.cuda.current_stream().cuda_stream
        self.ws, self._keep = plans._workspace_ptr(dev, stream, plan.workspace_size) if plan.workspace_size else (0, None)
        h = plan._handle
        torch.cuda.synchronize()
        cudnn.set_stream(handle=h.handle, stream=side.cuda_stream)
        h.stream = side.cuda_stream
        check(cuStreamBeginCapture(side.cuda_stream, 1), "begin capture")
        try:
            for slot, p in zip(slots, ptrs):
                array[slot] = p
            fnr(address, n, self.ws, raw_handle, index)
        finally:
            g = vp()
            check(cuStreamEndCapture(side.cuda_stream, ctypes.byref(g)), "end capture")
        self.graph, self.side = g, side
        ex = vp()
        check(cuGraphInstantiate(ctypes.byref(ex), g, 0), "instantiate")
        self.ex = ex.value
        n_nodes = ctypes.c_size_t(0)
        check(cuGraphGetNodes(g, None, ctypes.byref(n_nodes)), "get nodes (count)")
        nodes = (vp * n_nodes.value)()
        check(cuGraphGetNodes(g, nodes, ctypes.byref(n_nodes)), "get nodes")
        self.types = []
        for nd in nodes:
            t = ctypes.c_int()
            check(cuGraphNodeGetType(nd, ctypes.byref(t)), "node type")
            self.types.append(NODE_TYPES.get(t.value, str(t.value)))
        self.direct = None
        self.attrs = {}
        if self.types == ["kernel"]:
            node = nodes[0]
            p = KernelNodeParams()
            check(cuKernelNodeGetParams(node, ctypes.byref(p)), "kernel node params")
            self.params = p
            func = p.func
            if not func and p.kern:
                f = vp()
                check(cuKernelGetFunction(ctypes.byref(f), p.kern), "kernel -> function")
                func = f.value
            self.func = func
            self.node_values = {}
            for aid, name in ATTR_NAMES.items():
                v = AttrValue()
                rc = cuKernelNodeGetAttribute(node, aid, ctypes.byref(v))
                words = list(ctypes.cast(ctypes.byref(v), P(ctypes.c_uint32 * 4)).contents)
                self.attrs[name] = {"rc": rc, "words": words}
                if rc == 0 and any(bytes(v.pad)) and aid != 1:
                    self.node_values[aid] = v
            self.set_attrs(sorted(self.node_values))
            self.direct = True
            self.dims = {"grid": [p.gx, p.gy, p.gz], "block": [p.bx, p.by, p.bz], "smem": p.smem,
                         "extra": bool(p.extra), "func_from_kernel": not p.func}

    def set_attrs(self, ids):
        """The direct launch's config with the node's values of these attribute ids."""
        p = self.params
        self.attr_list = (LaunchAttr * max(1, len(ids)))()
        for i, aid in enumerate(ids):
            self.attr_list[i].id = aid
            ctypes.memmove(ctypes.byref(self.attr_list[i].value), ctypes.byref(self.node_values[aid]), 64)
        self.launched_attrs = [ATTR_NAMES[a] for a in ids]
        stream = torch.cuda.current_stream().cuda_stream
        self.cfg = LaunchConfig(p.gx, p.gy, p.gz, p.bx, p.by, p.bz, p.smem, stream, self.attr_list, len(ids))
        self.cfg_ref = ctypes.byref(self.cfg)

    def func_info(self) -> dict:
        """The kernel's cluster-related function attributes and its parameters' count and bytes."""
        out = {}
        for aid, name in FUNC_ATTRS.items():
            v = ctypes.c_int(-1)
            rc = cuFuncGetAttribute(ctypes.byref(v), aid, self.func)
            out[name] = v.value if rc == 0 else f"rc {rc}"
        if cuFuncGetParamInfo is not None:
            n, end = 0, 0
            off, size = ctypes.c_size_t(), ctypes.c_size_t()
            while n < 4096 and cuFuncGetParamInfo(self.func, n, ctypes.byref(off), ctypes.byref(size)) == 0:
                end = max(end, off.value + size.value)
                n += 1
            out["params"], out["param_bytes"] = n, end
        return out

    def variant(self, ids, bare=False):
        """A direct launch with these of the node's attribute ids (kept alive in the closure); ``bare``:
        through cuLaunchKernelEx without a prototype, given ready ctypes objects (as the library calls it,
        launch_graphs._bare), instead of the prototyped binding converting integers per call."""
        p = self.params
        attr_list = (LaunchAttr * max(1, len(ids)))()
        for i, aid in enumerate(ids):
            attr_list[i].id = aid
            ctypes.memmove(ctypes.byref(attr_list[i].value), ctypes.byref(self.node_values[aid]), 64)
        cfg = LaunchConfig(p.gx, p.gy, p.gz, p.bx, p.by, p.bz, p.smem, torch.cuda.current_stream().cuda_stream,
                           attr_list, len(ids))
        ref, func, params, extra = ctypes.byref(cfg), self.func, p.kernelParams, p.extra
        if bare:
            from cudnn_fuse import launch_graphs

            f = launch_graphs._bare(lib, "cuLaunchKernelEx")
            fp, pp, ep = vp(func), vp(params), (vp(extra) if extra else None)

            def launch_bare(_keep=(cfg, attr_list)):
                return f(ref, fp, pp, ep)
            return launch_bare

        def launch(_keep=(cfg, attr_list)):
            return cuLaunchKernelEx(ref, func, params, extra)
        return launch

    def legacy(self):
        """The same kernel through cuLaunchKernel (no attributes at all)."""
        p, stream = self.params, torch.cuda.current_stream().cuda_stream
        return lambda: cuLaunchKernel(self.func, p.gx, p.gy, p.gz, p.bx, p.by, p.bz, p.smem, stream, p.kernelParams, p.extra)

    def graph_launch(self):
        return cuGraphLaunch(self.ex, torch.cuda.current_stream().cuda_stream)

    def kernel_launch(self):
        return cuLaunchKernelEx(self.cfg_ref, self.func, self.params.kernelParams, self.params.extra)


def host_us(f, calls):
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        f()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / calls


def queued_us(f, calls):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e8))
    t = time.perf_counter()
    for _ in range(calls):
        f()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * dt / calls


def cases():
    d, h, bf = "cuda", torch.float16, torch.bfloat16
    cl = torch.channels_last
    g = torch.Generator(device=d).manual_seed(0)

    def r(*s, dt=h):
        return torch.randn(*s, device=d, dtype=dt, generator=g)

    x, w, b = r(64, 256), r(256, 256) * 0.06, r(256)
    yield "linear_64x256x256_relu", (x,), lambda x: cf.linear(x, w, b, activation="relu")
    xc, wc, bc = r(1, 64, 56, 56).to(memory_format=cl), (r(64, 64, 3, 3) * 0.05).to(memory_format=cl), r(64)
    yield "conv_bs1_c64_k64_56_r3_bias_relu", (xc,), lambda x: cf.conv2d(x, wc, bc, padding=1, activation="relu")
    x1, w1, b1 = r(1, 256, 56, 56).to(memory_format=cl), (r(64, 256, 1, 1) * 0.05).to(memory_format=cl), r(64)
    res = r(1, 64, 56, 56).to(memory_format=cl)
    yield "conv_bs1_c256_k64_56_r1_bias_res_relu", (x1,), lambda x: cf.conv2d(x, w1, b1, residual=res, activation="relu")
    q, k, v = r(1, 8, 128, 64, dt=bf), r(1, 8, 128, 64, dt=bf), r(1, 8, 128, 64, dt=bf)
    yield "sdpa_b1_h8_s128_d64_causal", (q,), lambda q: cf.scaled_dot_product_attention(q, k, v, is_causal=True)
    a, bm = r(128, 512, dt=bf), r(512, 256, dt=bf) * 0.05
    yield "matmul_128x512x256_amax", (a,), lambda a: cf.matmul(a, bm, return_amax=True)


def variant_cases(rec, rp, plan, ptrs, outs, inp, calls) -> None:
    """The direct launch with fewer attributes: the node's nonzero ones (``node``), the library's
    trimmed set (``trimmed``: launch_graphs.Driver.trim_attrs, against the capture's side stream; and
    ``trimmed_bare``, the same through the unprototyped binding the library uses), none (``none``),
    and cuLaunchKernel (``legacy``). Each: bit-identical to the raw launch on fresh
    inputs, host microseconds back to back and queued behind a sleep, interleaved rounds."""
    from cudnn_fuse import launch_graphs

    drv = launch_graphs.driver() or launch_graphs.Driver()  # the probe runs with launch graphs off
    ids = sorted(rp.node_values)
    trimmed = ids
    if drv is not None and drv.kernels:
        def lib_value(v):  # the library's own CUlaunchAttributeValue type, same 64 bytes
            out = launch_graphs._AttrValue()
            ctypes.memmove(ctypes.byref(out), ctypes.byref(v), 64)
            return out

        kept = drv.trim_attrs([(a, lib_value(rp.node_values[a])) for a in ids], rp.func, rp.side.cuda_stream)
        trimmed = [a for a, _ in kept]
    names = {"node": ids, "trimmed": trimmed, "none": []}
    launches = {k: rp.variant(v) for k, v in names.items()}
    launches["trimmed_bare"] = rp.variant(trimmed, bare=True)
    launches["legacy"] = rp.legacy()
    out = rec["variants"] = {k: {"attrs": [ATTR_NAMES[a] for a in v]} for k, v in names.items()}
    out["trimmed_bare"] = {"attrs": [ATTR_NAMES[a] for a in trimmed]}
    out["legacy"] = {"attrs": []}
    for k, f in launches.items():
        same = []
        for _ in range(3):
            inp.copy_(torch.randn_like(inp))
            for o in outs:
                o.fill_(0)
            plan.launch(ptrs)
            torch.cuda.synchronize()
            want = [o.clone() for o in outs]
            for o in outs:
                o.fill_(0)
            rc = f()
            torch.cuda.synchronize()
            if rc:
                out[k]["rc"] = rc
                break
            same.append(all(torch.equal(o, w) for o, w in zip(outs, want)))
        out[k]["bit_identical"] = same
    live = {k: f for k, f in launches.items() if "rc" not in out[k]}
    for k in live:
        out[k]["host_us"], out[k]["queued_256_us"] = [], []
    for _ in range(5):
        for k, f in live.items():
            out[k]["host_us"].append(round(host_us(f, calls), 3))
            out[k]["queued_256_us"].append(round(queued_us(f, 256), 3))
    for k in live:
        out[k]["host_us_median"] = statistics.median(out[k]["host_us"])
        out[k]["queued_256_us_median"] = statistics.median(out[k]["queued_256_us"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "launch_graphs"))
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    seen = {}
    orig = plans.Plan.launch

    def spy(self, ptrs):
        seen["last"] = (self, list(ptrs))
        return orig(self, ptrs)

    plans.Plan.launch = spy
    cf.set_launch_graphs(False)  # raw launches: the graphs here are the probe's own
    results = {}
    with torch.no_grad():
        for name, (inp,), op in cases():
            rec = results[name] = {}
            try:
                for _ in range(3):
                    out = op(inp)
                seen.clear()
                out = op(inp)  # kept alive: its pointers are in the capture
                if "last" not in seen:
                    rec["error"] = "no raw launch (memo not taken)"
                    continue
                plan, ptrs = seen["last"]
                rec["engine"] = plan.engine
                rp = Replay(plan, ptrs)
                rec["node_types"] = rp.types
                if not rp.direct:
                    rec["direct"] = False
                    continue
                rec.update(attrs=rp.attrs, launched_attrs=rp.launched_attrs, dims=rp.dims)
                outs = out if isinstance(out, tuple) else (out,)
                # bit-identical: fresh input values, raw launch vs direct kernel launch (same pointers)
                same = []
                for trial in range(3):
                    inp.copy_(torch.randn_like(inp))
                    for o in outs:
                        o.fill_(0)
                    plan.launch(ptrs)  # raw (graphs off)
                    torch.cuda.synchronize()
                    want = [o.clone() for o in outs]
                    for o in outs:
                        o.fill_(0)
                    rc = rp.kernel_launch()
                    if rc and trial == 0:  # retry with the cluster and cooperative attributes only
                        rec["kernel_launch_rc_all_attrs"] = rc
                        rp.set_attrs([a for a in sorted(rp.node_values) if a in (2, 4)])
                        rec["launched_attrs"] = rp.launched_attrs
                        rc = rp.kernel_launch()
                    torch.cuda.synchronize()
                    if rc:
                        rec["kernel_launch_rc"] = rc
                        break
                    same.append(all(torch.equal(o, wnt) for o, wnt in zip(outs, want)))
                    for o in outs:
                        o.fill_(0)
                    check(rp.graph_launch(), "graph launch")
                    torch.cuda.synchronize()
                    same.append(all(torch.equal(o, wnt) for o, wnt in zip(outs, want)))
                rec["bit_identical"] = same
                if "kernel_launch_rc" in rec:
                    continue
                kinds = {"cuGraphLaunch": rp.graph_launch, "cuLaunchKernelEx": rp.kernel_launch,
                         "raw_plan_launch": lambda: plan.launch(ptrs)}
                rec["host_us"] = {k: [] for k in kinds}
                rec["queued_256_us"] = {k: [] for k in kinds}
                for _ in range(3):
                    for k, f in kinds.items():
                        rec["host_us"][k].append(round(host_us(f, args.calls), 3))
                        rec["queued_256_us"][k].append(round(queued_us(f, 256), 3))
                rec["host_us_median"] = {k: statistics.median(v) for k, v in rec["host_us"].items()}
                rec["queued_256_us_median"] = {k: statistics.median(v) for k, v in rec["queued_256_us"].items()}
                rec["func"] = rp.func_info()
                variant_cases(rec, rp, plan, ptrs, outs, inp, args.calls)
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                rec["error"] = f"{type(exc).__name__}: {exc}"
    plans.Plan.launch = orig
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": results}
    write_json(os.path.join(args.out, "kernel_replay_probe.json"), doc)
    for name, rec in results.items():
        print(name, json.dumps({k: rec.get(k) for k in ("engine", "node_types", "launched_attrs", "dims", "bit_identical",
                                                      "kernel_launch_rc_all_attrs", "host_us_median", "queued_256_us_median", "error",
                                                      "kernel_launch_rc", "func")}))
        for k, v in rec.get("variants", {}).items():
            print("   ", k, json.dumps({f: v.get(f) for f in ("attrs", "bit_identical", "rc", "host_us_median",
                                                               "queued_256_us_median")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
