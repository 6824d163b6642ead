#!/usr/bin/env bash
# The wheels the GPU image lacks, fetched here once before a lease (benchmarks/gpu/README.md):
#   bash benchmarks/gpu/wheels.sh       # -> .whl/base, .whl/torchtitan (git-ignored)
# The image runs CPython 3.12 on x86-64 and reaches no network; its package list is the device
# tool's KINDS.md. .whl/base: ours (pydantic is not in the image; typing-extensions at least
# pydantic's floor). .whl/torchtitan: torchtitan 0.3 and what its `import torchtitan.train` needs
# that the image lacks (found by importing it with only these added: `peer_torchtitan.py --smoke`).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
fetch() {  # fetch DIR NAME==VERSION...: one version of each, for the image's Python
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
rm -rf .whl/base .whl/torchtitan
fetch .whl/base pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
# datasets 4.7 wants dill < 0.4.1 and multiprocess < 0.70.19; multiprocess 0.70.18 dill >= 0.4.
fetch .whl/torchtitan torchtitan==0.3.0 torchdata==0.11.0 datasets==4.7.0 tyro==1.0.17 \
  spmd_types==0.2.3 torch_checkpointing==0.1.1 docstring-parser==0.18.0 typeguard==4.6.1 \
  dill==0.4.0 multiprocess==0.70.18
ls .whl/base .whl/torchtitan
# The tool carries at most 64 MiB: the repository's tracked files and these together.
du -sh .whl
