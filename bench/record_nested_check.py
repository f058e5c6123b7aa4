"""GPU check of cf.record blocks that nest (the manifest audit's fix): the outer manifest holds
the specs made inside the inner block. Prints one JSON line; exit 1 if the check fails."""
import json
import os
import sys
import tempfile

import torch

import cudnn_fuse as cf
from cudnn_fuse import manifest

d = tempfile.mkdtemp()
outer_p, inner_p = os.path.join(d, "outer.json"), os.path.join(d, "inner.json")
x = torch.randn(64, 128, device="cuda", dtype=torch.float16)
w = torch.randn(256, 128, device="cuda", dtype=torch.float16)
with cf.record(outer_p):
    cf.linear(x, w, activation="relu")
    with cf.record(inner_p):
        cf.linear(x, w, activation="gelu")
outer, inner = manifest.load(outer_p), manifest.load(inner_p)
ops = lambda es: sorted(e.spec.epilogue.activation for e in es)  # noqa: E731
out = {"outer": ops(outer), "inner": ops(inner)}
print(json.dumps(out))
sys.exit(0 if out == {"outer": ["gelu", "relu"], "inner": ["gelu"]} else 1)
