#!/usr/bin/env bash
# One device call (2026-11-26, H200) after issue 29 landed: the gpu tests on the merged tree, then
# the tiled path at N = 65 536 .. 1 048 576 on CUDA (benchmarks/batch_memory.py --device cuda).
# Run on the device machine from the repository root with .whl/ carried (the device tool sets $OUT):
#   bash benchmarks/gpu/tiled_run.sh
# Results and what they show: benchmarks/gpu/results/2026-11-26-h200-tiled/, docs/benchmarks.md.
set -u; T=$(mktemp -d); date
python3 -m pip install -q --no-index --no-deps --no-compile --target $T/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ; export PYTHONPATH=$T/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c "import torch;print(torch.__version__, torch.version.cuda)"
timeout 210 python3 -m pytest tests/gpu -m gpu -o addopts="-ra --strict-markers" -q -p no:cacheprovider -rs --junitxml=$OUT/pytest.xml > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -5 $OUT/pytest.log
timeout 170 python3 benchmarks/batch_memory.py --device cuda --sizes 65536,262144,1048576 --pairs dot+infonce,dot+siglip,wpse+infonce --rounds 1 --tile 8192 --threads 4 --out $OUT/bm.jsonl > $OUT/bm.log 2>&1; echo "bm rc=$?"; tail -30 $OUT/bm.log
timeout 30 python3 benchmarks/batch_memory.py --summarize $OUT/bm.jsonl > $OUT/bm_summary.md 2>&1; cat $OUT/bm_summary.md; date
