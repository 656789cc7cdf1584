#!/usr/bin/env bash
# The project's two entry points, each creating or reusing the local virtual environment .venv:
#   ./run.sh demo   run the main job: the quickstart notebook, end to end in a real Jupyter kernel
#   ./run.sh test   run the whole test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV="${NBACCEL_VENV:-.venv}"

ensure_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV" || {
            echo "python3 -m venv failed; on Debian/Ubuntu install it with: apt-get install python3-venv" >&2
            exit 1
        }
    fi
    # Reinstall only when the dependency declarations changed since the last install.
    local stamp="$VENV/.nbaccel-installed"
    local want
    # the declarations and this script (its install commands) together
    want="$(cat pyproject.toml constraints.txt run.sh | sha256sum | cut -d' ' -f1)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install --help | grep -q -- "--group" || {
            echo "this venv's pip cannot install dependency groups (PEP 735 needs pip >= 25.1):" \
                "$VENV/bin/python -m pip install -U 'pip>=25.1'" >&2
            exit 1
        }
        # every extra, and the dev group (PEP 735; pip >= 25.1 reads it from pyproject.toml)
        "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[notebook,tensorboard,ray]" --group dev
        # lomo-optim needs transformers; kept out of the main environment (see constraints.txt), for the LOMO
        # test, the Trainer/PEFT kernel test and scripts/run_accelerate_examples.py
        rm -rf "$VENV/side/lomo"
        "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/side/lomo" -c constraints.txt \
            lomo-optim transformers tokenizers regex peft
        echo "$want" > "$stamp"
    fi
}

case "${1:-}" in
    demo)
        ensure_venv
        shift
        exec "$VENV/bin/python" scripts/run_notebook.py notebooks/01_quickstart.ipynb "$@"
        ;;
    test)
        ensure_venv
        shift
        # bytecode for the hundreds of Python processes the tests start (PYTHONDONTWRITEBYTECODE=1, as on some
        # CI images, would have each compile nbaccel again)
        "$VENV/bin/python" -m compileall -q nbaccel tests > /dev/null || true
        set +e
        # three workers, each taking whole files (a file's fixtures, such as the Ray cluster or the sshd, start
        # once): much of a test's time is a wait on the processes it started (a kernel's start, a hang's grace),
        # which another worker's test fills. On 2 cores, 2 workers kept the CPUs 88% busy (the suite: 20:50 and
        # 21:46), 3 kept them 92-98% busy (16:41-20:10 in three runs; the machine's speed drifts between runs).
        # NBACCEL_TEST_WORKERS=0 runs in this process (as does -n 0 after it)
        "$VENV/bin/python" -m pytest -n "${NBACCEL_TEST_WORKERS:-3}" --dist loadfile "$@"
        rc=$?
        set -e
        if [ "$rc" -eq 5 ]; then
            echo "pytest collected no tests: treating that as a failure" >&2
            exit 1
        fi
        exit "$rc"
        ;;
    *)
        echo "usage: ./run.sh demo | ./run.sh test [pytest args]" >&2
        exit 2
        ;;
esac
