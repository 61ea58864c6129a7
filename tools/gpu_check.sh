#!/usr/bin/env bash
# The GPU checks on a lent GPU machine, in one call (docs/gpu.md, "Checking on a GPU"):
# python -m ripples.bench.gpu (the goals' figures) first, then tests/gpu (marker gpu) for
# whatever is left of the budget. Everything lands in $OUT as it is made.
#
# The machine has Python 3.12 with torch, but not every package Ripples needs: carry them
# as cp312 wheels in .whl/ (git-ignored; docs/gpu.md names them and the pip command).
#
#   run(command="BENCH=0 BUDGET=300 bash tools/gpu_check.sh", carry=[".whl"], timeout_s=330)
#   run(command="TESTS=0 BUDGET=480 bash tools/gpu_check.sh", carry=[".whl"], timeout_s=510)
#
# BUDGET (seconds, default 540) bounds the whole script; BENCH_CONFIGS picks the bench's
# rows (default: all) and BENCH_BUDGET its seconds (default 330, or all that is left with
# TESTS=0); BENCH=0 skips the bench and TESTS=0 the tests (two calls, one each, fit the
# device's per-call limit better than one); DEVICE=cpu runs the bench on the CPU (a
# rehearsal of the script where there is no GPU: the tests then skip). The bench's work
# dir stays outside $OUT (too big to come back); its table and JSON land in $OUT.
# TO_LOSS=1 runs the bench's --to-loss mode instead of its step rows (DDP against Ripples
# to a loss; its table, results.json and loss.png land in $OUT):
#
#   run(command="TO_LOSS=1 TESTS=0 BUDGET=420 bash tools/gpu_check.sh", carry=[".whl"], timeout_s=450)
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

if [[ -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/rp . \
    2>&1 | tail -2
mkdir -p /tmp/bin && ln -sf "$(command -v python3)" /tmp/bin/python
export PYTHONPATH=/tmp/rp:/tmp/site PATH=/tmp/bin:/tmp/rp/bin:/tmp/site/bin:$PATH
echo "setup: $(( $(date +%s) - T0 )) s" | tee "$OUT/setup.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/setup.txt" 2>&1
# From outside the checkout: from its root, `python -m` finds the source folder first.
(cd /tmp && python3 -c "import torch, ripples.bench.gpu; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available())") >> "$OUT/setup.txt" 2>&1 || { cat "$OUT/setup.txt"; exit 3; }
cat "$OUT/setup.txt"

if [[ ${TO_LOSS:-0} != 0 ]]; then
    loss_dir=$(mktemp -d /tmp/bench-loss.XXXX)
    (cd /tmp && timeout "$(( $(left) - 30 ))" python3 -m ripples.bench.gpu --to-loss \
        ${DEVICE:+--device "$DEVICE"} --budget-seconds "$(( $(left) - 60 ))" \
        --work-dir "$loss_dir/work") > "$OUT/bench-loss.txt" 2>&1
    echo "bench --to-loss: rc=$? after $(( $(date +%s) - T0 )) s"
    cp "$loss_dir/work/results.json" "$loss_dir/work/loss.png" "$OUT/" 2>/dev/null
    tail -12 "$OUT/bench-loss.txt"
elif [[ ${BENCH:-1} != 0 ]]; then
    # The bench's own budget: what the tests leave it (all that is left without them).
    if [[ ${TESTS:-1} == 0 ]]; then bench_budget=$(( $(left) - 40 )); else bench_budget=330; fi
    (cd /tmp && timeout "$(( $(left) - 30 ))" python3 -m ripples.bench.gpu \
        ${BENCH_CONFIGS:+--configs "$BENCH_CONFIGS"} ${DEVICE:+--device "$DEVICE"} \
        --budget-seconds "${BENCH_BUDGET:-$bench_budget}" --work-dir "$(mktemp -d /tmp/bench-gpu.XXXX)" \
        --json "$OUT/bench-gpu.json") > "$OUT/bench-gpu.txt" 2>&1
    echo "bench: rc=$? after $(( $(date +%s) - T0 )) s"
    tail -30 "$OUT/bench-gpu.txt"
fi

if [[ ${TESTS:-1} != 0 && $(left) -gt 60 ]]; then
    # From /tmp too (the package from /tmp/rp, not the checkout's source folders); pytest
    # travels as wheels in .whl/ where the machine lacks it.
    REPO=$(pwd)
    (cd /tmp && timeout "$(( $(left) - 10 ))" python3 -m pytest -q -p no:cacheprovider \
        -m gpu --rootdir "$REPO" "$REPO/tests/gpu") > "$OUT/tests-gpu.txt" 2>&1
    echo "tests/gpu: rc=$? after $(( $(date +%s) - T0 )) s"
    tail -15 "$OUT/tests-gpu.txt"
fi
