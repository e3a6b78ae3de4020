"""Issue 17, the Python package: bad input that used to be accepted silently — wrapped, truncated or cut short at a
NUL on its way into C, or published as garbage — or that raised a bare Python exception, is a RingscopeError that
names the argument. One case per line of the issue, plus the valid edge values that must keep working.

Needs the built library (RINGSCOPE_LIB, or the checkout's target/release), like test_python_api.py.
"""
import math

import numpy as np
import pytest
import ringscope

RingscopeError = ringscope.RingscopeError


@pytest.fixture
def session():
    s = ringscope.Session("")
    yield s
    s.close()


@pytest.fixture
def hp(session):
    return session.register("h", dtype="f32", row_width=4)


@pytest.fixture
def stepped(session, hp):
    """A session with an f32 hookpoint `h` (row width 4) in an open step of 2 rows."""
    session.begin_step(0, [1, 2], [0, 0])
    yield session
    session.end_step()


def bad(match, call):
    with pytest.raises(RingscopeError, match=match) as e:
        call()
    assert e.value.status in ("RS_ERR_INVALID_ARGUMENT", "RS_ERR_CONFIG", "RS_ERR_IO"), e.value
    # Each status has its own subclass, whoever raised it (the library through _check, or a check in Python).
    assert type(e.value) is ringscope.errors.ERROR_FOR_STATUS[e.value.status], (type(e.value), e.value.status)
    return e.value


def test_each_status_is_its_own_error_class_and_still_a_ringscope_error():
    """``except ringscope.ConfigError`` catches exactly the configuration errors; ``except RingscopeError`` and
    ``.status`` keep working; an error survives pickling (an engine's worker process) as its class."""
    import pickle

    from ringscope._abi import _STATUS

    assert set(ringscope.errors.ERROR_FOR_STATUS) == set(_STATUS.values()) - {"RS_OK"}
    for status, cls in ringscope.errors.ERROR_FOR_STATUS.items():
        assert issubclass(cls, RingscopeError) and getattr(ringscope, cls.__name__) is cls
    with pytest.raises(ringscope.ConfigError) as e:  # refused by the library
        ringscope.Session("[ring]\ncapacity = \"no\"\n")
    assert e.value.status == "RS_ERR_CONFIG" and isinstance(e.value, RingscopeError)
    with ringscope.Session("") as s, pytest.raises(ringscope.InvalidArgumentError):  # refused in Python first
        s.register("h", dtype="f32", row_width=-1)
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is ringscope.ConfigError and (back.status, back.message) == (e.value.status, e.value.message)
    assert type(RingscopeError("status 99", "an unknown status")) is RingscopeError


# -- NUL bytes and unencodable text ------------------------------------------------------------------------------

@pytest.mark.parametrize("case, call, name", [
    ("config text", lambda s: ringscope.Session('[ring]\ncapacity = "4 MiB"\0garbage = 1\n'), "config"),
    ("config bytes", lambda s: ringscope.Session(b'[ring]\0'), "config"),
    ("config dict value", lambda s: ringscope.Session({"export": {"dir": "out\0x"}}), "config"),
    ("config file path", lambda s: ringscope.Session(config_file="ringscope.toml\0x"), "config_file"),
    ("hookpoint name", lambda s: s.register("layers.0\0.resid", dtype="f32", row_width=4), "name"),
    ("site", lambda s: s.register("h", site="residual\0x", dtype="f32", row_width=4), "site"),
    ("dtype", lambda s: s.register("h", dtype="f32\0x", row_width=4), "dtype"),
    ("hookpoint_id name", lambda s: s.hookpoint_id("h\0x"), "name"),
    ("subscriber name", lambda s: s.subscribe("probe\0x"), "name"),
])
def test_nul_in_text_is_refused(session, case, call, name):
    bad(rf"{name}.*NUL", lambda: call(session))


def test_nul_in_a_name_no_longer_aliases_another_hookpoint(session):
    # Before: "a\0b" registered as "a", so a second hookpoint "a\0c" collided with it (or looked it up).
    session.register("a", dtype="f32", row_width=4)
    bad("name.*NUL", lambda: session.hookpoint_id("a\0b"))


@pytest.mark.parametrize("call, name", [
    (lambda s: s.register("layer\ud800", dtype="f32", row_width=4), "name"),
    (lambda s: s.hookpoint_id("\udcff"), "name"),
    (lambda s: s.subscribe("probe\ud800"), "name"),
    (lambda s: ringscope.Session('[export]\nrun_id = "\ud800"\n'), "config"),
])
def test_lone_surrogate_is_refused(session, call, name):
    bad(rf"{name} is not encodable as UTF-8", lambda: call(session))


# -- integers that wrapped or truncated --------------------------------------------------------------------------

@pytest.mark.parametrize("row_width", [2**32 + 4, 4.7, 0, -1, True, "4", None])
def test_row_width_out_of_range_or_not_an_integer(session, row_width):
    bad(r"row_width must be an integer in 1\.\.=4294967295", lambda: session.register("h", dtype="f32",
                                                                                       row_width=row_width))


@pytest.mark.parametrize("layer", [2**63, 2**32, -1, 1.0, True])
def test_layer_out_of_range(session, layer):
    bad(r"layer must be an integer in 0\.\.=4294967295", lambda: session.register("h", layer=layer, dtype="f32",
                                                                                  row_width=4))


@pytest.mark.parametrize("method, args", [
    ("set_enabled", (True,)), ("set_every_n_steps", (2,)), ("set_rows", ("all",)), ("stats", ()),
    ("capture", (np.zeros((2, 4), np.float32),)), ("capture_device", (0x1000, 1, 0)),
])
@pytest.mark.parametrize("hookpoint", [2**32, -1, 0.0])
def test_hookpoint_id_out_of_range(stepped, method, args, hookpoint):
    # Before: hookpoint id 2**32 wrapped to 0 and acted on the first hookpoint.
    bad(r"hookpoint must be an integer in 0\.\.=4294967295", lambda: getattr(stepped, method)(hookpoint, *args))


@pytest.mark.parametrize("step", [-1, 2**64, 1.5])
def test_step_out_of_range(session, step):
    # Before: step -1 became 2**64 - 1.
    bad(r"step must be an integer in 0\.\.=18446744073709551615", lambda: session.begin_step(step, [1], [0]))


@pytest.mark.parametrize("n", [-1, 0, 2**32, 2.0])
def test_every_n_steps_out_of_range(session, hp, n):
    # Before: -1 became 4294967295.
    bad(r"n must be an integer in 1\.\.=4294967295", lambda: session.set_every_n_steps(hp, n))


@pytest.mark.parametrize("request_ids, where", [
    ([1.5, 2.7], r"request_ids\[0\]"),             # before: [1, 2]
    (np.array([1.5, 2.7]), r"request_ids must hold integers"),
    ([1, -1], r"request_ids\[1\]"),
    (np.array([1, -1]), r"request_ids\[1\]"),
    ([2**64, 1], r"request_ids\[0\]"),
    ([True, 2], r"request_ids\[0\]"),
    ("12", r"request_ids must be a sequence of integers"),
    (np.zeros((2, 1), np.uint64), r"request_ids must be one-dimensional"),
])
def test_request_ids_must_be_integers_in_range(session, request_ids, where):
    bad(where, lambda: session.begin_step(0, request_ids, [0, 0]))


@pytest.mark.parametrize("positions, where", [
    ([0, -1], r"positions\[1\]"),                   # before: 4294967295
    ([0, 2**32], r"positions\[1\]"),
    ([0.0, 1.0], r"positions\[0\]"),
    (np.array([0, -1], dtype=np.int64), r"positions\[1\]"),
])
def test_positions_must_be_u32(session, positions, where):
    bad(where, lambda: session.begin_step(0, [1, 2], positions))


@pytest.mark.parametrize("rows, where", [
    ("some", r'rows must be "all", "last_per_request" or a list'),   # before: ValueError
    ([0, -1], r"rows\[1\]"),
    ([0.5], r"rows\[0\]"),
    ([2**32], r"rows\[0\]"),
])
def test_set_rows_bad(session, hp, rows, where):
    bad(where, lambda: session.set_rows(hp, rows))


@pytest.mark.parametrize("layers, where", [([-1], r"layers\[0\]"), ([1.5], r"layers\[0\]"), ([2**32], r"layers\[0\]")])
def test_subscribe_layers_bad(session, layers, where):
    bad(where, lambda: session.subscribe("probe", layers=layers))


@pytest.mark.parametrize("enabled", [1, "no", None])
def test_set_enabled_needs_a_bool(session, hp, enabled):
    bad("enabled must be True or False", lambda: session.set_enabled(hp, enabled))


@pytest.mark.parametrize("args, name", [
    ((-1, 1, 0), "device_ptr"), ((0x1000, -1, 0), "rows"), ((0x1000, 2**32, 0), "rows"),
    ((0x1000, 1, -1), "stream"), ((0x1000, 1.0, 0), "rows"),
])
def test_capture_device_arguments(session, hp, args, name):
    bad(rf"{name} must be an integer", lambda: session.capture_device(hp, *args))


@pytest.mark.parametrize("ptr", [-1, 2**64, 1.0, "0x10"])
def test_set_valid_rows_device_takes_a_u64_pointer(session, hp, ptr):
    bad("device_ptr must be an integer", lambda: session.set_valid_rows_device(hp, ptr))


def test_set_valid_rows_device_is_cuda_only_and_checks_the_hookpoint(session, hp):
    # The host backend has no device rows to bound: a clear error, not a silent no-op; None removes (also refused).
    for ptr in (0x1000, None):
        bad(r"host backend: set ring.backend = \"cuda\"", lambda: session.set_valid_rows_device(hp, ptr))
    with pytest.raises(ringscope.errors.CaptureError, match=f"unknown hookpoint id {hp + 7}"):
        session.set_valid_rows_device(hp + 7, 0x1000)


@pytest.mark.parametrize("stream", [-1, 2**64])
def test_streams_are_u64(session, stream):
    bad("stream must be an integer", lambda: session.apply_controls(stream=stream))
    bad("stream must be an integer", lambda: session.admit_graph_step(stream=stream))
    bad("stream must be an integer", lambda: session.begin_step(0, [1], [0], stream=stream))


@pytest.mark.parametrize("slot", [-1, 2**32, 1.5, "0", None])
def test_held_copy_slots_are_u32_and_streams_u64(session, slot):
    bad("hold_step: slot must be an integer", lambda: session.hold_step(slot))
    bad("launch_held: slot must be an integer", lambda: session.launch_held(slot, stream=0))
    for stream in (-1, 2**64):
        bad("stream must be an integer", lambda: session.launch_held(0, stream=stream))
        bad("stream must be an integer", lambda: session.join_held(stream=stream))


def test_held_copies_are_cuda_only_and_refused_once_closed():
    # Held copies hold a CUDA graph's copy: a host session refuses each call, naming the backend.
    s = ringscope.Session({})
    for call in (lambda: s.hold_step(0), lambda: s.launch_held(0, stream=0), lambda: s.join_held(stream=0)):
        with pytest.raises(RingscopeError) as e:
            call()
        assert e.value.status == "RS_ERR_INVALID_ARGUMENT" and "host backend" in e.value.message, e.value
    s.close()
    with pytest.raises(RingscopeError) as e:
        s.launch_held(0, stream=0)
    assert e.value.status == "RS_ERR_CLOSED"


@pytest.mark.parametrize("rows", [0, -1, 2**32, 1.5, "8", True])
def test_admit_graph_step_rows_are_a_positive_u32(session, rows):
    bad("admit_graph_step: rows must be an integer", lambda: session.admit_graph_step(rows, stream=0))


def test_admit_graph_step_is_cuda_only_in_full_mode_and_nothing_to_do_in_best_effort():
    # Full mode on the host backend: there are no graph-begun steps to admit.
    with ringscope.Session({"policy": {"mode": "full"}}) as s:
        with pytest.raises(RingscopeError) as e:
            s.admit_graph_step(stream=0)
        assert e.value.status == "RS_ERR_INVALID_ARGUMENT" and "host backend" in e.value.message, e.value
    # Best-effort: graph replays need no host call, so engines may call it unconditionally.
    with ringscope.Session({"policy": {"mode": "best_effort"}}) as s:
        assert s.admit_graph_step(stream=0) is None
        assert s.admit_graph_step(8, stream=0) is None
    s = ringscope.Session({"policy": {"mode": "best_effort"}})
    s.close()
    with pytest.raises(RingscopeError) as e:
        s.admit_graph_step(stream=0)
    assert e.value.status == "RS_ERR_CLOSED"


def test_the_per_pass_calls_check_every_new_stream_and_every_row_count():
    """The plugins' per-pass call and admit_graph_step skip ctypes' argument conversion: the stream is converted
    once per new value. A bad stream or row count after good ones is still refused, every time; a row count past
    the C int range goes through the typed call."""
    with ringscope.Session({"policy": {"mode": "best_effort"}}) as s:
        admit = s._before_pass(True)
        for stream in (0, 0x1000, 0, 0x7FFF_FFFF_FFFF_F000, 0):
            assert admit(8, stream) is None
            assert s.admit_graph_step(8, stream=stream) is None
        for stream in (-1, 2**64, 0.0, 1.0, True, "0"):
            bad("stream must be an integer", lambda: admit(8, stream))
            bad("stream must be an integer", lambda: s.admit_graph_step(8, stream=stream))
        bad("stream must be an integer", lambda: admit(8, None))  # (admit_graph_step's default: torch's stream)
        assert admit(8, np.uint64(0x1000)) is None  # an integer of another type is converted each time
        for rows in (0, -1, 2**32, 1.5, "8", True):
            bad("admit_graph_step: rows must be an integer", lambda: admit(rows, 0))
        assert admit(np.uint32(8), 0) is None
        assert admit(2**31, 0) is None and s.admit_graph_step(2**32 - 1, stream=0) is None  # past a C int: typed
    with pytest.raises(RingscopeError) as e:
        admit(8, 0)
    assert e.value.status == "RS_ERR_CLOSED"
    with ringscope.Session() as s:  # host backend: the control upload is CUDA only, refused at every call
        apply = s._before_pass(False)
        for stream in (0, 0, 0x1000):
            with pytest.raises(RingscopeError) as e:
                apply(1, stream)
            assert "host backend" in e.value.message, e.value
        bad("stream must be an integer", lambda: apply(1, -1))


def test_the_per_pass_calls_hand_the_library_exactly_the_handle_rows_and_stream(monkeypatch):
    """What the untyped C calls receive (a recorder in place of the library's functions): the whole 64-bit handle and
    stream, the rows as given — after stream changes, and for a stream given as another integer type."""
    import ringscope.session as rs_session

    got = []

    def recorder(name):
        def call(*args):
            got.append((name,) + tuple(a.value if hasattr(a, "value") else a for a in args))
            return 0
        return call
    monkeypatch.setattr(rs_session, "_untyped", recorder)
    with ringscope.Session({"policy": {"mode": "best_effort"}}) as s:
        admit, apply = s._before_pass(True), s._before_pass(False)
        streams = [0x7FFF_FFFF_FFFF_F000, 2**64 - 1, 0x7FFF_FFFF_FFFF_F000, np.uint64(2**63 + 5), 0x1000]
        for k, stream in enumerate(streams):
            admit(k + 1, stream)
            apply(0, stream)
            s.admit_graph_step(2**31 - 1, stream=stream)
            s.apply_controls(stream=stream)
        s.admit_graph_step(stream=2**40)
        h = s._h
    want = []
    for k, stream in enumerate(streams):
        want += [("rs_admit_graph_step", h, k + 1, int(stream)), ("rs_apply_controls", h, int(stream)),
                 ("rs_admit_graph_step", h, 2**31 - 1, int(stream)), ("rs_apply_controls", h, int(stream))]
    want.append(("rs_admit_graph_step", h, 0, 2**40))
    assert got == want


# -- timeouts -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan, math.inf, 4294967.296, 10**400, "1", True, None])
def test_flush_timeout_bounded(session, timeout):
    # Before: -1 became 2**32 - 1000 ms (about 49.7 days); NaN raised ValueError; inf OverflowError.
    bad(r"timeout must be a number of seconds in 0\.\.=4294967\.295", lambda: session.flush(timeout=timeout))


@pytest.mark.parametrize("timeout", [-1, math.nan, math.inf, 1e10])
def test_poll_timeout_bounded(session, timeout):
    sub = session.subscribe("probe")
    session.close()  # an ended subscription answers at once: a regression fails here instead of waiting 49.7 days
    bad(r"timeout must be a number of seconds in 0\.\.=4294967\.295", lambda: sub.poll(timeout=timeout))


# -- arrays -------------------------------------------------------------------------------------------------------

def test_big_endian_array_is_refused_not_published_as_garbage(stepped, hp):
    x = np.arange(8, dtype=">f4").reshape(2, 4)
    e = bad("big-endian", lambda: stepped.capture(hp, x))
    assert "astype('<f4')" in e.message
    assert stepped.stats(hp)["produced_records"] == 0


def test_big_endian_array_is_refused_for_a_hookpoint_known_only_to_the_library():
    s = ringscope.Session('[[hookpoints]]\nname = "cfg"\nsite = "residual"\ndtype = "f32"\nrow_width = 4\n')
    hp = s.hookpoint_id("cfg")
    s.begin_step(0, [1], [0])
    bad("big-endian", lambda: s.capture(hp, np.zeros((1, 4), dtype=">f4")))
    bad("numeric array", lambda: s.capture(hp, np.array([object()] * 4)))
    s.end_step()
    s.close()


@pytest.mark.parametrize("shape", [(4, 2), (8,), (1, 8), (2, 2, 2), ()])
def test_shape_must_have_rows_of_the_row_width(stepped, hp, shape):
    # Before: (4, 2), (8,) and (1, 8) were accepted for 2 rows of 4 because 8 divides by 4.
    x = np.zeros(shape, dtype=np.float32)
    bad(r"has rows of 4 elements: the array must be \(rows, 4\)", lambda: stepped.capture(hp, x))


# -- configuration ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [123, 1.5, ["[ring]"], object()])
def test_config_must_be_text_or_a_mapping(config):
    # Before: Session(123) raised AttributeError.
    bad("config must be TOML text", lambda: ringscope.Session(config))


@pytest.mark.parametrize("config, where", [
    ({"ring": "big"}, r"config\['ring'\] must be a table"),                   # before: AttributeError
    ({"ring": ["capacity"]}, r"config\['ring'\] must be a table"),
    ({"hookpoints": {"name": "h"}}, r"config\['hookpoints'\] must be a list of tables"),
    ({"hookpoints": ["h"]}, r"config\['hookpoints'\]\[0\] must be a table"),
    ({"ring": {"capacity": None}}, r"config\['ring'\]\['capacity'\]: cannot write"),
    ({"ring": {1: 2}}, r"keys must be strings"),
])
def test_config_sections_must_be_tables(config, where):
    bad(where, lambda: ringscope.Session(config))


def test_config_and_config_file_together():
    bad("not both", lambda: ringscope.Session("", config_file="x.toml"))


def test_config_file_of_the_wrong_type():
    bad("config_file must be a path", lambda: ringscope.Session(config_file=123))


def test_dict_config_strings_are_escaped_not_broken(tmp_path):
    # Only backslashes and quotes were escaped: a newline or tab in a value wrote broken TOML (RS_ERR_CONFIG).
    out = tmp_path / 'a "quoted"\\ new\nline\tdir'
    ringscope.Session({"export": {"parquet": True, "dir": str(out), "run_id": "r"}}).close()
    assert (out / "r").is_dir()


# -- read_dump ----------------------------------------------------------------------------------------------------

def _one_file_run(tmp_path, close=True):
    s = ringscope.Session({"policy": {"mode": "full"}, "export": {"parquet": True, "dir": str(tmp_path),
                                                                  "run_id": "r"}})
    hp = s.register("h", dtype="f32", row_width=4)
    s.begin_step(0, [1], [0])
    s.capture(hp, np.ones((1, 4), np.float32))
    s.end_step()
    if close:
        s.close()
    return s


def test_read_dump_unknown_hookpoint_names_it_and_lists_the_present_ones(tmp_path):
    _one_file_run(tmp_path)
    e = bad(r"hookpoint 'nope' is not in .*; it holds 'h'",
            lambda: ringscope.read_dump(tmp_path / "r", hookpoint="nope"))  # before: {}
    assert e.status == "RS_ERR_INVALID_ARGUMENT"
    assert list(ringscope.read_dump(tmp_path / "r", hookpoint="h")) == ["h"]


def test_read_dump_before_any_commit_says_so(tmp_path):
    s = _one_file_run(tmp_path, close=False)
    try:
        bad("holds no committed files yet", lambda: ringscope.read_dump(tmp_path / "r"))   # before: {}
        bad("holds no committed files yet", lambda: ringscope.read_dump(tmp_path / "r", hookpoint="h"))
    finally:
        s.close()
    assert ringscope.read_dump(tmp_path / "r")["h"]["activation"].shape == (1, 4)


def test_read_dump_of_a_run_with_nothing_captured_says_so(tmp_path):
    ringscope.Session({"export": {"parquet": True, "dir": str(tmp_path), "run_id": "empty"}}).close()
    bad("holds no committed files yet", lambda: ringscope.read_dump(tmp_path / "empty"))


def test_read_dump_missing_path_and_parent_directory(tmp_path):
    bad("does not exist", lambda: ringscope.read_dump(tmp_path / "missing"))
    _one_file_run(tmp_path)
    bad(r"not a run directory but holds runs \(r\)", lambda: ringscope.read_dump(tmp_path))
    bad("hookpoint must be a string", lambda: ringscope.read_dump(tmp_path / "r", hookpoint=1))


# -- valid edge values keep working -------------------------------------------------------------------------------

def test_valid_edge_values(tmp_path):
    config = {"policy": {"mode": "full"}, "export": {"parquet": True, "dir": str(tmp_path), "run_id": "edge"}}
    with ringscope.Session(config) as s:
        one = s.register("one", layer=0, dtype="f32", row_width=1)
        # Datasets store the layer as int32: the library refuses a layer past 2**31 - 1 (it would read back negative).
        with pytest.raises(ringscope.RingscopeError, match="32-bit signed"):
            s.register("top_layer", layer=2**31, dtype="f32", row_width=2)
        big_layer = s.register("big_layer", layer=2**31 - 1, dtype="f32", row_width=2)
        assert s.hookpoint_id("one") == one
        s.set_every_n_steps(one, 1)
        s.set_enabled(one, np.True_)
        s.set_rows(big_layer, np.array([0, 1], dtype=np.int64))
        sub = s.subscribe("probe", layers=np.array([0], dtype=np.uint32))
        s.begin_step(2**64 - 1, [0, 2**64 - 1], np.array([0, 2**32 - 1], dtype=np.int64))
        assert s.capture(one, np.array([[1.0], [2.0]], dtype=np.float32)) == "published"   # rows of width 1
        assert s.capture(big_layer, np.zeros((1, 2, 2), dtype="<f4")) == "published"     # leading dims are rows
        s.end_step()
        with pytest.raises(RingscopeError) as e:  # timeout 0 reaches C: no time to commit the Parquet files
            s.flush(timeout=0)
        assert e.value.status == "RS_ERR_TIMEOUT"
        rec = sub.poll(timeout=5)
        assert rec is not None and rec.step == 2**64 - 1
        assert list(rec.request_id) == [0, 2**64 - 1] and list(rec.position) == [0, 2**32 - 1]
        assert sub.poll(timeout=0) is None
    dump = ringscope.read_dump(tmp_path / "edge")
    assert dump["one"]["activation"].shape == (2, 1)
    assert list(dump["one"]["layer"]) == [0]*2 and list(dump["big_layer"]["layer"]) == [2**31 - 1] * 2
    assert list(dump["one"]["step"]) == [2**64 - 1] * 2


def test_numpy_integers_and_bytes_config_are_accepted():
    with ringscope.Session(b'[ring]\ncapacity = "4 MiB"\n') as s:
        hp = s.register("h", layer=np.int64(3), dtype="bf16", row_width=np.uint32(4))
        s.set_every_n_steps(np.uint32(hp), np.int32(2))
        s.begin_step(np.uint64(0), (np.uint64(7),), [np.int16(0)])
        assert s.capture(hp, np.zeros((1, 4), dtype=np.uint16)) == "published"
        s.end_step()
