#!/usr/bin/env bash
# Run ON the lent GPU machine, in the repository root, after benchmarks/gpu_prep.sh here:
#
#   device run, carry [".whl"], command:
#     bash benchmarks/gpu_run.sh --stages pytest-gpu,policy-loss,fused-linear
#
# Installs the carried wheels into /tmp/site (never into the image's own environment) and runs
# benchmarks/run_all.py with every argument given here, its --out in $OUT/run (what comes back),
# its log in $OUT/run_all.log, the versions it imports in $OUT/versions.txt. The environment it sets:
#   PYTHONPATH=/tmp/site:benchmarks  fastrl from its wheel, the benchmarks' own helpers
#   PYTHONSAFEPATH=1                 no Python puts the working directory first on sys.path, where
#                                    the source fastrl/ (without its kernels/) would shadow the
#                                    wheel (pytest, the benchmarks and their subprocesses)
#   FASTRL_GIT_COMMIT=<.whl/COMMIT>  the commit the results files record (there is no .git)
#   PYTHONUNBUFFERED=1               the log is written as it goes, also when the call is killed
# A call may run 600 s at most: split the stages over calls (README "On a lent GPU machine"), then merge
# their folders here with `python benchmarks/run_all.py --merge DIR... --out benchmarks/results`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?OUT is not set: this runs inside a device call}
[ -f .whl/COMMIT ] || { echo "no .whl/COMMIT: run benchmarks/gpu_prep.sh here first and carry .whl"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD/benchmarks PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
FASTRL_GIT_COMMIT=$(cat .whl/COMMIT)
export FASTRL_GIT_COMMIT
mkdir -p "$OUT/run"
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib
for name in ("torch", "triton", "transformers", "fastrl", "trl", "liger_kernel", "datasets"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} {m.__file__}")
    except Exception as e:  # a baseline that does not import: its stage fails, the others run
        print(f"{name}: {type(e).__name__}: {e}")
import torch
print("cuda:", torch.cuda.is_available() and torch.cuda.get_device_name(0))
EOF
python3 benchmarks/run_all.py --out "$OUT/run" "$@" 2>&1 | tee "$OUT/run_all.log"
