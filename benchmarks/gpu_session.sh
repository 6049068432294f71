#!/usr/bin/env bash
# A GPU lease's one command (issue 55): the carried wheels installed, then `gpu_check.py` under a
# deadline, its files left in the device tool's $OUT (at most 8 come back: gpu_check.json, this
# session's log, and the parts' six JSON files in parts/).
#
#   here, once:  python3 benchmarks/device_wheels.py
#   call 1:      run(command="bash benchmarks/gpu_session.sh 480", carry=[".whl"], timeout_s=540)
#   call 2:      run(command="bash benchmarks/gpu_session.sh 240 --only decode,throughput",
#                    carry=[".whl"], timeout_s=290)        at once, while the machine is warm (30 s)
#
# A lease has 15 minutes of device time, the machine's start (a minute or more) and idle time
# included. At 480 s the check runs pytest_gpu, train_bf16, compiled and vs_trl (455 s of budgets);
# call 2 takes the decode loops and the eager MFU; gsm8k (200 s) is for a lease with time left, or
# for call 2 instead (`240 --only gsm8k`). A call that fails in its first seconds (an import, a
# wheel) leaves the time to mend it and call again.
#
# The first argument is gpu_check's --deadline in seconds (default 480); the rest are passed on to it.
# Leave the command's timeout_s about a minute above the deadline: the install and the imports take
# seconds, and the check writes its JSON after every part, so even a stop from outside keeps them.
set -uo pipefail
cd "$(dirname "$0")/.."
deadline="${1:-480}"
shift || true
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
site=/tmp/grpokit-site
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "[gpu_session] no wheels in .whl/: run python3 benchmarks/device_wheels.py here and carry .whl" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  .whl/*.whl || { echo "[gpu_session] the carried wheels did not install" >&2; exit 2; }
export PYTHONPATH="$site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' || exit 2
import datasets, pydantic, torch, transformers, trl

import grpokit

cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"[gpu_session] grpokit {grpokit.__version__} from {grpokit.__file__}; torch {torch.__version__} "
      f"({cuda}); transformers {transformers.__version__}, trl {trl.__version__}, "
      f"datasets {datasets.__version__}, pydantic {pydantic.__version__}", flush=True)
PY
python3 benchmarks/gpu_check.py --deadline "$deadline" --out "$out/gpu_check.json" --work "$out/parts" "$@" \
  2>&1 | tee "$out/gpu_session.log"
