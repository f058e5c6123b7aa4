"""What cf.optimize() must keep of a model's meaning (CPU path): in-place changes between a layer and its
epilogue, residuals that broadcast either way, the mode a forward reads, each submodule's own mode, the
model's state across an example call, and its state_dict keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudnn_fuse as cf
from cudnn_fuse import nn as cfnn


def _eval_same(model, *args):
    model.eval()
    opt = cf.optimize(model)
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args))
    return opt


# --------------------------------------------------------------------- in-place changes


class _ModuleInplace(nn.Module):
    """``h`` is changed in place (nn.ReLU(inplace=True)) after the conv read it and before the add."""

    def __init__(self):
        super().__init__()
        self.c0, self.c, self.act = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.c0(x)
        y = self.c(h)
        return torch.tanh(y + self.act(h))


class _FunctionInplace(nn.Module):
    def __init__(self, positional: bool):
        super().__init__()
        self.l0, self.l, self.positional = nn.Linear(8, 8), nn.Linear(8, 8), positional

    def forward(self, x):
        h = self.l0(x) * 1.0
        y = self.l(h)
        r = F.relu(h, True) if self.positional else F.relu(h, inplace=True)
        return y + r


class _MethodInplace(nn.Module):
    """``x.mul_(2)`` changes the conv's input after it; its result is unused (the model reads ``x``)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        x = x.clone()
        y = self.c(x)
        x.mul_(2)
        return y + x


class _AfterLinear(nn.Module):
    """The Linear's input changed after it, by item assignment or by a call's ``out=`` argument."""

    def __init__(self, how: str):
        super().__init__()
        self.l, self.how = nn.Linear(8, 8), how

    def forward(self, x):
        x = x.clone()
        y = self.l(x)
        if self.how == "setitem":
            x[:, 0] = 5.0
        else:
            torch.clamp(x, min=0, out=x)
        return F.relu(y + x)


@pytest.mark.parametrize("make", [_ModuleInplace, lambda: _FunctionInplace(False), lambda: _FunctionInplace(True),
                                  _MethodInplace, lambda: _AfterLinear("setitem"), lambda: _AfterLinear("out")],
                         ids=["module", "function", "positional", "method", "setitem", "out"])
def test_a_tensor_changed_in_place_between_a_layer_and_its_epilogue_keeps_the_epilogue_apart(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 4, 6, 6) if isinstance(model, (_ModuleInplace, _MethodInplace)) else torch.randn(3, 8)
    opt = _eval_same(model, x)
    assert not any("residual add" in p for _, p in opt.cudnn_fuse_summary.replaced)


def test_an_in_place_change_whose_result_is_unused_survives_the_rewrite():
    """fx's dead-code elimination dropped ``x.mul_(2)`` (no user of its result) once the graph had
    something else replaced."""
    torch.manual_seed(0)
    model = _MethodInplace()
    opt = _eval_same(model, torch.randn(2, 4, 6, 6))
    assert opt.cudnn_fuse_summary.replaced  # the conv was replaced: the rewritten graph runs
    assert any(n.op == "call_method" and n.target == "mul_" for n in opt.graph.nodes)


# --------------------------------------------------------------------- residuals


class _Grows(nn.Module):
    """``layer(x) + r`` where ``r`` is larger than the layer's output: torch's add broadcasts the output."""

    def __init__(self, conv: bool):
        super().__init__()
        self.layer = nn.Conv2d(4, 4, 1) if conv else nn.Linear(8, 8)

    def forward(self, x, r):
        return F.relu(self.layer(x) + r)


@pytest.mark.parametrize("conv,xs,rs", [(True, (1, 4, 5, 5), (3, 4, 5, 5)), (True, (2, 4, 1, 1), (2, 4, 5, 5)),
                                        (False, (1, 5, 8), (2, 5, 8)), (False, (5, 8), (3, 5, 8))],
                         ids=["conv-batch", "conv-map", "linear-batch", "linear-rank"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_residual_larger_than_the_layers_output_is_added_as_torch_adds_it(conv, xs, rs, train):
    torch.manual_seed(0)
    model = _Grows(conv).train(train)
    x, r = torch.randn(xs), torch.randn(rs)
    opt = cf.optimize(model)
    assert any("residual add" in p for _, p in opt.cudnn_fuse_summary.replaced)
    with torch.set_grad_enabled(train):
        torch.testing.assert_close(opt(x, r), model(x, r))


def test_a_residual_that_fits_no_output_is_named_in_the_error():
    m = cfnn.Conv2d(4, 4, 1)
    with pytest.raises(ValueError, match="residual"):
        m(torch.randn(2, 4, 5, 5), torch.randn(3, 4, 5, 5))


# --------------------------------------------------------------------- modes


class _DropoutByMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = F.dropout(self.l(x), p=0.5, training=self.training)
        return F.relu(self.l2(h) + x)


@pytest.mark.parametrize("first", ["train", "eval"])
def test_a_forward_that_reads_the_mode_runs_each_mode_after_optimize(first):
    """fx fixes ``self.training`` at trace time: traced in one mode, the graph ran that mode in both."""
    torch.manual_seed(0)
    model = _DropoutByMode().train(first == "train")
    opt = cf.optimize(model)
    assert any("depends on the training mode" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(64, 16)
    opt.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    opt.train()
    with torch.no_grad():
        assert not torch.equal(opt(x), opt(x))  # dropout draws again


class _ModeInAChild(nn.Module):
    """The mode read in a child's traced-through forward (a functional BatchNorm, timm's BatchNormAct2d)."""

    def __init__(self):
        super().__init__()
        self.block, self.head = _DropoutByMode(), nn.Linear(16, 4)

    def forward(self, x):
        return torch.relu(self.head(self.block(x)))


@pytest.mark.parametrize("first", ["train", "eval"])
def test_a_child_that_reads_the_mode_runs_each_mode_after_optimize(first):
    torch.manual_seed(0)
    model = _ModeInAChild().train(first == "train")
    opt = cf.optimize(model)
    assert all(m.training == (first == "train") for m in opt.modules())  # every flag put back
    x = torch.randn(64, 16)
    for mode in ("eval", "train"):
        opt.train(mode == "train"), model.train(mode == "train")
        torch.manual_seed(1)
        want = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(opt(x), want)


def _drops(x, p: float, training: bool):
    """A leaf function given the mode (torchvision's shifted-window attention is one)."""
    return F.dropout(x, p, training)


torch.fx.wrap("_drops")


class _PassesTheMode(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.l, self.l2, self.p = nn.Linear(16, 16), nn.Linear(16, 16), p

    def forward(self, x):
        return F.relu(self.l2(_drops(F.relu(self.l(x)), self.p, training=self.training)) + x)


class _PassesTheModeInAChild(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.block, self.head = _PassesTheMode(p), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("p,modes", [(0.0, (False, False)), (0.5, (False, False)), (0.5, (True, False)),
                                     (0.5, (False, True))])
def test_a_mode_passed_to_a_leaf_function_is_read_at_run_time_and_the_model_traced_whole(p, modes):
    torch.manual_seed(0)
    model = _PassesTheModeInAChild(p).train(modes[0])
    model.block.train(modes[1])  # a child set apart (a frozen block, dropout kept on for MC sampling)
    opt = cf.optimize(model)
    assert not any("training mode" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    assert "training" in opt.code  # read when it runs, not fixed
    import io

    buf = io.BytesIO()
    torch.save(opt, buf)  # fx traces the saved code again as it loads: the read must stay a read
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(64, 16)
    for modes in ((False, False), (True, True), (True, False)):  # the child set apart from its parent too
        for m in (opt, loaded, model):
            m.train(modes[0])
            m.block.train(modes[1])
        torch.manual_seed(1)
        want = model(x)
        for m in (opt, loaded):
            torch.manual_seed(1)
            torch.testing.assert_close(m(x), want)


class _Switch(nn.Module):
    """A drop-path: no parameters, its forward reads ``self.training`` and returns its input in eval."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = (torch.rand(x.shape[0], 1, device=x.device) >= self.p).to(x.dtype)
        return x * keep / (1 - self.p)


class _DropPathBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), _Switch(0.5)

    def forward(self, x):
        return x + self.drop(self.fc(x))


def test_a_drop_path_stays_a_call_and_the_residual_is_fused_across_it_in_eval():
    torch.manual_seed(0)
    model = _DropPathBlock().eval()
    opt = cf.optimize(model)
    assert dict(opt.cudnn_fuse_summary.replaced)["fc"] == "Linear + dropout (eval) + residual add"
    x = torch.randn(256, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        opt.train(), model.train()
        torch.manual_seed(1)
        a = opt(x)
        torch.manual_seed(1)
        torch.testing.assert_close(a, model(x))  # the same draws: the drop-path ran in training mode
    assert not torch.equal(a, opt(x))


class _Aux(nn.Module):
    """GoogLeNet-style: an auxiliary output in training mode only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.aux = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = self.body(x)
        return (y, self.aux(y)) if self.training else y


def test_a_mode_dependent_model_has_its_children_rewritten_and_answers_in_each_mode():
    torch.manual_seed(0)
    model = _Aux().train()
    opt = cf.optimize(model)
    assert dict(opt.cudnn_fuse_summary.replaced)["body.0"] == "Conv2d + relu"
    x = torch.randn(2, 3, 8, 8)
    assert isinstance(opt(x), tuple)
    opt.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_each_submodule_keeps_its_own_mode():
    """A model that trains with its BatchNorms frozen (eval) keeps them frozen and unfolded (its convs'
    weights train); a model in eval with a dropout kept in training (MC dropout) keeps it drawing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)).train()
    model[1].eval()
    opt = cf.optimize(model)
    assert opt.training and not opt.get_submodule("1").training
    assert any("under a Conv2d in training mode" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(opt(x), model(x))

    mc = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 16)).eval()
    mc[2].train()
    opt = cf.optimize(mc)
    assert not opt.training and opt.get_submodule("2").training
    with torch.no_grad():
        x = torch.randn(8, 16)
        assert not torch.equal(opt(x), opt(x))


def test_replacements_take_the_mode_of_the_layer_they_replace():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Conv2d(1, 1, 1)).eval()
    opt = cf.optimize(model)
    assert not any(m.training for m in opt.modules())


# --------------------------------------------------------------------- state


def test_an_example_call_in_training_mode_leaves_the_models_state_and_random_stream_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5)).train()
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(5)
    opt = cf.optimize(model, example_inputs=x)
    after = torch.rand(3)
    torch.manual_seed(5)
    torch.testing.assert_close(after, torch.rand(3))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[k], v)
    assert int(opt.state_dict()["1.num_batches_tracked"]) == 0


class _TableBias(nn.Module):
    """Indexes a table with a buffer: fx makes a tensor constant of the index it computes."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 4))
        self.register_buffer("idx", torch.arange(9) % 7)
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.l(x) + self.table[self.idx.view(-1)])


def test_tensor_constants_of_the_trace_stay_out_of_the_state_dict():
    torch.manual_seed(0)
    model = _TableBias()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced
    assert set(opt.state_dict()) == set(model.state_dict())
    opt.load_state_dict(model.state_dict())
    model.load_state_dict(opt.state_dict())
    x = torch.randn(9, 4)
    torch.testing.assert_close(opt(x), model(x))


class _RmsOutside(nn.Module):
    """eps beside the root, not under it: no RMSNorm (the two differ where mean(x^2) is near eps)."""

    def __init__(self):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

    def forward(self, x):
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps))


class _RmsInside(_RmsOutside):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize("norm,replaced", [(_RmsOutside, False), (_RmsInside, True)])
def test_only_a_true_rms_norm_is_replaced_by_torchs_kernel(norm, replaced):
    model = nn.Sequential(norm(), nn.Linear(16, 16))
    opt = cf.optimize(model)
    assert any("RMSNorm" in p for _, p in opt.cudnn_fuse_summary.replaced) is replaced
    x = torch.randn(3, 16) * 1e-3
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _TrainOverride(nn.Module):
    """A model whose ``train()`` does more than set the flags (counts its calls here; freezes layers in
    real models)."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.calls = nn.Linear(8, 8), nn.GELU(), 0

    def train(self, mode=True):
        self.calls += 1
        return super().train(mode)

    def forward(self, x):
        return self.act(self.fc(x))


def test_a_model_whose_train_does_more_keeps_it_and_optimize_does_not_call_it():
    """A traced model's train() would be the GraphModule's: the model is not traced whole, so it keeps its
    class; optimize() itself switches no mode through it."""
    model = _TrainOverride()
    opt = cf.optimize(model)
    assert any("overrides train()" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    assert opt.calls == 0 and model.calls == 0 and opt.training and opt.fc.training
    opt.eval()
    assert opt.calls == 1 and not opt.fc.training


class _Optional(nn.Module):
    """Branches on whether an optional argument is given: fx's Proxy is never None."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.l = nn.Linear(8, 8)

    def forward(self, x, bias=None):
        h = self.l(self.body(x))
        h = h * 2 if bias is None else h + bias
        return F.relu(h + x)


class _OptionalUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, unused=None):
        return F.relu(self.l(x) + x)


def test_a_forward_that_branches_on_an_optional_argument_has_its_children_rewritten():
    torch.manual_seed(0)
    model = _Optional().eval()
    opt = cf.optimize(model)
    assert any("optional argument" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    assert dict(opt.cudnn_fuse_summary.replaced)["body.0"] == "Linear + gelu"  # a child, still fused
    x, b = torch.randn(3, 8), torch.randn(8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        torch.testing.assert_close(opt(x, b), model(x, b))
    # one that never reads it traces whole
    opt = cf.optimize(_OptionalUnused().eval())
    assert dict(opt.cudnn_fuse_summary.replaced)["l"] == "Linear + residual add + relu"


class _Checkpointed(nn.Module):
    def __init__(self, by_name: bool):
        super().__init__()
        self.c, self.c2, self.by_name = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), by_name

    def block(self, x):
        return F.relu(self.c(x) + x)

    def forward(self, x):
        run = _checkpoint_fn if self.by_name else torch.utils.checkpoint.checkpoint
        x = run(self.block, x, use_reentrant=False)
        return F.relu(self.c2(x) + x)


from torch.utils.checkpoint import checkpoint as _checkpoint_fn  # noqa: E402 - imported by name, as users do


@pytest.mark.parametrize("by_name", [False, True], ids=["module-attribute", "imported-name"])
def test_a_forward_that_checkpoints_keeps_its_checkpoint(by_name):
    """Traced through, the checkpoint was gone: every activation kept for the backward."""
    torch.manual_seed(0)
    model = _Checkpointed(by_name).train()
    opt = cf.optimize(model)
    assert any("checkpoints" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    saved = []
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    for m in (model, opt):
        n = [0]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: n.__setitem__(0, n[0] + t.numel()) or t, lambda t: t):
            y = m(x)
        saved.append(n[0])
        y.sum().backward()
    assert saved[0] == saved[1]
    assert torch.utils.checkpoint.checkpoint is not None and torch.utils.checkpoint.checkpoint is _checkpoint_fn


def test_a_deepcopy_of_an_optimized_model_keeps_its_summary():
    import copy

    opt = cf.optimize(nn.Sequential(nn.Linear(8, 8), nn.GELU()))
    assert copy.deepcopy(opt).cudnn_fuse_summary.replaced == opt.cudnn_fuse_summary.replaced


class _Lazy(nn.Module):
    """Caches what it computes on its first call (torchvision's MultiScaleRoIAlign sets its scales so), and
    its parent does not trace (a data-dependent branch): traced, the cache held an fx Proxy."""

    def __init__(self):
        super().__init__()
        self.c, self.scale = nn.Conv2d(3, 4, 3), None

    def forward(self, x):
        if self.scale is None:
            self.scale = 1.0 / x.shape[-1]
        return F.relu(self.c(x)) * self.scale


class _Untraceable(nn.Module):
    def __init__(self, *children):
        super().__init__()
        self.parts = nn.ModuleList(children)

    def forward(self, x):
        for p in self.parts:
            x = p(x)
        return x if x.sum() > -1e9 else -x  # a branch on a value: fx cannot trace it


def test_a_trace_leaves_the_modules_own_attributes_as_they_were():
    torch.manual_seed(0)
    model = _Untraceable(_Lazy()).eval()
    opt = cf.optimize(model)
    assert opt.parts[0].scale is None and model.parts[0].scale is None
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _NonPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.register_buffer("r", torch.randn(1, 4, 1, 1), persistent=False)
        self.sub = nn.Module()
        self.sub.register_buffer("scale", torch.full((4, 1, 1), 0.5), persistent=False)

    def forward(self, x):
        return F.relu(self.c(x) + self.r) * self.sub.scale


class _Parent(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.sh, self.o = shared, nn.Linear(8, 8)

    def forward(self, x):
        return self.o(self.sh(x)) + x


class _TwoParents(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.a, self.b = _Parent(shared), _Parent(shared)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("make,x", [(_NonPersistent, (2, 4, 6, 6)), (_TwoParents, (3, 8))],
                         ids=["non-persistent-buffers", "shared-submodule"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_the_state_dict_loads_both_ways_strictly(make, x, train):
    torch.manual_seed(0)
    model = make().train(train)
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced or make is _TwoParents
    assert set(opt.state_dict()) == set(model.state_dict())
    opt.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(opt.state_dict(), strict=True)
    x = torch.randn(x)
    with torch.set_grad_enabled(train):
        torch.testing.assert_close(opt(x), model(x))


def test_a_child_shared_by_two_parents_that_do_not_trace_stays_one_module():
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    model = _Untraceable(_Untraceable(shared), _Untraceable(shared)).eval()
    opt = cf.optimize(model)
    assert opt.parts[0].parts[0] is opt.parts[1].parts[0]  # one rewrite, held by both parents
    assert [p for _, p in opt.cudnn_fuse_summary.replaced] == ["Conv2d + BatchNorm2d(folded) + relu"]
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _Warm(nn.Module):
    """Counts its calls in an attribute and scales by the count: one traced graph would fix the count."""

    def __init__(self):
        super().__init__()
        self.l, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        return F.relu(self.l(x)) * min(1.0, self.calls / 3)


def test_a_forward_that_sets_its_modules_attributes_is_not_traced_whole():
    torch.manual_seed(0)
    model = _Warm()
    opt = cf.optimize(model)
    assert opt.calls == 0 and any("sets attributes" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(2, 4)
    for _ in range(4):
        torch.testing.assert_close(opt(x), model(x))
    assert opt.calls == model.calls == 4


class _Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.j = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))

    def forward(self, x):
        return self.j(F.relu(self.a(x)))


def test_a_scripted_submodule_whose_copy_would_not_train_is_named_with_the_way_out(caplog):
    """torch's deepcopy of a ScriptModule gives parameters that are not leaves: a training model's copy
    would silently get no gradients there."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="inplace=True"):
        cf.optimize(_Scripted().train())
    model = _Scripted().train()
    opt = cf.optimize(model, inplace=True)
    opt(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in opt.parameters())
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        cf.optimize(_Scripted().eval())
    assert "inplace=True" in caplog.text


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.heads = nn.Linear(8, 8), 4

    def forward(self, x):
        return F.gelu(self.fc(x)) + x


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def test_the_containers_of_a_traced_model_keep_their_attributes_and_modes_and_run_alone_as_they_did():
    torch.manual_seed(0)
    model = _Stack().eval()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced
    assert opt.blocks[0].heads == 4 and not any(m.training for m in opt.modules())
    assert len(opt.blocks) == 2 and [b.heads for b in opt.blocks] == [4, 4]
    assert bool(opt) and bool(opt.blocks[0])  # a module is true, whatever its length
    with pytest.raises(TypeError):
        len(opt.blocks[0])  # a _Block is no sequence
    folded_model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()), nn.Flatten(),
                                 nn.Linear(4 * 9, 2)).eval()
    folded = cf.optimize(folded_model)
    assert isinstance(folded[0][1], nn.BatchNorm2d) and isinstance(folded[0][0], cfnn.Conv2d)  # folded in its call
    x = torch.randn(3, 8)
    with torch.no_grad():  # their own forward on the layers they hold: the fused ones compute the layers alone
        torch.testing.assert_close(opt.blocks(x), model.blocks(x))
        torch.testing.assert_close(opt.blocks[1](x), model.blocks[1](x))
        torch.testing.assert_close(folded[0](torch.ones(1, 3, 3, 3)), folded_model[0](torch.ones(1, 3, 3, 3)))
    import copy
    import io

    buf = io.BytesIO()
    torch.save(opt, buf)
    for again in (copy.deepcopy(opt), torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        torch.testing.assert_close(again(torch.ones(3, 8)), model(torch.ones(3, 8)))
        assert again.blocks[1].heads == 4


# --------------------------------------------------------------------- hooks


class _HookNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.extra = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh())])  # never called itself

    def forward(self, x):
        h = self.head(self.block(x).mean((2, 3)))
        for blk in self.extra:
            h = blk(h)
        return h


def _add_one(mod, args, out):
    return out + 1


def _triple_input(mod, args):
    return (args[0] * 3,)


def _double_grad(mod, grad_out):
    return (grad_out[0] * 2,)


_HOOKS = {
    "root-forward-pre": lambda m: m.register_forward_pre_hook(_triple_input),
    "root-forward": lambda m: m.register_forward_hook(_add_one),
    "root-backward-pre": lambda m: m.register_full_backward_pre_hook(_double_grad),
    "container-backward-pre": lambda m: m.block.register_full_backward_pre_hook(_double_grad),
    "container-forward": lambda m: m.block.register_forward_hook(_add_one),
    "list-item-backward-pre": lambda m: m.extra[0].register_full_backward_pre_hook(_double_grad),
}


@pytest.mark.parametrize("hook", list(_HOOKS))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_hooks_on_the_traced_model_or_a_container_it_runs_through_still_run(hook, train):
    """fx traces the root's forward itself and rebuilds the containers it runs through as bare modules:
    the hooks there were gone."""
    torch.manual_seed(0)
    model = _HookNet().train(train)
    _HOOKS[hook](model)
    opt = cf.optimize(model)
    assert any("has hooks" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    assert opt.cudnn_fuse_summary.replaced  # the children are still rewritten
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    grads = []
    for m in (model, opt):
        with torch.set_grad_enabled(True):
            y = m(x)
            grads.append(torch.autograd.grad(y.square().sum(), x)[0])
        if m is model:
            want = y
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(grads[1], grads[0])


def _add_key(mod, sd, prefix, local):
    sd[prefix + "meta"] = torch.ones(1)


def _pop_key(mod, sd, prefix, *args):
    sd.pop(prefix + "meta", None)


@pytest.mark.parametrize("on", ["root", "layer"])
def test_state_dict_hooks_are_kept_and_the_originals_state_dict_loads(on):
    torch.manual_seed(0)
    model = _HookNet().eval()
    target = model if on == "root" else model.head[0]
    target._register_state_dict_hook(_add_key)
    target.register_load_state_dict_pre_hook(_pop_key)
    opt = cf.optimize(model)
    assert set(opt.state_dict()) == set(model.state_dict())
    opt.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


# --------------------------------------------------------------------- what a trace would fix


class _LayerDrop(nn.Module):
    """Skips its branch with probability p in training (BART's, Whisper's LayerDrop): a draw with no tensor
    argument, which a trace makes once."""

    def __init__(self):
        super().__init__()
        self.l, self.p = nn.Linear(8, 8), 0.5

    def forward(self, x):
        if self.training and torch.rand([]) < self.p:
            return x
        return x + F.relu(self.l(x))


class _Noise(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return F.relu(self.l(x)) + 0.1 * torch.randn(8)


class _PyNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        import random

        return F.relu(self.l(x)) * random.random()


@pytest.mark.parametrize("make,train", [(_LayerDrop, True), (_Noise, False), (_PyNoise, False)],
                         ids=["layerdrop", "randn", "python-random"])
def test_random_numbers_drawn_at_trace_time_are_drawn_at_every_call_and_optimize_draws_none(make, train):
    import random

    torch.manual_seed(0)
    model = make().train(train)
    x = torch.randn(4, 8)
    for seed in range(4):  # whatever the trace's own draw would have been
        torch.manual_seed(seed), random.seed(seed)
        opt = cf.optimize(model)
        after = torch.rand(3), random.random()
        torch.manual_seed(seed), random.seed(seed)
        assert torch.equal(after[0], torch.rand(3)) and after[1] == random.random()
        assert any("random numbers" in why for _, why in opt.cudnn_fuse_summary.left_alone)
        for run in range(6):
            torch.manual_seed(run), random.seed(run)
            want = model(x)
            torch.manual_seed(run), random.seed(run)
            torch.testing.assert_close(opt(x), want)


class _GradBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        y = F.relu(self.l(x))
        return y * 2 if not torch.is_grad_enabled() else y


class _AutocastBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        y = F.relu(self.l(x))
        return y.float() if torch.is_autocast_enabled("cpu") else y


class _NoGradBlock(nn.Module):
    """Part of its forward in a no_grad block, which a trace would drop (the graph would record it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            h = F.relu(self.a(x))
        return F.relu(self.b(h) + x)


def test_a_forward_that_reads_the_grad_mode_answers_in_each_mode():
    torch.manual_seed(0)
    model = _GradBranch().eval()
    opt = cf.optimize(model)
    assert any("grad mode" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(3, 8)
    torch.testing.assert_close(opt(x), model(x))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    with torch.inference_mode():
        torch.testing.assert_close(opt(x), model(x))


def test_a_forward_that_reads_the_autocast_state_answers_in_its_dtype():
    torch.manual_seed(0)
    model = _AutocastBranch().eval()
    opt = cf.optimize(model)
    assert any("autocast" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(3, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), opt(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert torch.is_autocast_enabled is torch._C.is_autocast_enabled  # put back after the trace


def test_a_forward_with_a_no_grad_block_trains_only_what_the_original_trains():
    torch.manual_seed(0)
    model = _NoGradBlock().train()
    opt = cf.optimize(model)
    x = torch.randn(3, 8)
    opt(x).sum().backward()
    model(x).sum().backward()
    assert opt.a.weight.grad is None and model.a.weight.grad is None
    torch.testing.assert_close(opt.b.weight.grad, model.b.weight.grad)


class _OutActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.register_buffer("buf", torch.zeros(3, 8))

    def forward(self, x):
        torch.sigmoid(self.l(x), out=self.buf)
        return self.buf + 1


def test_an_activation_that_writes_into_out_is_not_fused():
    torch.manual_seed(0)
    model = _OutActivation().eval()
    opt = cf.optimize(model)
    assert not any("sigmoid" in p for _, p in opt.cudnn_fuse_summary.replaced)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    torch.testing.assert_close(opt.buf, model.buf)


def test_an_example_call_leaves_the_modules_plain_attributes_as_they_were():
    torch.manual_seed(0)
    model = _Warm()
    x = torch.randn(2, 4)
    opt = cf.optimize(model, example_inputs=x)
    assert opt.calls == 0 and model.calls == 0
    for _ in range(4):
        torch.testing.assert_close(opt(x), model(x))


class _LazyNet(nn.Module):
    def __init__(self, lazy_conv: bool):
        super().__init__()
        self.c = nn.LazyConv2d(4, 3) if lazy_conv else nn.Conv2d(3, 4, 3)
        self.l = nn.LazyLinear(8)

    def forward(self, im):
        return self.l(F.relu(self.c(im)).flatten(1))


@pytest.mark.parametrize("lazy_conv", [True, False], ids=["lazy-conv", "conv"])
@pytest.mark.parametrize("example", [False, True], ids=["first-call", "example-call"])
def test_a_model_with_lazy_layers_is_optimized_before_its_first_call(lazy_conv, example):
    """Its parameters are made at its first call (the example call's, where one is given): with the same
    random stream there, they are the original's."""
    import copy

    torch.manual_seed(0)
    model = _LazyNet(lazy_conv).eval()
    ref = copy.deepcopy(model)
    im = torch.randn(2, 3, 6, 6)
    torch.manual_seed(1)
    opt = cf.optimize(model, example_inputs=im if example else None)
    assert not example or not any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in opt.parameters())
    with torch.no_grad():
        torch.manual_seed(1)
        got = opt(im)
        torch.manual_seed(1)
        torch.testing.assert_close(got, ref(im))


class _ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), 1.0

    def forward(self, x):
        return F.gelu(self.fc(x)) * self.scale + x


class _Tempered(nn.Module):
    """A temperature and a container's scale: plain attributes the traced graph reads as constants."""

    def __init__(self):
        super().__init__()
        self.body = _ScaledBlock()
        self.l, self.tau = nn.Linear(8, 8), 1.0

    def forward(self, x):
        return F.relu(self.l(self.body(x))) / self.tau


class _TemperedSequence(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.tau = 1.0

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x / self.tau


class _RateDropped(nn.Module):
    """A dropout rate the forward reads (always on: a forward that reads ``self.training`` is not traced whole)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.p = nn.Linear(8, 8), nn.Linear(8, 8), 0.1

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), self.p))


def _set(module, path: str, value):
    *parents, name = path.split(".")
    setattr(module.get_submodule(".".join(parents)), name, value)


@pytest.mark.parametrize("make, path, value, train", [(_Tempered, "tau", 4.0, False),
                                                      (_Tempered, "body.scale", 3.0, False),
                                                      (_TemperedSequence, "tau", 4.0, False),
                                                      (_RateDropped, "p", 0.5, True)])
def test_an_attribute_the_traced_graph_read_set_after_optimize_takes_effect(make, path, value, train):
    torch.manual_seed(0)
    model = make().train(train)
    opt = cf.optimize(model)
    assert type(opt) is not make and opt.cudnn_fuse_summary.replaced  # traced whole, fused
    for m in (opt, model):
        _set(m, path, value)
    x = torch.randn(3, 8)
    with torch.no_grad():  # the same random draws: the dropout's mask is the original's
        torch.manual_seed(1)
        got = opt(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, model(x))


def test_setting_an_attribute_the_traced_graph_read_warns_once_per_model(caplog):
    import copy
    import io

    torch.manual_seed(0)
    model = _Tempered().eval()
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        opt = cf.optimize(model)
        again = copy.deepcopy(opt)
        buf = io.BytesIO()
        torch.save(opt, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        opt.eval(), opt.train(), opt.eval()
        opt.cudnn_fuse_summary = opt.cudnn_fuse_summary
        opt.tau, opt.body.scale = 1.0, 1.0  # the same values: nothing changes
        opt.tau = float("1")  # an equal float, another object
    assert not caplog.records  # built, copied, unpickled, its mode set, the same values set: no warning
    assert not any("untraced_by" in m.__dict__ for m in (opt, again, loaded))
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        opt.tau = 4.0
        opt.tau = 5.0
        opt.body.scale = 2.0  # the same model: no second warning
        again.body.scale = 8.0  # a container's carried attribute, in another model
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(" set after")[0] for m in messages] == \
        ["cudnn_fuse.optimize: _Tempered.tau", "cudnn_fuse.optimize: _ScaledBlock.scale"]
    for m in messages:
        assert "old value (1.0)" in m and "own forward over its fused layers" in m and "before optimize()" in m
    assert "untraced_by" not in loaded.__dict__
    caplog.clear()
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        alone = copy.deepcopy(loaded.body)  # a container copied out of its model: no model to run
        alone.scale = 2.0
        alone.scale = 3.0
    assert len(caplog.records) == 1 and "keeps the value" in caplog.records[0].getMessage()


def test_a_model_running_its_own_forward_keeps_its_fused_layers_state_dict_and_signature():
    import inspect

    torch.manual_seed(0)
    model = _Tempered().eval()
    opt = cf.optimize(model)
    keys, signature = list(opt.state_dict()), inspect.signature(opt.forward)
    opt.tau = model.tau = 4.0
    assert opt.__dict__.get("untraced_by") == "_Tempered.tau"
    assert opt.cudnn_fuse_summary.replaced and isinstance(opt.l, cfnn.Linear) and isinstance(opt.body.fc, cfnn.Linear)
    assert list(opt.state_dict()) == keys and set(keys) == set(model.state_dict())
    assert inspect.signature(opt.forward) == signature
    x = torch.randn(3, 8)
    opt.train(), model.train()
    opt(x).sum().backward()
    model(x).sum().backward()
    for (name, p), q in zip(opt.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_model_compiled_before_the_attribute_is_set_follows_it_too():
    """torch.compile's guards see the switch to the class's own forward: no stale compiled graph."""
    torch.manual_seed(0)
    model = _Tempered().eval()
    opt = cf.optimize(model)
    compiled = torch.compile(opt, fullgraph=True, backend="eager")
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), model(x))
    opt.tau, model.tau = 4.0, 4.0
    torch.testing.assert_close(compiled(x), model(x))


def test_copies_of_a_model_running_its_own_forward_do_too_and_one_copied_before_stays_traced(monkeypatch):
    import copy
    import io

    def saved(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        return buf.getvalue()

    torch.manual_seed(0)
    model = _Tempered().eval()
    opt = cf.optimize(model)
    before, pickled_before = copy.deepcopy(opt), saved(opt)
    calls = []
    own = _Tempered.forward
    monkeypatch.setattr(_Tempered, "forward", lambda self, *a: calls.append(self) or own(self, *a))
    opt.tau = 4.0
    switched = opt, copy.deepcopy(opt), torch.load(io.BytesIO(saved(opt)), weights_only=False)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want_before = own(model, x)
        model.tau = 4.0
        want = own(model, x)
        for m in (*switched, copy.deepcopy(switched[2])):  # also a deepcopy of the unpickled one
            del calls[:]
            assert m.tau == 4.0 and m.__dict__.get("untraced_by") == "_Tempered.tau"
            torch.testing.assert_close(m(x), want)
            assert calls == [m]  # its class's forward ran
        del calls[:]
        torch.testing.assert_close(before(x), want_before)  # copied before: its traced graph, the old value
        assert before.tau == 1.0 and "untraced_by" not in before.__dict__ and not calls
        model.body.scale = 3.0
        want = own(model, x)
        for m in (before, torch.load(io.BytesIO(pickled_before), weights_only=False)):
            m.body.scale = 3.0  # set on a copy's container: that copy runs its own forward
            assert m.__dict__.get("untraced_by") == "_ScaledBlock.scale"
            m.tau = 4.0
            torch.testing.assert_close(m(x), want)


_SERVED: list = []  # what the other thread saw (no attribute of the module: one filled in place is refused)


class _OtherThreadMeanwhile(nn.Module):
    """A forward during whose trace another thread enters torch.no_grad() (a model served meanwhile)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        import threading

        def serve():
            try:
                with torch.no_grad():
                    _SERVED.append(torch.is_grad_enabled())
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                _SERVED.append(exc)

        t = threading.Thread(target=serve)
        t.start()
        t.join()
        return F.relu(self.fc(x))


def test_another_threads_torch_calls_are_untouched_while_a_forward_is_traced():
    """The trace's stand-ins for torch's global-state functions raise in the tracing thread only, and are
    gone afterwards."""
    model = _OtherThreadMeanwhile()
    _SERVED.clear()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced and not opt.cudnn_fuse_summary.left_alone
    assert all(s is False for s in _SERVED) and _SERVED, _SERVED  # the thread ran, inside no_grad, without an error
    assert torch.is_grad_enabled.__module__ != cf.optimize.__module__ and torch.is_grad_enabled()


class _ListOrTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        if isinstance(x, (list, tuple)):
            x = torch.cat(x, 0)
        return F.relu(self.c(x))


class _TensorOrNumber(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, bias):
        bias = bias if torch.is_tensor(bias) else torch.full_like(x, bias)
        return F.relu(self.l(x) + bias)


class _TypeOfInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x, bias):
        bias = bias if type(bias) is torch.Tensor else torch.full_like(x, bias)
        return F.relu(self.l(x) + bias)


class _TypeOfSelf(nn.Module):
    """type() of the module itself and the builtin ``type`` as a class: no traced value asked, one graph."""

    def __init__(self):
        super().__init__()
        self.l, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        y = self.l(x)
        if type(self).__name__ == "_TypeOfSelf" and isinstance(type(self), type) and isinstance(3, (type, int)):
            y = self.act(y)
        return y


class _AsksOfAModule(nn.Module):
    """isinstance of a module, no traced value: one graph answers for every input."""

    def __init__(self):
        super().__init__()
        self.l, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        y = self.l(x)
        return self.act(y) if isinstance(self.act, nn.ReLU) else y


@pytest.mark.parametrize("make,calls", [
    (_ListOrTensor, [([torch.randn(1, 3, 5, 5), torch.randn(1, 3, 5, 5)],), (torch.randn(2, 3, 5, 5),)]),
    (_TensorOrNumber, [(torch.randn(3, 8), torch.randn(3, 8)), (torch.randn(3, 8), 0.5)]),
    (_TypeOfInput, [(torch.randn(3, 8), torch.randn(3, 8)), (torch.randn(3, 8), 0.5)]),
], ids=["isinstance", "is_tensor", "type"])
def test_a_forward_that_asks_the_type_of_its_input_answers_every_input_the_original_takes(make, calls):
    torch.manual_seed(0)
    model = make().eval()
    opt = cf.optimize(model)
    assert any("type of a traced value" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    for args in calls:
        torch.testing.assert_close(opt(*args), model(*args))
    assert "isinstance" not in globals() and "type" not in globals() and torch.is_tensor.__module__ == "torch"


@pytest.mark.parametrize("make", [_AsksOfAModule, _TypeOfSelf])
def test_isinstance_of_a_module_or_a_constant_still_traces_whole(make):
    torch.manual_seed(0)
    model = make().eval()
    opt = cf.optimize(model)
    assert not any("type of a traced value" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(3, 8)
    torch.testing.assert_close(opt(x), model(x))


# --------------------------------------------------------------------- what a trace would drop


class _GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.alpha * g, None


class _ReversesGrad(nn.Module):
    """A domain-adversarial head: a custom autograd Function with a backward of its own."""

    def __init__(self):
        super().__init__()
        self.feat, self.domain = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.domain(_GradReverse.apply(F.relu(self.feat(x)), 0.5))


class _FrozenTeacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.student, self.teacher = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        with torch.inference_mode():
            t = F.relu(self.teacher(x))
        return F.relu(self.student(x)) - t.clone()


class _CountsInAnObject(nn.Module):
    def __init__(self):
        super().__init__()
        import types

        self.fc, self.stats = nn.Linear(8, 8), types.SimpleNamespace(calls=0)

    def forward(self, x):
        self.stats.calls += 1
        return F.relu(self.fc(x))


@pytest.mark.parametrize("make,why", [
    (_ReversesGrad, "custom autograd Function"),
    (_FrozenTeacher, "inference mode"),
    (_CountsInAnObject, "SimpleNamespace stats in place"),
], ids=["custom-function", "inference-mode", "object-field"])
def test_what_a_traced_graph_would_drop_is_refused_and_runs_as_the_original(make, why):
    import copy

    torch.manual_seed(0)
    model = make().train()
    ref = copy.deepcopy(model)
    opt = cf.optimize(model)
    assert any(why in reason for _, reason in opt.cudnn_fuse_summary.left_alone), opt.cudnn_fuse_summary
    if hasattr(opt, "stats"):
        assert opt.stats.calls == 0  # no trace counted
    x = torch.randn(4, 8)
    ref(x).sum().backward()
    opt(x).sum().backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), opt.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert getattr(opt, "stats", None) is None or opt.stats.calls == ref.stats.calls == 1


class _CastsToItsDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = x.to(next(self.parameters()).dtype)  # the input cast to the model's dtype, read as it runs
        return self.fc2(F.relu(self.fc(x)))


def _plain_mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@pytest.mark.parametrize("make,untraced", [(_CastsToItsDtype, True), (_plain_mlp, False)])
def test_a_graph_holding_the_dtype_it_read_runs_the_forward_after_a_move_to_another(make, untraced, caplog):
    torch.manual_seed(0)
    model = make().eval()
    opt = cf.optimize(model)
    import importlib

    assert isinstance(opt, importlib.import_module("cudnn_fuse.optimize").OptimizedGraphModule)  # traced whole
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        opt.double()
        model.double()
    assert ("untraced_by" in vars(opt)) == untraced and ("dtype" in caplog.text) == untraced
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        y = opt(x)
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, model(x))


# --------------------------------------------------------------------- buffers changed in place as it traces


class _CountingNorm(nn.BatchNorm2d):
    """timm's BatchNormAct2d: the batch count kept in its forward, a cumulative average where momentum is None."""

    def forward(self, x):
        f = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                f = 1.0 / float(self.num_batches_tracked)
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         self.training or not self.track_running_stats, f, self.eps)
        return F.relu(y)


class _CountingNet(nn.Module):
    def __init__(self, momentum):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), _CountingNorm(8, momentum=momentum), \
            nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_buffer_a_forward_changes_in_place_is_left_as_it_was_and_keeps_counting(momentum):
    import copy

    torch.manual_seed(0)
    model = _CountingNet(momentum).train()
    ref = copy.deepcopy(model)
    opt = cf.optimize(model)
    assert opt.bn.num_batches_tracked.item() == 0  # the traces counted nothing
    for i in range(3):
        x = torch.randn(2, 3, 8, 8) * (i + 1)
        torch.testing.assert_close(opt(x), ref(x))
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(opt.state_dict()[key], value, msg=key)


class _CountsCalls(nn.Module):
    """Counts its calls in a buffer, in both modes."""

    def __init__(self):
        super().__init__()
        self.l, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls.add_(1)
        return self.l2(F.relu(self.l(x)))


@pytest.mark.parametrize("copied", [True, False])
def test_a_buffer_a_trace_changed_is_put_back_or_told_and_the_forward_is_not_traced(copied, monkeypatch, caplog):
    import importlib

    opt_module = importlib.import_module("cudnn_fuse.optimize")
    if not copied:
        monkeypatch.setattr(opt_module, "_RESTORED_BYTES", 0)  # too large to copy
    model = _CountsCalls().eval()
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        opt = cf.optimize(model)
    assert any("changes calls in place" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    told = [r.getMessage() for r in caplog.records if "calls was changed in place" in r.getMessage()]
    assert (model.calls.item(), bool(told)) == ((0, False) if copied else (model.calls.item(), True))
    before = opt.calls.item()
    opt(torch.randn(3, 8))
    assert opt.calls.item() == before + 1  # its own forward runs, and counts


# --------------------------------------------------------------------- containers filled in place, state_dict


class _Collects(nn.Module):
    """Collects its hidden features in a plain container (a perceptual loss's, attention maps)."""

    def __init__(self, kind: str):
        super().__init__()
        import collections

        self.l1, self.l2, self.kind = nn.Linear(8, 8), nn.Linear(8, 8), kind
        self.feats = {"list": list, "dict": dict, "set": set, "deque": collections.deque}[kind]()

    def forward(self, x):
        h = torch.relu(self.l1(x))
        if self.kind == "dict":
            self.feats[len(self.feats)] = h
        else:
            getattr(self.feats, "add" if self.kind == "set" else "append")(h)
        return self.l2(h)


class _CollectsInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = _Collects("list"), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.inner(x)))


@pytest.mark.parametrize("kind", ["list", "dict", "set", "deque", "child-list"])
def test_a_forward_that_fills_a_container_attribute_in_place_fills_it_in_the_optimized_model(kind):
    """A trace ran ``self.feats.append(h)`` with fx's Proxy: the Proxy stayed in the list (no pickling), and
    the traced graph never appended."""
    import io

    torch.manual_seed(0)
    model = (_CollectsInside() if kind == "child-list" else _Collects(kind)).eval()
    opt = cf.optimize(model)

    def feats(m):
        return (m.inner if kind == "child-list" else m).feats

    assert len(feats(opt)) == 0 and len(feats(model)) == 0  # nothing of the trace left there
    assert any("in place" in why and "feats" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        torch.testing.assert_close(opt(x), model(x))
    assert len(feats(opt)) == len(feats(model)) == 2
    torch.save(opt, io.BytesIO())


class _BiasCache(nn.Module):
    """timm LeViT's attention: its attention biases cached per device in a dict, in eval mode."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.biases = nn.Parameter(torch.randn(2, 3))
        self.register_buffer("idxs", torch.tensor([[0, 1, 2, 1], [2, 1, 0, 0], [1, 1, 1, 2], [0, 0, 2, 2]]),
                             persistent=False)
        self.cache = {}

    def get_biases(self, device):
        if self.training:
            return self.biases[:, self.idxs]
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.biases[:, self.idxs]
        return self.cache[key]

    def forward(self, x):  # [B, 4, 8]
        q, k, v = self.qkv(x).reshape(x.shape[0], 4, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1) + self.get_biases(x.device)).softmax(-1)
        return x + self.proj(F.relu((a @ v).transpose(1, 2).reshape(x.shape[0], 4, 8)))


class _Distilled(nn.Module):
    """LeViT's distilled head: two outputs in training mode, so the root is not traced whole."""

    def __init__(self):
        super().__init__()
        self.stages, self.head = nn.Sequential(_BiasCache(), _BiasCache()), nn.Linear(8, 8)

    def forward(self, x):
        x = self.head(self.stages(x))
        return (x, x * 2) if self.training else x


def test_a_dict_cache_filled_by_a_parents_trace_does_not_crash_a_childs_rewrite():
    """The root's trace left a Proxy in each attention's cache; a child's trace then read that other graph's
    node, and optimize() raised "Argument ... does not belong to this Graph"."""
    torch.manual_seed(0)
    model = _Distilled().eval()
    opt = cf.optimize(model)
    assert all(not m.cache for m in opt.stages)
    left = dict(opt.cudnn_fuse_summary.left_alone)  # its mode read in get_biases is told first, or its cache
    assert all("cache in place" in left[f"stages.{i}"] or "training mode" in left[f"stages.{i}"] for i in (0, 1))
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert [list(m.cache) for m in opt.stages] == [["cpu"], ["cpu"]]


def test_a_rewrite_that_fails_leaves_the_module_as_it_was_with_the_reason(monkeypatch, caplog):
    import sys

    def fail(self):
        raise RuntimeError("Argument 'getitem_6' of Node 'add' does not belong to this Graph")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    monkeypatch.setattr(sys.modules["cudnn_fuse.optimize"]._Rewriter, "chain", fail)  # after the replacements
    with caplog.at_level("WARNING", logger="cudnn_fuse.optimize"):
        opt = cf.optimize(model)
    assert type(opt) is nn.Sequential and type(opt[0]) is nn.Linear
    assert opt.cudnn_fuse_summary.replaced == []
    (where, why), = opt.cudnn_fuse_summary.left_alone
    assert where == "Sequential" and "could not be rewritten" in why and "does not belong" in why
    assert "left as it was" in caplog.text
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _RootBuffers(nn.Module):
    """A non-persistent buffer of the root and a tensor constant fx makes a buffer of (``_tensor_constant0``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("idx", torch.arange(4), persistent=False)

    def forward(self, x):
        return torch.relu(self.fc(x))[..., self.idx] + torch.ones(4)


def _copied(model, how: str):
    import copy
    import io

    if how == "deepcopy":
        return copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _same_state_dict(opt, model):
    assert list(opt.state_dict()) == list(model.state_dict())
    opt.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(opt.state_dict(), strict=True)


@pytest.mark.parametrize("how", ["deepcopy", "save-load"])
@pytest.mark.parametrize("nested", [False, True], ids=["root", "under-an-untraceable-parent"])
def test_copies_of_an_optimized_model_keep_its_non_persistent_buffers_out_of_the_state_dict(how, nested):
    torch.manual_seed(0)
    model = (_Untraceable(_RootBuffers()) if nested else _RootBuffers()).eval()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced
    x = torch.randn(2, 4)
    for copied in (_copied(opt, how), _copied(_copied(opt, how), how)):
        _same_state_dict(copied, model)
        assert {n for n, _ in copied.named_buffers()} == {n for n, _ in opt.named_buffers()}  # still buffers
        with torch.no_grad():
            torch.testing.assert_close(copied(x), model(x))


class _ShiftedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.shift = torch.tensor([0.5])  # a plain attribute: no buffer, not in the state_dict

    def forward(self, x):
        return torch.relu(self.conv(x)) - self.shift


class _PlainTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.block = nn.Conv2d(3, 4, 3), _ShiftedBlock()
        self.scale = torch.tensor([2.0])

    def forward(self, x):
        return self.block(torch.relu(self.conv(x)) * self.scale)


@pytest.mark.parametrize("how", ["optimized", "deepcopy", "save-load"])
def test_a_plain_tensor_attribute_is_no_state_dict_key_of_the_optimized_model(how):
    """fx registers a plain tensor the graph reads as a persistent buffer, at the root and at a container it
    rebuilds: the optimized state_dict had keys ``scale`` and ``block.shift`` the original's lacks."""
    torch.manual_seed(0)
    model = _PlainTensors().eval()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced and not opt.cudnn_fuse_summary.left_alone  # traced whole
    if how != "optimized":
        opt = _copied(opt, how)
    _same_state_dict(opt, model)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _Versioned(nn.Module):
    """A block whose state_dict holds extra state (a format version)."""

    def __init__(self):
        super().__init__()
        self.fc, self.version = nn.Linear(8, 8), 3

    def forward(self, x):
        return torch.relu(self.fc(x))

    def get_extra_state(self):
        return {"version": self.version}

    def set_extra_state(self, state):
        self.version = state["version"]


class _Renamed(nn.Module):
    """A block that saves its layer under another name, and loads it back from it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "saved_at"] = torch.tensor(1.0)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict.pop(prefix + "saved_at", None)
        super()._load_from_state_dict(state_dict, prefix, *args)


class _VersionedRoot(_Versioned):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(super().forward(x))


class _Holds(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block, self.head = block, nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("make", [_VersionedRoot, lambda: _Holds(_Versioned()), lambda: _Holds(_Renamed())],
                         ids=["extra-state-root", "extra-state-container", "save-to-state-dict-container"])
def test_a_module_whose_class_makes_its_own_state_dict_keeps_it(make):
    """nn.Module.state_dict asks the class for get_extra_state and _save_to_state_dict: the modules fx rebuilds
    (the root, the containers it runs through) lost them, and the key ``block._extra_state`` with them."""
    torch.manual_seed(0)
    model = make().eval()
    opt = cf.optimize(model)
    assert any("state_dict would change" in why for _, why in opt.cudnn_fuse_summary.left_alone)
    assert opt.cudnn_fuse_summary.replaced or make is _VersionedRoot  # the other children are rewritten
    _same_state_dict(opt, model)
    versioned = opt if make is _VersionedRoot else opt.block
    if hasattr(versioned, "version"):
        model.load_state_dict({**model.state_dict(), **{k: {"version": 7} for k in model.state_dict()
                                                        if k.endswith("_extra_state")}})
        opt.load_state_dict(model.state_dict(), strict=True)
        assert versioned.version == 7
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _FrozenNorm(nn.BatchNorm2d):
    """A norm of another library built on torch's BatchNorm2d (timm's BatchNormAct2d): it inherits torch's
    _load_from_state_dict, which reads older torch versions' checkpoints only."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class _OwnLoad(nn.Module):
    """torchvision's FrozenBatchNorm2d: a module without children that loads its state_dict its own way."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4, 1, 1))

    def forward(self, x):
        return x * self.scale

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("norm", [_FrozenNorm, _OwnLoad], ids=["inherits-torchs", "no-children"])
def test_a_norm_with_torchs_or_its_own_state_dict_loading_still_lets_its_parent_trace_whole(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm(4) if norm is _FrozenNorm else norm(), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()).eval()
    opt = cf.optimize(model)
    assert not opt.cudnn_fuse_summary.left_alone and opt.cudnn_fuse_summary.replaced
    if norm is _OwnLoad:
        assert opt[1] is not model[1] and type(opt[1]) is _OwnLoad  # kept as itself
    _same_state_dict(opt, model)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


class _Transposed(nn.Module):
    """Saved its layer's weight transposed before its version 2 (torchvision's MLPBlock renames its old keys so):
    its _load_from_state_dict converts by the version a checkpoint was saved with."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version", 1) < 2 and prefix + "fc.weight" in state_dict:
            state_dict[prefix + "fc.weight"] = state_dict[prefix + "fc.weight"].t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


@pytest.mark.parametrize("nested", [False, True], ids=["root", "container"])
def test_a_class_that_reads_its_older_checkpoints_still_does_when_traced_whole(nested):
    """The module fx rebuilt saved version 1 (nn.Module's) in the state_dict's metadata, so that the original
    converted the optimized model's checkpoint as an old one, and did not convert an old one itself."""
    torch.manual_seed(0)
    model = (_Holds(_Transposed()) if nested else _Transposed()).eval()
    opt = cf.optimize(model)
    assert opt.cudnn_fuse_summary.replaced and not opt.cudnn_fuse_summary.left_alone  # still traced whole
    path, key = ("block", "block.fc.weight") if nested else ("", "fc.weight")
    want = model.state_dict()[key].clone()
    for m in (opt, _copied(opt, "deepcopy"), _copied(opt, "save-load")):
        saved = m.state_dict()
        assert saved._metadata[path]["version"] == 2
        model.load_state_dict(saved, strict=True)
        torch.testing.assert_close(model.state_dict()[key], want)  # not converted as an old checkpoint
        old = model.state_dict()
        old[key] = old[key].t().contiguous()
        old._metadata[path]["version"] = 1
        m.load_state_dict(old, strict=True)
        torch.testing.assert_close(m.state_dict()[key], want)
        x = torch.randn(2, 8)
        with torch.no_grad():
            torch.testing.assert_close(m(x), model(x))
