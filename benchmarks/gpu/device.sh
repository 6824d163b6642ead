#!/usr/bin/env bash
# The one command for a GPU lease (benchmarks/gpu/README.md):
#   bash benchmarks/gpu/device.sh            # first call
#   bash benchmarks/gpu/device.sh --resume   # second call on the warm machine: what the first left
# Wheels the image lacks, if carried in .whl/base, go to /tmp/site; torchtitan's, if carried in
# .whl/torchtitan, go to the stage that runs it. The suite writes to a folder that outlives the
# call (the tool empties $OUT before each command) and its files are copied to $OUT after it.
set -o pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/base/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/base/*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
wheels=()
if compgen -G ".whl/torchtitan/*.whl" > /dev/null; then wheels=(--wheels .whl/torchtitan); fi
suite=/tmp/ultrascale-gpu-suite
python3 benchmarks/gpu/run.py --out "$suite" "${wheels[@]}" "$@"
code=$?
if [ -n "${OUT:-}" ]; then cp "$suite"/summary.json "$suite"/summary.md "$suite"/*.log "$suite"/*.txt "$OUT"/ 2>/dev/null; fi
exit $code
