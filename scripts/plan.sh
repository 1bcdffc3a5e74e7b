#!/usr/bin/env bash
# The main job on a machine without a GPU: set up (once: .ci/setup-venv
# reuses the venv while pyproject.toml is unchanged) and print the decode
# plan: per projection of the built-in shape table and M bucket, where the
# tactic came from (the plan or the heuristic), the tactic, grid, waves,
# residency, shared memory, registers (compiled for the target arch, in
# parallel, the first time; then read from the disk cache), the HBM floor
# and, where the plan has one, the time the tuner measured. Extra arguments
# go to `warpsplitk plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/setup-venv > /dev/null
warpsplitk plan "$@"
