"""The Python package's view of the C ABI (ringscope/_abi.py) is the header's: every signature in
``_abi.SIGNATURES`` has the argument and result types of its prototype in ffi/include/ringscope.h, every ``rs_*``
function of the header is in the table, and every ctypes struct has the header struct's fields, in order, at the
offsets and with the size the system C compiler gives them. A drift here would corrupt memory without a word, so it
fails here instead. Needs no built library; the struct check needs a C compiler (``cc``), as the test command does.
"""
import ctypes
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "ffi" / "include" / "ringscope.h"
PACKAGE_DIR = ROOT / "ffi" / "python" / "ringscope"

#: C scalar types → ctypes.
SCALARS = {"uint64_t": ctypes.c_uint64, "uint32_t": ctypes.c_uint32, "uint16_t": ctypes.c_uint16,
           "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "size_t": ctypes.c_size_t, "bool": ctypes.c_bool,
           "float": ctypes.c_float, "rs_status": ctypes.c_int32}


@pytest.fixture(scope="module")
def abi():
    # The checkout's source, not whatever `ringscope` is installed, loaded as a package of its own name so that its
    # relative imports resolve to the checkout too; importing it loads no library.
    name = "_ringscope_abi_source"
    spec = importlib.util.spec_from_file_location(name, PACKAGE_DIR / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE_DIR)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
        return importlib.import_module(f"{name}._abi")
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


@pytest.fixture(scope="module")
def header():
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", HEADER.read_text(), flags=re.S)


def ctype_of(c: str, abi):
    """The ctypes type of a C type as the header spells it (`const uint64_t **`, `struct rs_counts *`, ...)."""
    c = " ".join(c.replace("*", " * ").split())
    stars = c.count("*")
    base = c.replace("*", "").replace("const", "").replace("struct", "").strip()
    if base in ("char", "void") and stars >= 1:
        t, stars = (ctypes.c_char_p if base == "char" else ctypes.c_void_p), stars - 1
    elif base in SCALARS:
        t = SCALARS[base]
    elif base in abi.STRUCTS:
        t = abi.STRUCTS[base]
    else:
        raise AssertionError(f"the test does not know the C type {c!r}: add it to SCALARS")
    for _ in range(stars):
        t = ctypes.POINTER(t)
    return t


def prototypes(header):
    """`{name: (result type, [parameter types])}` of the header's functions, as C text."""
    found = {}
    for ret, name, params in re.findall(r"^([A-Za-z_][\w \*]*?)\s*\b((?:rs|ringscope)_\w+)\s*\(([^)]*)\)\s*;", header,
                                        flags=re.M):
        params = " ".join(params.split())
        types = [] if params in ("", "void") else [re.sub(r"\s*\b\w+$", "", p.strip()) for p in params.split(",")]
        found[name] = (ret.strip(), types)
    assert len(found) > 40, f"only {len(found)} prototypes parsed from {HEADER}"
    return found


def test_every_signature_is_the_headers(abi, header):
    protos = prototypes(header)
    missing = sorted(set(protos) - set(abi.SIGNATURES))
    assert not missing, f"functions of ringscope.h without a signature in _abi.SIGNATURES: {missing}"
    unknown = sorted(set(abi.SIGNATURES) - set(protos))
    assert not unknown, f"_abi.SIGNATURES names functions ringscope.h does not declare: {unknown}"
    for name, (version, args, res) in abi.SIGNATURES.items():
        ret, params = protos[name]
        want_args = [ctype_of(p, abi) for p in params]
        assert args == want_args, f"{name}: argument types {args} but the header says {params} ({want_args})"
        assert res == ctype_of(ret, abi), f"{name}: result type {res} but the header says {ret!r}"
        assert 1 <= version, name


def structs(header):
    """`{struct name: [(field, C type, array length or None)]}` of the header's `typedef struct`s."""
    found = {}
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", header, flags=re.S):
        fields = []
        for decl in (d.strip() for d in body.split(";")):
            if not decl:
                continue
            m = re.fullmatch(r"(.+?)\s*\b(\w+)(?:\[(\w+)\])?", " ".join(decl.split()))
            assert m, f"{name}: unparsed field {decl!r}"
            fields.append((m.group(2), m.group(1), m.group(3)))
        found[name] = fields
    return found


def test_every_struct_has_the_headers_fields_in_order(abi, header):
    defs = structs(header)
    assert set(defs) == set(abi.STRUCTS), f"header structs {sorted(defs)} vs _abi.STRUCTS {sorted(abi.STRUCTS)}"
    for name, fields in defs.items():
        ours = abi.STRUCTS[name]._fields_
        assert [f for f, _, _ in fields] == [f for f, _ in ours], f"{name}: field names or order differ"
        for (field, ctext, length), (_, t) in zip(fields, ours):
            if length is None:
                assert t == ctype_of(ctext, abi), f"{name}.{field}: {t} but the header says {ctext!r}"
            else:
                elem = ctypes.c_char if ctext == "char" else ctype_of(ctext, abi)
                assert t._type_ == elem, f"{name}.{field}: elements {t._type_}, the header says {ctext!r}"


def test_struct_sizes_and_offsets_are_the_c_compilers(abi, header, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc) to lay out the header's structs")
    defs = structs(header)
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "ringscope.h"', "int main(void) {"]
    for name, fields in defs.items():
        lines.append(f'  printf("{name} %zu\\n", sizeof(struct {name}));')
        for field, _, _ in fields:
            lines.append(f'  printf("{name}.{field} %zu %zu\\n", offsetof(struct {name}, {field}), '
                         f'sizeof(((struct {name} *)0)->{field}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(HEADER.parent), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    c = {}
    for line in filter(None, out):
        key, *nums = line.split()
        c[key] = tuple(int(n) for n in nums)
    for name, struct in abi.STRUCTS.items():
        assert ctypes.sizeof(struct) == c[name][0], f"sizeof({name}): ctypes {ctypes.sizeof(struct)}, C {c[name][0]}"
        for field, _ in struct._fields_:
            desc = getattr(struct, field)
            assert (desc.offset, desc.size) == c[f"{name}.{field}"], \
                f"{name}.{field}: ctypes offset/size {(desc.offset, desc.size)}, C {c[f'{name}.{field}']}"


def test_a_library_older_than_a_call_is_a_clear_error_naming_the_abi_version(abi, monkeypatch):
    """Only the calls a library lacks fail, with the C ABI version that added them and what to do."""
    monkeypatch.setenv("RINGSCOPE_LIB", "/opt/old/libringscope.so")
    monkeypatch.setattr(abi, "_lib", object())  # a library with none of the calls
    for call, version in [("rs_session_stats", 2), ("rs_alert_poll", 4), ("rs_admit_graph_step", 7)]:
        with pytest.raises(abi.RingscopeError, match=rf"/opt/old/libringscope.so predates {call} \(C ABI {version}\): "
                                                     r"rebuild it with `cargo build --release -p ringscope-ffi`"):
            abi._lib_with(call)


def test_only_the_abi_and_session_modules_call_the_library():
    """Every ``rs_*`` call goes through ringscope/_abi.py (loading, checking) or ringscope/session.py (the session and
    its raw-pointer captures for the custom ops and plugins), where the signature table and the value checks are."""
    calls = {}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        found = re.findall(r"\.(rs_\w+)\(", path.read_text())
        if found:
            calls[path.name] = sorted(set(found))
    assert set(calls) <= {"_abi.py", "session.py"}, {k: v for k, v in calls.items() if k not in ("_abi.py", "session.py")}
