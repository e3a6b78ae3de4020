# Sourced by test.sh, tests/engine.sh and tests/sglang/run_cuda.sh: the tests' Python environments, each exactly what its requirement files pin —
# never a leftover of an earlier run that happens to work.
#
#   ensure_cached_venv NAME OVERRIDE INSTALL_FUNCTION FILE...
#
# is ensure_venv (below) on a directory outside the checkout, named by what it holds: OVERRIDE when it is not empty
# (RINGSCOPE_VENV and the like: a directory of the caller's choice), else
# ${RINGSCOPE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/ringscope}/NAME-HASH, HASH standing for the requirement files and
# the install commands. A fresh clone of an unchanged checkout so finds the environment an earlier run built (several
# GB and minutes of downloads) instead of building it again; a changed pin names another directory, and the
# environments of NAME that it replaces are deleted (only those made by these scripts: they hold a record). A new
# environment's large files that another cached one holds byte for byte (the engines' torch builds pull the same
# NVIDIA wheels) are hard-linked to it (tests/share_files.py): the disk is shared, the environments stay independent.
#
#   ensure_venv DIR INSTALL_FUNCTION FILE...
#
# creates the virtual environment DIR and runs INSTALL_FUNCTION (with $py set to its python) the first time. It
# records two things in DIR/.ringscope-env: a hash of FILE... (the requirement files) and of INSTALL_FUNCTION, and a hash of what `pip freeze`
# then lists (every package and version, the ringscope package itself left out: the tests install it afresh). A later
# run reuses DIR only when both still match; when either differs — the requirement files changed, or something was
# installed, upgraded or removed by hand — DIR is deleted and built again from scratch, so a reused environment
# holds exactly what a fresh machine would get. A DIR that was not made here (no record) is left alone, with an error.

_ringscope_freeze() {
  "$1/bin/python" -m pip freeze --disable-pip-version-check 2>/dev/null | grep -viE '^ringscope( |=|@|$)' \
    | LC_ALL=C sort | sha256sum | cut -d' ' -f1
}

# The requirement files and the install commands themselves (their pins: torch==..., --no-deps ...).
_ringscope_wanted() {
  local install=$1
  shift
  (cat "$@"; declare -f "$install") | sha256sum | cut -d' ' -f1
}

ensure_cached_venv() {
  local name=$1 override=$2 install=$3
  shift 3
  if [ -n "$override" ]; then
    ensure_venv "$override" "$install" "$@"
    return
  fi
  local cache=${RINGSCOPE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ringscope}
  local dir old
  dir="$cache/$name-$(_ringscope_wanted "$install" "$@" | cut -c1-16)"
  mkdir -p "$cache"
  for old in "$cache/$name"-*; do
    if [ "$old" != "$dir" ] && [ -f "$old/.ringscope-env" ]; then
      echo "== removing $old (made for other pins than today's)"
      rm -rf "$old"
    fi
  done
  _ringscope_built=0
  ensure_venv "$dir" "$install" "$@"
  if [ "$_ringscope_built" = 1 ]; then
    # The engines' torch builds pull the same NVIDIA wheels: share their files with the other cached environments.
    local others=()
    for old in "$cache"/*/; do
      old=${old%/}
      [ "$old" != "$dir" ] && [ -f "$old/.ringscope-env" ] && others+=("$old")
    done
    [ ${#others[@]} = 0 ] || python3 "$(dirname "${BASH_SOURCE[0]}")/share_files.py" "$dir" "${others[@]}"
  fi
}

ensure_venv() {
  local dir=$1 install=$2
  shift 2
  local wanted record
  wanted=$(_ringscope_wanted "$install" "$@")
  record="$dir/.ringscope-env"
  if [ -e "$dir" ]; then
    if [ ! -f "$record" ] && [ -f "$dir/.ringscope-building" ]; then
      echo "== an earlier build of $dir did not finish: building it again from scratch"
      rm -rf "$dir"
    elif [ ! -f "$record" ] && ls "$dir"/.ringscope-*packages >/dev/null 2>&1; then
      echo "== $dir was made by an older version of the test scripts: building it again from scratch"
      rm -rf "$dir"
    elif [ ! -f "$record" ]; then
      echo "venv.sh: $dir exists but was not made by the test scripts (no $record): remove it, or point the" \
           "script's environment variable at another directory" >&2
      return 1
    fi
    if [ "$(sed -n 1p "$record")" = "$wanted" ] && [ "$(sed -n 2p "$record")" = "$(_ringscope_freeze "$dir")" ]; then
      py="$dir/bin/python"
      return 0
    fi
    if [ -f "$record" ]; then
      echo "== $dir no longer holds exactly what $* pin: building it again from scratch"
      rm -rf "$dir"
    fi
  fi
  echo "== creating the Python environment $dir (first run: several minutes and a few GB of downloads)"
  # Marked until the record is written: a build cut short is recognised as one, and started again next time.
  mkdir -p "$dir"
  : > "$dir/.ringscope-building"
  python3 -m venv "$dir" || {
    echo "venv.sh: 'python3 -m venv' failed; install your distribution's venv module (Debian: apt install python3-venv)" >&2
    return 1
  }
  py="$dir/bin/python"
  local start
  start=$(date +%s)
  "$install"
  printf '%s\n%s\n' "$wanted" "$(_ringscope_freeze "$dir")" > "$record"
  rm -f "$dir/.ringscope-building"
  _ringscope_built=1
  echo "== $dir installed in $(( $(date +%s) - start )) s"
}

#   plugin_entry_point DIR ENGINE GROUP
#
# declares the ringscope plugin of ENGINE (vllm, sglang) under the entry-point GROUP the engine loads plugins from, by a
# distribution's metadata written into DIR: DIR on PYTHONPATH (also in the engine's worker processes, which inherit it)
# makes the engine load the plugin of a checkout that is not pip-installed.
plugin_entry_point() {
  local dist="$1/ringscope_${2}_tests-0.dist-info"
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: ringscope-%s-tests\nVersion: 0\n' "$2" > "$dist/METADATA"
  printf '[%s]\nringscope = ringscope.%s:register\n' "$3" "$2" > "$dist/entry_points.txt"
}
