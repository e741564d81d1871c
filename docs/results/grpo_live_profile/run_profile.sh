#!/bin/bash
# where the default's GRPO step goes in the live run: top + py-spy on the trainer, 40 steps, SFT reused
while [ ! -f /work/exp/evalconc_bench.end ]; do sleep 10; done
cd /tmp/fresh31
exec flock /tmp/heavy.lock bash -c '
(make run RUN_ARGS="--training-steps 40 --eval-samples 0" > /work/exp/diag_run.log 2>&1; echo rc=$? >> /work/exp/diag_run.log) &
while ! grep -q "env + trainer" /work/exp/diag_run.log 2>/dev/null; do sleep 2; done
sleep 20
pid=$(python3 -c "import json,glob,os; d=sorted(glob.glob(\"/tmp/fresh31/runs/*/pids.json\"), key=os.path.getmtime)[-1]; p=json.load(open(d)); print(p[\"trainer\"][\"pid\"])")
echo "trainer pid $pid" > /work/exp/diag.log
top -b -n 4 -d 5 >> /work/exp/diag_top.log
PYTHONPATH=/work/exp/pyspy /work/exp/pyspy/bin/py-spy record --pid $pid --duration 40 --rate 100 --format raw -o /work/exp/diag_spy.txt --nonblocking >> /work/exp/diag.log 2>&1
PYTHONPATH=/work/exp/pyspy /work/exp/pyspy/bin/py-spy record --pid $pid --duration 20 --rate 100 --idle --format raw -o /work/exp/diag_spy_idle.txt --nonblocking >> /work/exp/diag.log 2>&1
wait
date +%s > /work/exp/diag.end'
