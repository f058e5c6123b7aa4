"""Where do cudnn_fuse.triton_act's exact-GELU results leave one 16-bit ulp of aten's? For the GPU
exactness test's shapes, prints each case's count of such elements, the range of z they sit at,
the worst error in units of float32-eps x |z| (forward) or |dy| (backward), and a few values.
GPU only; run as ``python3 bench/triton_gelu_tail_probe.py`` (docs/decisions.md, "The MLP's
elementwise passes in Triton")."""
import torch
import torch.nn.functional as F

from cudnn_fuse import triton_act

F32_EPS = torch.finfo(torch.float32).eps


def main() -> None:
    triton_act.MODE = "triton"
    for dtype in (torch.bfloat16, torch.float16):
        for shape in ((1024, 4096), (4099, 257)):
            g = torch.Generator(device="cuda").manual_seed(0)
            z = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype)
            dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
            for name, ours, ref, sc in (("fwd", triton_act.act_forward(z, "gelu"), F.gelu(z), z),
                                        ("bwd", triton_act.act_grad_dbias(dy, z, "gelu", False)[0],
                                         torch.ops.aten.gelu_backward(dy, z), dy)):
                ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
                err = (ours.float() - ref.float()).abs()
                bad = err > ulp
                zb = z[bad].float()
                print(dtype, shape, name, "old-bound violations", int(bad.sum()),
                      "z range", (zb.min().item(), zb.max().item()) if bad.any() else None,
                      "max err/(|scale|*f32eps)", (err[bad] / (sc[bad].float().abs() * F32_EPS)).max().item() if bad.any() else None,
                      "refs", ref[bad][:4].tolist(), "ours", ours[bad][:4].tolist())


if __name__ == "__main__":
    main()
