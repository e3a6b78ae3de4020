"""Stand-in for the `sgl_kernel` package when SGLang 0.5.23 runs on a CUDA GPU that has no sgl-kernel wheel (the GPU
machine this project measures on has no network and sgl-kernel's CUDA wheel is far larger than what can be brought
to it). Used only by tests/sglang/gpu/run.sh, with SGLANG_FORCE_FUSED_OP_BACKEND=torch (every fused op — RMSNorm,
SiLU-and-mul, rotary embedding — takes its pure-torch forward_native path), the triton attention backend and the
pytorch sampling backend, so that the forward pass needs no sgl_kernel function. Every name and submodule SGLang
imports is served on demand; calling one raises NotImplementedError naming it, so a path that needs a real kernel
fails loudly instead of computing something else.
"""
import importlib.abc
import importlib.machinery
import sys
import types

CALLED = []


class _Missing:
    """A stand-in name: calling it raises; its attributes (e.g. ``scalar_types.uint4b8``) are stand-ins too."""

    def __init__(self, qualname):
        self.__name__ = qualname.rsplit(".", 1)[-1]
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        CALLED.append(self._qualname)
        raise NotImplementedError(f"sgl_kernel stand-in: {self._qualname} is not implemented (CUDA stand-in)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")


def _missing(qualname):
    return _Missing(qualname)


def _module_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        fn = _missing(f"{modname}.{name}")
        setattr(sys.modules[modname], name, fn)
        return fn

    return __getattr__


def is_arch_support_pdl() -> bool:  # sgl_kernel.utils: programmatic dependent launch off
    return False


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every `sgl_kernel.<sub>` submodule as a module of stand-ins."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _module_getattr(spec.name)
        if spec.name == __name__ + ".utils":
            m.is_arch_support_pdl = is_arch_support_pdl
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
__version__ = "0.4.9"
