"""FP8 training on the CPU reference path: the recipes' scales against a hand computation (amax 0, inf and
NaN keep the previous scale), cf.nn.Linear(fp8=recipe) casting X, W and dY with them, its state in the
state_dict, and a small MLP trained 200 steps with each recipe tracking the same model in float32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import fp8
from cudnn_fuse.errors import ArgumentError

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("amax, want", [(2.0, 448.0 / 2.0 / 4.0), (0.0, 3.0), (float("inf"), 3.0),
                                        (float("nan"), 3.0), (1e-45, 3.0)])
def test_a_scale_is_fp8_max_over_amax_over_two_to_the_margin_or_the_previous_one(amax, want):
    got = fp8.scale_from_amax(torch.tensor(amax), E4, 2, torch.tensor(3.0))
    assert got.item() == pytest.approx(want)  # 1e-45: 448 / amax overflows float32, the previous scale stays


def test_current_scaling_uses_this_steps_amax_and_delayed_the_history_before_it():
    cur = cf.Float8CurrentScaling()
    hist = torch.tensor([4.0, 8.0, 1.0])
    assert cur.scale(torch.tensor(2.0), hist, torch.tensor(1.0), E4).item() == pytest.approx(224.0)
    dmax = cf.DelayedScaling(amax_history_len=3)
    assert dmax.scale(torch.tensor(2.0), hist, torch.tensor(1.0), E4).item() == pytest.approx(448 / 8)
    recent = cf.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent", fp8_format="e4m3")
    assert recent.scale(torch.tensor(2.0), hist, torch.tensor(1.0), E4).item() == pytest.approx(448 / 4)
    assert recent.formats() == (E4, E4) and cur.formats() == (E4, E5)
    first = dmax.scale(torch.tensor(2.0), torch.zeros(3), torch.tensor(1.0), E4)
    assert first.item() == 1.0  # no history yet: the previous scale


def test_a_cast_pushes_its_amax_and_keeps_the_scale_it_used():
    scales, history = torch.ones(3), torch.zeros(3, 4)
    casts = fp8.Casts(cf.DelayedScaling(amax_history_len=4), scales, history)
    t = torch.tensor([[1.0, -6.0], [2.0, 0.5]])
    q, d = casts.cast(t, "x", E4)
    assert d.tolist() == [1.0] and q.dtype == E4 and history[0].tolist() == [6.0, 0.0, 0.0, 0.0]
    q, d = casts.cast(t * 2, "x", E4)
    assert scales[0].item() == pytest.approx(448 / 6) and d.item() == pytest.approx(6 / 448)
    assert history[0].tolist() == [12.0, 6.0, 0.0, 0.0]
    # the history's amax (6) set the scale: this step's -12 saturates at -448, i.e. -6 once dequantized
    torch.testing.assert_close(q.float() * d, (t * 2).clamp(-6, 6), rtol=2.0**-4, atol=0.0)


@pytest.mark.parametrize("bad, exc", [(dict(margin=-1), ArgumentError), (dict(fp8_format="e5m2"), ArgumentError),
                                       (dict(amax_history_len=0), ArgumentError),
                                       (dict(amax_compute_algo="mean"), ArgumentError),
                                       (dict(margin="a"), TypeError), (dict(margin=True), TypeError),
                                       (dict(amax_history_len=2.0), TypeError), (dict(fp8_format=None), TypeError),
                                       (dict(amax_compute_algo=1), TypeError)])
def test_recipes_refuse_bad_settings_naming_them(bad, exc):
    with pytest.raises(exc, match=next(iter(bad))):
        cf.DelayedScaling(**bad)


def test_a_linear_takes_only_a_recipe():
    with pytest.raises(TypeError, match="fp8 must be None"):
        cf.nn.Linear(16, 16, fp8="hybrid")


def test_the_fp8_linear_is_the_dequantized_product_and_its_gradients_come_from_fp8_dy():
    torch.manual_seed(0)
    lin = cf.nn.Linear(32, 16, fp8=cf.Float8CurrentScaling())
    x = torch.randn(5, 7, 32, requires_grad=True)
    y = lin(x)
    want = x @ lin.weight.t() + lin.bias
    assert y.shape == (5, 7, 16)
    torch.testing.assert_close(y, want, rtol=0.1, atol=0.15)  # X and W each rounded to e4m3 (2^-4 relative)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ lin.weight, rtol=0.15, atol=0.3)  # dY in e5m2 (2^-3 relative)
    torch.testing.assert_close(lin.bias.grad, g.sum((0, 1)))
    assert lin.fp8_amax_history[:, 0].tolist() == pytest.approx(
        [x.abs().max().item(), lin.weight.abs().max().item(), g.abs().max().item()])


def test_fp8_state_is_in_the_state_dict_and_a_plain_checkpoint_loads():
    lin = cf.nn.Linear(16, 16, fp8=cf.DelayedScaling(amax_history_len=8))
    lin(torch.randn(4, 16))
    sd = lin.state_dict()
    assert set(sd) == {"weight", "bias", "fp8_scales", "fp8_amax_history"} and sd["fp8_amax_history"].shape == (3, 8)
    again = cf.nn.Linear(16, 16, fp8=cf.DelayedScaling(amax_history_len=8))
    again.load_state_dict(sd)
    assert torch.equal(again.fp8_amax_history, lin.fp8_amax_history)
    plain = nn.Linear(16, 16).state_dict()
    again.load_state_dict(plain)  # strict: the FP8 state starts fresh
    assert torch.equal(again.weight, plain["weight"])


def test_a_layer_fp8_cannot_take_runs_unquantized():
    lin = cf.nn.Linear(20, 16, fp8=cf.Float8CurrentScaling())  # 20 is no multiple of 16
    x = torch.randn(3, 20)
    torch.testing.assert_close(lin(x), x @ lin.weight.t() + lin.bias)
    assert lin.fp8_amax_history.abs().sum() == 0  # nothing cast


def _mlp(recipe):
    torch.manual_seed(0)
    return nn.Sequential(cf.nn.Linear(32, 64, activation="gelu", fp8=recipe), cf.nn.Linear(64, 16, fp8=recipe))


@pytest.mark.parametrize("recipe", [cf.Float8CurrentScaling(), cf.DelayedScaling(amax_history_len=16)],
                         ids=["current", "delayed"])
def test_a_small_mlp_trains_200_steps_with_fp8_and_tracks_float32(recipe):
    """Tolerance: e4m3 rounds X and W to 2^-4 relative, e5m2 dY to 2^-3, every step, and those errors
    average out over a layer's sums; the loss of a regression toward a fixed random target followed
    float32's to within 0.9% at every 20th step and 1.2% at the end (both recipes); the test allows 3%,
    and both losses must fall by more than half. The two curves must differ: FP8 really ran."""
    torch.manual_seed(1)
    data, target = torch.randn(256, 32), torch.randn(256, 16) * 0.5
    runs = {}
    for name, model in (("fp8", _mlp(recipe)), ("fp32", _mlp(None))):
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for step in range(200):
            i = (step * 32) % 256
            loss = (model(data[i:i + 32]) - target[i:i + 32]).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                losses.append((model(data) - target).square().mean().item())
        runs[name] = losses
    a, b = runs["fp8"], runs["fp32"]
    assert a[-1] < 0.5 * a[0] and b[-1] < 0.5 * b[0]
    assert all(abs(x - y) <= 0.03 * y for x, y in zip(a[::20], b[::20]))
    assert abs(a[-1] - b[-1]) <= 0.03 * b[-1] and a != b


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)
        self.head, self.odd = nn.Linear(32, 16), nn.Linear(16, 10)  # 10 outputs: no FP8

    def forward(self, x):
        return self.odd(self.head(x + self.fc2(self.act(self.fc1(x)))))


def test_optimize_with_a_recipe_makes_every_linear_it_can_fp8():
    torch.manual_seed(0)
    m = _Block()
    o = cf.optimize(m, fp8=cf.DelayedScaling(amax_history_len=4))
    got = {n: type(mod).__name__ + ("+fp8" if getattr(mod, "fp8", None) is not None else "")
           for n, mod in o.named_modules() if isinstance(mod, nn.Linear)}
    assert got == {"fc1": "Linear+fp8", "fc2": "Linear+fp8", "head": "Linear+fp8", "odd": "Linear"}
    replaced = dict(o.cudnn_fuse_summary.replaced)
    assert replaced["fc1"] == "Linear + gelu + (FP8)" and replaced["head"] == "Linear (FP8)"
    assert "fc2" in replaced and "FP8" in replaced["fc2"]
    x = torch.randn(8, 32, requires_grad=True)
    y = o(x)
    torch.testing.assert_close(y, m(x), rtol=0.15, atol=0.15)
    y.sum().backward()
    assert x.grad is not None and o.fc1.weight.grad is not None
    assert o.fc1.fp8_amax_history[2, 0] > 0  # dY was cast
    assert "fc1.fp8_scales" in o.state_dict()
    with pytest.raises(TypeError, match="fp8 must be None"):
        cf.optimize(m, fp8="e4m3")


@pytest.mark.parametrize("recipe", [cf.Float8CurrentScaling(), cf.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_a_fused_optimizers_update_is_seen_by_the_next_call(recipe, monkeypatch):
    """A fused optimizer updates the weight in place without bumping its version counter: a cast of the
    weight kept across calls would serve its old values (a model that trained only its biases)."""
    from cudnn_fuse import fp8_cast

    torch.manual_seed(0)
    lin = cf.nn.Linear(32, 16, fp8=recipe)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, fused=True)
    x = torch.randn(8, 32)
    with torch.no_grad():
        before = lin(x)
    lin(x).sum().backward()
    version = lin.weight._version
    opt.step()
    assert lin.weight._version == version  # unversioned, as on the GPU
    casts = []
    real = fp8_cast.cast_scaled
    monkeypatch.setattr(fp8_cast, "cast_scaled", lambda t, *a, **k: casts.append(tuple(t.shape)) or real(t, *a, **k))
    with torch.no_grad():
        fresh = copy.deepcopy(lin)
        got, want = lin(x), fresh(x)
    assert casts.count((16, 32)) == 2  # the weight cast on each call, the layer's and its copy's
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, before, atol=1e-2)


def test_without_autograd_the_fp8_linear_fuses_its_epilogue_and_agrees_with_the_training_path():
    torch.manual_seed(0)
    lin = cf.nn.Linear(32, 16, activation="relu", fp8=cf.Float8CurrentScaling())
    x, res = torch.randn(6, 32), torch.randn(6, 16)
    with torch.no_grad():
        fused = lin(x, res)
        broadcast = lin(x, res[:1])  # a residual of another shape is added after the GEMM
    trained = lin(x.requires_grad_(), res)
    torch.testing.assert_close(fused, trained.detach(), rtol=1e-2, atol=1e-2)  # one rounding fewer
    with torch.no_grad():
        exact = torch.relu(x @ lin.weight.t() + lin.bias + res)
        exact_broadcast = torch.relu(x @ lin.weight.t() + lin.bias + res[:1])
    torch.testing.assert_close(broadcast, exact_broadcast, rtol=0.15, atol=0.2)
    assert fused.min() >= 0 and not torch.equal(fused, exact)  # the operands were rounded to FP8


def _fp8_block(recipe, act="gelu_tanh"):
    torch.manual_seed(0)
    fc1, fc2 = cf.nn.Linear(32, 64, activation=act), nn.Linear(64, 16)
    return cf.nn.FusedMLP(fc1, fc2, fp8=recipe), fc1, fc2


@pytest.mark.parametrize("recipe", [cf.Float8CurrentScaling(), cf.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
def test_fused_mlp_with_a_recipe_runs_both_layers_fp8_as_two_fp8_linears_would(recipe):
    mlp, fc1, fc2 = _fp8_block(recipe)
    lin1 = cf.nn.Linear(32, 64, activation="gelu_tanh", fp8=recipe)
    lin2 = cf.nn.Linear(64, 16, fp8=recipe)
    with torch.no_grad():
        for a, b in ((lin1, fc1), (lin2, fc2)):
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)
    x = torch.randn(8, 32, requires_grad=True)
    res = torch.randn(8, 16)
    y = mlp(x, res)
    want = lin2(lin1(x.detach().requires_grad_()), res)
    torch.testing.assert_close(y, want)
    y.square().sum().backward()
    assert fc1.weight.grad is not None and fc2.weight.grad is not None and x.grad is not None
    plain = fc2(fc1(x.detach())) + res
    assert not torch.equal(y.detach(), plain)  # the operands were rounded to FP8
    torch.testing.assert_close(y.detach(), plain.detach(), rtol=0.15, atol=0.3)
    assert mlp.fc1_fp8_amax_history[:, 0].min() > 0 and mlp.fc2_fp8_amax_history[2, 0] > 0  # x, w, dY of both
    assert torch.equal(mlp.fc1_fp8_amax_history[0, 0], x.detach().abs().max())


def test_fused_mlp_fp8_state_is_in_the_state_dict_and_a_plain_checkpoint_loads():
    mlp, _, _ = _fp8_block(cf.DelayedScaling(amax_history_len=8))
    with torch.no_grad():
        mlp(torch.randn(4, 32))
    sd = mlp.state_dict()
    assert {"fc1_fp8_scales", "fc1_fp8_amax_history", "fc2_fp8_scales", "fc2_fp8_amax_history"} <= set(sd)
    assert sd["fc2_fp8_amax_history"].shape == (3, 8)
    again, _, _ = _fp8_block(cf.DelayedScaling(amax_history_len=8))
    again.load_state_dict(sd)
    assert torch.equal(again.fc1_fp8_amax_history, mlp.fc1_fp8_amax_history)
    plain, _, _ = _fp8_block(None)
    plain.load_state_dict(mlp.state_dict(), strict=False)
    again.load_state_dict(plain.state_dict())  # strict: a bfloat16 block's checkpoint loads, FP8 state fresh
    assert "fp8=DelayedScaling" in repr(again)


def test_fused_mlp_refuses_a_second_recipe_and_runs_odd_features_unquantized():
    with pytest.raises(ArgumentError, match="fp8"):
        cf.nn.FusedMLP(cf.nn.Linear(32, 64, activation="gelu", fp8=cf.Float8CurrentScaling()), nn.Linear(64, 16),
                       fp8=cf.Float8CurrentScaling())
    with pytest.raises(TypeError, match="fp8 must be None"):
        cf.nn.FusedMLP(cf.nn.Linear(32, 64, activation="gelu"), nn.Linear(64, 16), fp8="hybrid")
    torch.manual_seed(0)
    mlp = cf.nn.FusedMLP(cf.nn.Linear(32, 40, activation="relu"), nn.Linear(40, 16), fp8=cf.Float8CurrentScaling())
    x = torch.randn(3, 32)
    torch.testing.assert_close(mlp(x), mlp.fc2(torch.relu(x @ mlp.fc1.weight.t() + mlp.fc1.bias)))
    assert mlp.fc1_fp8_amax_history.abs().sum() == 0  # nothing cast


def test_the_cast_with_its_transpose_is_the_cast_and_its_transpose():
    from cudnn_fuse import fp8_cast

    x = torch.randn(7, 33, dtype=torch.bfloat16)[:, 1:] * 300  # rows with a pitch
    y, yt, am = fp8_cast.cast_transpose_amax(x, E4, torch.tensor(0.5))
    want, want_am = fp8_cast.torch_cast_amax(x, E4, torch.tensor(0.5))
    assert torch.equal(y.view(torch.uint8), want.view(torch.uint8)) and yt.is_contiguous()
    assert torch.equal(yt.view(torch.uint8), want.t().contiguous().view(torch.uint8)) and am == want_am
    assert am == x.abs().max().float()


_INTERPRETED_CAST = r"""
import sys, torch
from cudnn_fuse import fp8_cast
kernels = fp8_cast._triton_kernel()
assert kernels, "Triton's interpreter did not load the kernels"
E4 = torch.float8_e4m3fn
source, transpose = sys.argv[1], sys.argv[2] == "1"
torch.manual_seed(0)
x = torch.randn(130, 71, dtype=torch.bfloat16)[:, 1:] * 3  # neither dimension a whole tile; rows with a pitch
src = {"own": x.float().abs().max(), "zero": torch.tensor(0.0), "nan": torch.tensor(float("nan")),
       "history": torch.tensor(5.0)}[source]
delayed = source == "history"  # a delayed recipe's cast: the scale from the history, the amax its own
got_state, want_state = torch.tensor([0.0, 3.0, 0.0]), torch.tensor([0.0, 3.0, 0.0])  # [_, scale, amax]
got = fp8_cast._launch(kernels, x, E4, got_state[1], src, 2, None if delayed else got_state[2], transpose, delayed)
want = fp8_cast._torch_cast(x, E4, want_state[1], src, 2, None if delayed else want_state[2], transpose)
assert torch.equal(got_state.nan_to_num(-1), want_state.nan_to_num(-1)), (got_state, want_state)
assert torch.equal(got[3], want[3]), (got[3], want[3])
assert got_state[1] == (3.0 if source in ("zero", "nan") else torch.tensor(448.0) / src / 4), got_state
assert abs(got[3].item() * got_state[1].item() - 1) < 1e-6
# the interpreter's own FP8 rounding differs from torch's: the kernel given that scale must cast alike
plain = fp8_cast._launch(kernels, x, E4, want_state[1].clone(), None, 0, None, transpose, True)
assert torch.equal(got[0].view(torch.uint8), plain[0].view(torch.uint8))
assert plain[2].item() == x.float().abs().max().item()
if transpose:
    assert got[1].is_contiguous() and torch.equal(got[1].view(torch.uint8), got[0].t().view(torch.uint8))
if delayed:
    assert got[2].item() == x.float().abs().max().item()
"""


@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transposed"])
@pytest.mark.parametrize("source", ["own", "zero", "nan", "history"])
def test_the_cast_kernel_derives_and_records_the_scale_as_torchs_ops_do(source, transpose):
    """The cast kernel, run by Triton's interpreter on the CPU (a fresh process: the interpreter must be on
    before Triton is imported): the scale it derives from an amax (fp8_max / amax / 2**margin; the previous
    one where the amax is 0 or NaN), stored with its reciprocal and the amax by its first program, equals
    what the torch path computes; the cast is made with that scale, the transposed copy is its transpose."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED_CAST, source, "1" if transpose else "0"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_fp8_state_stays_float32_when_the_module_is_cast():
    lin = cf.nn.Linear(16, 16, fp8=cf.DelayedScaling(amax_history_len=4)).to(torch.bfloat16)
    mlp = cf.nn.FusedMLP(cf.nn.Linear(16, 32, activation="relu"), nn.Linear(32, 16), fp8=cf.Float8CurrentScaling())
    mlp = mlp.half().to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16 and mlp.fc1.weight.dtype == torch.bfloat16
    assert lin.fp8_scales.dtype == lin.fp8_amax_history.dtype == torch.float32
    assert mlp.fc1_fp8_scales.dtype == mlp.fc2_fp8_amax_history.dtype == torch.float32
    lin(torch.randn(4, 16, dtype=torch.bfloat16))
    assert lin.fp8_amax_history.dtype == torch.float32 and lin.fp8_amax_history[0, 0] > 0


@pytest.fixture
def timed(monkeypatch):
    """fp8.pays on the CPU with made-up timings: ``timed.figures`` = (FP8 ms, bfloat16 ms); ``timed.calls``
    the shapes timed."""
    class Timed:
        figures, calls = (1.0, 1.0), []

    def fake(M, dtype, w, bias, recipe, training):
        Timed.calls.append((M, w.shape[1], w.shape[0], training))
        if Timed.figures is None:
            raise RuntimeError("no timing here")
        return Timed.figures

    monkeypatch.setattr(fp8, "_timeable", lambda x: True)
    monkeypatch.setattr(fp8, "_timed", fake)
    monkeypatch.setattr(fp8, "_paid", {})
    return Timed


def test_a_shape_measured_slower_in_fp8_runs_in_bfloat16_said_once(timed, caplog):
    torch.manual_seed(0)
    lin = cf.nn.Linear(32, 16, fp8=cf.Float8CurrentScaling())
    plain = cf.nn.Linear(32, 16)
    plain.load_state_dict(lin.state_dict(), strict=False)
    timed.figures = (2.0, 1.0)
    x = torch.randn(5, 32)
    with caplog.at_level("INFO", logger="cudnn_fuse.fp8"), torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(lin(x), plain(x), rtol=0, atol=0)  # not quantized
    assert lin.fp8_amax_history.abs().sum() == 0  # nothing cast
    said = [r.getMessage() for r in caplog.records if "bfloat16 runs it" in r.getMessage()]
    assert len(said) == 1 and "5x32->16" in said[0] and "1.000 ms" in said[0] and "2.000 ms" in said[0], said
    assert timed.calls == [(5, 32, 16, False)]
    lin(torch.randn(7, 32))  # the same power-of-two bucket of rows, training now: timed again (another key)
    with torch.no_grad():
        lin(torch.randn(8, 32))  # rows 5 and 8 share a bucket
        lin(torch.randn(9, 32))
    assert timed.calls == [(5, 32, 16, False), (7, 32, 16, True), (9, 32, 16, False)]


def test_a_shape_measured_before_keeps_its_choice_where_no_timing_can_run(timed, monkeypatch):
    """Inside a capture (no timing possible) a shape measured slower in FP8 still runs bfloat16, and one
    never measured runs FP8 untimed, its choice left for a call that can time it."""
    timed.figures = (2.0, 1.0)
    lin = cf.nn.Linear(32, 16, fp8=cf.Float8CurrentScaling())
    with torch.no_grad():
        lin(torch.randn(5, 32))
        monkeypatch.setattr(fp8, "_timeable", lambda x: False)
        lin(torch.randn(6, 32))  # the same bucket: bfloat16, as measured
        assert lin.fp8_amax_history.abs().sum() == 0
        lin(torch.randn(40, 32))  # never measured: FP8, untimed and not remembered
    assert lin.fp8_amax_history[0, 0] > 0 and len(timed.calls) == 1 and len(fp8._paid) == 1


@pytest.mark.parametrize("figures", [(1.02, 1.0), None], ids=["within_the_margin", "timing_failed"])
def test_fp8_stays_on_a_tie_and_where_the_timing_fails(timed, figures):
    timed.figures = figures
    lin = cf.nn.Linear(32, 16, fp8=cf.Float8CurrentScaling())
    with torch.no_grad():
        lin(torch.randn(5, 32))
    assert lin.fp8_amax_history[:2, 0].min() > 0  # x and w were cast


def test_each_layer_of_an_fp8_mlp_runs_fp8_where_it_pays(timed, monkeypatch):
    torch.manual_seed(0)
    mlp = cf.nn.FusedMLP(cf.nn.Linear(32, 64, activation="relu"), nn.Linear(64, 16), fp8=cf.DelayedScaling())
    monkeypatch.setattr(fp8, "_timed", lambda M, dtype, w, *a: (1.0, 2.0) if w.shape[0] == 64 else (2.0, 1.0))
    x = torch.randn(6, 32, requires_grad=True)
    y = mlp(x)
    h = fp8.linear(x, mlp.fc1.weight, mlp.fc1.bias, fp8.Casts(mlp.fp8, torch.ones(3), torch.zeros(3, 1024)), "relu")
    torch.testing.assert_close(y, nn.functional.linear(h, mlp.fc2.weight, mlp.fc2.bias))  # fc2 unquantized
    y.sum().backward()
    assert mlp.fc1_fp8_amax_history[:, 0].min() > 0 and mlp.fc2_fp8_amax_history.abs().sum() == 0
    assert x.grad is not None and mlp.fc2.weight.grad is not None
