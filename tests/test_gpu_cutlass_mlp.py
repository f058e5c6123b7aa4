"""The CUTLASS exact-GELU epilogues on the GPU (cudnn_fuse.cutlass_mlp; built by bench/build_cutlass.sh)."""

import pytest
import torch
import torch.nn.functional as F

from cudnn_fuse import backward, cutlass_mlp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.fixture(autouse=True)
def _needs_library():
    if not cutlass_mlp.available():
        pytest.skip("cudnn_fuse/_cutlass_mlp.so not built (bench/build_cutlass.sh)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 kernels")


def _operands(rows, n, k, k2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(rows, k, device="cuda", generator=g).to(bf)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(bf)
    b = torch.randn(n, device="cuda", generator=g).to(bf)
    gy = torch.randn(rows, k2, device="cuda", generator=g).to(bf)
    w2 = (torch.randn(k2, n, device="cuda", generator=g) * n ** -0.5).to(bf)
    return x, w, b, gy, w2


@pytest.mark.parametrize("cfg", [0, 1, 2, 3, 4, 5, 3 + 16 * 3, 1 + 16 * 2 + 64 * 2])
@pytest.mark.parametrize("rows,n,k,k2", [(136, 200, 64, 40), (1024, 4096, 1024, 1024)])
def test_forward_and_backward_against_float64_and_eager(monkeypatch, cfg, rows, n, k, k2):
    monkeypatch.setattr(cutlass_mlp, "FWD_CONFIG", cfg)
    monkeypatch.setattr(cutlass_mlp, "BWD_CONFIG", cfg)
    x, w, b, gy, w2 = _operands(rows, n, k, k2, seed=cfg)
    y, z = cutlass_mlp.linear_gelu_aux(x, w, b)
    assert torch.equal(y, F.gelu(z)), "y must be aten's GELU of the kernel's own bf16 z, bit for bit"
    ref = F.linear(x.double(), w.double(), b.double())
    eager = F.linear(x, w, b)
    err = (z.double() - ref).abs().max() / ref.abs().max()
    eager_err = (eager.double() - ref).abs().max() / ref.abs().max()
    assert err <= max(2 * eager_err, 2 ** -8), (err, eager_err)
    dz = cutlass_mlp.dgelu(gy, w2, z)
    d64 = torch.ops.aten.gelu_backward(gy.double() @ w2.double(), z.double())
    de = torch.ops.aten.gelu_backward(gy @ w2, z)
    derr = (dz.double() - d64).abs().max() / d64.abs().max()
    deager = (de.double() - d64).abs().max() / d64.abs().max()
    assert derr <= max(2 * deager, 2 ** -8), (derr, deager)


def test_three_dim_input_and_declines():
    x, w, b, gy, w2 = _operands(64, 96, 32, 48)
    y, z = cutlass_mlp.linear_gelu_aux(x.view(4, 16, 32), w, b)
    assert y.shape == (4, 16, 96) and torch.equal(y.reshape(64, 96), F.gelu(z.reshape(64, 96)))
    assert cutlass_mlp.linear_gelu_aux(x.half(), w.half(), b.half()) is None  # bf16 only
    assert cutlass_mlp.linear_gelu_aux(x[:, :30], w[:, :30], b) is None  # K not a multiple of 8 (and not contiguous)
    assert cutlass_mlp.linear_gelu_aux(x, w, None) is None  # needs the bias
    assert cutlass_mlp.dgelu(gy, w2, z.reshape(64, 96)[:, :88].contiguous()) is None  # z's width


def test_runs_on_the_callers_stream_and_under_graph_capture():
    x, w, b, gy, w2 = _operands(256, 512, 128, 128)
    y0, z0 = cutlass_mlp.linear_gelu_aux(x, w, b)
    dz0 = cutlass_mlp.dgelu(gy, w2, z0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y1, z1 = cutlass_mlp.linear_gelu_aux(x, w, b)
        dz1 = cutlass_mlp.dgelu(gy, w2, z1)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(y0, y1) and torch.equal(z0, z1) and torch.equal(dz0, dz1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg, zg = cutlass_mlp.linear_gelu_aux(x, w, b)
        dzg = cutlass_mlp.dgelu(gy, w2, zg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    y2, z2 = cutlass_mlp.linear_gelu_aux(x, w, b)
    torch.cuda.synchronize()
    assert torch.equal(yg, y2) and torch.equal(zg, z2) and torch.equal(dzg, cutlass_mlp.dgelu(gy, w2, z2))
    assert not torch.equal(yg, y0)


def test_fused_mlp_step_on_cutlass_tracks_eager(monkeypatch):
    import cudnn_fuse as cf

    monkeypatch.setattr(backward, "MLP", "cutlass")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256),
                                torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda().bfloat16()
    fused = cf.optimize(__import__("copy").deepcopy(model))
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    s0 = dict(cutlass_mlp.stats)
    out = fused(x)
    out.float().square().mean().backward()
    assert cutlass_mlp.stats["forward"] - s0["forward"] == 2 and cutlass_mlp.stats["backward"] - s0["backward"] == 2
    gx, gp = x.grad.clone(), [p.grad.clone() for p in fused.parameters()]
    x.grad = None
    ref = model(x)
    ref.float().square().mean().backward()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for a, b in zip([gx] + gp, [x.grad] + [p.grad for p in model.parameters()]):
        assert (a.float() - b.float()).abs().max() <= 0.03 * b.float().abs().max() + 1e-6
