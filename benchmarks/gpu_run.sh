#!/usr/bin/env bash
# Run ON the lent GPU machine, in the repository root, after benchmarks/gpu_prep.sh here:
#
#   device run, carry [".whl"], command:
#     timeout -k 5 572 bash benchmarks/gpu_run.sh --stages pytest-gpu,policy-loss,fused-linear
#
# Installs the carried wheels into /tmp/site (never into the image's own environment) and runs
# benchmarks/run_all.py with every argument given here, its --out in $OUT/run (what comes back),
# its log in $OUT/run_all.log. The environment it sets:
#   PYTHONPATH=/tmp/site:benchmarks  fastrl from its wheel, the benchmarks' own helpers
#   PYTHONSAFEPATH=1                 no Python puts the working directory first on sys.path, where
#                                    the source fastrl/ (without its kernels/) would shadow the
#                                    wheel (pytest, the benchmarks and their subprocesses)
#   FASTRL_GIT_COMMIT=<.whl/COMMIT>  the commit the results files record (there is no .git)
#   PYTHONUNBUFFERED=1               the log is written as it goes, also when the call is killed
# The versions it imports go to $OUT/run/versions.txt (inside the folder the call tars; every
# results file's meta records the baselines' versions too: `packages`).
#
# Time: run_all gets --deadline (GPU_RUN_DEADLINE_S, default 560 s from this script's start,
# less what the install took; a later --deadline among the arguments wins), so its own stage
# timeouts, which keep the rows measured, fire before an outer `timeout -k 5 572`. Should that
# outer timeout still fire, its SIGTERM reaches run_all (which forwards it to the running stage
# as SIGINT: the stage writes its rows, then run_all its summary) while this shell and `tee`
# ignore it, so the log and the summary are still written in the 5 s before the SIGKILL.
# A call may run 600 s at most: split the stages over calls (README "On a lent GPU machine"), then
# merge their folders here with `python benchmarks/run_all.py --merge DIR... --out benchmarks/results`.
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
python3 - <<'PY' 2>&1 | tee "$OUT/run/versions.txt"
import importlib
import _baselines  # (benchmarks/ is on PYTHONPATH)
for name in ("torch", "triton", "transformers", "fastrl", "trl", "liger_kernel", "verl", "datasets"):
    try:
        if name == "verl":  # with a stand-in for ray where ray is missing (the note says so)
            print(_baselines.import_verl() or "verl imports as installed")
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} {m.__file__}")
    except Exception as e:  # a baseline that does not import: its stage fails, the others run
        print(f"{name}: {type(e).__name__}: {e}")
import torch
print("cuda:", torch.cuda.is_available() and torch.cuda.get_device_name(0))
PY
deadline=$(( ${GPU_RUN_DEADLINE_S:-560} - SECONDS ))
# this shell and tee ignore TERM / INT (run_all handles them and ends the pipeline itself)
trap '' TERM INT
python3 benchmarks/run_all.py --out "$OUT/run" --deadline "$deadline" "$@" 2>&1 \
    | (trap '' TERM INT; exec tee "$OUT/run_all.log")
