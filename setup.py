"""The one compiled piece: cudnn_fuse._native, the memoized op call in C (cudnn_fuse/_native.c).

It needs only a C compiler and Python's headers (no torch or CUDA headers). It is optional: where it
does not build, the install goes on and the library runs its Python path (``cudnn-fuse doctor`` says
which one a process uses). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cudnn_fuse._native", ["cudnn_fuse/_native.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-missing-field-initializers"])])
