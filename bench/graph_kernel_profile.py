"""Which kernels one launch of a batch-1 conv runs, raw and replayed as a launch graph (the probe
behind bench/graph_device_probe.py's "same kernel, same kernel time"). torch.profiler over 16
calls each way, per conv; the 1x1 convs without a residual run as cuBLAS GEMMs (conv_gemm.py).

Ran once on an H200 at fccccd4's library code as bench/tmp_prof.py (this file's body, less an
unused import of cudnn_fuse.plans); its output is bench/results/launch_graphs/graph_kernel_profile.txt:
one kernel a call both ways, 2.92 / 2.91 us (no residual, nvjet), 3.18 / 3.20 us and 3.62 / 3.62 us
(residual, cuDNN).

    python3 bench/graph_kernel_profile.py
"""
import os, sys, torch
sys.path.insert(0, os.getcwd())
import cudnn_fuse as cf
from torch.profiler import profile, ProfilerActivity
from bench.graph_device_probe import _sets
for name, c, k, hw, r, res, act in [("nores", 64, 256, 56, 1, False, None), ("res", 64, 256, 56, 1, True, "relu"), ("res14", 256, 1024, 14, 1, True, "relu")]:
    sets = _sets(c, k, hw, r, 1, res)
    fn = lambda x, w, b, rr: cf.conv2d(x, w, b, 1, r // 2, activation=act, residual=rr)
    for i in range(64): fn(*sets[i % 16])
    for mode in (False, True):
        cf.set_launch_graphs(mode)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(16): fn(*sets[i % 16])
            torch.cuda.synchronize()
        print("==", name, "graphs" if mode else "raw")
        for e in prof.key_averages():
            d = getattr(e, "self_device_time_total", 0)
            if d > 0 or e.key.startswith("cu") or "Memset" in e.key or "Memcpy" in e.key:
                print(f"   {e.count:4d} dev {d/ max(e.count,1):8.2f}us  {e.key[:110]}")
    print(cf.plan_stats())
