"""Makes `import ringscope` work from a checkout too: the installed package (`pip install ./ffi/python`) if there is
one, else the sources in ffi/python with the library `cargo build --release -p ringscope-ffi` left in target/."""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if importlib.util.find_spec("ringscope") is None:
    sys.path.insert(0, str(ROOT / "ffi" / "python"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "torch: needs torch and transformers; test.sh runs these in the vLLM tests' environment "
        "(`tests/engine.sh vllm tests/python -m torch`), the others with `-m 'not torch'` in a torch-free one")
