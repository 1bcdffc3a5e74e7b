#!/usr/bin/env bash
# The main job on a machine without a GPU: set up (once) and print the decode
# plan: per projection of the built-in shape table and M bucket, the tactic,
# grid, waves, residency, shared memory, registers (compiled here for the
# target arch), the HBM floor and, where the plan has one, the time the tuner
# measured. Extra arguments go to `warpsplitk plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/setup-venv > /dev/null
warpsplitk plan "$@"
