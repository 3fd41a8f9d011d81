set -u
ROOT=$(pwd)
export XLA_PYTHON_CLIENT_PREALLOCATE=false SPRNN_CUDA_ARCHS=90
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/v_new . > /tmp/bn.log 2>&1 &
(cd base && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/v_old . > /tmp/bo.log 2>&1) &
wait; tail -3 /tmp/bn.log /tmp/bo.log
for r in 1 2 3; do for v in old new; do
  (cd /tmp && PYTHONPATH=/tmp/v_$v:$ROOT/benchmarks timeout 100 python3 $ROOT/ab.py $v 2>&1 | grep us/step) | tee -a $OUT/ab.txt
done; done
