"""Hard-links the files a new test environment has in common with the other cached ones (tests/venv.sh runs it after
building one): both engines' torch builds pull the same NVIDIA wheels (cuBLAS, cuSPARSE, cuFFT, ... — gigabytes that
`import torch` needs even on CPU), so each environment would otherwise hold its own copy.

    python3 tests/share_files.py NEW_ENV OTHER_ENV...

A file of NEW_ENV is replaced by a hard link to the file at the same path in another environment only when both are
regular files of the same size and the same bytes (compared, not assumed), at least MIN_BYTES large, on the same
file system. A linked file stays whole when either environment is deleted or rebuilt (pip removes files by unlinking
them), so the environments stay independent; only the disk they take is shared. Prints what it saved."""

import filecmp
import os
import sys

MIN_BYTES = 1 << 20


def site_files(env: str):
    """(path relative to the environment, absolute path) of every regular file under its lib/ directory."""
    root = os.path.join(env, "lib")
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                yield os.path.relpath(path, env), path


def share(new: str, others: "list[str]") -> "tuple[int, int]":
    linked, saved = 0, 0
    for rel, path in site_files(new):
        st = os.stat(path)
        if st.st_size < MIN_BYTES or st.st_nlink > 1:
            continue
        for other in others:
            twin = os.path.join(other, rel)
            try:
                ot = os.stat(twin, follow_symlinks=False)
            except OSError:
                continue
            if (ot.st_dev != st.st_dev or ot.st_ino == st.st_ino or ot.st_size != st.st_size
                    or ot.st_mode != st.st_mode or not os.path.isfile(twin)):
                continue
            if not filecmp.cmp(path, twin, shallow=False):
                continue
            tmp = path + ".ringscope-link"
            os.link(twin, tmp)
            os.replace(tmp, path)
            linked += 1
            saved += st.st_size
            break
    return linked, saved


def main(argv: "list[str]") -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    new, others = argv[1], [d for d in argv[2:] if os.path.isdir(d)]
    linked, saved = share(new, others)
    if linked:
        print(f"== {new}: {linked} files shared with {len(others)} other environment(s), {saved / 2**30:.1f} GB saved")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
