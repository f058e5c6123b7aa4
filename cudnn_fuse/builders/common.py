"""What every builder shares: dtype mapping, fixed uids, operand declaration."""

from __future__ import annotations

import cudnn

from ..spec import (
    ActGradSpec,
    ConvDgradSpec,
    ConvSpec,
    ConvWgradSpec,
    MatmulSpec,
    RecomputeGradSpec,
    SaveZSpec,
    SdpaBwdSpec,
    SdpaSpec,
    SdpaTrainSpec,
    TensorSpec,
)

# Fixed uids per role, the same for every op family, so a deserialized plan is
# fed from the spec alone (no builder needed to learn its uids).
UIDS = {
    "x": 1, "a": 1, "q": 1,
    "w": 2, "b": 2, "k": 2,
    "v": 3,
    "bias": 4,
    "residual": 5,
    "y": 10, "o": 10,
    "amax": 11,
    # training graphs (builders/backward.py, attention.py)
    "dy": 6, "do": 6,
    "src": 7,
    "z": 12,
    "dz": 13,
    "dbias": 14,
    "dx": 15,
    "dw": 16,
    "stats": 17,
    "dq": 18, "dk": 19, "dv": 20,
}

_DT = {
    "float16": cudnn.data_type.HALF,
    "bfloat16": cudnn.data_type.BFLOAT16,
    "float32": cudnn.data_type.FLOAT,
}


def cudnn_dtype(name: str):
    return _DT[name]


def roles_of(spec) -> tuple:
    """Operand roles of ``spec`` in buffer order: inputs, then outputs."""
    training = _training_roles(spec)
    if training is not None:
        return training
    if isinstance(spec, SdpaSpec):
        return ("q", "k", "v") + (("bias",) if spec.bias is not None else ()) + ("o",)
    main = ("x", "w") if isinstance(spec, ConvSpec) else ("a", "b")
    assert isinstance(spec, (ConvSpec, MatmulSpec))
    epi = spec.epilogue
    return (
        main
        + (("bias",) if epi.bias is not None else ())
        + (("residual",) if epi.residual is not None else ())
        + ("y",)
        + (("amax",) if epi.amax else ())
    )


def _training_roles(spec):
    if isinstance(spec, SaveZSpec):
        return roles_of(spec.fwd) + ("z",)
    if isinstance(spec, RecomputeGradSpec):
        epi = spec.fwd.epilogue
        main = ("x", "w") if isinstance(spec.fwd, ConvSpec) else ("a", "b")
        return (main + (("bias",) if epi.bias is not None else ()) + (("residual",) if epi.residual is not None else ())
                + ("dy", "dz") + (("dbias",) if spec.dbias is not None else ()))
    if isinstance(spec, ActGradSpec):
        return ("dy", "src", "dz") + (("dbias",) if spec.dbias is not None else ())
    if isinstance(spec, ConvDgradSpec):
        return ("dy", "w", "dx")
    if isinstance(spec, ConvWgradSpec):
        return ("x", "dy", "dw")
    if isinstance(spec, SdpaTrainSpec):
        return ("q", "k", "v") + (("bias",) if spec.bias is not None else ()) + ("o", "stats")
    if isinstance(spec, SdpaBwdSpec):
        return ("q", "k", "v", "o", "do", "stats") + (("bias",) if spec.bias is not None else ()) + ("dq", "dk", "dv")
    return None


def new_graph(io_dtype: str, handle=None):
    kwargs = dict(
        io_data_type=cudnn_dtype(io_dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    if handle is not None:
        kwargs["handle"] = handle
    return cudnn.pygraph(**kwargs)


def declare(g, role: str, t: TensorSpec):
    """An input operand with its real strides and its fixed uid."""
    return g.tensor(name=role, dim=list(t.shape), stride=list(t.stride), data_type=cudnn_dtype(t.dtype), uid=UIDS[role])


def mark_output(tensor, role: str, t: TensorSpec):
    """Outputs always get explicit dims and strides (inferred strides gave wrong
    results for NCHW outputs, see CUDNN_NOTES)."""
    tensor.set_output(True).set_uid(UIDS[role]).set_name(role).set_data_type(cudnn_dtype(t.dtype))
    tensor.set_dim(list(t.shape)).set_stride(list(t.stride))
    return tensor
