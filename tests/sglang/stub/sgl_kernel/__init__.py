"""Stand-in for the `sgl_kernel` package in the SGLang tests, written for SGLang 0.5.23 and used with 0.5.17 too (PyPI
has no CPU build of sgl-kernel / sglang-kernel). Only what sglang 0.5.23 actually *calls* on the
SGLANG_USE_CPU_ENGINE=1 path (torch_native attention, no speculative decoding)
is implemented, in plain torch. Every other name that sglang merely *imports*
at module load on the CPU path is served by __getattr__ below as a function
that raises NotImplementedError if ever called.

Because torch.ops.sgl_kernel.convert_weight_packed does not exist,
_is_intel_amx_backend_available() (sglang/srt/utils/common.py:354) is False, so
layers take their forward_native / plain-torch paths even on an AMX host.
"""
import os


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    # CALLED on every extend/decode batch: sglang/srt/mem_cache/allocation.py:746
    # (assign_req_to_token_pool_func; imported at allocation.py:46 when is_cpu()).
    # Same semantics as the triton kernel `assign_req_to_token_pool` in that file:
    # request i gets KV slots out_cache_loc[sum_{j<i}(end_j-start_j) : +(end_i-start_i)]
    # written into req_to_token[req_pool_indices[i], start_i:end_i].
    off = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


# Names only *imported* (never called here) on the CPU path, all at module import time
# in the scheduler process; observed with SGL_KERNEL_STUB_TRACE=<file>:
#   copy_all_layer_kv_cache_cpu            sglang/kernels/ops/kvcache/cache_move.py:10
#       (called at cache_move.py:191 only via KV-pool move_kv_cache = speculative decoding)
#   build_tree_kernel_efficient_cpu        sglang/kernels/ops/speculative/spec_tree.py:40
#   verify_tree_greedy_cpu                 sglang/kernels/ops/speculative/spec_tree.py:43
#   assign_draft_cache_locs_contiguous_cpu sglang/kernels/ops/speculative/cache_locs.py:28
#   assign_extend_cache_locs_cpu           sglang/kernels/ops/speculative/cache_locs.py:28
#   fill_accept_out_cache_loc_cpu          sglang/kernels/ops/speculative/eagle.py:10
#   fill_bonus_tokens_cpu                  sglang/kernels/ops/speculative/eagle.py:10
# (all EAGLE/speculative-decoding only). torch.ops.sgl_kernel.* custom ops are absent:
# sglang logs "Ignore import error when loading sglang.srt.models.qwen3_5..." for a few
# model files that touch torch.ops.sgl_kernel.fused_sigmoid_mul_cpu at import; harmless
# for Llama.
IMPORTED_ONLY = []


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_implemented(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stub: {name} is not implemented on CPU")

    _not_implemented.__name__ = name
    IMPORTED_ONLY.append(name)
    if os.environ.get("SGL_KERNEL_STUB_TRACE"):  # debugging aid: which names are imported
        with open(os.environ["SGL_KERNEL_STUB_TRACE"], "a") as f:
            f.write(f"{os.getpid()} {name}\n")
    globals()[name] = _not_implemented
    return _not_implemented
