"""A test-only SGLang plugin for tests/sglang/run_cuda.sh with SGLang's real CUDA kernels (sgl_kernel): the tests'
model is float32 (so that its rows can be compared with a float32 Hugging Face reference), and some of sgl_kernel's
fused ops have no float32 kernel (``rmsnorm``: "failed to dispatch data type Float"). With
``RINGSCOPE_SGLANG_TEST_NATIVE_OPS=1`` every SGLang op that has a pure-torch path (``forward_native``: RMSNorm,
SiluAndMul, the rotary embedding) takes it; attention (triton), the CUDA graphs, the scheduler and everything
else stay SGLang's own."""

import os


def register() -> None:
    if os.environ.get("RINGSCOPE_SGLANG_TEST_NATIVE_OPS") != "1":
        return
    from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

    orig = MultiPlatformOp.__dict__["dispatch_forward"]
    if getattr(orig, "_ringscope_test", False):
        return

    def dispatch_forward(self):
        # Only where the op has a torch path of its own (the base class's raises NotImplementedError).
        if type(self).forward_native is not MultiPlatformOp.forward_native:
            return self.forward_native
        return orig(self)

    dispatch_forward._ringscope_test = True
    dispatch_forward.__wrapped__ = orig
    MultiPlatformOp.dispatch_forward = dispatch_forward
