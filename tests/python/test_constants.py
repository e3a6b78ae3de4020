"""The Python package's copies of the C ABI's numbers equal the header's: status codes (`enum rs_status`), drop
reasons (`RS_DROP_*`, indices into `rs_counts.dropped_by_reason`), dtype codes (`RS_DTYPE_*`) and limits
(`RS_RUNG_LEN`, `RS_MAX_ENDED_TOKENS`).

ffi/python re-types them by hand for ctypes; ffi/include/ringscope.h is generated from ffi/src/lib.rs, whose tests tie
the constants to the Rust enums (and fail when the committed header is stale). Needs no built library: the header is
parsed as text and the package's source is imported on its own (importing it loads nothing until a call).
"""
import importlib
import importlib.util
import pathlib
import re
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "ffi" / "include" / "ringscope.h"
PACKAGE_SOURCE = ROOT / "ffi" / "python" / "ringscope" / "__init__.py"


@pytest.fixture(scope="module")
def header():
    text = HEADER.read_text()
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


@pytest.fixture(scope="module")
def package():
    # The checkout's source, not whatever `ringscope` is installed: it is the file a change would have to keep right.
    # Loaded as a package of its own name, so that its relative imports (ringscope/_abi.py) resolve to the checkout.
    name = "_ringscope_source"
    spec = importlib.util.spec_from_file_location(name, PACKAGE_SOURCE,
                                                  submodule_search_locations=[str(PACKAGE_SOURCE.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        abi = importlib.import_module(f"{name}._abi")
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
    # The package's names, with the ABI module's private tables (status codes, drop reasons, structs) beside them.
    return types.SimpleNamespace(**{**vars(abi), **vars(module)})


def defines(header, prefix):
    """`{name: value}` of the header's `#define <prefix>... <integer>` lines, in header order."""
    found = {}
    for name, value in re.findall(rf"^#define\s+({prefix}\w*)\s+(\S+)\s*$", header, flags=re.M):
        assert re.fullmatch(r"-?\d+", value), f"{name} is {value!r}, not an integer literal"
        found[name] = int(value)
    assert found, f"no #define {prefix}* in {HEADER}"
    return found


def by_code(names_to_codes, prefix):
    """`{code: name}` sorted by code, the name lower-cased without its prefix; codes must be unique."""
    codes = list(names_to_codes.values())
    assert len(set(codes)) == len(codes), f"duplicate codes in {names_to_codes}"
    return {code: name[len(prefix):].lower() for name, code in sorted(names_to_codes.items(), key=lambda kv: kv[1])}


def test_status_codes_are_the_headers(header, package):
    enum = re.search(r"enum rs_status\b[^{]*\{(.*?)\};", header, flags=re.S)
    assert enum, f"no `enum rs_status` in {HEADER}"
    lines = [line.strip() for line in enum.group(1).splitlines() if line.strip()]
    entries = [re.fullmatch(r"(RS_\w+)\s*=\s*(-?\d+),?", line) for line in lines]
    assert all(entries), f"unparsed rs_status lines: {[l for l, e in zip(lines, entries) if not e]}"
    from_header = {int(e.group(2)): e.group(1) for e in entries}
    assert len(from_header) == len(entries), "duplicate rs_status codes"

    assert package._STATUS == from_header
    # Same order too (by code), so the table reads like the header.
    assert list(package._STATUS.items()) == sorted(from_header.items())


def test_drop_reasons_are_the_headers(header, package):
    count = defines(header, "RS_DROP_REASON_COUNT")["RS_DROP_REASON_COUNT"]
    reasons = {n: v for n, v in defines(header, "RS_DROP_").items() if n != "RS_DROP_REASON_COUNT"}
    from_header = by_code(reasons, "RS_DROP_")
    assert list(from_header) == list(range(count)), f"RS_DROP_* are not the indices 0..{count - 1}: {reasons}"
    assert re.search(r"uint64_t dropped_by_reason\[RS_DROP_REASON_COUNT\];", header)

    # `_DROP_REASONS[i]` names `dropped_by_reason[i]`.
    assert package._DROP_REASONS == tuple(from_header.values())
    by_reason = dict(package._Counts._fields_)["dropped_by_reason"]
    assert by_reason._length_ == count


def test_dtype_codes_are_the_headers(header, package):
    from_header = by_code(defines(header, "RS_DTYPE_"), "RS_DTYPE_")

    assert {code: name for code, (name, _) in package.DTYPE_CODES.items()} == from_header
    assert list(package.DTYPE_CODES) == list(from_header), "DTYPE_CODES is not in code order"



def test_limits_are_the_headers(header, package):
    assert package._RUNG_LEN == defines(header, "RS_RUNG_LEN")["RS_RUNG_LEN"]
    assert package.MAX_ENDED_TOKENS == defines(header, "RS_MAX_ENDED_TOKENS")["RS_MAX_ENDED_TOKENS"]
