#!/usr/bin/env bash
# The SGLang plugin's tests (ringscope/sglang.py) against a real SGLang engine on CPU (sglang 0.5.23, in-process engines
# with their scheduler in a process of their own, serving a tiny random Llama): tests/engine.sh sglang, which sets up
# the environment — once without SGLang's overlap scheduler, then again with it (its default: the next batch is
# scheduled while the current one runs). Arguments go to pytest.
set -euo pipefail
engine="$(dirname "$0")/../engine.sh"
"$engine" sglang tests/sglang "$@"
echo "== again with SGLang's overlap scheduler"
RINGSCOPE_SGLANG_TEST_OVERLAP=1 "$engine" sglang tests/sglang -k "not unsupported and not launch_server" "$@"
