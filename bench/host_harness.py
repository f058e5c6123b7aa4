"""The host (Python + torch) cost of cudnn_fuse's calls with cuDNN replaced by no-op launches, on
any machine, a GPU or not: the CPU side of bench/host_overhead.py. Every plan is a fake whose
launch does nothing, so what is timed is what the library adds around the kernels: validation,
memo lookups, autograd.Function plumbing, spec caches, output allocation. The baseline is a bare
autograd.Function that allocates the same outputs and nothing else (the floor of any Python op).

``--eager``: the memoized inference call instead (``cf.linear`` 64x256x256 + ReLU, host_overhead's
row), through a real plan whose launches go to libc stand-ins of the driver calls (gettimeofday
for cuGraphLaunch's two pointers, memcmp of zero bytes for cuLaunchKernelEx's four): its
launch-graph replays, its kernel replays and its raw launches. Where ``cudnn_fuse._native`` is
built the rows run the C memo, and ``kernel_replays_python`` is the kernel replays on the Python path.

A CPU host's numbers are not a GPU host's: use it to compare changes; quote bench/host_overhead.py.

    python3 bench/host_harness.py [--profile OP] [--eager]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import cudnn_fuse as cf  # noqa: E402
from cudnn_fuse import backward, loader, ops, plans  # noqa: E402


class FakePlan:
    raw = True
    engine = "fake"

    def __init__(self, spec):
        self.spec = spec

    def launch(self, ptrs):
        pass

    def run(self, buffers):
        pass


def _fake_get_plan(spec, device):
    return FakePlan(spec)


class Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        y = torch.empty_like(x)
        ctx.save_for_backward(x, w, y, b)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, y, b = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t) / calls


def eager_rows(calls: int = 100000, rounds: int = 5) -> dict:
    """{path: (us per memoized cf.linear call, entry type, replays)} for the graph, kernel and raw
    paths of a stand-in plan (see the module docstring); the best of ``rounds`` loops."""
    import contextlib
    import ctypes
    import threading
    import timeit
    import types

    from cudnn_fuse import launch_graphs

    libc = ctypes.CDLL(None)
    gtod = libc.gettimeofday
    gtod.argtypes, gtod.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    memcmp = launch_graphs._bare(libc, "memcmp")  # unprototyped, as the Driver binds cuLaunchKernelEx
    tv = ctypes.create_string_buffer(64)
    node = launch_graphs._KernelNodeParams()  # kernelParams 0: memcmp's length, so it reads nothing
    hints = []
    for aid in (4, 5, 9):  # as many attributes as the H200's cuDNN kernels carried
        v = launch_graphs._AttrValue()
        v.words[0] = 1
        hints.append((aid, v))

    class StandIn:
        def __init__(self, kernels):
            self.kernels = kernels
            self.launch = gtod

        def capture(self, stream, work, kernel_only=False):
            work()
            if self.kernels:
                return launch_graphs.KernelReplay(memcmp, 0x100, 0x300, node, hints, stream)
            return ctypes.addressof(tv)

        def destroy(self, ex):
            pass

        def error_name(self, rc):
            return str(rc)

    def plan(drv):
        p = object.__new__(plans.Plan)
        p.spec = types.SimpleNamespace(op="linear")
        p.graph, p.uids, p.workspace_size, p.device, p.engine, p._ordered = None, (1, 2, 3, 4), 0, 0, "stand-in", True
        p._handle = types.SimpleNamespace(lock=threading.Lock(), stream=0, handle=None)
        array = (ctypes.c_uint64 * 4)()
        p._raw = (lambda *a: None, (0, 1, 2, 3), array, ctypes.addressof(array), 4, -1, 0)
        p._graphs = launch_graphs.GraphSet(drv) if drv is not None else None
        return p

    x, w, b = (torch.randn(64, 256).half(), torch.randn(256, 256).half(), torch.randn(256).half())
    attrs = ("relu", False, 0.01)
    out = {}
    with contextlib.ExitStack() as stack:
        for name, value in (("_current_stream", lambda d: 0), ("_current_device", lambda: 0),
                            ("_side_stream", lambda d: 0)):
            stack.enter_context(mock.patch.object(plans, name, value))
        stack.enter_context(mock.patch.object(launch_graphs, "ENABLED", True))
        stack.enter_context(mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext()))
        import cudnn

        stack.enter_context(mock.patch.object(cudnn, "set_stream", lambda **k: None, create=True))
        with torch.no_grad():
            native = ops.native_enabled()
            for path, drv, c in (("graph_replays", StandIn(False), native), ("kernel_replays", StandIn(True), native),
                                 ("kernel_replays_python", StandIn(True), False), ("raw", None, native)):
                if path.endswith("_python") and not native:
                    continue  # the Python path is every row already
                ops.set_native(c)
                key, _ = ops._memo("linear", x, w, b, None, attrs)
                p = plan(drv)
                ops._FAST[key] = ops._Launch(p, torch.empty(64, 256).half(), False, x)

                def call():
                    cf.linear(x, w, b, activation="relu")
                for _ in range(200):
                    call()
                replays = launch_graphs.STATS.replays
                us = min(timeit.repeat(call, number=calls, repeat=rounds)) / calls * 1e6
                entries = list(p._graphs.execs.values()) if p._graphs is not None else []
                out[path] = (us, type(entries[0]).__name__ if entries else None,
                             launch_graphs.STATS.replays - replays)
        ops.set_native(native)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", choices=("conv2d", "linear", "stack8", "chain8"), help="cProfile 1000 steps of this op")
    ap.add_argument("--eager", action="store_true", help="the memoized inference call's paths instead")
    args = ap.parse_args(argv)
    if args.eager:
        for path, (us, entry, _) in eager_rows().items():
            print(f"cf_linear_eager_{path:16s} {us:8.3f} us  (entries: {entry})")
        return 0
    cl = torch.channels_last
    dt = torch.float16
    x = torch.randn(2, 16, 8, 8).to(dt).to(memory_format=cl).requires_grad_()
    w = torch.randn(16, 16, 3, 3).to(dt).to(memory_format=cl).requires_grad_()
    b = torch.randn(16).to(dt).requires_grad_()
    gy = torch.randn(2, 16, 8, 8).to(dt).to(memory_format=cl)
    xl = torch.randn(64, 32).to(dt).requires_grad_()
    wl = torch.randn(48, 32).to(dt).requires_grad_()
    bl = torch.randn(48).to(dt).requires_grad_()
    gl = torch.randn(64, 48).to(dt)

    def conv_step():
        cf.conv2d(x, w, b, padding=1, activation="relu").backward(gy)

    def linear_step():
        cf.linear(xl, wl, bl, activation="relu").backward(gl)

    def bare_step():
        Bare.apply(x, w, b).backward(gy)

    # an 8-layer conv-bias-ReLU stack as cf.nn modules: each layer its own autograd node, or one
    # cf.nn.ConvChain node for all 8 (optimize(chain_convs=True)); the same layers either way
    torch.manual_seed(0)
    layers = [cf.nn.Conv2d(16, 16, 3, padding=1, activation="relu").to(dt).to(memory_format=cl) for _ in range(8)]
    stack = torch.nn.Sequential(*layers)
    chain = cf.nn.ConvChain(layers, chained=True)

    def stack_step():
        stack(x).backward(gy)

    def chain_step():
        chain(x).backward(gy)

    patches = [mock.patch.object(loader, "get_plan", _fake_get_plan),
               mock.patch.object(ops, "_why_not_fused", lambda op, ts: None),
               mock.patch.object(backward, "usable", lambda *ts: True)]
    for p in patches:
        p.start()
    try:
        loader.clear()
        res = {name: per_call_us(fn, args.calls) for name, fn in
               (("bare_function_step", bare_step), ("cf_conv2d_step", conv_step), ("cf_linear_step", linear_step),
                ("cf_conv_stack8_step", stack_step), ("cf_conv_chain8_step", chain_step))}
        for k, v in res.items():
            print(f"{k:24s} {v:8.1f} us")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            step = {"conv2d": conv_step, "linear": linear_step, "stack8": stack_step, "chain8": chain_step}[args.profile]
            for _ in range(1000):
                step()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            print(buf.getvalue())
    finally:
        for p in patches:
            p.stop()
        loader.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
