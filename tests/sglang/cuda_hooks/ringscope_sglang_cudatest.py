"""A test-only SGLang plugin for tests/sglang/run_cuda.sh: the tests' model is float32 (so that its rows can be compared
with a float32 Hugging Face reference), and some of SGLang's fused CUDA ops have no float32 kernel (sgl_kernel's
``rmsnorm``: "failed to dispatch data type Float"). With ``RINGSCOPE_SGLANG_TEST_NATIVE_OPS=1`` every op of SGLang
0.5.17's ``MultiPlatformOp`` class that has a pure-torch path (``forward_native``: RMSNorm, SiluAndMul, the rotary
embedding) takes it; attention (triton), the CUDA graphs, the scheduler and everything else stay SGLang's own.
(SGLang 0.5.23's fused ops take their torch path with ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` instead.)"""

import os


def register() -> None:
    if os.environ.get("RINGSCOPE_SGLANG_TEST_NATIVE_OPS") != "1":
        return
    from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

    orig = MultiPlatformOp.__dict__.get("dispatch_forward")
    if orig is None or getattr(orig, "_ringscope_test", False):
        return  # not 0.5.17's op class (0.5.23's fused ops read SGLANG_FORCE_FUSED_OP_BACKEND), or already done

    def dispatch_forward(self):
        # Only where the op has a torch path of its own (the base class's raises NotImplementedError).
        if type(self).forward_native is not MultiPlatformOp.forward_native:
            return self.forward_native
        return orig(self)

    dispatch_forward._ringscope_test = True
    dispatch_forward.__wrapped__ = orig
    MultiPlatformOp.dispatch_forward = dispatch_forward
