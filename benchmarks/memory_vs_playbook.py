"""The memory estimator against the playbook's H100 runs (nanotron, 1.34B and 3.57B Llama models).

Its code, options and recorded comparisons:
`ultrascale.memory.playbook` (the same command as
`python -m ultrascale.memory.playbook`);
`python benchmarks/memory_vs_playbook.py --help` prints them.
"""

import sys

from ultrascale.memory import playbook

if __name__ == "__main__":
    sys.exit(playbook.main(description=playbook.__doc__))
