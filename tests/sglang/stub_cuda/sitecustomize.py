"""Imported at start-up by every Python process of the CUDA test run (tests/sglang/run_cuda.sh puts this directory on
PYTHONPATH): SGLang 0.5.23 imports its CuTe-DSL dual-GEMM kernels (`cutlass`, not installable on the GPU machine this
project measures on) when it builds a Llama MLP on CUDA. Their module is served by a stand-in that says the kernel
cannot be used, so the MLP takes its plain GEMM path (as it does for float32 weights anyway)."""
import enum
import importlib.abc
import importlib.machinery
import sys
import types

_NAME = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"


class _DualGemmStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == _NAME else None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)

        class DualGemmQuantMode(enum.IntEnum):
            STATIC_PER_TENSOR = 0
            STATIC_PER_TOKEN = 1
            DYNAMIC_PER_TENSOR = 2
            DYNAMIC_PER_TOKEN = 3
            UNQUANT = 4

        m.DualGemmQuantMode = DualGemmQuantMode
        m.MAX_DUAL_GEMM_DECODE_TOKENS = 0
        m.can_use_dual_gemm = lambda *args, **kwargs: False
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _DualGemmStandIn())
