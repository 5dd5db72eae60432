#!/usr/bin/env bash
# The sealed whole-context measurements still to take, in order, each resuming what its records hold (a step that is
# complete loads the models, finds every item measured and ends, writing nothing):
#   1. the 4K report items of both maps (protocols whole-context and whole-context-conv4k, one run: the target, the
#      source and the sparse arms shared),
#   2. the guard ladder's 120 calibration items (whole-context-conv4k's `ladder`: the chosen map, seed 4322),
#   3. the 8K report items of both maps.
#
#   WORK=/path/to/work bash benchmarks/sealed/whole_context.sh
#
# WORK holds the two fitted maps as benchmarks/README.md fits them ("Which map carries the context"): $WORK/w5k and
# $WORK/wconv. RESULTS (default: this checkout's benchmarks/results/sealed/whole-context) is where the records go, so a
# run from a second worktree can write into the checkout that commits them. One job at a time on a 2-core machine:
# the first tokens are read only on items measured at the protocol's load. The reports come from the records
# afterwards (benchmarks/README.md, "Sealed protocols").
set -euo pipefail
: "${WORK:?set WORK to the folder that holds the fitted maps (w5k, wconv)}"
[ -d "$WORK" ] || { echo "WORK=$WORK is not a folder: set it to the folder that holds w5k and wconv" >&2; exit 2; }
WORK=$(cd "$WORK" && pwd)  # paths given relative to where the command ran, before the cd below
if [ -n "${RESULTS:-}" ]; then mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd); fi
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-benchmarks/results/sealed/whole-context}
M=mappers/0.5b-to-1.5b/ridge-k8
for map in "$WORK/w5k/$M" "$WORK/wconv/$M"; do
    [ -f "$map/config.json" ] || { echo "no fitted map at $map: fit it first (benchmarks/README.md)" >&2; exit 2; }
done
PROTOCOLS=benchmarks/protocols/whole-context.json,benchmarks/protocols/whole-context-conv4k.json
MAPS=ridge-k8-5k=$WORK/w5k/$M,ridge-k8-conv4k=$WORK/wconv/$M
TASKS=ruler_vt,ruler_fwe,chat_split
RUNGS="query_overlap:fill=draft_branches@0.1,draft_branches@0.1,sparse:query_overlap:fill=draft_branches@0.1,sparse:draft_branches@0.1"

echo "== 1/3: the 4K report items of both maps"
python -m benchmarks.switch.map_compare --protocol "$PROTOCOLS" --maps "$MAPS" --tasks "$TASKS" --tokens 4096 \
    --records-dir "$RESULTS/4096"
echo "== 2/3: the guard ladder's calibration items (4K, seed 4322, ridge-k8-conv4k)"
python -m benchmarks.switch.long_switch --mapper "$WORK/wconv/$M" --tasks "$TASKS" --tokens 4096 --items 40 \
    --seed 4322 --dtype bfloat16 --threads 2 --rungs "$RUNGS" --records "$RESULTS/ladder-calibration-4096.jsonl"
echo "== 3/3: the 8K report items of both maps"
python -m benchmarks.switch.map_compare --protocol "$PROTOCOLS" --maps "$MAPS" --tasks "$TASKS" --tokens 8192 \
    --records-dir "$RESULTS/8192"
echo "== every sealed whole-context item is measured"
