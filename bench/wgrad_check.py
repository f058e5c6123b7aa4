"""One-off check for wgrad_probe's torch_lt row: is cuBLASLt called in the step, and how do its
gradients differ from eager's (bitwise and relative)?"""
import copy, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cudnn_fuse as cf  # noqa: E402
from bench.memory import mlp  # noqa: E402
from bench.wgrad_probe import use  # noqa: E402
from cudnn_fuse import cublaslt  # noqa: E402

torch.manual_seed(0)
base = mlp().cuda().to(torch.bfloat16)
x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
base(x).float().square().mean().backward()
ref = [p.grad.clone() for p in base.parameters()]
for v in ("torch", "torch_lt", "cf_lt"):
    m = cf.optimize(copy.deepcopy(base))
    use(v)
    calls = []
    real = cublaslt.wgrad_bgrad
    cublaslt.wgrad_bgrad = lambda *a, **k: calls.append(1) or real(*a, **k)
    m(x).float().square().mean().backward()
    cublaslt.wgrad_bgrad = real
    got = [p.grad for p in m.parameters()]
    diff = [int((a != b).sum()) for a, b in zip(got, ref)]
    print(v, "lt calls", len(calls), "elements differing per param", diff[:8], "total", sum(diff), flush=True)
use("cf")
