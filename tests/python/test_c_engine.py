"""Reads back the dump of the C example (examples/c/engine.c, run by test.sh through libringscope) and checks every
value: row r of layer l at step s holds bf16(l * 1000 + s * 10 + r) (truncated) in every element, for requests 100..102 at
position 5 + s.

Run after the example:  RINGSCOPE_C_RUN_DIR=ringscope-out/c-engine python -m pytest tests/python/test_c_engine.py
"""
import os
import pathlib

import numpy as np
import pyarrow.dataset as ds
import pytest

C_RUN_DIR = os.environ.get("RINGSCOPE_C_RUN_DIR")


@pytest.mark.skipif(not C_RUN_DIR, reason="RINGSCOPE_C_RUN_DIR is not set (test.sh sets it after running the C example)")
def test_c_engine_dump_holds_what_the_c_program_wrote():
    table = ds.dataset(pathlib.Path(C_RUN_DIR), format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 4 * 3 * 10
    layer = table.column("layer").to_numpy()
    step = table.column("step").to_numpy().astype(np.int64)
    req = table.column("request_id").to_numpy().astype(np.int64)
    pos = table.column("position").to_numpy().astype(np.int64)
    raw = np.frombuffer(b"".join(table.column("activation").to_pylist()), dtype="<u2").reshape(table.num_rows, 64)
    row = req - 100
    assert set(row.tolist()) == {0, 1, 2}
    assert (pos == 5 + step).all()
    # The C program truncates an f32 to bf16 (its top 16 bits); so does this.
    expected = (layer.astype(np.int64) * 1000 + step * 10 + row).astype(np.float32)
    expected_bf16 = (expected.view(np.uint32) >> 16).astype(np.uint16)
    assert (raw == expected_bf16[:, None]).all()
