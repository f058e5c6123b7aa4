"""Builders: an op spec -> a ``cudnn.pygraph`` holding its nodes, with fixed uids.

Builders only add nodes. ``engines.finalize`` runs validate -> build -> plan
selection, so one place decides how graphs are built and what a failure means.
"""

from __future__ import annotations

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
)
from . import attention, backward, conv, matmul
from .common import UIDS, roles_of

_BUILDERS = {
    ConvSpec: conv.build,
    MatmulSpec: matmul.build,
    SdpaSpec: attention.build,
    # training graphs
    SaveZSpec: backward.build_save_z,
    RecomputeGradSpec: backward.build_recompute_grad,
    ActGradSpec: backward.build_act_grad,
    ConvDgradSpec: backward.build_dgrad,
    ConvWgradSpec: backward.build_wgrad,
    SdpaTrainSpec: attention.build_train,
    SdpaBwdSpec: attention.build_backward,
}


def build_graph(spec, handle=None):
    """Return the un-finalized pygraph of ``spec`` (no driver needed)."""
    return _BUILDERS[type(spec)](spec, handle)


def uids_of(spec) -> tuple:
    """The tensor uids, in the order ``Plan.run`` takes buffers, for ``spec``."""
    return tuple(UIDS[r] for r in roles_of(spec))


__all__ = ["build_graph", "uids_of", "roles_of", "UIDS"]
