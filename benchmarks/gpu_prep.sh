#!/usr/bin/env bash
# Run HERE (a machine with the package registries), before the first call of a GPU session.
#
# The lent GPU machines (H100 / H200) carry torch 2.11, triton 3.6 and transformers, but not the
# baselines (trl, liger-kernel, datasets and two of its needs; verl and the five of its needs
# that its loss, LM-head and GAE functions import: not ray, whose 79 MB wheel is over what a call
# carries, and which the benchmarks replace with a stand-in, _baselines.import_verl), and they
# cannot download. This puts, for their Python 3.12 on x86-64:
#   .whl/*.whl      those wheels, and fastrl's own wheel built from this working tree (the source
#                   tree alone cannot be imported: kernels/ installs as fastrl.kernels)
#   .whl/COMMIT     `git rev-parse HEAD` (+ "-dirty"), for the results files' meta (no .git there)
# and lists /.whl/ in .git/info/exclude, so git ignores it and the device call carries it
# (`carry: [".whl"]`). Then, on the machine: benchmarks/gpu_run.sh (see its header).
#
#   bash benchmarks/gpu_prep.sh            # about 3 MB; fails loudly if a wheel cannot be had
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl
mkdir .whl
# the versions this machine tests with (keep them in step with what CI installs; omegaconf 2.4
# and orjson 3.13 because CI's 2.3 needs an sdist-only antlr4 and its orjson has no cp312 wheel)
WHEELS=(trl==1.16.0 liger_kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 codetiming==1.4.0
    orjson==3.13.0)
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
python -m pip wheel -q --no-deps --no-build-isolation -w .whl .
commit=$(git rev-parse HEAD)
[ -z "$(git status --porcelain -- . ':(exclude)benchmarks/results')" ] || commit="$commit-dirty"
echo "$commit" >.whl/COMMIT
ls -l .whl
du -sh .whl
